// LayerNorm forward and backward on CUDA (schemas: csrc/cpu/layer_norm.cpp).
//
// x is [M, N] (rows x normalized size). Forward and dx: a team of `tpr` threads per row, tpr a
// power of two from 32 (one warp per row, several rows per block: small and medium N) up to 1024
// (one block per row: large N), so no thread handles more than a few dozen elements (forward rows are held
// in registers, up to fwd_vectors() vectors a thread, and x read once, when the team fits 512 threads and,
// for 16-bit rows, is wider than a warp). A team reduces with warp shuffles and, when wider than a warp,
// through shared memory. Statistics are in float (double for float64 x): shifted sums per thread, merged across threads
// as Welford states (a row whose sums overflow, |x| around 1e19 and beyond in float, is redone on exactly
// scaled values). Loads and stores are 16-byte vectors when N and every pointer allow it.
//
// Backward, rows of up to 16 elements per thread of a 512-thread team (N <= 8192; 4096 in double): one
// pass over x and dy. Each team keeps its part of the row in registers for dx and adds dy*xhat and dy
// into per-thread dweight/dbias sums over all the rows it takes; a block then writes one fp32 row of
// partial sums, and column_sum.cuh sums those rows in a fixed order (deterministic, no atomics).
// Wider rows take two sweeps of x and dy: the row sums by a team a row, then dx and the per-row-chunk partials
// of dweight/dbias by column tiles (dx alone: both sweeps by the row's team).
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>
#include <torch/types.h>

#include "cuda/column_sum.cuh"
#include "cuda/resident_blocks.cuh"
#include "layer_norm_host.h"

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <type_traits>

