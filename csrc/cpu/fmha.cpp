// Fused Swin window attention scores on CPU: softmax(attn + relative_pos_bias + attn_mask) over the
// last dim, and its backward (grad of attn, and of the bias reduced over the B*nW windows).
//
// attn [B*nW, nH, N, N] (any float dtype), bias [nH, N, N], mask [nW, N, N] or none; the mask of
// window w applies to attn rows b*nW + w. Math is in at::opmath_type (float for half/bfloat16/float,
// double for double); bias and mask are read in that type, whatever their own dtype.
// The backward needs only the softmax output y: dx = y * (g - sum(g * y)), dbias = sum over B*nW of dx.
// The bias gradient is summed in a fixed order (per chunk of windows, then over chunks), so it does
// not depend on the thread count.
//
// Two implementations of the row work: portable loops the compiler vectorizes (all dtypes, any x86 or
// other CPU), and AVX-512 intrinsics for float/half/bfloat16 storage, picked at run time where the CPU
// has AVX-512 (vec::avx512_enabled()). Against the portable loops (one thread, AMD EPYC Zen 5, Swin's
// N = 49), the AVX-512 forward is ~2.2x faster in every dtype, the backward as fast in float and
// 1.5-2x faster in bfloat16/half.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu/vec_math.h"
#include "fmha_host.h"

namespace accel {
namespace {

// Windows per chunk of the bias-gradient reduction: chunks run in parallel into their own partial sums.
constexpr int64_t kChunk = 32;

// Backward tasks are (chunk c of windows, head h), task = c * nH + h; task (c, h) owns partial[c, h] and
// adds its windows' dx to it in window order (so the result does not depend on the thread count).
// for_each_head_run calls f(c, h0, h1) for the runs of a thread's tasks [begin, end) that share a chunk,
// at most `group` heads a run; the caller walks the run window by window over its heads, i.e. through g, y
// and dx ([B*nW, nH, N, N]) in memory order. Task by task instead, each window's head is a block nH of
// them apart: on a 2-core AVX-512 EPYC that walk took 1.12x (float) and 1.49x (bf16) this one's time at
// Swin's stage 1, 1.33x and 1.26x at stage 3 (alternating processes), and lost to torch's softmax
// backward + sum in float (0.92-0.99x; now 1.13-1.25x, benchmarks/results/kernels_cpu_avx512_fmha.json).
template <typename F>
void for_each_head_run(int64_t begin, int64_t end, int64_t nH, int64_t group, F f) {
  for (int64_t task = begin; task < end;) {
    const int64_t c = task / nH, h0 = task % nH;
    const int64_t h1 = std::min({nH, h0 + group, end - c * nH});
    f(c, h0, h1);
    task = c * nH + h1;
  }
}

// Floats of padded bias-gradient rows the AVX-512 backward sums at once (a run's heads): 256 KB, an L2
// share; Swin's N = 49 (49 x 64 floats a head) fits 20 heads.
constexpr int64_t kAccFloats = 64 * 1024;

// The row loops below are written so that -O3 vectorizes them without -ffast-math: reductions keep
// kLanes partial results (the compiler may not reorder a single floating-point accumulator) and the
// exponential is vec::exp, which is branch-free.
constexpr int64_t kLanes = 8;

template <typename T>
inline T row_max(const T* v, int64_t n) {
  T part[kLanes];
  for (int64_t k = 0; k < kLanes; ++k) part[k] = -std::numeric_limits<T>::infinity();
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int64_t k = 0; k < kLanes; ++k) part[k] = part[k] > v[j + k] ? part[k] : v[j + k];
  }
  T mx = -std::numeric_limits<T>::infinity();
  for (; j < n; ++j) mx = mx > v[j] ? mx : v[j];
  for (int64_t k = 0; k < kLanes; ++k) mx = mx > part[k] ? mx : part[k];
  return mx;
}

