// LayerNorm forward and backward on CPU, and the schemas of the accel::layer_norm_* ops.
//
// x is viewed as [M, N]: N = the product of the last `normalized_ndim` dims, M = everything before.
// Statistics (mean, rstd = 1/sqrt(var + eps)) are kept per row in float (double for float64 input)
// and saved by the forward for the backward. weight/bias ("params") have either x's dtype or, for
// half/bfloat16 x, float32 (mixed precision); outputs keep x's dtype, gradients keep the params'.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include "layer_norm_host.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

namespace accel {
namespace {

using namespace layer_norm_host;

// Independent lanes let the compiler vectorize the sums (a single float accumulator is a serial
// dependency it may not reorder) and keep each lane's rounding error to N/kLanes terms.
constexpr int kLanes = 16;

template <typename acc_t>
inline acc_t sum_lanes(const acc_t* lanes) {
  acc_t s = 0;
  for (int l = 0; l < kLanes; ++l) s += lanes[l];
  return s;
}

// Sum of (x - shift): with shift one of the row's values the terms are the size of the row's
// spread, not of its offset, so a float sum over 64K elements of a row around 1000 stays exact
// to ~1e-6 of the spread instead of ~1e-3.
template <typename T, typename acc_t>
inline acc_t row_sum_shifted(const T* x, int64_t N, acc_t shift) {
  acc_t lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= N; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += static_cast<acc_t>(x[i + l]) - shift;
  for (int l = 0; i < N; ++i, ++l) lanes[l] += static_cast<acc_t>(x[i]) - shift;
  return sum_lanes(lanes);
}

// Sum of ((x - shift) * scale)^2.
template <typename T, typename acc_t>
inline acc_t row_sum_sq(const T* x, int64_t N, acc_t shift, acc_t scale) {
  acc_t lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= N; i += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      const acc_t d = (static_cast<acc_t>(x[i + l]) - shift) * scale;
      lanes[l] += d * d;
    }
  for (int l = 0; i < N; ++i, ++l) {
    const acc_t d = (static_cast<acc_t>(x[i]) - shift) * scale;
    lanes[l] += d * d;
  }
  return sum_lanes(lanes);
}

// 2^-e for m = f * 2^e, f in [0.5, 1), with e capped where 2^-e would be subnormal (126 in
// float): m * pow2_inv(m) is in [0.5, 4) for finite m > 0, and multiplying by it is exact.
template <typename acc_t>
inline acc_t pow2_inv(acc_t m) {
  int e = 0;
  std::frexp(m, &e);
  return std::ldexp(acc_t(1), -std::min(e, std::numeric_limits<acc_t>::max_exponent - 2));
}

// The statistics of a row whose sums overflow acc_t (in float: the sum of squared deviations
// once |x - mean| reaches ~1.8e19 / sqrt(N), the sum of deviations once they reach ~3.4e38 / N),
// exact for every row with |x| <= 2^126 (2^1022 in double).
// The sums are taken over (x - x0) * s with s = pow2_inv(D), D = max|x - x0| (x0 = x[0]): every
// term of the mean is below 4 and every square below 64 (|x - mean| <= 2D), while the largest
// |x - mean| * s is at least D * s / 2 >= 1/4, so var * s^2 >= 1/(16 N) stays far from underflow.
// Powers of two scale exactly: this is the two-pass computation below on exactly scaled values,
// and rstd = s / sqrt(var s^2 + eps s^2) = 1 / sqrt(var + eps), whose floor 1 / max|x| >= 2^-126
// is a normal float. A row holding an inf or NaN gets non-finite statistics (its outputs are NaN,
// like F.layer_norm's).
template <typename T, typename acc_t>
inline void row_stats_scaled(const T* x, int64_t N, acc_t eps, acc_t& mean, acc_t& rstd) {
  const acc_t x0 = static_cast<acc_t>(x[0]);
  acc_t dmax = 0;
  for (int64_t i = 0; i < N; ++i) dmax = std::max(dmax, std::abs(static_cast<acc_t>(x[i]) - x0));
  if (!std::isfinite(dmax)) return;  // an inf; a NaN (skipped by max) turns the sums below NaN
  const acc_t s = pow2_inv(dmax);
  acc_t lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= N; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += (static_cast<acc_t>(x[i + l]) - x0) * s;
  for (int l = 0; i < N; ++i, ++l) lanes[l] += (static_cast<acc_t>(x[i]) - x0) * s;
  mean = x0 + sum_lanes(lanes) / static_cast<acc_t>(N) / s;
  const acc_t var_s = row_sum_sq<T, acc_t>(x, N, mean, s) / static_cast<acc_t>(N);
  rstd = s / std::sqrt(var_s + eps * s * s);
}

// Two passes (mean, then squared deviations from it): exact for rows with a large offset,
// where the one-pass E[x^2] - E[x]^2 cancels catastrophically. A row whose sum of squares is
// not finite (an overflow: |x| around 1e19 and beyond in float) is redone on scaled values.
template <typename T, typename acc_t>
inline void row_stats(const T* x, int64_t N, acc_t eps, acc_t& mean, acc_t& rstd) {
  const acc_t shift = static_cast<acc_t>(x[0]);
  mean = shift + row_sum_shifted<T, acc_t>(x, N, shift) / static_cast<acc_t>(N);
  const acc_t ss = row_sum_sq<T, acc_t>(x, N, mean, acc_t(1));
  rstd = acc_t(1) / std::sqrt(ss / static_cast<acc_t>(N) + eps);
  if (!std::isfinite(ss)) row_stats_scaled<T, acc_t>(x, N, eps, mean, rstd);
}

// One loop per affine variant so that none of them branches per element.
template <typename T, typename P, typename acc_t>
inline void write_row(const T* x, const P* w, const P* b, T* y, int64_t N, acc_t mean, acc_t rstd) {
  if (w != nullptr && b != nullptr) {
    for (int64_t j = 0; j < N; ++j)
      y[j] = static_cast<T>((static_cast<acc_t>(x[j]) - mean) * rstd * static_cast<acc_t>(w[j]) +
                            static_cast<acc_t>(b[j]));
  } else if (w != nullptr) {
    for (int64_t j = 0; j < N; ++j)
      y[j] = static_cast<T>((static_cast<acc_t>(x[j]) - mean) * rstd * static_cast<acc_t>(w[j]));
  } else if (b != nullptr) {
    for (int64_t j = 0; j < N; ++j)
      y[j] = static_cast<T>((static_cast<acc_t>(x[j]) - mean) * rstd + static_cast<acc_t>(b[j]));
  } else {
    for (int64_t j = 0; j < N; ++j) y[j] = static_cast<T>((static_cast<acc_t>(x[j]) - mean) * rstd);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd_cpu(
    const at::Tensor& x_, const c10::optional<at::Tensor>& weight_, const c10::optional<at::Tensor>& bias_,
    int64_t normalized_ndim, double eps) {
  Fwd f = prepare_fwd(x_, weight_, bias_, normalized_ndim, eps);
  const int64_t M = f.M, N = f.N;
  if (M == 0 || N == 0) return {f.y, f.mean, f.rstd};
  dispatch_types(f.x.scalar_type(), param_type_of(f.x, f.weight, f.bias), [&](auto t, auto p) {
    using T = decltype(t);
    using P = decltype(p);
    using acc_t = typename AccOf<T>::type;
    const auto d = ptrs_of<T, P>(f);
    const acc_t e = static_cast<acc_t>(eps);
    const int64_t grain = std::max<int64_t>(1, 32768 / N);
    at::parallel_for(0, M, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        acc_t mu, rs;
        row_stats<T, acc_t>(d.x + r * N, N, e, mu, rs);
        d.mean[r] = mu;
        d.rstd[r] = rs;
        write_row<T, P, acc_t>(d.x + r * N, d.w, d.b, d.y + r * N, N, mu, rs);
      }
    });
  });
  return {f.y, f.mean, f.rstd};
}

// dx = rstd * (w*dy - mean_j(w*dy) - xhat * mean_j(w*dy*xhat)),  xhat = (x - mean) * rstd.
// dweight = sum_rows dy*xhat, dbias = sum_rows dy: each block of rows accumulates into its own
// partial buffer (no two threads share one), then the partials are summed in a fixed order, so
// the result does not depend on scheduling.
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd_cpu(
    const at::Tensor& dy_, const at::Tensor& x_, const at::Tensor& mean_, const at::Tensor& rstd_,
    const c10::optional<at::Tensor>& weight_, const c10::optional<at::Tensor>& bias_, int64_t normalized_ndim,
    bool need_dweight, bool need_dbias) {
  Bwd b = prepare_bwd(dy_, x_, mean_, rstd_, weight_, bias_, normalized_ndim, need_dweight, need_dbias);
  const int64_t M = b.M, N = b.N;
  if (M == 0 || N == 0) return {b.dx, b.dweight, b.dbias};
  const bool need_params = need_dweight || need_dbias;
  dispatch_types(b.x.scalar_type(), b.param_type, [&](auto t, auto p) {
    using T = decltype(t);
    using P = decltype(p);
    using acc_t = typename AccOf<T>::type;
    const auto d = ptrs_of<T, P>(b);
    const P* wp = d.w;
    // Blocks of rows: as many as threads (fewer for few rows), each with its own partials.
    const int64_t blocks = need_params ? std::min<int64_t>(at::get_num_threads(), M) : M;
    std::vector<acc_t> partial(need_params ? static_cast<size_t>(blocks) * 2 * N : 0, acc_t(0));
    const acc_t inv_n = acc_t(1) / static_cast<acc_t>(N);
    at::parallel_for(0, blocks, need_params ? 1 : std::max<int64_t>(1, 32768 / N), [&](int64_t b0, int64_t b1) {
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t r0 = need_params ? blk * M / blocks : blk;
        const int64_t r1 = need_params ? (blk + 1) * M / blocks : blk + 1;
        acc_t* pw = need_params ? partial.data() + static_cast<size_t>(blk) * 2 * N : nullptr;
        acc_t* pb = need_params ? pw + N : nullptr;
        for (int64_t r = r0; r < r1; ++r) {
          const T* xr = d.x + r * N;
          const T* gr = d.dy + r * N;
          T* dxr = d.dx + r * N;
          const acc_t mu = d.mean[r], rs = d.rstd[r];
          acc_t la[kLanes] = {}, lb[kLanes] = {};
          int64_t j = 0;
          for (; j + kLanes <= N; j += kLanes)
            for (int l = 0; l < kLanes; ++l) {
              const acc_t wg = static_cast<acc_t>(gr[j + l]) * (wp ? static_cast<acc_t>(wp[j + l]) : acc_t(1));
              la[l] += wg;
              lb[l] += wg * (static_cast<acc_t>(xr[j + l]) - mu);
            }
          for (int l = 0; j < N; ++j, ++l) {
            const acc_t wg = static_cast<acc_t>(gr[j]) * (wp ? static_cast<acc_t>(wp[j]) : acc_t(1));
            la[l] += wg;
            lb[l] += wg * (static_cast<acc_t>(xr[j]) - mu);
          }
          const acc_t a = sum_lanes(la) * inv_n;
          acc_t bsum = sum_lanes(lb) * rs * inv_n;
          if (!std::isfinite(bsum)) {
            // sum w*dy*(x - mean) overflowed (rows of |x| >~ 1e33 in float): sum w*dy*xhat instead
            acc_t lx[kLanes] = {};
            for (j = 0; j < N; ++j) {
              const acc_t wg = static_cast<acc_t>(gr[j]) * (wp ? static_cast<acc_t>(wp[j]) : acc_t(1));
              lx[j % kLanes] += wg * ((static_cast<acc_t>(xr[j]) - mu) * rs);
            }
            bsum = sum_lanes(lx) * inv_n;
          }
          for (j = 0; j < N; ++j) {
            const acc_t g = static_cast<acc_t>(gr[j]);
            const acc_t xhat = (static_cast<acc_t>(xr[j]) - mu) * rs;
            const acc_t wg = g * (wp ? static_cast<acc_t>(wp[j]) : acc_t(1));
            dxr[j] = static_cast<T>(rs * (wg - a - xhat * bsum));
          }
          if (need_params) {
            for (j = 0; j < N; ++j) {
              const acc_t g = static_cast<acc_t>(gr[j]);
              pw[j] += g * ((static_cast<acc_t>(xr[j]) - mu) * rs);  // dy * xhat: finite for huge x
              pb[j] += g;
            }
          }
        }
      }
    });
    if (!need_params) return;
    P* dwp = need_dweight ? b.dweight.mutable_data_ptr<P>() : nullptr;
    P* dbp = need_dbias ? b.dbias.mutable_data_ptr<P>() : nullptr;
    at::parallel_for(0, N, 4096, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        acc_t sw = 0, sb = 0;
        for (int64_t blk = 0; blk < blocks; ++blk) {
          sw += partial[static_cast<size_t>(blk) * 2 * N + c];
          sb += partial[static_cast<size_t>(blk) * 2 * N + N + c];
        }
        if (dwp) dwp[c] = static_cast<P>(sw);
        if (dbp) dbp[c] = static_cast<P>(sb);
      }
    });
  });
  return {b.dx, b.dweight, b.dbias};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(accel, m) {
  // Returns (y, mean, rstd); mean/rstd have one entry per row, float32 (float64 for float64 x).
  m.def("layer_norm_fwd(Tensor x, Tensor? weight, Tensor? bias, int normalized_ndim, float eps)"
        " -> (Tensor, Tensor, Tensor)");
  // Returns (dx, dweight, dbias); a gradient not asked for is an empty tensor.
  m.def("layer_norm_bwd(Tensor dy, Tensor x, Tensor mean, Tensor rstd, Tensor? weight, Tensor? bias,"
        " int normalized_ndim, bool need_dweight, bool need_dbias) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(accel, CPU, m) {
  m.impl("layer_norm_fwd", &layer_norm_fwd_cpu);
  m.impl("layer_norm_bwd", &layer_norm_bwd_cpu);
}

}  // namespace accel
