// QuickGELU, y = x * sigmoid(1.702 x), and its backward, on CPU.
// Half and bfloat16 are computed in float (at::opmath_type) and rounded once on store.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>
#include <torch/types.h>

#include "cpu/vec_math.h"

namespace accel {
namespace {

constexpr double kAlpha = 1.702;

// Layouts, as torch's elementwise ops lay out their results: the output has x's strides when x is
// non-overlapping and dense (contiguous, channels-last, any permutation of dims), at::empty_like(x)'s
// dense strides in x's order of dims otherwise (a slice with gaps). Every tensor a kernel reads or
// writes then fills the numel() elements from its data pointer in one and the same order, so the
// kernels run over memory in storage order, whatever that order is.

// x itself when it is non-overlapping and dense, else a copy laid out as at::empty_like(x) (the clone
// of torch's default preserve_format).
at::Tensor dense(const at::Tensor& x) { return x.is_non_overlapping_and_dense() ? x : x.clone(); }

// t (of like's shape) if it has the strides of like (dense), else a copy with like's strides. Strides of
// size-1 dims are never used, so they need not agree.
at::Tensor strided_like(const at::Tensor& t, const at::Tensor& like) {
  for (int64_t d = 0; d < like.dim(); ++d) {
    if (like.size(d) != 1 && t.stride(d) != like.stride(d)) {
      auto copy = at::empty_like(like);
      copy.copy_(t);
      return copy;
    }
  }
  return t;
}

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