// v[j] = exp(v[j] - mx); returns the sum.
template <typename T>
inline T exp_and_sum(T* v, int64_t n, T mx) {
  T part[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int64_t k = 0; k < kLanes; ++k) {
      v[j + k] = vec::exp(v[j + k] - mx);
      part[k] += v[j + k];
    }
  }
  T sum = 0;
  for (; j < n; ++j) {
    v[j] = vec::exp(v[j] - mx);
    sum += v[j];
  }
  for (int64_t k = 0; k < kLanes; ++k) sum += part[k];
  return sum;
}

template <typename T, typename scalar_t>
inline T dot(const scalar_t* a, const scalar_t* b, int64_t n) {
  T part[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int64_t k = 0; k < kLanes; ++k) part[k] += static_cast<T>(a[j + k]) * static_cast<T>(b[j + k]);
  }
  T s = 0;
  for (; j < n; ++j) s += static_cast<T>(a[j]) * static_cast<T>(b[j]);
  for (int64_t k = 0; k < kLanes; ++k) s += part[k];
  return s;
}

// The portable float row work, compiled for the x86-64 v4 (AVX-512) and v3 (AVX2, FMA, F16C) levels
// as well as the baseline and picked at load time by CPU features (GCC function multi-versioning): an
// ahead-of-time build cannot assume the machine it runs on, and its baseline is SSE2. ("arch=<cpu>"
// clones would dispatch on the CPU model instead: an AMD or newer Intel CPU got the baseline.)
// Half and bfloat16 rows are widened to float before they get here.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) && __GNUC__ >= 12
#define ACCEL_FMHA_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#elif defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
// GCC 12 added the x86-64-vN levels to target_clones; older ones (GCC 11 is Ubuntu 22.04's) reject
// them, but dispatch single ISA names on CPU features as well.
#define ACCEL_FMHA_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define ACCEL_FMHA_CLONES
#endif

// v <- softmax(v) over n values.
template <typename T>
inline void softmax_inplace_impl(T* v, int64_t n) {
  const T inv = T(1) / exp_and_sum(v, n, row_max(v, n));
  for (int64_t j = 0; j < n; ++j) v[j] *= inv;
}

// One window-head [N, N]: dx = y * (g - rowsum(g * y)) and acc += dx; dx may be g.
template <typename T>
inline void softmax_backward_head_impl(const T* g, const T* y, T* dx, T* acc, int64_t N) {
  for (int64_t i = 0; i < N; ++i) {
    const T* gr = g + i * N;
    const T* yr = y + i * N;
    T* dr = dx + i * N;
    T* ar = acc + i * N;
    const T gy = dot<T>(gr, yr, N);
    for (int64_t j = 0; j < N; ++j) {
      const T d = yr[j] * (gr[j] - gy);
      dr[j] = d;
      ar[j] += d;
    }
  }
}

// One window-head [N, N]: out = softmax(a + b + m) row by row; m may be null; a may be out.
template <typename T>
inline void add_softmax_head_impl(const T* a, const T* b, const T* m, T* out, int64_t N) {
  for (int64_t i = 0; i < N * N; i += N) {
    if (m != nullptr) {
      for (int64_t j = i; j < i + N; ++j) out[j] = a[j] + b[j] + m[j];
    } else {
      for (int64_t j = i; j < i + N; ++j) out[j] = a[j] + b[j];
    }
    softmax_inplace_impl(out + i, N);
  }
}

ACCEL_FMHA_CLONES void add_softmax_head(const float* a, const float* b, const float* m, float* out, int64_t N) {
  add_softmax_head_impl(a, b, m, out, N);
}
void add_softmax_head(const double* a, const double* b, const double* m, double* out, int64_t N) {
  add_softmax_head_impl(a, b, m, out, N);
}
ACCEL_FMHA_CLONES void softmax_backward_head(const float* g, const float* y, float* dx, float* acc, int64_t N) {
  softmax_backward_head_impl(g, y, dx, acc, N);
}
void softmax_backward_head(const double* g, const double* y, double* dx, double* acc, int64_t N) {
  softmax_backward_head_impl(g, y, dx, acc, N);
}

