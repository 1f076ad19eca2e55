// QuickGELU, y = x * sigmoid(1.702 x), and its backward, on CPU.
// Half and bfloat16 are computed in float (at::opmath_type) and rounded once on store.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>
#include <torch/types.h>

#include "cpu/vec_math.h"
#include "quick_gelu_host.h"

namespace accel {
namespace {

constexpr double kAlpha = 1.702;

using namespace quick_gelu_host;  // dense(), strided_like(): the layouts of the results

at::Tensor quick_gelu_fwd_cpu(const at::Tensor& x_) {
  const auto x = dense(x_);
  auto y = at::empty_like(x);  // x's strides
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "quick_gelu_fwd_cpu", [&] {
    using T = at::opmath_type<scalar_t>;
    vec::map_tiles<scalar_t, T, 1>({x.const_data_ptr<scalar_t>()}, y.mutable_data_ptr<scalar_t>(), x.numel(),
                                   [](const auto& in, T* __restrict__ out, int64_t n) {
                                     const T* __restrict__ v = in[0];
                                     for (int64_t i = 0; i < n; ++i) out[i] = v[i] * vec::sigmoid(T(kAlpha) * v[i]);
                                   });
  });
  return y;
}

// d/dx [x s(a x)] = s + a x s (1 - s), multiplied in the order x s (1 - s) a (that of autograd through
// x * torch.sigmoid(a * x)): x s and s (1 - s) are 0 wherever s saturates, where a x may already have
// overflowed (|x| > FLT_MAX / a) and a x s would be inf * 0 = NaN or inf times a subnormal.
// dx has x's layout (the gradient of a leaf then needs no re-layout for .grad), whatever grad's is.
at::Tensor quick_gelu_bwd_cpu(const at::Tensor& grad_, const at::Tensor& x_) {
  TORCH_CHECK(grad_.sizes() == x_.sizes(), "quick_gelu_bwd: grad and x differ in shape");
  TORCH_CHECK(grad_.scalar_type() == x_.scalar_type(), "quick_gelu_bwd: grad must have x's dtype ",
              x_.scalar_type());
  const auto x = dense(x_);
  const auto grad = strided_like(grad_, x);
  auto dx = at::empty_like(x);  // x's strides
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "quick_gelu_bwd_cpu", [&] {
    using T = at::opmath_type<scalar_t>;
    vec::map_tiles<scalar_t, T, 2>(
        {grad.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>()}, dx.mutable_data_ptr<scalar_t>(), x.numel(),
        [](const auto& in, T* __restrict__ out, int64_t n) {
          const T* __restrict__ g = in[0];
          const T* __restrict__ v = in[1];
          for (int64_t i = 0; i < n; ++i) {
            const T s = vec::sigmoid(T(kAlpha) * v[i]);
            out[i] = g[i] * (s + v[i] * s * (T(1) - s) * T(kAlpha));
          }
        });
  });
  return dx;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(accel, m) {
  m.def("quick_gelu_fwd(Tensor x) -> Tensor");
  m.def("quick_gelu_bwd(Tensor grad, Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(accel, CPU, m) {
  m.impl("quick_gelu_fwd", &quick_gelu_fwd_cpu);
  m.impl("quick_gelu_bwd", &quick_gelu_bwd_cpu);
}

}  // namespace accel