namespace accel {
namespace {

using namespace layer_norm_host;

template <typename U, int V>
struct alignas(sizeof(U) * V) Pack {
  U v[V];
};

// An optimisation barrier on a held 16-bit vector: the compiler must take its registers as changed, so it
// converts the elements to acc_t again after the barrier instead of keeping the statistics pass's conversions
// live through the team's reduction (for bf16 rows of 8 vectors a thread: 64 more registers, 128 in all,
// a quarter of an SM's threads resident). Converting a 16-bit value is one instruction.
template <typename U, int V>
__device__ __forceinline__ void reload_barrier(Pack<U, V>& p) {
  if constexpr (sizeof(p) % 4 == 0) {  // whole 32-bit registers (a single 16-bit value: left alone)
    auto* words = reinterpret_cast<uint32_t*>(&p);
#pragma unroll
    for (int i = 0; i < static_cast<int>(sizeof(p) / 4); ++i) asm volatile("" : "+r"(words[i]));
  }
}

constexpr int kWarp = 32;
constexpr int kMaxTeam = 1024;

__device__ __forceinline__ float rsqrt_(float v) { return rsqrtf(v); }
__device__ __forceinline__ double rsqrt_(double v) { return 1.0 / sqrt(v); }

// A product nvcc may not fuse into the next add. dx needs w*dy - mean(w*dy) to be exactly 0 where every
// w*dy of the row is equal (normalized size 1): contracted into fma(dy, w, -mean) it subtracts the rounded
// mean from the unrounded product and leaves the product's rounding error, times rstd (316 at eps 1e-5).
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }

// The scale of a row whose statistics overflow (see layer_norm_fwd_kernel).
__device__ __forceinline__ float overflow_scale(float) { return 0x1p-82f; }
__device__ __forceinline__ double overflow_scale(double) { return 0x1p-640; }

template <typename acc_t>
struct Welford {
  acc_t mean, m2, count;
};

// An empty side returns the other one as is: through the general formula a row far from zero
// (|mean| > ~1.8e19 in float) would give d * d = inf and inf * 0 = NaN. Lanes past the row's end
// (N < 32 * VEC) are empty.
template <typename acc_t>
__device__ __forceinline__ Welford<acc_t> combine(const Welford<acc_t>& a, const Welford<acc_t>& b) {
  if (b.count == acc_t(0)) return a;
  if (a.count == acc_t(0)) return b;
  const acc_t n = a.count + b.count;
  const acc_t d = b.mean - a.mean;
  const acc_t fb = b.count / n;
  return {a.mean + d * fb, a.m2 + b.m2 + d * d * a.count * fb, n};
}

template <typename acc_t>
struct Sums {
  acc_t a, b;
};

template <typename acc_t>
__device__ __forceinline__ Sums<acc_t> combine(const Sums<acc_t>& x, const Sums<acc_t>& y) {
  return {x.a + y.a, x.b + y.b};
}

template <typename acc_t>
__device__ __forceinline__ Welford<acc_t> shfl_xor(const Welford<acc_t>& w, int m) {
  return {__shfl_xor_sync(0xffffffffu, w.mean, m), __shfl_xor_sync(0xffffffffu, w.m2, m),
          __shfl_xor_sync(0xffffffffu, w.count, m)};
}

template <typename acc_t>
__device__ __forceinline__ Sums<acc_t> shfl_xor(const Sums<acc_t>& s, int m) {
  return {__shfl_xor_sync(0xffffffffu, s.a, m), __shfl_xor_sync(0xffffffffu, s.b, m)};
}

template <typename acc_t>
__device__ __forceinline__ Welford<acc_t> shfl_lane0(const Welford<acc_t>& w) {
  return {__shfl_sync(0xffffffffu, w.mean, 0), __shfl_sync(0xffffffffu, w.m2, 0),
          __shfl_sync(0xffffffffu, w.count, 0)};
}

template <typename acc_t>
__device__ __forceinline__ Sums<acc_t> shfl_lane0(const Sums<acc_t>& s) {
  return {__shfl_sync(0xffffffffu, s.a, 0), __shfl_sync(0xffffffffu, s.b, 0)};
}

// All `tpr` threads of a row team get the team's combined value. `smem` holds one V per warp of
// the block. Every thread of the block must call this the same number of times (it may sync).
template <typename V>
__device__ __forceinline__ V team_allreduce(V v, V* smem, int tpr) {
#pragma unroll
  for (int m = kWarp / 2; m > 0; m >>= 1) v = combine(v, shfl_xor(v, m));
  // combine(a, b) and combine(b, a) may round differently: let every lane use lane 0's result,
  // so that a row's outputs and its saved statistics agree bit for bit.
  v = shfl_lane0(v);
  if (tpr == kWarp) return v;
  const int warp = threadIdx.x / kWarp;
  if (threadIdx.x % kWarp == 0) smem[warp] = v;
  __syncthreads();
  const int first = (threadIdx.x / tpr) * (tpr / kWarp);
  V r = smem[first];
  for (int i = 1; i < tpr / kWarp; ++i) r = combine(r, smem[first + i]);
  __syncthreads();  // smem is reused by the next row
  return r;
}

// The values the forward's statistics are taken over: x itself, or (x - x0) * s for a row whose sums
// overflow (see layer_norm_fwd_kernel).
template <typename acc_t>
struct Plain {
  template <typename T>
  __device__ __forceinline__ acc_t operator()(T v) const { return static_cast<acc_t>(v); }
};

template <typename acc_t>
struct ShiftScale {
  acc_t x0, s;
  template <typename T>
  __device__ __forceinline__ acc_t operator()(T v) const { return (static_cast<acc_t>(v) - x0) * s; }
};

// Vectors a thread takes at most when it loops over the row in memory (the forward of rows wider than a held
// team takes, the wide-row dx kernel).
constexpr int kLoopVectors = 8;
// Vectors of a row a forward thread holds in registers (launch_for gives a thread at most this many unless
// rows are wider than kMaxTeam * fwd_vectors() vectors), for teams of up to kHeldMaxTeam threads (whose
// launch bound leaves 128 registers a thread: double spills at 64). All of a thread's loads are issued
// before the first is used, and the row is read once: statistics and output from the same registers.
// A/B on an H100 against the loop over memory with up to kLoopVectors vectors a thread
// (benchmarks/results/kernels_ab_cuda_h100_run2.json), 4 vectors a thread: float rows of 768 to 4096
// 1.07-1.23x, 8192 and 65536 0.98-1.02x; bf16 rows 0.83-1.05x, but there the team was twice the loop's
// (8192: 256 threads, 0.83x). So 16-bit rows hold kLoopVectors (8: 128 bytes, the loop's team) instead.
// A/B of that on an H200 (kernels_ab_cuda_h200_run3.json): bf16 rows of 4096 and 8192 1.03-1.05x the loop,
// but 768 and 1024 (a one-warp team, 3-4 vectors a thread) 0.88-0.89x: 16-bit rows are held only when their
// team is wider than a warp (kHeldMin16).
template <typename T>
constexpr int fwd_vectors() {
  return sizeof(T) >= 4 ? 4 : kLoopVectors;
}
constexpr int kHeldMaxTeam = 512;
constexpr int kHeldMin16 = 2 * kWarp;  // the narrowest team that holds 16-bit rows

// One thread's (count, mean, M2) of f(x) over the vectors lane, lane + tpr, ... of a row (lane < nvec),
// its mean as an offset from `base`: sums of (f(x) - shift) and its square, shifted by one of the thread's
// own values so that the one-pass variance does not cancel for rows far from zero; one division per
// thread (a per-element Welford update costs a division per element, too slow for bf16 rows).
// The thread's vectors come from `held` (registers, HELD: count <= fwd_vectors<T>(), indexed by constants only)
// or from the row in memory, `xr` (vectors lane + j * tpr).
template <typename acc_t, bool HELD, typename T, int VEC, typename F>
__device__ __forceinline__ Welford<acc_t> thread_welford(const Pack<T, VEC>* held, const Pack<T, VEC>* xr, int lane,
                                                         int tpr, int64_t count, acc_t base, F f) {
  const acc_t shift = f((HELD ? held[0] : xr[lane]).v[0]);
  acc_t s1 = 0, s2 = 0;
  const auto add = [&](const Pack<T, VEC>& p) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const acc_t d = f(p.v[k]) - shift;
      s1 += d;
      s2 += d * d;
    }
  };
  if constexpr (HELD) {
#pragma unroll
    for (int j = 0; j < fwd_vectors<T>(); ++j)
      if (j < count) add(held[j]);
  } else {
    for (int64_t j = 0; j < count; ++j) add(xr[lane + j * tpr]);
  }
  const acc_t n = static_cast<acc_t>(count * VEC);
  const acc_t dm = s1 / n;
  return {(shift - base) + dm, max(s2 - s1 * dm, acc_t(0)), n};
}

// The vectors of a thread in a row, lane + j * tpr for j < count (count < 1 when lane >= nvec).
__device__ __forceinline__ int64_t vectors_of(int lane, int64_t nvec, int tpr) {
  return lane < nvec ? (nvec - 1 - lane) / tpr + 1 : 0;
}