// Half/bfloat16 <-> opmath over a block. bfloat16 is a shift and vectorizes as is; half goes through
// F16C's 8-wide conversions where the CPU has them (every x86-64 v3 CPU does), since c10::Half's
// scalar conversion, or GCC 12's of _Float16, converts one element at a time and took 3/4 of the
// portable backward's time. Both round to nearest even.
template <typename S, typename T>
inline void widen(const S* in, T* out, int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] = static_cast<T>(in[j]);
}
template <typename S, typename T>
inline void narrow(const T* in, S* out, int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] = static_cast<S>(in[j]);
}
#if ACCEL_HAVE_X86_INTRINSICS
__attribute__((target("avx,f16c"))) void widen_half_f16c(const c10::Half* in, float* out, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    _mm256_storeu_ps(out + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + j))));
  }
  for (; j < n; ++j) out[j] = static_cast<float>(in[j]);
}
__attribute__((target("avx,f16c"))) void narrow_half_f16c(const float* in, c10::Half* out, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j),
                     _mm256_cvtps_ph(_mm256_loadu_ps(in + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  for (; j < n; ++j) out[j] = static_cast<c10::Half>(in[j]);
}
inline void widen(const c10::Half* in, float* out, int64_t n) {
  if (vec::f16c_enabled()) return widen_half_f16c(in, out, n);
  for (int64_t j = 0; j < n; ++j) out[j] = static_cast<float>(in[j]);
}
inline void narrow(const float* in, c10::Half* out, int64_t n) {
  if (vec::f16c_enabled()) return narrow_half_f16c(in, out, n);
  for (int64_t j = 0; j < n; ++j) out[j] = static_cast<c10::Half>(in[j]);
}
#endif

#if ACCEL_HAVE_X86_INTRINSICS
// The row work with AVX-512 intrinsics, for float, half and bfloat16 storage: 16 lanes per step,
// half/bfloat16 converted in registers, a row's last partial vector masked on load.
//
// Two things made the straightforward version (one row at a time, masked tail stores) no faster than
// the portable loops: a row alone is a chain of dependent steps (max, then exponentials, then sum,
// then scaling), so the forward runs the steps over a block of rows each; and a load that overlaps
// the 64 bytes of an earlier masked store cannot take its data from the store buffer and waits for
// the store, so scratch rows are padded to whole vectors (stride ld = N rounded up to 16) and a row
// of the output ends with a whole vector over its last 16 values, rewriting some.
namespace avx512 = vec::avx512;

// p rounded up to a multiple of 64 bytes (p must have 15 floats to spare), so that padded rows
// start at a cache line.
inline float* align64(float* p) {
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~static_cast<uintptr_t>(63));
}

// Rows of the forward per block: ~4 KB of scratch, so that it and the block's rows of attn, bias,
// mask and output stay in the L1 cache.
inline int64_t rows_per_block(int64_t N, int64_t ld) { return std::max<int64_t>(1, std::min<int64_t>(N, 1024 / ld)); }

