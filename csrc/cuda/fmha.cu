// Fused Swin window attention scores on CUDA: softmax(attn + relative_pos_bias + attn_mask) over the
// last dim, and its backward (see csrc/cpu/fmha.cpp for the schemas and shapes).
//
// Forward: a row of N <= 1024 scores takes 8, 16 or 32 lanes (LANES, by N), each keeping its ceil(N/LANES)
// values in registers (KPT), so attn is read once and the output written once; a warp holds two groups of
// 32/LANES rows at a time, persistent warps loading their next groups while they reduce the current ones
// (memory-level parallelism); the max and the sum are fp32 (fp64 for double) shuffle reductions within a row's
// lanes. bias/mask rows are tiny and
// shared by many rows, so they stay in cache; they are read in attn's 16-bit dtype when both have it, else in
// fp32 (no conversion kernel a call).
// A row of -inf (fully masked) or holding a NaN gives NaN, as torch.softmax does.
// Backward: dx = y * (g - sum(g * y)) per row, again one warp per row. The bias gradient sums dx over
// the B*nW windows without atomics: a block owns one (head, query row) pair and one chunk of windows,
// its warps accumulate that bias row in registers, combine through shared memory in a fixed order and
// write one partial row; a second kernel sums the partial rows over the chunks in order. Results are
// therefore bitwise reproducible. Rows and blocks are counted on a 1-D grid (no gridDim.y/z limits).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>
#include <torch/types.h>

#include "cuda/fast_div.cuh"
#include "cuda/resident_blocks.cuh"
#include "fmha_host.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>

