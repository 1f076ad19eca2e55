// Fused Swin window attention scores on CPU: softmax(attn + relative_pos_bias + attn_mask) over the
// last dim, and its backward (grad of attn, and of the bias reduced over the B*nW windows).
//
// attn [B*nW, nH, N, N] (any float dtype), bias [nH, N, N], mask [nW, N, N] or none; the mask of
// window w applies to attn rows b*nW + w. Math is in at::opmath_type (float for half/bfloat16/float,
// double for double); bias and mask are read in that type, whatever their own dtype.
// The backward needs only the softmax output y: dx = y * (g - sum(g * y)), dbias = sum over B*nW of dx.
// The bias gradient is summed in a fixed order (per chunk of windows, then over chunks), so it does
// not depend on the thread count.
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

namespace accel {
namespace {

// Windows per chunk of the bias-gradient reduction: chunks run in parallel into their own partial sums.
constexpr int64_t kChunk = 32;

// The row loops below are written so that -O3 vectorizes them without -ffast-math: reductions keep
// kLanes partial results (the compiler may not reorder a single floating-point accumulator) and the
// exponential is branch-free.
constexpr int64_t kLanes = 8;

// exp(x) for x <= 0 (softmax exponentiates v - max): 2^n * e^r with n = round(x / ln 2) and
// |r| <= ln(2)/2, e^r by its Taylor series to degree 7 (truncation < 1e-8 relative, about the float
// rounding error). x < -87 (e^x < 1.7e-38, the bottom of float's normal range) gives 0; NaN stays NaN.
inline float exp_nonpositive(float x) {
  const bool underflow = x < -87.0f;
  x = underflow ? -87.0f : x;
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;   // ln 2 in two parts
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  // 2^n, n in [-126, 0]; a NaN n (from a NaN x, where p is NaN too) must not reach the int conversion
  const int32_t bits = (static_cast<int32_t>(n >= -126.0f ? n : -126.0f) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return underflow ? 0.0f : p * scale;
}
inline double exp_nonpositive(double x) { return std::exp(x); }

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
      v[j + k] = exp_nonpositive(v[j + k] - mx);
      part[k] += v[j + k];
    }
  }
  T sum = 0;
  for (; j < n; ++j) {
    v[j] = exp_nonpositive(v[j] - mx);
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

// The float row work, compiled for AVX-512 and AVX2 as well as the baseline and picked at load time
// (GCC function multi-versioning): an ahead-of-time build cannot assume the machine it runs on, and
// its baseline is SSE2. Half and bfloat16 rows are widened to float before they get here.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define ACCEL_FMHA_CLONES __attribute__((target_clones("arch=skylake-avx512", "arch=haswell", "default")))
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
// the compiler's _Float16 (F16C instructions in the AVX2/AVX-512 clones), where c10::Half's scalar
// conversion would dominate the run time.
template <typename S, typename T>
inline void widen(const S* in, T* out, int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] = static_cast<T>(in[j]);
}
template <typename S, typename T>
inline void narrow(const T* in, S* out, int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] = static_cast<S>(in[j]);
}
#if defined(__FLT16_MAX__) && defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
static_assert(sizeof(_Float16) == sizeof(c10::Half), "half layouts differ");
ACCEL_FMHA_CLONES void widen_half(const _Float16* in, float* out, int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] = static_cast<float>(in[j]);
}
ACCEL_FMHA_CLONES void narrow_half(const float* in, _Float16* out, int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] = static_cast<_Float16>(in[j]);  // round to nearest even
}
inline void widen(const c10::Half* in, float* out, int64_t n) {
  widen_half(reinterpret_cast<const _Float16*>(in), out, n);
}
inline void narrow(const float* in, c10::Half* out, int64_t n) {
  narrow_half(in, reinterpret_cast<_Float16*>(out), n);
}
#endif

void check_inputs(const at::Tensor& attn, const at::Tensor& bias, const std::optional<at::Tensor>& mask,
                  int64_t window_num) {
  TORCH_CHECK(attn.dim() == 4 && attn.size(2) == attn.size(3),
              "fmha_swin_fwd: attn must be [B*nW, nH, N, N], got ", attn.sizes());
  const int64_t nH = attn.size(1), N = attn.size(2);
  TORCH_CHECK(bias.dim() == 3 && bias.size(0) == nH && bias.size(1) == N && bias.size(2) == N,
              "fmha_swin_fwd: relative_pos_bias must be [nH, N, N] = [", nH, ", ", N, ", ", N, "], got ",
              bias.sizes());
  TORCH_CHECK(bias.device() == attn.device(), "fmha_swin_fwd: bias must be on ", attn.device());
  TORCH_CHECK(!mask.has_value() || mask->device() == attn.device(), "fmha_swin_fwd: attn_mask must be on ",
              attn.device());
  TORCH_CHECK(window_num > 0 && attn.size(0) % window_num == 0, "fmha_swin_fwd: window_num=", window_num,
              " must be positive and divide attn.size(0)=", attn.size(0));
  if (mask.has_value()) {
    const auto& m = *mask;
    TORCH_CHECK(m.dim() == 3 && m.size(0) == window_num && m.size(1) == N && m.size(2) == N,
                "fmha_swin_fwd: attn_mask must be [nW, N, N] = [", window_num, ", ", N, ", ", N, "], got ",
                m.sizes());
  }
}

at::Tensor fmha_fwd_cpu(const at::Tensor& attn_, const at::Tensor& bias_, const std::optional<at::Tensor>& mask_,
                        int64_t window_num) {
  check_inputs(attn_, bias_, mask_, window_num);
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
  TORCH_CHECK(out_.dim() == 4 && out_.size(2) == out_.size(3),
              "fmha_swin_bwd: out must be [B*nW, nH, N, N], got ", out_.sizes());
  TORCH_CHECK(grad_.sizes() == out_.sizes(), "fmha_swin_bwd: grad ", grad_.sizes(), " and out ", out_.sizes(),
              " differ in shape");
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
    // One task = one head of one chunk of windows: it owns partial[c, h] and writes it in window order.
    at::parallel_for(0, chunks * nH, 1, [&](int64_t begin, int64_t end) {
      // One window-head of g and y widened once to opmath: the row loops then run on plain arrays.
      std::vector<opmath_t> gbuf(static_cast<size_t>(head)), ybuf(static_cast<size_t>(head));
      for (int64_t task = begin; task < end; ++task) {
        const int64_t c = task / nH, h = task % nH;
        opmath_t* acc = p + (c * nH + h) * head;
        for (int64_t bw = c * kChunk; bw < std::min(BnW, (c + 1) * kChunk); ++bw) {
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
