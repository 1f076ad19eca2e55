// Fused bias-dropout-add, out = residual + dropout(x + bias, p), and its backward, on CUDA.
//
// Same mask as the CPU kernels (csrc/cpu/bias_dropout_add.cpp): element i of the flattened x is kept
// when word i % 4 of Philox-4x32-10(key = seed, counter = (offset, i / 4)) is below (1 - p) * 2^32.
// Each thread handles blocks of 4 elements, so one Philox call serves one vectorized load.
// (seed, offset) come from the CUDA generator's philox_cuda_state (graph-capture safe: unpacked on
// the device); the forward writes them to rng_state, from which the backward regenerates the mask.
// Memory-bound: 64-bit indices, 4-wide vector loads when aligned, fp32 math for half/bfloat16.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/PhiloxRNGEngine.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/PhiloxUtils.cuh>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>
#include <torch/types.h>

#include <cmath>
#include <mutex>

namespace accel {
namespace {

template <typename T>
struct alignas(4 * sizeof(T)) Vec4 {
  T v[4];
};

inline uint64_t keep_threshold(double p) {
  return static_cast<uint64_t>(std::floor((1.0 - p) * 4294967296.0));
}

inline double keep_scale(double p) { return p < 1.0 ? 1.0 / (1.0 - p) : 0.0; }

__device__ __forceinline__ void philox_draws(uint64_t seed, uint64_t offset, int64_t blk, uint32_t (&d)[4]) {
  at::Philox4_32 engine(seed, static_cast<uint64_t>(blk), offset);
  d[0] = engine();
  d[1] = engine();
  d[2] = engine();
  d[3] = engine();
}

// kVec: all pointers 16-element-aligned for Vec4 and n % 4 == 0, so every block is a full vector.
template <typename scalar_t, bool kDropout, bool kVec>
__global__ void bias_dropout_add_fwd_kernel(const scalar_t* __restrict__ x, const scalar_t* __restrict__ bias,
                                            const scalar_t* __restrict__ residual, scalar_t* __restrict__ out,
                                            int64_t n, int64_t cols, at::PhiloxCudaState philox,
                                            int64_t* __restrict__ rng_state, uint64_t threshold, double scale) {
  using opmath_t = at::opmath_type<scalar_t>;
  uint64_t seed = 0, offset = 0;
  if constexpr (kDropout) {
    auto unpacked = at::cuda::philox::unpack(philox);
    seed = std::get<0>(unpacked);
    offset = std::get<1>(unpacked);
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      rng_state[0] = static_cast<int64_t>(seed);
      rng_state[1] = static_cast<int64_t>(offset);
    }
  }
  const int64_t blocks = (n + 3) / 4;
  for (int64_t blk = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; blk < blocks;
       blk += (int64_t)gridDim.x * blockDim.x) {
    uint32_t d[4] = {0, 0, 0, 0};
    if constexpr (kDropout) philox_draws(seed, offset, blk, d);
    const int64_t base = blk * 4;
    scalar_t xv[4], rv[4], ov[4];
    if constexpr (kVec) {
      const Vec4<scalar_t> xl = reinterpret_cast<const Vec4<scalar_t>*>(x)[blk];
      const Vec4<scalar_t> rl = reinterpret_cast<const Vec4<scalar_t>*>(residual)[blk];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        xv[k] = xl.v[k];
        rv[k] = rl.v[k];
      }
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const bool in = base + k < n;
        xv[k] = in ? x[base + k] : scalar_t(0);
        rv[k] = in ? residual[base + k] : scalar_t(0);
      }
    }
    int64_t col = bias != nullptr ? base % cols : 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      opmath_t v = static_cast<opmath_t>(xv[k]);
      if (bias != nullptr) {
        v += static_cast<opmath_t>(bias[col]);
        if (++col == cols) col = 0;
      }
      if constexpr (kDropout) v = static_cast<uint64_t>(d[k]) < threshold ? v * static_cast<opmath_t>(scale) : opmath_t(0);
      ov[k] = static_cast<scalar_t>(static_cast<opmath_t>(rv[k]) + v);
    }
    if constexpr (kVec) {
      Vec4<scalar_t> ol;
#pragma unroll
      for (int k = 0; k < 4; ++k) ol.v[k] = ov[k];
      reinterpret_cast<Vec4<scalar_t>*>(out)[blk] = ol;
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k)
        if (base + k < n) out[base + k] = ov[k];
    }
  }
}

