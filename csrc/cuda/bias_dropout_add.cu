// Fused bias-dropout-add, out = residual + dropout(x + bias, p), and its backward, on CUDA.
//
// Same mask as the CPU kernels (csrc/cpu/bias_dropout_add.cpp): element i of the flattened x is kept
// when word i % 4 of Philox-4x32-10(key = seed, counter = (c, i / 4)) is below (1 - p) * 2^32, where
// (seed, c) = rng_state. The mask depends on the element index only, never on the thread mapping,
// so forward and backward (and the CPU backward) regenerate the same mask from rng_state.
// Dropped elements are multiplied by 0, not replaced by 0, so NaN/inf propagate as in torch's
// dropout and the CPU kernel.
//
// (seed, offset) come from the device's CUDA generator (philox_cuda_state under its mutex; unpacked
// on the device, so it works under CUDA graph capture). The generator's offset counts 32-bit draws
// (curand's convention, always a multiple of 4), while a Philox counter step yields 4 draws: one
// call reserves 4 draws per subsequence and uses counter c = offset / 4, which keeps these masks
// disjoint from the streams of torch's own curand-based kernels. The forward writes (seed, c) to
// rng_state for the backward.
// Memory-bound: 64-bit indices, 4-wide vector loads when every pointer is aligned and n % 4 == 0,
// fp32 math for half/bfloat16, no integer division in the grid-stride loop.
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
#include <cstdint>
#include <algorithm>
#include <initializer_list>
#include <mutex>
#include <type_traits>

#include "bias_dropout_add_host.h"
#include "cuda/column_sum.cuh"

