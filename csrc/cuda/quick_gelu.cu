// QuickGELU, y = x * sigmoid(1.702 x), and its backward, on CUDA.
//
// Memory-bound: one grid-stride kernel for both directions, 16-byte vector loads and stores when
// every pointer is 16-byte aligned (a view such as x[1:] takes the scalar instantiation), the last
// n % VEC elements one per thread. 64-bit indices; half/bfloat16 computed in float. Layouts as on the
// CPU (csrc/cpu/quick_gelu.cpp): the output keeps x's strides when x is non-overlapping and dense
// (channels-last, permuted), and the kernel runs over the inputs' and the output's memory in storage
// order, all of them laid out alike.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>
#include <torch/types.h>

#include "quick_gelu_host.h"

#include <algorithm>
#include <cstdint>

namespace accel {
namespace {

// A double, so that float64 uses 1.702 itself; float(1.702) is the float32 constant.
constexpr double kAlpha = 1.702;
constexpr int kThreads = 256;

// expf, not __expf: the fast intrinsic's error grows with |x| (tens of ulps at |x| ~ 20), and a
// memory-bound kernel gains nothing from it. For very negative v, expf(-v) overflows to inf (so does
// a v itself beyond FLT_MAX / a) and the IEEE division gives s = 0 exactly, hence x s = -0 as in
// plain PyTorch; a clamped exponential would leave a finite s that x * s scales up.
__device__ __forceinline__ float sigmoid(float v) { return 1.f / (1.f + expf(-v)); }
__device__ __forceinline__ double sigmoid(double v) { return 1.0 / (1.0 + exp(-v)); }

struct QuickGeluForward {
  static constexpr int kInputs = 1;  // x
  template <typename A>
  __device__ __forceinline__ A operator()(const A* in) const {
    const A v = in[0];
    return v * sigmoid(A(kAlpha) * v);
  }
};

// d/dx [x s(a x)] = s + a x s (1 - s), multiplied as x s (1 - s) a, as the CPU kernel does: where s
// saturates to 0 or 1 the product is 0 before a x (inf beyond |x| > FLT_MAX / a) can enter it.
struct QuickGeluBackward {
  static constexpr int kInputs = 2;  // grad, x
  template <typename A>
  __device__ __forceinline__ A operator()(const A* in) const {
    const A g = in[0], v = in[1];
    const A s = sigmoid(A(kAlpha) * v);
    return g * (s + v * s * (A(1) - s) * A(kAlpha));
  }
};

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

template <typename T>
struct Inputs {
  const T* p[2];
};

// out[i] = op(in[0][i], ...) over n elements, VEC at a time; VEC == 1 is the unaligned fallback.
template <typename Op, typename scalar_t, int VEC>
__global__ void __launch_bounds__(kThreads) map_kernel(Inputs<scalar_t> in, scalar_t* __restrict__ out, int64_t n,
                                                      Op op) {
  using A = at::opmath_type<scalar_t>;
  using V = Pack<scalar_t, VEC>;
  const int64_t first = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  const int64_t packs = n / VEC;
  for (int64_t k = first; k < packs; k += stride) {
    V p[Op::kInputs];
#pragma unroll
    for (int j = 0; j < Op::kInputs; ++j) p[j] = reinterpret_cast<const V*>(in.p[j])[k];
    V o;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      A a[Op::kInputs];
#pragma unroll
      for (int j = 0; j < Op::kInputs; ++j) a[j] = static_cast<A>(p[j].v[e]);
      o.v[e] = static_cast<scalar_t>(op(a));
    }
    reinterpret_cast<V*>(out)[k] = o;
  }
  // the tail of fewer than VEC elements (none when VEC == 1)
  for (int64_t i = packs * VEC + first; i < n; i += stride) {
    A a[Op::kInputs];
#pragma unroll
    for (int j = 0; j < Op::kInputs; ++j) a[j] = static_cast<A>(in.p[j][i]);
    out[i] = static_cast<scalar_t>(op(a));
  }
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

using namespace quick_gelu_host;  // dense(), strided_like(): the layouts of the results

// Runs op over the inputs (one shape, dtype, device and dense layout: their numel() elements from each
// data pointer, in one order) into a new tensor with x's strides (x dense). The result takes x's strides,
// not those of another input: where they differ only in a size-1 dim's stride (a contiguous grad of a
// channels-last x with one channel), both orders agree but the fake kernel and the CPU give x's.
template <typename Op>
at::Tensor map(const at::Tensor& x, const at::Tensor* const* ins) {
  auto out = at::empty_like(x);
  const int64_t n = x.numel();
  if (n == 0) return out;  // a grid must not be empty
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "quick_gelu_fwd_cuda", [&] {
    constexpr int VEC = 16 / sizeof(scalar_t);
    Inputs<scalar_t> in{};
    bool vec_ok = aligned16(out.const_data_ptr());
    for (int j = 0; j < Op::kInputs; ++j) {
      in.p[j] = ins[j]->const_data_ptr<scalar_t>();
      vec_ok = vec_ok && aligned16(in.p[j]);
    }
    const int vec = vec_ok ? VEC : 1;
    // Enough blocks for every SM many times over (8 resident blocks of 256 per SM, 4 waves);
    // the grid-stride loop covers the rest.
    const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    const int64_t work = std::max<int64_t>(n / vec, 1);
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((work + kThreads - 1) / kThreads, sms * 32));
    auto stream = at::cuda::getCurrentCUDAStream();
    if (vec_ok) {
      map_kernel<Op, scalar_t, VEC><<<blocks, kThreads, 0, stream>>>(in, out.mutable_data_ptr<scalar_t>(), n, Op());
    } else {
      map_kernel<Op, scalar_t, 1><<<blocks, kThreads, 0, stream>>>(in, out.mutable_data_ptr<scalar_t>(), n, Op());
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor quick_gelu_fwd_cuda(const at::Tensor& x_) {
  c10::cuda::CUDAGuard guard(x_.device());
  const auto x = dense(x_);
  const at::Tensor* ins[] = {&x};
  return map<QuickGeluForward>(x, ins);
}

at::Tensor quick_gelu_bwd_cuda(const at::Tensor& grad_, const at::Tensor& x_) {
  c10::cuda::CUDAGuard guard(x_.device());
  TORCH_CHECK(grad_.sizes() == x_.sizes(), "quick_gelu_bwd: grad and x differ in shape");
  TORCH_CHECK(grad_.scalar_type() == x_.scalar_type() && grad_.device() == x_.device(),
              "quick_gelu_bwd: grad must have x's dtype and device (", x_.scalar_type(), " on ", x_.device(), ")");
  const auto x = dense(x_);  // dx has x's layout, whatever grad's is
  const auto grad = strided_like(grad_, x);
  const at::Tensor* ins[] = {&grad, &x};
  return map<QuickGeluBackward>(x, ins);
}

}  // namespace

TORCH_LIBRARY_IMPL(accel, CUDA, m) {
  m.impl("quick_gelu_fwd", &quick_gelu_fwd_cuda);
  m.impl("quick_gelu_bwd", &quick_gelu_bwd_cuda);
}

}  // namespace accel
