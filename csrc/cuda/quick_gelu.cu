// QuickGELU, y = x * sigmoid(1.702 x), and its backward, on CUDA.
// Memory-bound: a grid-stride loop with 64-bit indices; half/bfloat16 computed in float.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>
#include <torch/types.h>

namespace accel {
namespace {

constexpr float kAlpha = 1.702f;

__device__ __forceinline__ float sigmoidf(float v) { return 1.f / (1.f + __expf(-v)); }
__device__ __forceinline__ double sigmoidf(double v) { return 1.0 / (1.0 + exp(-v)); }

template <typename scalar_t>
__global__ void quick_gelu_kernel(const scalar_t* __restrict__ x, scalar_t* __restrict__ y, int64_t n) {
  using opmath_t = at::opmath_type<scalar_t>;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const opmath_t v = static_cast<opmath_t>(x[i]);
    y[i] = static_cast<scalar_t>(v * sigmoidf(opmath_t(kAlpha) * v));
  }
}

template <typename scalar_t>
__global__ void quick_gelu_backward_kernel(const scalar_t* __restrict__ g, const scalar_t* __restrict__ x,
                                           scalar_t* __restrict__ dx, int64_t n) {
  using opmath_t = at::opmath_type<scalar_t>;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const opmath_t v = static_cast<opmath_t>(x[i]);
    const opmath_t s = sigmoidf(opmath_t(kAlpha) * v);
    dx[i] = static_cast<scalar_t>(static_cast<opmath_t>(g[i]) * (s + opmath_t(kAlpha) * v * s * (opmath_t(1) - s)));
  }
}

inline dim3 grid_for(int64_t n, int threads) {
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t blocks = std::min<int64_t>((n + threads - 1) / threads, sms * 32);
  return dim3(static_cast<unsigned>(std::max<int64_t>(blocks, 1)));
}

at::Tensor quick_gelu_cuda(const at::Tensor& x_) {
  c10::cuda::CUDAGuard guard(x_.device());
  auto x = x_.contiguous();
  auto y = at::empty_like(x);
  const int64_t n = x.numel();
  if (n == 0) return y;
  constexpr int threads = 256;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "quick_gelu_cuda", [&] {
    quick_gelu_kernel<scalar_t><<<grid_for(n, threads), threads, 0, at::cuda::getCurrentCUDAStream()>>>(
        x.const_data_ptr<scalar_t>(), y.mutable_data_ptr<scalar_t>(), n);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

at::Tensor quick_gelu_backward_cuda(const at::Tensor& grad_, const at::Tensor& x_) {
  c10::cuda::CUDAGuard guard(x_.device());
  auto x = x_.contiguous();
  auto grad = grad_.contiguous();
  TORCH_CHECK(grad.sizes() == x.sizes(), "quick_gelu_backward: grad and x differ in shape");
  auto dx = at::empty_like(x);
  const int64_t n = x.numel();
  if (n == 0) return dx;
  constexpr int threads = 256;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "quick_gelu_backward_cuda", [&] {
    quick_gelu_backward_kernel<scalar_t><<<grid_for(n, threads), threads, 0, at::cuda::getCurrentCUDAStream()>>>(
        grad.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), dx.mutable_data_ptr<scalar_t>(), n);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return dx;
}

}  // namespace

TORCH_LIBRARY_IMPL(accel, CUDA, m) {
  m.impl("quick_gelu", &quick_gelu_cuda);
  m.impl("quick_gelu_backward", &quick_gelu_backward_cuda);
}

}  // namespace accel