namespace accel {
namespace {

using namespace bias_dropout_add_host;

// Generator offset increment per call: one Philox counter (4 draws) per subsequence.
constexpr uint64_t kDrawsPerSubsequence = 4;

template <typename T>
struct alignas(4 * sizeof(T)) Vec4 {
  T v[4];
};

// The 4 elements of group blk (elements 4 blk .. 4 blk + 3). kVec: one aligned vector access
// (the caller checked alignment and n % 4 == 0); otherwise element-wise with the tail masked.
template <typename T, bool kVec>
__device__ __forceinline__ void load4(const T* __restrict__ p, int64_t blk, int64_t n, T (&v)[4]) {
  if constexpr (kVec) {
    const Vec4<T> l = reinterpret_cast<const Vec4<T>*>(p)[blk];
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = l.v[k];
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = 4 * blk + k < n ? p[4 * blk + k] : T(0);
  }
}

template <typename T, bool kVec>
__device__ __forceinline__ void store4(T* __restrict__ p, int64_t blk, int64_t n, const T (&v)[4]) {
  if constexpr (kVec) {
    Vec4<T> l;
#pragma unroll
    for (int k = 0; k < 4; ++k) l.v[k] = v[k];
    reinterpret_cast<Vec4<T>*>(p)[blk] = l;
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (4 * blk + k < n) p[4 * blk + k] = v[k];
  }
}

// The (seed, Philox counter) of one call's reserved state: counter = offset / 4 (see the top of this file).
struct PhiloxKey {
  uint64_t seed, counter;
};

__device__ __forceinline__ PhiloxKey philox_key(const at::PhiloxCudaState& philox) {
  const auto unpacked = at::cuda::philox::unpack(philox);
  return {std::get<0>(unpacked), std::get<1>(unpacked) / kDrawsPerSubsequence};
}

// Multipliers of group blk: scale where kept, 0 where dropped.
template <typename opmath_t>
__device__ __forceinline__ void keep_multipliers(uint64_t seed, uint64_t counter, int64_t blk, uint64_t threshold,
                                                 opmath_t scale, opmath_t (&mult)[4]) {
  at::Philox4_32 engine(seed, static_cast<uint64_t>(blk), counter);
#pragma unroll
  for (int k = 0; k < 4; ++k) mult[k] = static_cast<uint64_t>(engine()) < threshold ? scale : opmath_t(0);
}

// dst = src * the keep multipliers of group blk (scale or 0, in opmath, rounded once), which land in mult:
// dropout's scaling step, forward and backward alike.
template <typename scalar_t, bool kVec>
__device__ __forceinline__ void scale_group(const scalar_t* __restrict__ src, scalar_t* __restrict__ dst, int64_t blk,
                                            int64_t n, uint64_t seed, uint64_t counter, uint64_t threshold,
                                            at::opmath_type<scalar_t> scale, at::opmath_type<scalar_t> (&mult)[4]) {
  using opmath_t = at::opmath_type<scalar_t>;
  keep_multipliers(seed, counter, blk, threshold, scale, mult);
  scalar_t in[4], out[4];
  load4<scalar_t, kVec>(src, blk, n, in);
#pragma unroll
  for (int k = 0; k < 4; ++k) out[k] = static_cast<scalar_t>(static_cast<opmath_t>(in[k]) * mult[k]);
  store4<scalar_t, kVec>(dst, blk, n, out);
}

// keep <=> draw < threshold; kept values are multiplied by scale.
struct Keep {
  uint64_t threshold;
  double scale;
};

// bias may be null (cols is then unused). col_step = (4 * gridDim.x * blockDim.x) % cols, so a
// thread's bias column advances without a division per iteration.
template <typename scalar_t, bool kDropout, bool kVec>
__global__ void bias_dropout_add_fwd_kernel(const scalar_t* __restrict__ x, const scalar_t* __restrict__ bias,
                                            const scalar_t* __restrict__ residual, scalar_t* __restrict__ out,
                                            int64_t n, int64_t cols, int64_t col_step, at::PhiloxCudaState philox,
                                            Keep keep, int64_t* __restrict__ rng_state) {
  using opmath_t = at::opmath_type<scalar_t>;
  uint64_t seed = 0, counter = 0;
  if constexpr (kDropout) {
    const PhiloxKey key = philox_key(philox);
    seed = key.seed;
    counter = key.counter;
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      rng_state[0] = static_cast<int64_t>(seed);
      rng_state[1] = static_cast<int64_t>(counter);
    }
  }
  const opmath_t scale = static_cast<opmath_t>(keep.scale);
  const int64_t groups = (n + 3) / 4;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t col0 = bias != nullptr ? (4 * first) % cols : 0;  // bias column of element 4 blk (one division)
  for (int64_t blk = first; blk < groups; blk += stride) {
    opmath_t mult[4];
    if constexpr (kDropout) keep_multipliers(seed, counter, blk, keep.threshold, scale, mult);
    scalar_t xv[4], rv[4], ov[4];
    load4<scalar_t, kVec>(x, blk, n, xv);
    load4<scalar_t, kVec>(residual, blk, n, rv);
    int64_t col = col0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      opmath_t v = static_cast<opmath_t>(xv[k]);
      if (bias != nullptr) {
        // 4 blk + k may lie past n on the tail; col stays in [0, cols), so the read is in bounds.
        v += static_cast<opmath_t>(bias[col]);
        if (++col == cols) col = 0;
      }
      if constexpr (kDropout) v *= mult[k];
      ov[k] = static_cast<scalar_t>(static_cast<opmath_t>(rv[k]) + v);
    }
    store4<scalar_t, kVec>(out, blk, n, ov);
    if (bias != nullptr) {
      col0 += col_step;
      if (col0 >= cols) col0 -= cols;
    }
  }
}

template <typename scalar_t, bool kVec>
__global__ void bias_dropout_add_bwd_kernel(const scalar_t* __restrict__ grad, scalar_t* __restrict__ dx, int64_t n,
                                            const int64_t* __restrict__ rng_state, Keep keep) {
  using opmath_t = at::opmath_type<scalar_t>;
  const uint64_t seed = static_cast<uint64_t>(rng_state[0]);
  const uint64_t counter = static_cast<uint64_t>(rng_state[1]);
  const opmath_t scale = static_cast<opmath_t>(keep.scale);
  const int64_t groups = (n + 3) / 4;
  for (int64_t blk = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; blk < groups;
       blk += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    opmath_t mult[4];
    scale_group<scalar_t, kVec>(grad, dx, blk, n, seed, counter, keep.threshold, scale, mult);
  }
}