template <typename scalar_t, bool kVec>
__global__ void bias_dropout_add_bwd_kernel(const scalar_t* __restrict__ grad, scalar_t* __restrict__ dx,
                                            int64_t n, const int64_t* __restrict__ rng_state,
                                            uint64_t threshold, double scale) {
  using opmath_t = at::opmath_type<scalar_t>;
  const uint64_t seed = static_cast<uint64_t>(rng_state[0]);
  const uint64_t offset = static_cast<uint64_t>(rng_state[1]);
  const int64_t blocks = (n + 3) / 4;
  for (int64_t blk = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; blk < blocks;
       blk += (int64_t)gridDim.x * blockDim.x) {
    uint32_t d[4];
    philox_draws(seed, offset, blk, d);
    const int64_t base = blk * 4;
    if constexpr (kVec) {
      const Vec4<scalar_t> gl = reinterpret_cast<const Vec4<scalar_t>*>(grad)[blk];
      Vec4<scalar_t> ol;
#pragma unroll
      for (int k = 0; k < 4; ++k)
        ol.v[k] = static_cast<uint64_t>(d[k]) < threshold
                      ? static_cast<scalar_t>(static_cast<opmath_t>(gl.v[k]) * static_cast<opmath_t>(scale))
                      : scalar_t(0);
      reinterpret_cast<Vec4<scalar_t>*>(dx)[blk] = ol;
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if (base + k < n) {
          dx[base + k] = static_cast<uint64_t>(d[k]) < threshold
                             ? static_cast<scalar_t>(static_cast<opmath_t>(grad[base + k]) * static_cast<opmath_t>(scale))
                             : scalar_t(0);
        }
      }
    }
  }
}

inline unsigned grid_for(int64_t work_items, int threads) {
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t blocks = std::min<int64_t>((work_items + threads - 1) / threads, sms * 32);
  return static_cast<unsigned>(std::max<int64_t>(blocks, 1));
}

inline bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