// Rows [0, rows), each N long and N apart: out = softmax(a + b + m) (m may be null), one step at a
// time over all rows: sums into buf and row maxima, then exponentials and row sums, then scaling.
// buf holds rows * ld floats, stat 2 * rows.
template <typename scalar_t>
ACCEL_AVX512 void add_softmax_rows_avx512(const scalar_t* a, const float* b, const float* m, scalar_t* out,
                                          float* buf, float* stat, int64_t rows, int64_t N, int64_t ld) {
  const int64_t full = N / 16 * 16;  // values in whole vectors; the rest, if any, in one masked vector
  const __mmask16 tail = avx512::first_lanes(N - full);
  float* inv_sum = stat + rows;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = r * N;
    float* row = buf + r * ld;
    __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t j = 0;
    for (; j < full; j += 16) {
      __m512 s = _mm512_add_ps(avx512::load(a + i + j), _mm512_loadu_ps(b + i + j));
      if (m != nullptr) s = _mm512_add_ps(s, _mm512_loadu_ps(m + i + j));
      _mm512_storeu_ps(row + j, s);
      vmax = _mm512_max_ps(vmax, s);
    }
    if (tail) {
      __m512 s = _mm512_add_ps(avx512::load(a + i + j, tail), _mm512_maskz_loadu_ps(tail, b + i + j));
      if (m != nullptr) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(tail, m + i + j));
      _mm512_storeu_ps(row + j, s);  // lanes past N hold 0 and stay out of the max and the sum
      vmax = _mm512_mask_max_ps(vmax, tail, vmax, s);
    }
    // The max may drop a NaN, but the NaN reaches the row's sum, which makes the whole row NaN.
    stat[r] = _mm512_reduce_max_ps(vmax);
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* row = buf + r * ld;
    const __m512 mx = _mm512_set1_ps(stat[r]);
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t j = 0; j < full; j += 16) {
      const __m512 e = avx512::exp(_mm512_sub_ps(_mm512_loadu_ps(row + j), mx));
      _mm512_storeu_ps(row + j, e);
      vsum = _mm512_add_ps(vsum, e);
    }
    if (tail) {
      const __m512 e = avx512::exp(_mm512_sub_ps(_mm512_loadu_ps(row + full), mx));
      _mm512_storeu_ps(row + full, e);
      vsum = _mm512_mask_add_ps(vsum, tail, vsum, e);
    }
    inv_sum[r] = 1.0f / _mm512_reduce_add_ps(vsum);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = r * N;
    const float* row = buf + r * ld;
    const __m512 inv = _mm512_set1_ps(inv_sum[r]);
    for (int64_t j = 0; j < full; j += 16) avx512::store(out + i + j, _mm512_mul_ps(_mm512_loadu_ps(row + j), inv));
    if (tail && N >= 16) {
      avx512::store(out + i + N - 16, _mm512_mul_ps(_mm512_loadu_ps(row + N - 16), inv));
    } else if (tail) {
      avx512::store(out + i, _mm512_mul_ps(_mm512_loadu_ps(row), inv), tail);
    }
  }
}

// Window-heads [begin, end) of the forward (see fmha_fwd_cpu).
template <typename scalar_t>
ACCEL_AVX512 void add_softmax_heads_avx512(const scalar_t* a, const float* b, const float* m, scalar_t* y,
                                           int64_t begin, int64_t end, int64_t nH, int64_t window_num,
                                           int64_t N) {
  const int64_t head = N * N, ld = (N + 15) / 16 * 16, rows = rows_per_block(N, ld);
  std::vector<float> scratch(static_cast<size_t>(rows * ld + 2 * rows + 16));
  float* buf = align64(scratch.data());
  float* stat = buf + rows * ld;
  for (int64_t blk = begin; blk < end; ++blk) {
    const int64_t h = blk % nH, w = (blk / nH) % window_num;
    for (int64_t i = 0; i < N; i += rows) {
      const int64_t at = i * N;
      add_softmax_rows_avx512(a + blk * head + at, b + h * head + at, m != nullptr ? m + w * head + at : nullptr,
                              y + blk * head + at, buf, stat, std::min(rows, N - i), N, ld);
    }
  }
}

// A row of N values, 16 (V - 1) < N <= 16 V, held in V vectors (the last one's lanes past N are
// junk) stored to out: the first V - 1 whole, then the row's last 16 values as one whole vector
// (lanes t .. t + 15 of [v[V-2], v[V-1]], t = N - 16 (V - 1), from last_idx), or, for N < 16, masked.
ACCEL_AVX512 inline __m512i last_idx(int64_t N) {
  return _mm512_add_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                          _mm512_set1_epi32(static_cast<int>(N % 16)));
}