// The backward with the bias gradient in the same pass: grad viewed as [rows, cols] (cols % 4 == 0, every
// pointer aligned to a 4-element vector: 8 bytes for half/bf16, 16 for float), block (kBiasVecs, kBiasRows)
// over kBiasVecs 4-column groups and one chunk of rows (blockIdx.y). Each thread writes dx for its group down
// the chunk's rows and sums the stored (rounded) dx values per column in opmath; the block adds its kBiasRows
// sums in order into partial[chunk][col], and column_sum.cuh adds the chunks in order: dbias = the sum of dx
// over the rows, deterministic, with no second read of dx. The mask is the one of the element index, as in
// every kernel here (cols % 4 == 0 keeps each Philox group of 4 elements within a row).
// Assumptions: blockDim = (kBiasVecs, kBiasRows); gridDim = (ceil(cols / 4 / kBiasVecs), chunks);
// rows_per_chunk * gridDim.y >= rows.
constexpr int kBiasVecs = 32;
constexpr int kBiasRows = 8;

template <typename scalar_t>
__global__ void bias_dropout_add_bwd_bias_kernel(const scalar_t* __restrict__ grad, scalar_t* __restrict__ dx,
                                                 at::opmath_type<scalar_t>* __restrict__ partial, int64_t rows,
                                                 int64_t cols, int64_t rows_per_chunk,
                                                 const int64_t* __restrict__ rng_state, Keep keep) {
  using opmath_t = at::opmath_type<scalar_t>;
  __shared__ opmath_t sums[kBiasRows][4 * kBiasVecs + 1];
  const uint64_t seed = static_cast<uint64_t>(rng_state[0]);
  const uint64_t counter = static_cast<uint64_t>(rng_state[1]);
  const opmath_t scale = static_cast<opmath_t>(keep.scale);
  const int64_t groups_per_row = cols / 4;
  const int64_t cg = (int64_t)blockIdx.x * kBiasVecs + threadIdx.x;  // this thread's 4-column group
  const int64_t r0 = (int64_t)blockIdx.y * rows_per_chunk;
  const int64_t r1 = min(rows, r0 + rows_per_chunk);
  opmath_t acc[4] = {0, 0, 0, 0};
  if (cg < groups_per_row) {
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kBiasRows) {
      const int64_t blk = r * groups_per_row + cg;
      opmath_t mult[4];
      keep_multipliers(seed, counter, blk, keep.threshold, scale, mult);
      scalar_t gv[4], ov[4];
      load4<scalar_t, true>(grad, blk, 0, gv);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        ov[k] = static_cast<scalar_t>(static_cast<opmath_t>(gv[k]) * mult[k]);
        acc[k] += static_cast<opmath_t>(ov[k]);
      }
      store4<scalar_t, true>(dx, blk, 0, ov);
    }
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) sums[threadIdx.y][4 * threadIdx.x + k] = acc[k];
  __syncthreads();
  if (threadIdx.y != 0 || cg >= groups_per_row) return;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    opmath_t sum = acc[k];
    for (int i = 1; i < kBiasRows; ++i) sum += sums[i][4 * threadIdx.x + k];
    partial[(int64_t)blockIdx.y * cols + 4 * cg + k] = sum;
  }
}

constexpr int kThreads = 256;

// Enough blocks to fill every SM several times over; the grid-stride loop takes the rest.
inline int64_t grid_for(int64_t groups) {
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return std::max<int64_t>(1, std::min<int64_t>((groups + kThreads - 1) / kThreads, sms * 32));
}

// Vector path: n % 4 == 0 and every pointer aligned to a whole Vec4 (a view with a storage offset
// may not be).
template <typename scalar_t>
bool vectorizable(int64_t n, std::initializer_list<const void*> ptrs) {
  if (n % 4 != 0) return false;
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % sizeof(Vec4<scalar_t>) != 0) return false;
  return true;
}

// Calls f(std::bool_constant<b>()) so a runtime flag selects a kernel instantiation.
template <typename F>
void with_bool(bool b, F&& f) {
  if (b) {
    f(std::true_type());
  } else {
    f(std::false_type());
  }
}