// grid-stride over groups of rows so that every thread of a block runs the same number of
// iterations (team_allreduce syncs the block when a team spans several warps).
// launch bounds: teams of up to 1024 threads must fit the register file (<= 64 per thread; HELD: 512, 128)
// Assumptions: blockDim.x = tpr * rows per block, tpr a power of two in [32, 1024]; VEC elements per access,
// N % VEC == 0 and every pointer aligned to a whole vector; HELD: tpr <= kHeldMaxTeam and nvec <= tpr *
// fwd_vectors<T>(); any grid.
template <typename T, typename P, int VEC, bool HELD>
__global__ void __launch_bounds__(HELD ? kHeldMaxTeam : kMaxTeam)
    layer_norm_fwd_kernel(const T* __restrict__ x, const P* __restrict__ w, const P* __restrict__ b, T* __restrict__ y,
                          typename AccOf<T>::type* __restrict__ mean_out,
                          typename AccOf<T>::type* __restrict__ rstd_out, int64_t M, int64_t N,
                          typename AccOf<T>::type eps, int tpr) {
  using acc_t = typename AccOf<T>::type;
  __shared__ Welford<acc_t> smem[kMaxTeam / kWarp];
  const int rpb = blockDim.x / tpr;
  const int lane = threadIdx.x % tpr;
  const int64_t nvec = N / VEC;
  const int64_t mine = vectors_of(lane, nvec, tpr);
  for (int64_t base = (int64_t)blockIdx.x * rpb; base < M; base += (int64_t)gridDim.x * rpb) {
    const int64_t row = base + threadIdx.x / tpr;
    const bool valid = row < M;
    const Pack<T, VEC>* xr = reinterpret_cast<const Pack<T, VEC>*>(x + (valid ? row : 0) * N);
    Pack<T, VEC> px[HELD ? fwd_vectors<T>() : 1];
    if constexpr (HELD) {
#pragma unroll
      for (int j = 0; j < fwd_vectors<T>(); ++j)
        if (valid && j < mine) px[j] = xr[lane + j * tpr];
    }
    // Per thread: Welford states of the thread's elements (thread_welford). Threads then merge
    // (count, mean, M2) exactly (Chan et al.). Means travel as offsets from one shift shared by the
    // row (its first element): carried as absolute values, a row with mean 1000 would be rounded at
    // ulp(1000) in every merge and drift by ~1e-4 over a 1024-thread team.
    const acc_t row_shift = valid ? static_cast<acc_t>(x[row * N]) : acc_t(0);
    Welford<acc_t> st{acc_t(0), acc_t(0), acc_t(0)};
    if (valid && mine > 0) {
      st = thread_welford<acc_t, HELD>(px, xr, lane, tpr, mine, row_shift, Plain<acc_t>{});
    }
    st = team_allreduce(st, smem, tpr);
    acc_t mu = row_shift + st.mean;
    acc_t rs = rsqrt_(st.m2 / static_cast<acc_t>(N) + eps);
    // A row whose sums overflow acc_t (in float: M2 once |x - mean| reaches ~1.8e19 / sqrt(N)) is redone
    // on u = (x - x0) * s, x0 = x[0], s = 2^-82 (2^-640 in double), the scaling being exact: then
    // mean = x0 + mean_u / s and rstd = s / sqrt(var_u + eps s^2). In float, for rows of N < 2^31
    // elements with |x| <= 2^126 (D = max|x - mean| <= 2^127): every quantity the sums and merges form
    // is below 16 N D^2, so an overflow means D >= 2^62 / sqrt(N) >= 2^46.5; scaled, 16 N (D s)^2 <=
    // 2^125 cannot overflow, and var_u >= (D s)^2 / N >= 2^-102 is far from underflow (elements within
    // 2^-44 of x0 lose digits to subnormals, negligibly next to D). Likewise in double for |x| <= 2^1022.
    // A row holding an inf or NaN keeps non-finite statistics, so non-finite outputs. The redo's reductions are collective: a one-warp
    // team takes it alone (its flag is the same in every lane); wider teams sync the block, so there the
    // whole block goes through it when any of its rows needs it, and only the rows that overflowed take
    // its result. Rows that do not overflow are unchanged.
    const bool overflow = valid && !(isfinite(st.m2) && isfinite(mu));
    bool redo = overflow;
    if (tpr > kWarp && rpb > 1) redo = __syncthreads_or(redo) != 0;
    if (redo) {
      const acc_t sc = overflow_scale(acc_t(0));
      Welford<acc_t> su{acc_t(0), acc_t(0), acc_t(0)};
      if (valid && mine > 0)  // rare: read again from memory
        su = thread_welford<acc_t, false>(px, xr, lane, tpr, mine, acc_t(0),
                                          ShiftScale<acc_t>{row_shift, sc});
      su = team_allreduce(su, smem, tpr);
      if (overflow) {
        mu = row_shift + su.mean / sc;
        rs = sc * rsqrt_(su.m2 / static_cast<acc_t>(N) + eps * sc * sc);
      }
    }
    if (!valid) continue;
    if (lane == 0) {
      mean_out[row] = mu;
      rstd_out[row] = rs;
    }
    Pack<T, VEC>* yr = reinterpret_cast<Pack<T, VEC>*>(y + row * N);
    const Pack<P, VEC>* wv = reinterpret_cast<const Pack<P, VEC>*>(w);
    const Pack<P, VEC>* bv = reinterpret_cast<const Pack<P, VEC>*>(b);
    const auto write = [&](int64_t j, const Pack<T, VEC>& p) {
      const int64_t v = lane + j * tpr;
      Pack<P, VEC> pw, pb;
      if (w != nullptr) pw = wv[v];
      if (b != nullptr) pb = bv[v];
      Pack<T, VEC> out;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        acc_t o = (static_cast<acc_t>(p.v[k]) - mu) * rs;
        if (w != nullptr) o *= static_cast<acc_t>(pw.v[k]);
        if (b != nullptr) o += static_cast<acc_t>(pb.v[k]);
        out.v[k] = static_cast<T>(o);
      }
      yr[v] = out;
    };
    if constexpr (HELD) {
#pragma unroll
      for (int j = 0; j < fwd_vectors<T>(); ++j) {
        if constexpr (sizeof(T) == 2) reload_barrier(px[j]);
        if (j < mine) write(j, px[j]);
      }
    } else {
      for (int64_t j = 0; j < mine; ++j) write(j, xr[lane + j * tpr]);
    }
  }
}