template <int V, typename scalar_t>
ACCEL_AVX512 inline void store_row(scalar_t* out, const __m512 (&v)[V], __mmask16 last, __m512i idx, int64_t N) {
  for (int k = 0; k + 1 < V; ++k) avx512::store(out + 16 * k, v[k]);
  if (last == static_cast<__mmask16>(0xFFFF)) {
    avx512::store(out + 16 * (V - 1), v[V - 1]);
  } else if constexpr (V >= 2) {
    avx512::store(out + N - 16, _mm512_permutex2var_ps(v[V - 2], idx, v[V - 1]));
  } else {
    avx512::store(out, v[0], last);
  }
}

// The N rows of one window-head, 16 (V - 1) < N <= 16 V: dx = y * (g - rowsum(g * y)) and acc += dx,
// with g and y of a row held in registers (unlike the forward, one row at a time keeps up here: the
// chain is shorter and the loads of the next rows overlap it). acc has rows ld = 16 V apart; its
// lanes past N collect zeros.
template <int V, typename scalar_t>
ACCEL_AVX512 void softmax_backward_head_regs(const scalar_t* g, const scalar_t* y, scalar_t* dx, float* acc,
                                             int64_t N, int64_t ld) {
  const __mmask16 last = avx512::first_lanes(N - 16 * (V - 1));
  const __m512i idx = last_idx(N);
  for (int64_t r = 0; r < N; ++r) {
    const int64_t i = r * N;
    __m512 gv[V], yv[V];
    for (int k = 0; k < V; ++k) {
      const __mmask16 lanes = k + 1 < V ? static_cast<__mmask16>(0xFFFF) : last;
      gv[k] = avx512::load(g + i + 16 * k, lanes);
      yv[k] = avx512::load(y + i + 16 * k, lanes);
    }
    __m512 vdot = _mm512_mul_ps(gv[0], yv[0]);
    for (int k = 1; k < V; ++k) vdot = _mm512_fmadd_ps(gv[k], yv[k], vdot);
    const __m512 s = _mm512_set1_ps(_mm512_reduce_add_ps(vdot));
    float* arow = acc + r * ld;
    for (int k = 0; k < V; ++k) {
      gv[k] = _mm512_mul_ps(yv[k], _mm512_sub_ps(gv[k], s));  // now dx
      _mm512_storeu_ps(arow + 16 * k, _mm512_add_ps(_mm512_loadu_ps(arow + 16 * k), gv[k]));
    }
    store_row<V>(dx + i, gv, last, idx, N);
  }
}

// The same for rows [0, rows) of any length N, in two steps over the rows: all row sums into gy,
// then the updates. acc has rows ld apart (N rounded up to 16).
template <typename scalar_t>
ACCEL_AVX512 void softmax_backward_rows_avx512(const scalar_t* g, const scalar_t* y, scalar_t* dx, float* acc,
                                               float* gy, int64_t rows, int64_t N, int64_t ld) {
  const int64_t full = N / 16 * 16;
  const __mmask16 tail = avx512::first_lanes(N - full);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = r * N;
    __m512 vdot = _mm512_setzero_ps();
    for (int64_t j = 0; j < full; j += 16) {
      vdot = _mm512_fmadd_ps(avx512::load(g + i + j), avx512::load(y + i + j), vdot);
    }
    if (tail) vdot = _mm512_fmadd_ps(avx512::load(g + i + full, tail), avx512::load(y + i + full, tail), vdot);
    gy[r] = _mm512_reduce_add_ps(vdot);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = r * N;
    float* arow = acc + r * ld;
    const __m512 s = _mm512_set1_ps(gy[r]);
    for (int64_t j = 0; j < full; j += 16) {
      const __m512 d = _mm512_mul_ps(avx512::load(y + i + j), _mm512_sub_ps(avx512::load(g + i + j), s));
      avx512::store(dx + i + j, d);
      _mm512_storeu_ps(arow + j, _mm512_add_ps(_mm512_loadu_ps(arow + j), d));
    }
    if (tail) {  // y is 0 past N, so d is too (or NaN if gy is not finite; acc's lanes there are never read)
      const __m512 d =
          _mm512_mul_ps(avx512::load(y + i + full, tail), _mm512_sub_ps(avx512::load(g + i + full, tail), s));
      _mm512_storeu_ps(arow + full, _mm512_add_ps(_mm512_loadu_ps(arow + full), d));
      if (N >= 16) {
        const int64_t k = i + N - 16;
        avx512::store(dx + k, _mm512_mul_ps(avx512::load(y + k), _mm512_sub_ps(avx512::load(g + k), s)));
      } else {
        avx512::store(dx + i, d, tail);
      }
    }
  }
}

