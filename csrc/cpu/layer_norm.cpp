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
#include <tuple>
#include <type_traits>
#include <vector>

namespace accel {
namespace {

template <typename T> struct AccOf { using type = float; };
template <> struct AccOf<double> { using type = double; };

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

// Two passes (mean, then squared deviations from it): exact for rows with a large offset,
// where the one-pass E[x^2] - E[x]^2 cancels catastrophically.
template <typename T, typename acc_t>
inline void row_stats(const T* x, int64_t N, acc_t eps, acc_t& mean, acc_t& rstd) {
  const acc_t shift = static_cast<acc_t>(x[0]);
  mean = shift + row_sum_shifted<T, acc_t>(x, N, shift) / static_cast<acc_t>(N);
  acc_t lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= N; i += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      const acc_t d = static_cast<acc_t>(x[i + l]) - mean;
      lanes[l] += d * d;
    }
  for (int l = 0; i < N; ++i, ++l) {
    const acc_t d = static_cast<acc_t>(x[i]) - mean;
    lanes[l] += d * d;
  }
  const acc_t var = sum_lanes(lanes) / static_cast<acc_t>(N);
  rstd = acc_t(1) / std::sqrt(var + eps);
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

using namespace layer_norm_host;

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd_cpu(
    const at::Tensor& x_, const c10::optional<at::Tensor>& weight_, const c10::optional<at::Tensor>& bias_,
    int64_t normalized_ndim, double eps) {
  const Rows shape = rows_of(x_, normalized_ndim);
  const int64_t M = shape.M, N = shape.N;  // named variables: lambdas cannot capture bindings in C++17
  check_params(x_, weight_, bias_, N);
  auto x = x_.contiguous();
  c10::optional<at::Tensor> weight, bias;
  if (weight_.has_value()) weight = weight_->contiguous();
  if (bias_.has_value()) bias = bias_->contiguous();
  auto y = at::empty_like(x, at::MemoryFormat::Contiguous);
  auto mean = at::empty({M}, x.options().dtype(stat_type_of(x)));
  auto rstd = at::empty({M}, x.options().dtype(stat_type_of(x)));
  if (M == 0) return {y, mean, rstd};
  dispatch_types(x.scalar_type(), param_type_of(x, weight, bias), [&](auto t, auto p) {
    using T = decltype(t);
    using P = decltype(p);
    using acc_t = typename AccOf<T>::type;
    const T* xp = x.const_data_ptr<T>();
    T* yp = y.mutable_data_ptr<T>();
    const P* wp = data_or_null<P>(weight);
    const P* bp = data_or_null<P>(bias);
    acc_t* mp = mean.mutable_data_ptr<acc_t>();
    acc_t* rp = rstd.mutable_data_ptr<acc_t>();
    const acc_t e = static_cast<acc_t>(eps);
    const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(N, 1));
    at::parallel_for(0, M, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        acc_t mu = 0, rs = acc_t(1) / std::sqrt(e);
        if (N > 0) row_stats<T, acc_t>(xp + r * N, N, e, mu, rs);
        mp[r] = mu;
        rp[r] = rs;
        write_row<T, P, acc_t>(xp + r * N, wp, bp, yp + r * N, N, mu, rs);
      }
    });
  });
  return {y, mean, rstd};
}

// dx = rstd * (w*dy - mean_j(w*dy) - xhat * mean_j(w*dy*xhat)),  xhat = (x - mean) * rstd.
// dweight = sum_rows dy*xhat, dbias = sum_rows dy: each block of rows accumulates into its own
// partial buffer (no two threads share one), then the partials are summed in a fixed order, so
// the result does not depend on scheduling.
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd_cpu(
    const at::Tensor& dy_, const at::Tensor& x_, const at::Tensor& mean_, const at::Tensor& rstd_,
    const c10::optional<at::Tensor>& weight_, const c10::optional<at::Tensor>& bias_, int64_t normalized_ndim,
    bool need_dweight, bool need_dbias) {
  const Rows shape = rows_of(x_, normalized_ndim);
  const int64_t M = shape.M, N = shape.N;  // named variables: lambdas cannot capture bindings in C++17
  check_params(x_, weight_, bias_, N);
  check_bwd_args(dy_, x_, mean_, rstd_, weight_, bias_, M, need_dweight, need_dbias);
  auto x = x_.contiguous();
  auto dy = dy_.to(x.scalar_type()).contiguous();
  auto mean = mean_.contiguous();
  auto rstd = rstd_.contiguous();
  c10::optional<at::Tensor> weight;
  if (weight_.has_value()) weight = weight_->contiguous();
  const at::ScalarType pt = param_type_of(x, weight_, bias_);
  auto dx = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor dweight = need_dweight ? at::empty_like(*weight_, at::MemoryFormat::Contiguous)
                                    : at::empty({0}, x.options().dtype(pt));
  at::Tensor dbias = need_dbias ? at::empty_like(*bias_, at::MemoryFormat::Contiguous)
                                : at::empty({0}, x.options().dtype(pt));
  const bool need_params = need_dweight || need_dbias;
  if (M == 0 || N == 0) {
    if (need_dweight) dweight.zero_();
    if (need_dbias) dbias.zero_();
    return {dx, dweight, dbias};
  }
  dispatch_types(x.scalar_type(), pt, [&](auto t, auto p) {
    using T = decltype(t);
    using P = decltype(p);
    using acc_t = typename AccOf<T>::type;
    const T* xp = x.const_data_ptr<T>();
    const T* gp = dy.const_data_ptr<T>();
    const acc_t* mp = mean.const_data_ptr<acc_t>();
    const acc_t* rp = rstd.const_data_ptr<acc_t>();
    const P* wp = data_or_null<P>(weight);
    T* dxp = dx.mutable_data_ptr<T>();
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
          const T* xr = xp + r * N;
          const T* gr = gp + r * N;
          T* dxr = dxp + r * N;
          const acc_t mu = mp[r], rs = rp[r];
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
          const acc_t bsum = sum_lanes(lb) * rs * inv_n;
          for (j = 0; j < N; ++j) {
            const acc_t g = static_cast<acc_t>(gr[j]);
            const acc_t xhat = (static_cast<acc_t>(xr[j]) - mu) * rs;
            const acc_t wg = g * (wp ? static_cast<acc_t>(wp[j]) : acc_t(1));
            dxr[j] = static_cast<T>(rs * (wg - a - xhat * bsum));
          }
          if (need_params) {
            for (j = 0; j < N; ++j) {
              const acc_t g = static_cast<acc_t>(gr[j]);
              pw[j] += g * (static_cast<acc_t>(xr[j]) - mu) * rs;
              pb[j] += g;
            }
          }
        }
      }
    });
    if (!need_params) return;
    P* dwp = need_dweight ? dweight.mutable_data_ptr<P>() : nullptr;
    P* dbp = need_dbias ? dbias.mutable_data_ptr<P>() : nullptr;
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
  return {dx, dweight, dbias};
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