// dx = rstd * (w*dy - mean_j(w*dy) - xhat * mean_j(w*dy*xhat)), xhat = (x - mean) * rstd.
// The two helpers below are the per-vector halves of that formula, shared by both backward kernels.

// Adds one vector's w*dy and w*dy*xhat to the row's sums (w == nullptr: no weight).
template <typename acc_t, typename T, typename P, int VEC>
__device__ __forceinline__ void add_row_sums(const Pack<T, VEC>& px, const Pack<T, VEC>& pg, const Pack<P, VEC>& pw,
                                             const P* w, acc_t mu, acc_t rs, Sums<acc_t>& s) {
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    acc_t wg = static_cast<acc_t>(pg.v[k]);
    if (w != nullptr) wg = mul_rn(wg, static_cast<acc_t>(pw.v[k]));
    s.a += wg;
    // w*dy*xhat (w*dy*(x - mean) would overflow for rows of huge |x|)
    s.b += wg * ((static_cast<acc_t>(px.v[k]) - mu) * rs);
  }
}

// One vector of dx from the row's means a = mean(w*dy) and bsum = mean(w*dy*xhat).
template <typename acc_t, typename T, typename P, int VEC>
__device__ __forceinline__ Pack<T, VEC> dx_vector(const Pack<T, VEC>& px, const Pack<T, VEC>& pg, const Pack<P, VEC>& pw,
                                                  const P* w, acc_t mu, acc_t rs, acc_t a, acc_t bsum) {
  Pack<T, VEC> out;
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    acc_t wg = static_cast<acc_t>(pg.v[k]);
    if (w != nullptr) wg = mul_rn(wg, static_cast<acc_t>(pw.v[k]));
    const acc_t xhat = (static_cast<acc_t>(px.v[k]) - mu) * rs;
    out.v[k] = static_cast<T>(rs * (wg - a - xhat * bsum));
  }
  return out;
}

// Rows wider than the fused kernel takes. Without dweight/dbias: dx alone, two sweeps of a row by its team.
// With them, SUMS_ONLY: the first sweep alone, which writes the row's a = mean(w*dy) and bsum = mean(w*dy*xhat)
// to row_means[2 * row + 0 / 1]; layer_norm_bwd_dx_params_kernel then makes dx and the dweight/dbias partials
// in one more sweep (two sweeps of x and dy in all, where dx then a separate dweight/dbias pass took three).
// Assumptions: blockDim.x = tpr * rows per block, tpr a power of two in [32, 1024]; VEC elements per access,
// N % VEC == 0 and every pointer aligned to a whole vector; any grid (grid-stride over row groups);
// SUMS_ONLY: row_means holds 2 * M values (dx is not written); else dx holds M * N.
template <typename T, typename P, int VEC, bool SUMS_ONLY>
__global__ void __launch_bounds__(kMaxTeam) layer_norm_bwd_dx_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                         const typename AccOf<T>::type* __restrict__ mean,
                                         const typename AccOf<T>::type* __restrict__ rstd, const P* __restrict__ w,
                                         T* __restrict__ dx, typename AccOf<T>::type* __restrict__ row_means,
                                         int64_t M, int64_t N, int tpr) {
  using acc_t = typename AccOf<T>::type;
  __shared__ Sums<acc_t> smem[kMaxTeam / kWarp];
  const int rpb = blockDim.x / tpr;
  const int lane = threadIdx.x % tpr;
  const int64_t nvec = N / VEC;
  const Pack<P, VEC>* wv = reinterpret_cast<const Pack<P, VEC>*>(w);
  const acc_t inv_n = acc_t(1) / static_cast<acc_t>(N);
  for (int64_t base = (int64_t)blockIdx.x * rpb; base < M; base += (int64_t)gridDim.x * rpb) {
    const int64_t row = base + threadIdx.x / tpr;
    const bool valid = row < M;
    const int64_t r = valid ? row : 0;
    const Pack<T, VEC>* xr = reinterpret_cast<const Pack<T, VEC>*>(x + r * N);
    const Pack<T, VEC>* gr = reinterpret_cast<const Pack<T, VEC>*>(dy + r * N);
    const acc_t mu = mean[r], rs = rstd[r];
    Sums<acc_t> s{acc_t(0), acc_t(0)};
    if (valid) {
      for (int64_t v = lane; v < nvec; v += tpr) {
        Pack<P, VEC> pw;
        if (w != nullptr) pw = wv[v];
        add_row_sums(xr[v], gr[v], pw, w, mu, rs, s);
      }
    }
    s = team_allreduce(s, smem, tpr);
    if (!valid) continue;
    const acc_t a = s.a * inv_n;
    const acc_t bsum = s.b * inv_n;
    if constexpr (SUMS_ONLY) {
      if (lane == 0) {
        row_means[2 * row] = a;
        row_means[2 * row + 1] = bsum;
      }
      continue;
    }
    Pack<T, VEC>* dxr = reinterpret_cast<Pack<T, VEC>*>(dx + row * N);
    for (int64_t v = lane; v < nvec; v += tpr) {
      Pack<P, VEC> pw;
      if (w != nullptr) pw = wv[v];
      dxr[v] = dx_vector(xr[v], gr[v], pw, w, mu, rs, a, bsum);
    }
  }
}