// Backward tasks [begin, end) (for_each_head_run): each head of a run sums its bias gradient in a padded
// buffer of its own in window order, then copies it to p[c, h].
template <typename scalar_t>
ACCEL_AVX512 void softmax_backward_tasks_avx512(const scalar_t* g, const scalar_t* y, scalar_t* d, float* p,
                                                int64_t begin, int64_t end, int64_t BnW, int64_t nH, int64_t N) {
  const int64_t head = N * N, ld = (N + 15) / 16 * 16, rows = rows_per_block(N, ld), padded = N * ld;
  const int64_t group = std::max<int64_t>(1, std::min(nH, kAccFloats / padded));
  std::vector<float> scratch(static_cast<size_t>(group * padded + rows + 16));
  float* accs = align64(scratch.data());  // padded is a multiple of 16 floats: every head's rows stay aligned
  float* gy = accs + group * padded;
  for_each_head_run(begin, end, nH, group, [&](int64_t c, int64_t h0, int64_t h1) {
    std::fill(accs, accs + (h1 - h0) * padded, 0.0f);
    for (int64_t bw = c * kChunk; bw < std::min(BnW, (c + 1) * kChunk); ++bw) {
      for (int64_t h = h0; h < h1; ++h) {
        const int64_t base = (bw * nH + h) * head;
        float* acc = accs + (h - h0) * padded;
        switch (ld / 16) {  // rows of at most 4 vectors (Swin's N = 49 and 64) stay in registers
          case 1: softmax_backward_head_regs<1>(g + base, y + base, d + base, acc, N, ld); continue;
          case 2: softmax_backward_head_regs<2>(g + base, y + base, d + base, acc, N, ld); continue;
          case 3: softmax_backward_head_regs<3>(g + base, y + base, d + base, acc, N, ld); continue;
          case 4: softmax_backward_head_regs<4>(g + base, y + base, d + base, acc, N, ld); continue;
          default: break;
        }
        for (int64_t i = 0; i < N; i += rows) {
          const int64_t at = base + i * N;
          softmax_backward_rows_avx512(g + at, y + at, d + at, acc + i * ld, gy, std::min(rows, N - i), N, ld);
        }
      }
    }
    for (int64_t h = h0; h < h1; ++h) {
      const float* acc = accs + (h - h0) * padded;
      float* out = p + (c * nH + h) * head;
      for (int64_t i = 0; i < N; ++i) std::memcpy(out + i * N, acc + i * ld, sizeof(float) * N);
    }
  });
}
#endif  // ACCEL_HAVE_X86_INTRINSICS

// Run the forward (backward) with the AVX-512 kernels when they apply: float, half or bfloat16 storage
// on a CPU that has AVX-512. Returns whether it ran.
template <typename scalar_t, typename opmath_t>
bool forward_avx512(const scalar_t* a, const opmath_t* b, const opmath_t* m, scalar_t* y, int64_t heads,
                    int64_t grain, int64_t nH, int64_t window_num, int64_t N) {
#if ACCEL_HAVE_X86_INTRINSICS
  if constexpr (std::is_same_v<opmath_t, float>) {
    if (vec::avx512_enabled()) {
      at::parallel_for(0, heads, grain, [&](int64_t begin, int64_t end) {
        add_softmax_heads_avx512(a, b, m, y, begin, end, nH, window_num, N);
      });
      return true;
    }
  }
#endif
  return false;
}