namespace accel {
namespace {

constexpr int kWarp = 32;
constexpr int kMaxN = 1024;

// The max / sum over each aligned group of LANES lanes (a power of two up to kWarp), in every lane of the group.
// Every lane of the warp calls them (full mask).
template <int LANES, typename T>
__device__ __forceinline__ T lanes_max(T v) {
#pragma unroll
  for (int o = LANES / 2; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

template <int LANES, typename T>
__device__ __forceinline__ T lanes_sum(T v) {
#pragma unroll
  for (int o = LANES / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename T>
__device__ __forceinline__ T warp_max(T v) {
  return lanes_max<kWarp>(v);
}

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
  return lanes_sum<kWarp>(v);
}

__device__ __forceinline__ float exp_op(float v) { return expf(v); }
__device__ __forceinline__ double exp_op(double v) { return exp(v); }

// Rows each forward warp handles at once: their loads are all issued together. 8 rows lost on an H200
// (benchmarks/results/kernels_ab_cuda_h200_run3.json: Swin stage-1 and stage-3 fp32 0.86-0.87x two rows;
// the 16-bit stage-3 rows gained only from reading the bias and mask without conversion kernels, which
// stage 1 lost again to the 8 rows).
constexpr int kFwdRows = 2;

// Windows each backward warp handles at once. The same H200 A/B: 8 at once (KPT <= 2) with one chunk (below)
// made the fp32 stage-3 backward 1.25x two at once and left stage 1 unchanged, but the 16-bit one 0.64x
// (stage 1) and 0.80x (stage 3): 16-bit rows keep 2 (and so never take the one-chunk path at Swin's sizes).
template <typename scalar_t, int KPT>
constexpr int bwd_rows_at_once() {
  return sizeof(scalar_t) >= 4 && KPT <= 2 ? 8 : 2;
}

// Row r of attn [B*nW, nH, N, N] is query i = r % N of head h = (r / N) % nH of window-batch row
// bw = r / (N*nH), whose mask is window bw % nW. The three divisions cost more than the softmax of a
// 49-value row if done as integer divisions, so they are multiply-shifts when rows < 2^31.
struct RowMap {
  FastDiv32 N, nH, nW;
  bool fast;  // rows < 2^31: FastDiv32 applies; else 64-bit division
};

// Offsets (in rows of N) of row r's bias row h*N + i and mask row (bw % nW)*N + i.
__device__ __forceinline__ void bias_and_mask_rows(int64_t r, const RowMap& m, int64_t& bias_row,
                                                   int64_t& mask_row) {
  if (m.fast) {
    const uint32_t r32 = static_cast<uint32_t>(r);
    const uint32_t t = m.N.div(r32), i = r32 - t * m.N.d;
    const uint32_t bw = m.nH.div(t), h = t - bw * m.nH.d;
    const uint32_t w = bw - m.nW.div(bw) * m.nW.d;
    bias_row = static_cast<int64_t>(h) * m.N.d + i;
    mask_row = static_cast<int64_t>(w) * m.N.d + i;
  } else {
    const int64_t N = m.N.d, nH = m.nH.d, nW = m.nW.d;
    const int64_t t = r / N, i = r - t * N;
    bias_row = (t % nH) * N + i;
    mask_row = ((t / nH) % nW) * N + i;
  }
}

// Forward. Warps are persistent: warp w of the grid's W handles the row groups w, w + W, ... and (short rows,
// kAhead) loads the next group's attn values before it reduces the current group, so its DRAM reads are in flight
// while it computes (bias and mask rows are cache hits). One-shot warps (a launch of rows / 16 blocks) left each
// block's lifetime a chain of memory latencies: the stage-1 forward ran at 36% of an H200's copy bandwidth in
// fp32 and 18% in 16-bit, as slow for half the bytes. A row takes LANES lanes, KPT values each: Swin's rows of 49
// take 8 lanes of 7 values (4 rows a warp at once), so a row's max and sum cost 3 shuffle steps shared by 4 rows
// instead of 5 steps for each row over a whole warp's 2 values a lane (persistent warps alone left the stage-1
// fp32 forward at 0.86x torch.compile's kernel, kernels_cuda_h200_run4_fmha_adam_layer_norm.json; with the lanes
// 1.07x, 1.26x the kernel before: kernels_ab_cuda_h200_run5.json). Long rows
// (a whole warp a row, 8 or more values a lane) read attn where they use it: held twice, their values would double
// the registers.
// Assumptions: blockDim.x a multiple of kWarp; any grid; LANES a power of two dividing kWarp; N <= LANES * KPT;
// bias_t (of bias and mask) is scalar_t or its opmath type, widened to the opmath type on load (exact).
template <typename scalar_t, typename bias_t, int KPT, int LANES>
__global__ void fmha_fwd_kernel(const scalar_t* __restrict__ attn, const bias_t* __restrict__ bias,
                                const bias_t* __restrict__ mask, scalar_t* __restrict__ out, int64_t rows,
                                RowMap map) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int kRows = kFwdRows;            // row groups a warp holds at once
  constexpr int kPerGroup = kWarp / LANES;   // rows of a group: one per LANES lanes
  constexpr int64_t kSpan = kRows * kPerGroup;
  constexpr bool kAhead = LANES < kWarp;  // rows up to 128 (8 values a lane); longer ones as the comment above
  const int N = static_cast<int>(map.N.d);
  const int lane = threadIdx.x % LANES;                // this lane's place in its row
  const int sub = (threadIdx.x % kWarp) / LANES;       // its row within a group
  const int64_t stride = static_cast<int64_t>(gridDim.x) * (blockDim.x / kWarp) * kSpan;
  int64_t first = (static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarp) + threadIdx.x / kWarp) * kSpan;
  if (first >= rows) return;  // uniform over the warp: whole warps leave, shuffles stay full

  scalar_t a[kRows][KPT];  // this lane's attn values of a group; past the last row or N: unset, never read
  const auto load = [&](int64_t group) {
#pragma unroll
    for (int q = 0; q < kRows; ++q) {
      const int64_t row = group + q * kPerGroup + sub;
#pragma unroll
      for (int k = 0; k < KPT; ++k) {
        const int j = lane + k * LANES;
        if (row < rows && j < N) a[q][k] = attn[row * N + j];
      }
    }
  };
  if constexpr (kAhead) load(first);
  for (; first < rows; first += stride) {
    acc_t v[kRows][KPT];
    acc_t mx[kRows];
#pragma unroll
    for (int q = 0; q < kRows; ++q) {
      const int64_t row = first + q * kPerGroup + sub;
      mx[q] = -std::numeric_limits<acc_t>::infinity();
      if (row >= rows) continue;  // this lane's row only: the shuffles below stay outside the branch
      int64_t bias_row, mask_row;
      bias_and_mask_rows(row, map, bias_row, mask_row);
      const bias_t* b = bias + bias_row * N;
      const bias_t* m = mask != nullptr ? mask + mask_row * N : nullptr;
#pragma unroll
      for (int k = 0; k < KPT; ++k) {
        const int j = lane + k * LANES;
        if (j < N) {
          const scalar_t x = kAhead ? a[q][k] : attn[row * N + j];  // long rows: read here, as used
          v[q][k] = static_cast<acc_t>(x) + static_cast<acc_t>(b[j]) +
                    (m != nullptr ? static_cast<acc_t>(m[j]) : acc_t(0));
          mx[q] = max(mx[q], v[q][k]);
        }
      }
    }
    // this group's values are in v: the next group's loads go out before the reductions
    if constexpr (kAhead) {
      if (first + stride < rows) load(first + stride);
    }
#pragma unroll
    for (int q = 0; q < kRows; ++q) mx[q] = lanes_max<LANES>(mx[q]);
    acc_t sum[kRows];
#pragma unroll
    for (int q = 0; q < kRows; ++q) {
      sum[q] = 0;
#pragma unroll
      for (int k = 0; k < KPT; ++k) {
        if (first + q * kPerGroup + sub < rows && lane + k * LANES < N) {
          v[q][k] = exp_op(v[q][k] - mx[q]);
          sum[q] += v[q][k];
        }
      }
    }
#pragma unroll
    for (int q = 0; q < kRows; ++q) sum[q] = lanes_sum<LANES>(sum[q]);
#pragma unroll
    for (int q = 0; q < kRows; ++q) {
      const int64_t row = first + q * kPerGroup + sub;
      if (row >= rows) continue;
      const acc_t inv = acc_t(1) / sum[q];
      scalar_t* y = out + row * N;
#pragma unroll
      for (int k = 0; k < KPT; ++k) {
        const int j = lane + k * LANES;
        if (j < N) y[j] = static_cast<scalar_t>(v[q][k] * inv);
      }
    }
  }
}

// Backward, fused with the first stage of the bias-gradient reduction.
// Block blockIdx.x = c * (nH*N) + e owns bias row e = h*N + i and windows [c*chunk, (c+1)*chunk);
// its warps take kRows = bwd_rows_at_once<scalar_t, KPT>() windows at a time (short rows: the next ones
// loaded ahead).
// Assumptions: blockDim.x a multiple of kWarp, (blockDim.x / kWarp) * N values of acc_t in dynamic shared
// memory; gridDim.x = chunks * bias_rows with chunks * chunk >= BnW; N <= 32 * KPT.
template <typename scalar_t, int KPT>
__global__ void fmha_bwd_kernel(const scalar_t* __restrict__ grad, const scalar_t* __restrict__ out,
                                scalar_t* __restrict__ dx, at::opmath_type<scalar_t>* __restrict__ partial,
                                int64_t BnW, int64_t bias_rows, int N, int64_t chunk) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int kRows = bwd_rows_at_once<scalar_t, KPT>();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  acc_t* smem = reinterpret_cast<acc_t*>(smem_raw);  // [warps][N]
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  const int warps = blockDim.x / kWarp;
  const int64_t e = blockIdx.x % bias_rows;
  const int64_t c = blockIdx.x / bias_rows;
  const int64_t bw_end = min(BnW, (c + 1) * chunk);

  acc_t acc[KPT];
#pragma unroll
  for (int k = 0; k < KPT; ++k) acc[k] = 0;

  // Where a pass's values are few (kAhead), the next pass's g and y are loaded before this pass's reductions
  // (in flight while the warp computes); else at the top of each pass (held twice they would spill).
  // Values past bw_end or N are zeros.
  constexpr bool kAhead = KPT * kRows <= 8;
  scalar_t gn[kRows][KPT], yn[kRows][KPT];
  const auto load = [&](int64_t bw0) {
#pragma unroll
    for (int q = 0; q < kRows; ++q) {
      const int64_t bw = bw0 + q * warps;
      const int64_t base = (bw * bias_rows + e) * N;
#pragma unroll
      for (int k = 0; k < KPT; ++k) {
        const int j = lane + k * kWarp;
        const bool in = bw < bw_end && j < N;
        gn[q][k] = in ? grad[base + j] : scalar_t(0);
        yn[q][k] = in ? out[base + j] : scalar_t(0);
      }
    }
  };
  const int64_t step = static_cast<int64_t>(kRows) * warps;
  if (kAhead && c * chunk + warp < bw_end) load(c * chunk + warp);
  for (int64_t bw0 = c * chunk + warp; bw0 < bw_end; bw0 += step) {
    if constexpr (!kAhead) load(bw0);
    acc_t g[kRows][KPT], y[kRows][KPT], dot[kRows];
#pragma unroll
    for (int q = 0; q < kRows; ++q) {
      dot[q] = 0;
#pragma unroll
      for (int k = 0; k < KPT; ++k) {
        g[q][k] = static_cast<acc_t>(gn[q][k]);
        y[q][k] = static_cast<acc_t>(yn[q][k]);
        dot[q] += g[q][k] * y[q][k];
      }
    }
    if (kAhead && bw0 + step < bw_end) load(bw0 + step);
#pragma unroll
    for (int q = 0; q < kRows; ++q) dot[q] = warp_sum(dot[q]);
#pragma unroll
    for (int q = 0; q < kRows; ++q) {
      const int64_t bw = bw0 + q * warps;
      if (bw >= bw_end) break;  // uniform over the warp
      const int64_t base = (bw * bias_rows + e) * N;
#pragma unroll
      for (int k = 0; k < KPT; ++k) {
        const int j = lane + k * kWarp;
        if (j < N) {
          const acc_t d = y[q][k] * (g[q][k] - dot[q]);
          dx[base + j] = static_cast<scalar_t>(d);
          acc[k] += d;
        }
      }
    }
  }
#pragma unroll
  for (int k = 0; k < KPT; ++k) {
    const int j = lane + k * kWarp;
    if (j < N) smem[warp * N + j] = acc[k];
  }
  __syncthreads();
  for (int j = threadIdx.x; j < N; j += blockDim.x) {
    acc_t s = 0;
    for (int q = 0; q < warps; ++q) s += smem[q * N + j];
    partial[(c * bias_rows + e) * N + j] = s;
  }
}

// Second stage: dbias[e] = sum over chunks c (in order) of partial[c][e].
template <typename acc_t>
__global__ void sum_chunks_kernel(const acc_t* __restrict__ partial, acc_t* __restrict__ dbias, int64_t numel,
                                  int64_t chunks) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < numel;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    acc_t s = 0;
    for (int64_t c = 0; c < chunks; ++c) s += partial[c * numel + e];
    dbias[e] = s;
  }
}