// The fused backward: dx, and (partial != nullptr) per-block partial sums of dweight = sum(dy * xhat) and
// dbias = sum(dy) in partial[blockIdx.x][0 or 1][col], fp32 (double for double x).
constexpr int kFusedMaxThreads = 512;   // 128 registers a thread: the row part and the sums stay in registers
constexpr int kFusedBlockThreads = 256; // rows per block = this / tpr (at least one)

// Vectors a thread holds: 16 elements (8 in double, whose sums take two registers each).
template <typename T, int VEC>
constexpr int fused_vectors() {
  return (sizeof(typename AccOf<T>::type) == 8 ? 8 : 16) / VEC;
}

// Assumptions: blockDim.x = tpr * rows per block, tpr a multiple of 32 with tpr * VPT >= N / VEC and
// blockDim.x <= kFusedMaxThreads; VEC elements per access, N % VEC == 0 and every pointer aligned to a whole
// vector; any grid (team t of block b takes rows b * rows per block + t, then every gridDim.x * rows per block
// further). Every thread of a block runs the same number of row iterations (team_allreduce may sync).
template <typename T, typename P, int VEC, int VPT>
__global__ void __launch_bounds__(kFusedMaxThreads) layer_norm_bwd_fused_kernel(
    const T* __restrict__ dy, const T* __restrict__ x, const typename AccOf<T>::type* __restrict__ mean,
    const typename AccOf<T>::type* __restrict__ rstd, const P* __restrict__ w, T* __restrict__ dx,
    typename AccOf<T>::type* __restrict__ partial, int64_t M, int64_t N, int tpr) {
  using acc_t = typename AccOf<T>::type;
  __shared__ Sums<acc_t> smem[kFusedMaxThreads / kWarp];
  __shared__ acc_t across[kFusedMaxThreads];
  const int rpb = blockDim.x / tpr;
  const int team = threadIdx.x / tpr;
  const int lane = threadIdx.x % tpr;
  const int64_t nvec = N / VEC;
  const bool params = partial != nullptr;
  // A thread's vectors are lane + j * tpr, the same in every row: its weights are loaded once.
  Pack<P, VEC> pw[VPT];
#pragma unroll
  for (int j = 0; j < VPT; ++j)
    if (w != nullptr && lane + (int64_t)j * tpr < nvec) pw[j] = reinterpret_cast<const Pack<P, VEC>*>(w)[lane + j * tpr];
  acc_t dw[VPT][VEC], db[VPT][VEC];
#pragma unroll
  for (int j = 0; j < VPT; ++j)
#pragma unroll
    for (int k = 0; k < VEC; ++k) dw[j][k] = db[j][k] = acc_t(0);
  const acc_t inv_n = acc_t(1) / static_cast<acc_t>(N);
  for (int64_t base = (int64_t)blockIdx.x * rpb; base < M; base += (int64_t)gridDim.x * rpb) {
    const int64_t row = base + team;
    const bool valid = row < M;
    const int64_t r = valid ? row : 0;
    const Pack<T, VEC>* xr = reinterpret_cast<const Pack<T, VEC>*>(x + r * N);
    const Pack<T, VEC>* gr = reinterpret_cast<const Pack<T, VEC>*>(dy + r * N);
    const acc_t mu = mean[r], rs = rstd[r];
    Pack<T, VEC> px[VPT], pg[VPT];
#pragma unroll
    for (int j = 0; j < VPT; ++j) {  // all loads first: they are in flight together
      const int64_t v = lane + (int64_t)j * tpr;
      if (valid && v < nvec) {
        px[j] = xr[v];
        pg[j] = gr[v];
      }
    }
    Sums<acc_t> s{acc_t(0), acc_t(0)};
#pragma unroll
    for (int j = 0; j < VPT; ++j)
      if (valid && lane + (int64_t)j * tpr < nvec) add_row_sums(px[j], pg[j], pw[j], w, mu, rs, s);
    s = team_allreduce(s, smem, tpr);
    if (!valid) continue;
    const acc_t a = s.a * inv_n;
    const acc_t bsum = s.b * inv_n;
    Pack<T, VEC>* dxr = reinterpret_cast<Pack<T, VEC>*>(dx + row * N);
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
      const int64_t v = lane + (int64_t)j * tpr;
      if (v >= nvec) continue;
      dxr[v] = dx_vector(px[j], pg[j], pw[j], w, mu, rs, a, bsum);
      if (!params) continue;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const acc_t g = static_cast<acc_t>(pg[j].v[k]);
        dw[j][k] += g * ((static_cast<acc_t>(px[j].v[k]) - mu) * rs);  // dy * xhat: finite for huge x
        db[j][k] += g;
      }
    }
  }
  if (!params) return;
  // The block's teams hold sums for the same columns: team 0 adds them in team order and writes the block's row.
  acc_t* out = partial + (int64_t)blockIdx.x * 2 * N;
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    const int64_t v = lane + (int64_t)j * tpr;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
#pragma unroll
      for (int which = 0; which < 2; ++which) {
        acc_t sum = which == 0 ? dw[j][k] : db[j][k];
        if (rpb > 1) {
          across[threadIdx.x] = sum;
          __syncthreads();
          for (int t = 1; t < rpb; ++t) sum += across[t * tpr + lane];
          __syncthreads();
        }
        if (team == 0 && v < nvec) out[which * N + v * VEC + k] = sum;
      }
    }
  }
}