template <typename scalar_t, typename opmath_t>
bool backward_avx512(const scalar_t* g, const scalar_t* y, scalar_t* d, opmath_t* p, int64_t tasks, int64_t BnW,
                     int64_t nH, int64_t N) {
#if ACCEL_HAVE_X86_INTRINSICS
  if constexpr (std::is_same_v<opmath_t, float>) {
    if (vec::avx512_enabled()) {
      at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
        softmax_backward_tasks_avx512(g, y, d, p, begin, end, BnW, nH, N);
      });
      return true;
    }
  }
#endif
  return false;
}

at::Tensor fmha_fwd_cpu(const at::Tensor& attn_, const at::Tensor& bias_, const std::optional<at::Tensor>& mask_,
                        int64_t window_num) {
  fmha_host::check_fwd_inputs(attn_, bias_, mask_, window_num);
  auto attn = attn_.contiguous();
  auto out = at::empty_like(attn);
  if (attn.numel() == 0) return out;
  const int64_t nH = attn.size(1), N = attn.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, attn.scalar_type(), "fmha_swin_fwd_cpu", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const auto op_dtype = c10::CppTypeToScalarType<opmath_t>::value;
    const auto bias = bias_.to(op_dtype).contiguous();
    at::Tensor mask;
    if (mask_.has_value()) mask = mask_->to(op_dtype).contiguous();
    const scalar_t* a = attn.const_data_ptr<scalar_t>();
    const opmath_t* b = bias.const_data_ptr<opmath_t>();
    const opmath_t* m = mask.defined() ? mask.const_data_ptr<opmath_t>() : nullptr;
    scalar_t* y = out.mutable_data_ptr<scalar_t>();
    const int64_t head = N * N;
    const int64_t grain = std::max<int64_t>(1, 16384 / head);
    // One task unit = one window-head: N rows sharing the bias head h and the mask of window w.
    if (forward_avx512(a, b, m, y, attn.size(0) * nH, grain, nH, window_num, N)) return;
    at::parallel_for(0, attn.size(0) * nH, grain, [&](int64_t begin, int64_t end) {
      std::vector<opmath_t> buf(std::is_same_v<scalar_t, opmath_t> ? 0 : static_cast<size_t>(head));
      for (int64_t blk = begin; blk < end; ++blk) {
        const int64_t h = blk % nH;
        const int64_t w = (blk / nH) % window_num;
        const opmath_t* bh = b + h * head;
        const opmath_t* mh = m != nullptr ? m + w * head : nullptr;
        if constexpr (std::is_same_v<scalar_t, opmath_t>) {
          // (the casts are identities here; they let the other dtypes' instantiation compile)
          add_softmax_head(reinterpret_cast<const opmath_t*>(a + blk * head), bh, mh,
                           reinterpret_cast<opmath_t*>(y + blk * head), N);
        } else {  // widen, compute in opmath, narrow once
          widen(a + blk * head, buf.data(), head);
          add_softmax_head(buf.data(), bh, mh, buf.data(), N);
          narrow(buf.data(), y + blk * head, head);
        }
      }
    });
  });
  return out;
}