// Calls f(std::integral_constant<int, KPT>) with the smallest KPT in {1, 2, 4, ..., 32} with 32*KPT >= N.
template <typename F>
void dispatch_kpt(int N, F&& f) {
  if (N <= 32) f(std::integral_constant<int, 1>());
  else if (N <= 64) f(std::integral_constant<int, 2>());
  else if (N <= 128) f(std::integral_constant<int, 4>());
  else if (N <= 256) f(std::integral_constant<int, 8>());
  else if (N <= 512) f(std::integral_constant<int, 16>());
  else f(std::integral_constant<int, 32>());
}

// The forward's (KPT, LANES) for rows of N: rows up to 64 take 8 lanes (Swin's 49: 7 values a lane), up to 128
// 16 lanes, longer ones a whole warp (dispatch_kpt's values a lane).
template <typename F>
void dispatch_fwd_shape(int N, F&& f) {
  using std::integral_constant;
  if (N <= 64) f(integral_constant<int, 8>(), integral_constant<int, 8>());
  else if (N <= 128) f(integral_constant<int, 8>(), integral_constant<int, 16>());
  else if (N <= 256) f(integral_constant<int, 8>(), integral_constant<int, kWarp>());
  else if (N <= 512) f(integral_constant<int, 16>(), integral_constant<int, kWarp>());
  else f(integral_constant<int, 32>(), integral_constant<int, kWarp>());
}