std::tuple<at::Tensor, at::Tensor> bias_dropout_add_fwd_cuda(const at::Tensor& x_,
                                                             const std::optional<at::Tensor>& bias_,
                                                             const at::Tensor& residual_, double p, bool train) {
  TORCH_CHECK(p >= 0.0 && p <= 1.0, "bias_dropout_add: p must be in [0, 1], got ", p);
  c10::cuda::CUDAGuard guard(x_.device());
  auto x = x_.contiguous();
  auto residual = residual_.contiguous();
  TORCH_CHECK(residual.sizes() == x.sizes(), "bias_dropout_add: residual and x differ in shape");
  TORCH_CHECK(residual.scalar_type() == x.scalar_type(), "bias_dropout_add: residual and x differ in dtype");
  const bool has_bias = bias_.has_value() && bias_->defined();
  at::Tensor bias;
  int64_t cols = 1;
  if (has_bias) {
    bias = bias_->contiguous();
    TORCH_CHECK(x.dim() >= 1 && bias.dim() == 1 && bias.size(0) == x.size(-1),
                "bias_dropout_add: bias must have shape (x.size(-1),)");
    TORCH_CHECK(bias.scalar_type() == x.scalar_type(), "bias_dropout_add: bias and x differ in dtype");
    cols = std::max<int64_t>(bias.size(0), 1);
  }
  auto out = at::empty_like(x);
  auto rng_state = at::zeros({2}, x.options().dtype(at::kLong));
  const int64_t n = x.numel();
  const bool dropout = train && p > 0.0;
  if (n == 0) return {out, rng_state};

  constexpr int threads = 256;
  const int64_t blocks4 = (n + 3) / 4;
  const unsigned grid = grid_for(blocks4, threads);
  at::PhiloxCudaState philox;
  if (dropout) {
    // Each thread takes one Philox counter per 4-element block at subsequence = block index, so a
    // call uses counter offsets [offset, offset + 1); reserve 4 to keep PyTorch's multiple-of-4 habit.
    auto gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(std::nullopt, at::cuda::detail::getDefaultCUDAGenerator());
    std::lock_guard<std::mutex> lock(gen->mutex_);
    philox = gen->philox_cuda_state(4);
  }
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "bias_dropout_add_fwd_cuda", [&] {
    const scalar_t* b = has_bias ? bias.const_data_ptr<scalar_t>() : nullptr;
    const size_t vbytes = 4 * sizeof(scalar_t);
    const bool vec = n % 4 == 0 && aligned(x.const_data_ptr(), vbytes) && aligned(residual.const_data_ptr(), vbytes) &&
                     aligned(out.const_data_ptr(), vbytes);
    const uint64_t threshold = keep_threshold(p);
    const double scale = keep_scale(p);
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* rp = residual.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    int64_t* sp = rng_state.mutable_data_ptr<int64_t>();
    if (dropout && vec) {
      bias_dropout_add_fwd_kernel<scalar_t, true, true><<<grid, threads, 0, stream>>>(xp, b, rp, op, n, cols, philox, sp, threshold, scale);
    } else if (dropout) {
      bias_dropout_add_fwd_kernel<scalar_t, true, false><<<grid, threads, 0, stream>>>(xp, b, rp, op, n, cols, philox, sp, threshold, scale);
    } else if (vec) {
      bias_dropout_add_fwd_kernel<scalar_t, false, true><<<grid, threads, 0, stream>>>(xp, b, rp, op, n, cols, philox, sp, threshold, scale);
    } else {
      bias_dropout_add_fwd_kernel<scalar_t, false, false><<<grid, threads, 0, stream>>>(xp, b, rp, op, n, cols, philox, sp, threshold, scale);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, rng_state};
}

at::Tensor bias_dropout_add_bwd_cuda(const at::Tensor& grad_, const at::Tensor& rng_state_, double p) {
  TORCH_CHECK(p >= 0.0 && p <= 1.0, "bias_dropout_add: p must be in [0, 1], got ", p);
  TORCH_CHECK(rng_state_.scalar_type() == at::kLong && rng_state_.numel() == 2,
              "bias_dropout_add_bwd: rng_state must be 2 int64 values");
  c10::cuda::CUDAGuard guard(grad_.device());
  auto grad = grad_.contiguous();
  auto rng_state = rng_state_.to(grad.device()).contiguous();
  auto dx = at::empty_like(grad);
  const int64_t n = grad.numel();
  if (n == 0) return dx;
  constexpr int threads = 256;
  const unsigned grid = grid_for((n + 3) / 4, threads);
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "bias_dropout_add_bwd_cuda", [&] {
    const size_t vbytes = 4 * sizeof(scalar_t);
    const bool vec = n % 4 == 0 && aligned(grad.const_data_ptr(), vbytes) && aligned(dx.const_data_ptr(), vbytes);
    const uint64_t threshold = keep_threshold(p);
    const double scale = keep_scale(p);
    if (vec) {
      bias_dropout_add_bwd_kernel<scalar_t, true><<<grid, threads, 0, stream>>>(
          grad.const_data_ptr<scalar_t>(), dx.mutable_data_ptr<scalar_t>(), n, rng_state.const_data_ptr<int64_t>(),
          threshold, scale);
    } else {
      bias_dropout_add_bwd_kernel<scalar_t, false><<<grid, threads, 0, stream>>>(
          grad.const_data_ptr<scalar_t>(), dx.mutable_data_ptr<scalar_t>(), n, rng_state.const_data_ptr<int64_t>(),
          threshold, scale);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return dx;
}

}  // namespace

TORCH_LIBRARY_IMPL(accel, CUDA, m) {
  m.impl("bias_dropout_add_fwd", &bias_dropout_add_fwd_cuda);
  m.impl("bias_dropout_add_bwd", &bias_dropout_add_bwd_cuda);
}

}  // namespace accel