// One call's (seed, offset) from `device`'s default generator, under its mutex: 4 draws per subsequence.
at::PhiloxCudaState reserve_philox(c10::DeviceIndex device) {
  auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
      std::nullopt, at::cuda::detail::getDefaultCUDAGenerator(device));
  std::lock_guard<std::mutex> lock(gen->mutex_);
  return gen->philox_cuda_state(kDrawsPerSubsequence);
}

std::tuple<at::Tensor, at::Tensor> bias_dropout_add_fwd_cuda(const at::Tensor& x_,
                                                             const std::optional<at::Tensor>& bias_,
                                                             const at::Tensor& residual_, double p, bool train) {
  check_p(p);
  TORCH_CHECK(residual_.device() == x_.device(), "bias_dropout_add: residual must be on ", x_.device());
  c10::cuda::CUDAGuard guard(x_.device());
  auto x = x_.contiguous();
  auto residual = residual_.contiguous();
  TORCH_CHECK(residual.sizes() == x.sizes(), "bias_dropout_add: residual and x differ in shape");
  TORCH_CHECK(residual.scalar_type() == x.scalar_type(), "bias_dropout_add: residual and x differ in dtype");
  const bool has_bias = bias_.has_value() && bias_->defined();
  at::Tensor bias;
  int64_t cols = 1;
  if (has_bias) {
    TORCH_CHECK(bias_->device() == x.device(), "bias_dropout_add: bias must be on ", x.device());
    bias = bias_->contiguous();
    TORCH_CHECK(x.dim() >= 1 && bias.dim() == 1 && bias.size(0) == x.size(-1),
                "bias_dropout_add: bias must have shape (x.size(-1),)");
    TORCH_CHECK(bias.scalar_type() == x.scalar_type(), "bias_dropout_add: bias and x differ in dtype");
    cols = std::max<int64_t>(bias.size(0), 1);
  }
  auto out = at::empty_like(x);
  const int64_t n = x.numel();
  const bool dropout = train && p > 0.0;
  // [0, 0] when nothing is drawn (as on CPU); otherwise the forward kernel writes it.
  auto rng_state = dropout && n > 0 ? at::empty({2}, x.options().dtype(at::kLong))
                                    : at::zeros({2}, x.options().dtype(at::kLong));
  if (n == 0) return {out, rng_state};

  const int64_t grid = grid_for((n + 3) / 4);
  const int64_t col_step = (4 * grid * kThreads) % cols;
  const Keep keep{keep_threshold(p), keep_scale(p)};
  const at::PhiloxCudaState philox = dropout ? reserve_philox(x.get_device()) : at::PhiloxCudaState();
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "bias_dropout_add_fwd_cuda", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* rp = residual.const_data_ptr<scalar_t>();
    const scalar_t* bp = has_bias ? bias.const_data_ptr<scalar_t>() : nullptr;
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    with_bool(dropout, [&](auto kDropout) {
      with_bool(vectorizable<scalar_t>(n, {xp, rp, op}), [&](auto kVec) {
        bias_dropout_add_fwd_kernel<scalar_t, decltype(kDropout)::value, decltype(kVec)::value>
            <<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(xp, bp, rp, op, n, cols, col_step, philox, keep,
                                                                   rng_state.mutable_data_ptr<int64_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  });
  return {out, rng_state};
}

// Returns (dx, dbias): dbias = dx summed over every dim but the last, in grad's dtype, when bias_grad
// (else an empty tensor). Both in one pass where the rows allow it (bias_dropout_add_bwd_bias_kernel);
// otherwise dx, then the shared row sum.
std::tuple<at::Tensor, at::Tensor> bias_dropout_add_bwd_cuda(const at::Tensor& grad_, const at::Tensor& rng_state_,
                                                             double p, bool bias_grad) {
  check_bwd_args(grad_, rng_state_, p, bias_grad);
  c10::cuda::CUDAGuard guard(grad_.device());
  auto grad = grad_.contiguous();
  auto rng_state = rng_state_.to(grad.device()).contiguous();
  auto dx = at::empty_like(grad);
  const int64_t n = grad.numel();
  const int64_t cols = bias_grad ? grad.size(-1) : 1;
  const Keep keep{keep_threshold(p), keep_scale(p)};
  auto stream = at::cuda::getCurrentCUDAStream();
  at::Tensor dbias;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "bias_dropout_add_bwd_cuda", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* gp = grad.const_data_ptr<scalar_t>();
    scalar_t* dp = dx.mutable_data_ptr<scalar_t>();
    const bool vec = vectorizable<scalar_t>(n, {gp, dp});
    if (bias_grad && n > 0 && vec && cols % 4 == 0) {
      const int64_t rows = n / cols;
      const int64_t col_tiles = (cols / 4 + kBiasVecs - 1) / kBiasVecs;
      const auto [chunks, rows_per_chunk] = column_sum::row_chunks(rows, col_tiles, 4 * kBiasRows);  // 4 rows a thread
      TORCH_CHECK(col_tiles <= 0x7fffffff, "bias_dropout_add_bwd: ", cols, " columns are too many");
      auto partial = at::empty({chunks, cols}, grad.options().dtype(c10::CppTypeToScalarType<opmath_t>::value));
      bias_dropout_add_bwd_bias_kernel<scalar_t><<<dim3((unsigned)col_tiles, (unsigned)chunks), dim3(kBiasVecs, kBiasRows), 0,
                                                   stream>>>(gp, dp, partial.mutable_data_ptr<opmath_t>(), rows, cols,
                                                             rows_per_chunk, rng_state.const_data_ptr<int64_t>(), keep);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      dbias = at::empty({cols}, grad.options());
      column_sum::launch<opmath_t, scalar_t>(partial.const_data_ptr<opmath_t>(), chunks, cols, cols,
                                             dbias.mutable_data_ptr<scalar_t>(), nullptr, stream);
      return;
    }
    if (n == 0) return;
    const int64_t grid = grid_for((n + 3) / 4);
    with_bool(vec, [&](auto kVec) {
      bias_dropout_add_bwd_kernel<scalar_t, decltype(kVec)::value><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
          gp, dp, n, rng_state.const_data_ptr<int64_t>(), keep);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  if (!dbias.defined()) dbias = bias_grad_of(dx, bias_grad);
  return {dx, dbias};
}

// Assumptions: mask holds n bools, aligned to 4 bytes (at::empty's); any grid (grid-stride over groups of 4
// elements); philox reserved 4 draws per subsequence. Byte i is 1 where element i is kept, by the forward's keep
// rule. A whole group's 4 bytes go out in one 4-byte store (a warp's 128 bytes in one instruction, not four
// instructions of a byte a lane).
__global__ void dropout_mask_kernel(bool* __restrict__ mask, int64_t n, at::PhiloxCudaState philox,
                                    uint64_t threshold) {
  const auto [seed, counter] = philox_key(philox);
  const int64_t groups = (n + 3) / 4;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t blk = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; blk < groups; blk += stride) {
    at::Philox4_32 engine(seed, static_cast<uint64_t>(blk), counter);
    uint32_t bytes = 0;  // little-endian: byte k is element 4 * blk + k
#pragma unroll
    for (int k = 0; k < 4; ++k) bytes |= static_cast<uint32_t>(static_cast<uint64_t>(engine()) < threshold) << (8 * k);
    if (4 * blk + 3 < n) {
      reinterpret_cast<uint32_t*>(mask)[blk] = bytes;
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k)
        if (4 * blk + k < n) mask[4 * blk + k] = (bytes >> (8 * k)) & 1u;
    }
  }
}

// dropout_mask on CUDA (csrc/cpu/bias_dropout_add.cpp says what it returns); (seed, offset) from the
// device's generator as in the forward, so a CUDA graph replay draws a new mask.
at::Tensor dropout_mask_cuda(c10::SymIntArrayRef size, double p, at::Device device, int64_t /*call*/) {
  check_p(p);
  c10::cuda::CUDAGuard guard(device);
  auto mask = at::empty(C10_AS_INTARRAYREF_SLOW(size), at::TensorOptions().dtype(at::kBool).device(device));
  const int64_t n = mask.numel();
  if (n == 0 || p == 0.0 || p == 1.0) return mask.fill_(p == 0.0);
  const at::PhiloxCudaState philox = reserve_philox(mask.get_device());
  const auto grid = static_cast<unsigned>(grid_for((n + 3) / 4));
  dropout_mask_kernel<<<grid, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(mask.mutable_data_ptr<bool>(), n,
                                                                                 philox, keep_threshold(p));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return mask;
}

// dropout_mask and masked_scale in one pass: y = x * scale where kept, x * 0 where dropped (rounded once from
// opmath, as native_dropout_backward rounds x * mask * scale), and the mask's bytes. One read of x and one
// write of y and of the mask, as torch's own dropout kernel.
// Assumptions: x, y contiguous of n elements, mask n bools; any grid (grid-stride over groups of 4 elements);
// kVec: n % 4 == 0, x and y aligned to a Vec4 (the mask, from at::empty, to 4 bytes at every group); philox
// reserved 4 draws per subsequence. The draws are dropout_mask_kernel's: same mask for the same state.
template <typename scalar_t, bool kVec>
__global__ void dropout_fwd_kernel(const scalar_t* __restrict__ x, scalar_t* __restrict__ y, bool* __restrict__ mask,
                                   int64_t n, at::PhiloxCudaState philox, Keep keep) {
  using opmath_t = at::opmath_type<scalar_t>;
  const auto [seed, counter] = philox_key(philox);
  const opmath_t scale = static_cast<opmath_t>(keep.scale);
  const int64_t groups = (n + 3) / 4;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t blk = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; blk < groups; blk += stride) {
    opmath_t mult[4];
    scale_group<scalar_t, kVec>(x, y, blk, n, seed, counter, keep.threshold, scale, mult);
    if constexpr (kVec) {
      uchar4 bytes;
      bytes.x = mult[0] != opmath_t(0);
      bytes.y = mult[1] != opmath_t(0);
      bytes.z = mult[2] != opmath_t(0);
      bytes.w = mult[3] != opmath_t(0);
      reinterpret_cast<uchar4*>(mask)[blk] = bytes;
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k)
        if (4 * blk + k < n) mask[4 * blk + k] = mult[k] != opmath_t(0);
    }
  }
}

