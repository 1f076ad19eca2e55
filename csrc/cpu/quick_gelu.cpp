// QuickGELU, y = x * sigmoid(1.702 x), and its backward, on CPU.
// Half and bfloat16 are computed in float (at::opmath_type) and rounded once on store.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <cmath>

namespace accel {
namespace {

constexpr double kAlpha = 1.702;

template <typename T>
inline T sigmoid(T v) {
  return T(1) / (T(1) + std::exp(-v));
}

at::Tensor quick_gelu_cpu(const at::Tensor& x_) {
  auto x = x_.contiguous();
  auto y = at::empty_like(x);
  const int64_t n = x.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "quick_gelu_cpu", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* in = x.const_data_ptr<scalar_t>();
    scalar_t* out = y.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, n, 16384, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const opmath_t v = static_cast<opmath_t>(in[i]);
        out[i] = static_cast<scalar_t>(v * sigmoid<opmath_t>(opmath_t(kAlpha) * v));
      }
    });
  });
  return y;
}

// d/dx [x s(a x)] = s + a x s (1 - s)
at::Tensor quick_gelu_backward_cpu(const at::Tensor& grad_, const at::Tensor& x_) {
  auto x = x_.contiguous();
  auto grad = grad_.contiguous();
  TORCH_CHECK(grad.sizes() == x.sizes(), "quick_gelu_backward: grad and x differ in shape");
  auto dx = at::empty_like(x);
  const int64_t n = x.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "quick_gelu_backward_cpu", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* in = x.const_data_ptr<scalar_t>();
    const scalar_t* g = grad.const_data_ptr<scalar_t>();
    scalar_t* out = dx.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, n, 16384, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const opmath_t v = static_cast<opmath_t>(in[i]);
        const opmath_t s = sigmoid<opmath_t>(opmath_t(kAlpha) * v);
        const opmath_t d = s + opmath_t(kAlpha) * v * s * (opmath_t(1) - s);
        out[i] = static_cast<scalar_t>(static_cast<opmath_t>(g[i]) * d);
      }
    });
  });
  return dx;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(accel, m) {
  m.def("quick_gelu(Tensor x) -> Tensor");
  m.def("quick_gelu_backward(Tensor grad, Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(accel, CPU, m) {
  m.impl("quick_gelu", &quick_gelu_cpu);
  m.impl("quick_gelu_backward", &quick_gelu_backward_cpu);
}

}  // namespace accel