// Returns (grad of attn in attn's dtype, grad of the bias [nH, N, N] in the op math type).
std::tuple<at::Tensor, at::Tensor> fmha_bwd_cpu(const at::Tensor& grad_, const at::Tensor& out_) {
  fmha_host::check_bwd_inputs(grad_, out_);
  auto out = out_.contiguous();
  auto grad = grad_.to(out.scalar_type()).contiguous();
  const int64_t BnW = out.size(0), nH = out.size(1), N = out.size(2);
  auto dx = at::empty_like(out);
  at::Tensor dbias;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "fmha_swin_bwd_cpu", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const auto op_dtype = c10::CppTypeToScalarType<opmath_t>::value;
    const int64_t head = N * N;  // elements of one head of one window, and of one bias head
    const int64_t chunks = (BnW + kChunk - 1) / kChunk;
    if (out.numel() == 0 || chunks <= 1) {
      dbias = at::zeros({nH, N, N}, out.options().dtype(op_dtype));
    }
    if (out.numel() == 0) return;
    // partial[c] sums the windows of chunk c; with a single chunk it is the result itself.
    at::Tensor partial = chunks <= 1 ? dbias : at::zeros({chunks, nH, N, N}, out.options().dtype(op_dtype));
    const scalar_t* g = grad.const_data_ptr<scalar_t>();
    const scalar_t* y = out.const_data_ptr<scalar_t>();
    scalar_t* d = dx.mutable_data_ptr<scalar_t>();
    opmath_t* p = partial.mutable_data_ptr<opmath_t>();
    // One task = one head of one chunk of windows (for_each_head_run): it owns partial[c, h].
    if (!backward_avx512(g, y, d, p, chunks * nH, BnW, nH, N)) {
      at::parallel_for(0, chunks * nH, 1, [&](int64_t begin, int64_t end) {
        // One window-head of g and y widened once to opmath: the row loops then run on plain arrays.
        std::vector<opmath_t> gbuf(static_cast<size_t>(head)), ybuf(static_cast<size_t>(head));
        for_each_head_run(begin, end, nH, nH, [&](int64_t c, int64_t h0, int64_t h1) {
          for (int64_t bw = c * kChunk; bw < std::min(BnW, (c + 1) * kChunk); ++bw) {
            for (int64_t h = h0; h < h1; ++h) {
              opmath_t* acc = p + (c * nH + h) * head;
              const int64_t base = (bw * nH + h) * head;
              const scalar_t* gh = g + base;
              const scalar_t* yh = y + base;
              scalar_t* dh = d + base;
              if constexpr (std::is_same_v<scalar_t, opmath_t>) {
                // (identity casts, as in the forward)
                softmax_backward_head(reinterpret_cast<const opmath_t*>(gh), reinterpret_cast<const opmath_t*>(yh),
                                      reinterpret_cast<opmath_t*>(dh), acc, N);
              } else {  // widen g and y once, compute dx into gbuf, narrow once
                widen(gh, gbuf.data(), head);
                widen(yh, ybuf.data(), head);
                softmax_backward_head(gbuf.data(), ybuf.data(), gbuf.data(), acc, N);
                narrow(gbuf.data(), dh, head);
              }
            }
          }
        });
      });
    }
    if (chunks > 1) {
      dbias = at::empty({nH, N, N}, out.options().dtype(op_dtype));
      opmath_t* db = dbias.mutable_data_ptr<opmath_t>();
      const int64_t numel = nH * head;
      at::parallel_for(0, numel, 4096, [&](int64_t begin, int64_t end) {
        for (int64_t e = begin; e < end; ++e) {
          opmath_t s = 0;
          for (int64_t c = 0; c < chunks; ++c) s += p[c * numel + e];
          db[e] = s;
        }
      });
    }
  });
  return {dx, dbias};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(accel, m) {
  // softmax(attn + bias[None] + mask.repeat(B)[:, None], -1); attn [B*nW, nH, N, N]
  m.def("fmha_swin_fwd(Tensor attn, Tensor bias, Tensor? mask, int window_num) -> Tensor");
  // (grad of attn, grad of bias in fp32 (fp64 for double)) from the forward's output
  m.def("fmha_swin_bwd(Tensor grad, Tensor out) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(accel, CPU, m) {
  m.impl("fmha_swin_fwd", &fmha_fwd_cpu);
  m.impl("fmha_swin_bwd", &fmha_bwd_cpu);
}

}  // namespace accel