std::tuple<at::Tensor, at::Tensor> dropout_fwd_cuda(const at::Tensor& x_, double p) {
  check_dropout_fwd(x_, p);
  c10::cuda::CUDAGuard guard(x_.device());
  const at::Tensor x = x_.contiguous();
  const int64_t n = x.numel();
  const double scale = keep_scale(p);
  if (n == 0 || p == 0.0 || p == 1.0) {  // nothing drawn, as dropout_mask
    at::Tensor mask = at::empty(x.sizes(), x.options().dtype(at::kBool)).fill_(p == 0.0);
    return {at::native_dropout_backward(x, mask, scale), mask};
  }
  at::Tensor y = at::empty_like(x);
  at::Tensor mask = at::empty(x.sizes(), x.options().dtype(at::kBool));
  const at::PhiloxCudaState philox = reserve_philox(x.get_device());
  // a keep multiplier is never 0 for a kept element: scale = 1 / (1 - p) > 0 here
  const Keep keep{keep_threshold(p), scale};
  const auto grid = static_cast<unsigned>(grid_for((n + 3) / 4));
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dropout_fwd_cuda", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    scalar_t* yp = y.mutable_data_ptr<scalar_t>();
    bool* mp = mask.mutable_data_ptr<bool>();
    const bool vec = vectorizable<scalar_t>(n, {xp, yp}) && reinterpret_cast<uintptr_t>(mp) % 4 == 0;
    with_bool(vec, [&](auto kVec) {
      dropout_fwd_kernel<scalar_t, decltype(kVec)::value><<<grid, kThreads, 0, stream>>>(xp, yp, mp, n, philox, keep);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return {y, mask};
}

}  // namespace

TORCH_LIBRARY_IMPL(accel, CUDA, m) {
  m.impl("bias_dropout_add_fwd", &bias_dropout_add_fwd_cuda);
  m.impl("bias_dropout_add_bwd", &bias_dropout_add_bwd_cuda);
  m.impl("dropout_mask", &dropout_mask_cuda);
  m.impl("dropout_fwd", &dropout_fwd_cuda);
}

}  // namespace accel