void check_inputs(const at::Tensor& attn, const at::Tensor& bias, const std::optional<at::Tensor>& mask,
                  int64_t window_num) {
  fmha_host::check_fwd_inputs(attn, bias, mask, window_num);
  const int64_t nH = attn.size(1), N = attn.size(2);
  TORCH_CHECK(N <= kMaxN, "fmha_swin_fwd: the CUDA kernel handles N <= ", kMaxN, ", got N=", N);
  TORCH_CHECK(nH <= std::numeric_limits<int>::max() && window_num <= std::numeric_limits<int>::max(),
              "fmha_swin_fwd: nH and window_num must fit in int32");
}

at::Tensor fmha_fwd_cuda(const at::Tensor& attn_, const at::Tensor& bias_, const std::optional<at::Tensor>& mask_,
                         int64_t window_num) {
  check_inputs(attn_, bias_, mask_, window_num);
  c10::cuda::CUDAGuard guard(attn_.device());
  auto attn = attn_.contiguous();
  auto out = at::empty_like(attn);
  if (attn.numel() == 0) return out;
  const int64_t nH = attn.size(1), N = attn.size(2);
  const int64_t rows = attn.size(0) * nH * N;
  constexpr int threads = 256;
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, attn.scalar_type(), "fmha_swin_fwd_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const RowMap map{FastDiv32(static_cast<uint32_t>(N)), FastDiv32(static_cast<uint32_t>(nH)),
                     FastDiv32(static_cast<uint32_t>(window_num)), rows <= std::numeric_limits<int32_t>::max()};
    // bias and mask are read in attn's own 16-bit dtype where both have it (no conversion kernels a call),
    // else in the opmath dtype (converted here where they are in neither).
    const auto own = attn.scalar_type();
    constexpr bool wide = (std::is_same_v<scalar_t, acc_t>);  // parenthesised: a macro argument
    const bool narrow = !wide && bias_.scalar_type() == own &&
                        (!mask_.has_value() || mask_->scalar_type() == own);
    const auto launch = [&](auto bias_type) {
      using bias_t = decltype(bias_type);
      const auto dtype = c10::CppTypeToScalarType<bias_t>::value;
      const at::Tensor bias = bias_.to(dtype).contiguous();
      at::Tensor mask;
      if (mask_.has_value()) mask = mask_->to(dtype).contiguous();
      const bias_t* m = mask.defined() ? mask.const_data_ptr<bias_t>() : nullptr;
      dispatch_fwd_shape(static_cast<int>(N), [&](auto kpt, auto lanes) {
        constexpr int KPT = decltype(kpt)::value, LANES = decltype(lanes)::value;
        constexpr int64_t rows_per_block = threads / LANES * kFwdRows;
        constexpr auto kernel = fmha_fwd_kernel<scalar_t, bias_t, KPT, LANES>;
        // persistent warps: as many blocks as the GPU holds at once (one wave), fewer where the rows are fewer
        const int64_t blocks =
            std::min<int64_t>((rows + rows_per_block - 1) / rows_per_block, resident_blocks<kernel>(threads));
        kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
            attn.const_data_ptr<scalar_t>(), bias.const_data_ptr<bias_t>(), m, out.mutable_data_ptr<scalar_t>(),
            rows, map);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    };
    if constexpr (wide) {
      launch(acc_t());
    } else {
      if (narrow) launch(scalar_t());
      else launch(acc_t());
    }
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> fmha_bwd_cuda(const at::Tensor& grad_, const at::Tensor& out_) {
  fmha_host::check_bwd_inputs(grad_, out_);
  TORCH_CHECK(out_.size(2) <= kMaxN, "fmha_swin_bwd: the CUDA kernel handles N <= ", kMaxN);
  c10::cuda::CUDAGuard guard(out_.device());
  auto out = out_.contiguous();
  auto grad = grad_.to(out.scalar_type()).contiguous();
  const int64_t BnW = out.size(0), nH = out.size(1), N = out.size(2);
  auto dx = at::empty_like(out);
  at::Tensor dbias;
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "fmha_swin_bwd_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto op_dtype = c10::CppTypeToScalarType<acc_t>::value;
    if (out.numel() == 0) {
      dbias = at::zeros({nH, N, N}, out.options().dtype(op_dtype));
      return;
    }
    constexpr int threads = 128;
    constexpr int warps = threads / kWarp;
    const int64_t bias_rows = nH * N;
    // Enough blocks to fill the GPU (~16 per SM, 64 warps), each walking as many windows as that
    // allows: fewer chunks mean fewer partial rows for the second stage to add up.
    const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    const int64_t want_chunks = std::max<int64_t>(1, (sms * 16 + bias_rows - 1) / bias_rows);
    dbias = at::empty({nH, N, N}, out.options().dtype(op_dtype));
    dispatch_kpt(static_cast<int>(N), [&](auto kpt) {
      constexpr int KPT = decltype(kpt)::value;
      const int64_t per_pass = warps * bwd_rows_at_once<scalar_t, KPT>();  // windows a block takes at once
      // One chunk where the bias rows alone give 4 blocks an SM and a block takes at most 4 passes (Swin's
      // later stages at moderate batches: 12 heads x 49 rows): no second kernel and no partial rows (with
      // 8 windows a warp, the fp32 stage-3 backward at batch 32 on an H200: 1.25x four chunks of 2).
      const bool one_chunk = bias_rows >= sms * 4 && BnW <= 4 * per_pass;
      const int64_t chunk = one_chunk ? BnW : std::max<int64_t>(per_pass, (BnW + want_chunks - 1) / want_chunks);
      const int64_t chunks = (BnW + chunk - 1) / chunk;
      const int64_t blocks = chunks * bias_rows;
      TORCH_CHECK(blocks <= std::numeric_limits<int32_t>::max(), "fmha_swin_bwd: too many rows");
      at::Tensor partial = chunks == 1 ? dbias : at::empty({chunks, nH, N, N}, out.options().dtype(op_dtype));
      const size_t smem = static_cast<size_t>(warps) * N * sizeof(acc_t);
      fmha_bwd_kernel<scalar_t, KPT><<<static_cast<unsigned>(blocks), threads, smem, stream>>>(
          grad.const_data_ptr<scalar_t>(), out.const_data_ptr<scalar_t>(), dx.mutable_data_ptr<scalar_t>(),
          partial.mutable_data_ptr<acc_t>(), BnW, bias_rows, static_cast<int>(N), chunk);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      if (chunks > 1) {
        const int64_t numel = bias_rows * N;
        const int64_t sum_blocks = std::min<int64_t>((numel + 255) / 256, sms * 8);
        sum_chunks_kernel<acc_t><<<static_cast<unsigned>(sum_blocks), 256, 0, stream>>>(
            partial.const_data_ptr<acc_t>(), dbias.mutable_data_ptr<acc_t>(), numel, chunks);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    });
  });
  return {dx, dbias};
}

}  // namespace

TORCH_LIBRARY_IMPL(accel, CUDA, m) {
  m.impl("fmha_swin_fwd", &fmha_fwd_cuda);
  m.impl("fmha_swin_bwd", &fmha_bwd_cuda);
}

}  // namespace accel