// The second sweep of wide rows with dweight/dbias: dx, and stage 1 of dweight = sum(dy * xhat) and dbias =
// sum(dy). Block (tile, chunk) owns kTileThreads vectors of columns and rows [chunk * rows_per_chunk,
// +rows_per_chunk); thread (tx, ty) takes its column vector in rows ty, ty + kTileRows, ..., so a warp reads
// kTileThreads whole vectors of a row (16-byte accesses, contiguous) and its weights once. The block adds its
// kTileRows sums per column in row order and writes partial[chunk][0 or 1][col]; stage 2 is
// csrc/cuda/column_sum.cuh. Deterministic: fixed orders, no atomics.
// Assumptions: blockDim = (kTileThreads, kTileRows); VEC elements per access, N % VEC == 0 and every pointer
// aligned to a whole vector; gridDim.x * kTileThreads * VEC >= N and gridDim.y * rows_per_chunk >= M;
// row_means[2 * r + 0 / 1] = mean(w*dy), mean(w*dy*xhat) of row r (the SUMS_ONLY sweep before).
constexpr int kTileThreads = 32;
constexpr int kTileRows = 8;

template <typename T, typename P, int VEC>
__global__ void __launch_bounds__(kTileThreads * kTileRows) layer_norm_bwd_dx_params_kernel(
    const T* __restrict__ dy, const T* __restrict__ x, const typename AccOf<T>::type* __restrict__ mean,
    const typename AccOf<T>::type* __restrict__ rstd, const typename AccOf<T>::type* __restrict__ row_means,
    const P* __restrict__ w, T* __restrict__ dx, typename AccOf<T>::type* __restrict__ partial, int64_t M, int64_t N,
    int64_t rows_per_chunk) {
  using acc_t = typename AccOf<T>::type;
  constexpr int kTileCols = kTileThreads * VEC;
  // sums[which][ty][k * kTileThreads + tx]: column tx * VEC + k of the tile (conflict-free stores)
  __shared__ acc_t sums[2][kTileRows][kTileCols];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t nvec = N / VEC;
  const int64_t v = (int64_t)blockIdx.x * kTileThreads + tx;
  const int64_t r0 = (int64_t)blockIdx.y * rows_per_chunk;
  const int64_t r1 = std::min<int64_t>(M, r0 + rows_per_chunk);
  acc_t dw[VEC], db[VEC];
#pragma unroll
  for (int k = 0; k < VEC; ++k) dw[k] = db[k] = acc_t(0);
  if (v < nvec) {
    Pack<P, VEC> pw;
    if (w != nullptr) pw = reinterpret_cast<const Pack<P, VEC>*>(w)[v];
#pragma unroll 2
    for (int64_t r = r0 + ty; r < r1; r += kTileRows) {
      const Pack<T, VEC> px = reinterpret_cast<const Pack<T, VEC>*>(x + r * N)[v];
      const Pack<T, VEC> pg = reinterpret_cast<const Pack<T, VEC>*>(dy + r * N)[v];
      const acc_t mu = mean[r], rs = rstd[r];
      reinterpret_cast<Pack<T, VEC>*>(dx + r * N)[v] = dx_vector(px, pg, pw, w, mu, rs, row_means[2 * r],
                                                                 row_means[2 * r + 1]);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const acc_t g = static_cast<acc_t>(pg.v[k]);
        dw[k] += g * ((static_cast<acc_t>(px.v[k]) - mu) * rs);  // dy * xhat: finite for huge x
        db[k] += g;
      }
    }
  }
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    sums[0][ty][k * kTileThreads + tx] = dw[k];
    sums[1][ty][k * kTileThreads + tx] = db[k];
  }
  __syncthreads();
  const int64_t first_col = (int64_t)blockIdx.x * kTileCols;
  for (int i = ty * kTileThreads + tx; i < 2 * kTileCols; i += kTileThreads * kTileRows) {
    const int which = i / kTileCols, j = i % kTileCols;
    const int64_t col = first_col + (int64_t)(j % kTileThreads) * VEC + j / kTileThreads;
    if (col >= N) continue;
    acc_t sum = sums[which][0][j];
    for (int t = 1; t < kTileRows; ++t) sum += sums[which][t][j];
    partial[((int64_t)blockIdx.y * 2 + which) * N + col] = sum;
  }
}

inline bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Team width: the smallest power of two >= 32 with at most `vectors` vectors of `vec` elements per thread,
// capped at a block.
struct Launch {
  int tpr;
  int threads;
  unsigned blocks;
};

Launch launch_for(int64_t M, int64_t N, int vec, int vectors) {
  int tpr = kWarp;
  while (tpr < kMaxTeam && (int64_t)tpr * vec * vectors < N) tpr *= 2;
  const int rpb = std::max(1, 128 / tpr);
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t want = (M + rpb - 1) / rpb;
  // Enough blocks to fill every SM many times over; the grid-stride loop covers the rest.
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(want, sms * 64));
  return {tpr, tpr * rpb, static_cast<unsigned>(blocks)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd_cuda(
    const at::Tensor& x_, const c10::optional<at::Tensor>& weight_, const c10::optional<at::Tensor>& bias_,
    int64_t normalized_ndim, double eps) {
  c10::cuda::CUDAGuard guard(x_.device());
  Fwd f = prepare_fwd(x_, weight_, bias_, normalized_ndim, eps);
  const int64_t M = f.M, N = f.N;
  if (M == 0 || N == 0) return {f.y, f.mean, f.rstd};  // nothing to launch (a grid must not be empty)
  dispatch_types(f.x.scalar_type(), param_type_of(f.x, f.weight, f.bias), [&](auto t, auto p) {
    using T = decltype(t);
    using P = decltype(p);
    using acc_t = typename AccOf<T>::type;
    constexpr int VEC = 16 / sizeof(T);
    const auto d = ptrs_of<T, P>(f);
    // Row starts are aligned when the base is and N is a multiple of VEC; a view that starts
    // mid-vector (x[1:]) takes the scalar kernel.
    const bool vec_ok = N % VEC == 0 && aligned(d.x, 16) && aligned(d.y, 16) &&
                        (d.w == nullptr || aligned(d.w, sizeof(P) * VEC)) &&
                        (d.b == nullptr || aligned(d.b, sizeof(P) * VEC));
    const int vec = vec_ok ? VEC : 1;
    constexpr int kHeldVectors = fwd_vectors<T>();
    const Launch l = launch_for(M, N, vec, kHeldVectors);
    auto stream = at::cuda::getCurrentCUDAStream();
    const auto run = [&](auto kernel) {
      kernel<<<l.blocks, l.threads, 0, stream>>>(d.x, d.w, d.b, d.y, d.mean, d.rstd, M, N, static_cast<acc_t>(eps),
                                                  l.tpr);
    };
    const bool held = l.tpr <= kHeldMaxTeam && N / vec <= (int64_t)l.tpr * kHeldVectors &&
                      (sizeof(T) >= 4 || l.tpr >= kHeldMin16);
    if (vec_ok && held) run(layer_norm_fwd_kernel<T, P, VEC, true>);
    else if (vec_ok) run(layer_norm_fwd_kernel<T, P, VEC, false>);
    else if (held) run(layer_norm_fwd_kernel<T, P, 1, true>);
    else run(layer_norm_fwd_kernel<T, P, 1, false>);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {f.y, f.mean, f.rstd};
}

// Rows a team takes at least before another block (and its row of partial sums) is added: the partials
// cost 2 N fp32 writes and reads a block, against the rows' 3 N elements of traffic each.
constexpr int64_t kFusedMinRowsPerTeam = 4;

// The fused backward of M rows of N with teams of tpr threads: as many blocks as stay resident, fewer when
// the rows are too few to give every team kFusedMinRowsPerTeam of them, but never fewer than one block per
// SM while rows last (BERT-base's 1024 x 768 would otherwise take 64 blocks on 132 SMs); then stage 2 when
// dweight or dbias is asked for (dwp/dbp not null).
template <typename T, typename P, int VEC>
void bwd_fused(const BwdPtrs<T, P>& d, int64_t M, int64_t N, int tpr, P* dwp, P* dbp, const at::Tensor& like,
               cudaStream_t stream) {
  using acc_t = typename AccOf<T>::type;
  constexpr auto kernel = layer_norm_bwd_fused_kernel<T, P, VEC, fused_vectors<T, VEC>()>;
  const bool params = dwp != nullptr || dbp != nullptr;
  const int rpb = std::max(1, kFusedBlockThreads / tpr);
  const int64_t min_rows = params ? rpb * kFusedMinRowsPerTeam : rpb;
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t wanted = std::max((M + min_rows - 1) / min_rows, std::min(sms, (M + rpb - 1) / rpb));
  const int64_t blocks = std::max<int64_t>(1, std::min(resident_blocks<kernel>(tpr * rpb), wanted));
  at::Tensor partial;
  if (params) partial = at::empty({blocks, 2, N}, like.options().dtype(stat_type_of(like)));
  kernel<<<(unsigned)blocks, tpr * rpb, 0, stream>>>(d.dy, d.x, d.mean, d.rstd, d.w, d.dx,
                                                      params ? partial.mutable_data_ptr<acc_t>() : nullptr, M, N, tpr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (params) column_sum::launch<acc_t, P>(partial.const_data_ptr<acc_t>(), blocks, 2 * N, N, dwp, dbp, stream);
}

// Rows wider than the fused kernel takes, dx alone: one kernel, two sweeps of each row.
template <typename T, typename P, int VEC>
void wide_bwd_dx(const BwdPtrs<T, P>& d, const Launch& l, int64_t M, int64_t N, cudaStream_t stream) {
  layer_norm_bwd_dx_kernel<T, P, VEC, false><<<l.blocks, l.threads, 0, stream>>>(d.dy, d.x, d.mean, d.rstd, d.w, d.dx,
                                                                                  nullptr, M, N, l.tpr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Rows wider than the fused kernel takes, with dweight/dbias: the row sums (first sweep), dx with the partial
// sums of dweight/dbias per row chunk (second sweep), then the partials summed per column.
template <typename T, typename P, int VEC>
void wide_bwd_dx_params(const BwdPtrs<T, P>& d, const Launch& l, int64_t M, int64_t N, P* dwp, P* dbp,
                        const at::Tensor& like, cudaStream_t stream) {
  using acc_t = typename AccOf<T>::type;
  auto row_means = at::empty({M, 2}, like.options().dtype(stat_type_of(like)));
  acc_t* rm = row_means.mutable_data_ptr<acc_t>();
  layer_norm_bwd_dx_kernel<T, P, VEC, true><<<l.blocks, l.threads, 0, stream>>>(d.dy, d.x, d.mean, d.rstd, d.w,
                                                                                 nullptr, rm, M, N, l.tpr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int64_t col_tiles = (N / VEC + kTileThreads - 1) / kTileThreads;
  TORCH_CHECK(col_tiles <= 0x7fffffff, "layer_norm_bwd: ", N, " columns are too many");
  const auto [chunks, rows_per_chunk] = column_sum::row_chunks(M, col_tiles, 4 * kTileRows);
  auto partial = at::empty({chunks, 2, N}, like.options().dtype(stat_type_of(like)));
  layer_norm_bwd_dx_params_kernel<T, P, VEC><<<dim3((unsigned)col_tiles, (unsigned)chunks),
                                               dim3(kTileThreads, kTileRows), 0, stream>>>(
      d.dy, d.x, d.mean, d.rstd, rm, d.w, d.dx, partial.mutable_data_ptr<acc_t>(), M, N, rows_per_chunk);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  column_sum::launch<acc_t, P>(partial.const_data_ptr<acc_t>(), chunks, 2 * N, N, dwp, dbp, stream);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd_cuda(
    const at::Tensor& dy_, const at::Tensor& x_, const at::Tensor& mean_, const at::Tensor& rstd_,
    const c10::optional<at::Tensor>& weight_, const c10::optional<at::Tensor>& bias_, int64_t normalized_ndim,
    bool need_dweight, bool need_dbias) {
  c10::cuda::CUDAGuard guard(x_.device());
  Bwd b = prepare_bwd(dy_, x_, mean_, rstd_, weight_, bias_, normalized_ndim, need_dweight, need_dbias);
  const int64_t M = b.M, N = b.N;
  if (M == 0 || N == 0) return {b.dx, b.dweight, b.dbias};  // nothing to launch
  auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_types(b.x.scalar_type(), b.param_type, [&](auto t, auto p) {
    using T = decltype(t);
    using P = decltype(p);
    constexpr int VEC = 16 / sizeof(T);
    const auto d = ptrs_of<T, P>(b);
    P* dwp = need_dweight ? b.dweight.mutable_data_ptr<P>() : nullptr;
    P* dbp = need_dbias ? b.dbias.mutable_data_ptr<P>() : nullptr;
    const bool vec_ok = N % VEC == 0 && aligned(d.x, 16) && aligned(d.dy, 16) && aligned(d.dx, 16) &&
                        (d.w == nullptr || aligned(d.w, sizeof(P) * VEC));
    const int vec = vec_ok ? VEC : 1;
    const int64_t nvec = N / vec;
    const int64_t per_warp = kWarp * static_cast<int64_t>(vec_ok ? fused_vectors<T, VEC>() : fused_vectors<T, 1>());
    const int64_t fused_tpr = kWarp * ((nvec + per_warp - 1) / per_warp);  // the smallest team that holds a row
    if (fused_tpr <= kFusedMaxThreads) {
      const int tpr = static_cast<int>(fused_tpr);
      if (vec_ok) bwd_fused<T, P, VEC>(d, M, N, tpr, dwp, dbp, b.x, stream);
      else bwd_fused<T, P, 1>(d, M, N, tpr, dwp, dbp, b.x, stream);
      return;
    }

    const Launch l = launch_for(M, N, vec, kLoopVectors);
    const bool params = dwp != nullptr || dbp != nullptr;
    if (!params) {
      if (vec_ok) wide_bwd_dx<T, P, VEC>(d, l, M, N, stream);
      else wide_bwd_dx<T, P, 1>(d, l, M, N, stream);
      return;
    }
    if (vec_ok) wide_bwd_dx_params<T, P, VEC>(d, l, M, N, dwp, dbp, b.x, stream);
    else wide_bwd_dx_params<T, P, 1>(d, l, M, N, dwp, dbp, b.x, stream);
  });
  return {b.dx, b.dweight, b.dbias};
}

}  // namespace

TORCH_LIBRARY_IMPL(accel, CUDA, m) {
  m.impl("layer_norm_fwd", &layer_norm_fwd_cuda);
  m.impl("layer_norm_bwd", &layer_norm_bwd_cuda);
}

}  // namespace accel
