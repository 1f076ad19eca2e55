// Fused Adam / AdamW step on CPU: one op call updates every parameter of a group.
//
// Work is split into (tensor, chunk) items of `chunk_size` elements that at::parallel_for spreads
// over the threads, so one big embedding and a hundred small biases balance alike. All sizes and
// offsets are int64 (tensors of 2^31 elements and more). The per-element math follows
// torch.optim.Adam's single-tensor path (foreach=False) operation by operation; fp16/bf16
// parameters are computed in fp32 against fp32 state and rounded once on store.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include "fused_adam_host.h"

#include <cmath>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#define ACCEL_AVX512 1
#include <immintrin.h>
#endif


namespace accel {
namespace {

// Hyper-parameters that are the same for every tensor of the call.
struct AdamHyper {
  double lr, beta1, beta2, eps, weight_decay;
  bool amsgrad, maximize, decoupled;
  bool has_scale;
  double grad_scale;
};

// Per-tensor scalars, already in the math type, rounded from double exactly where torch's
// Python-scalar arguments are.
template <typename T>
struct Coeffs {
  T scale;             // grads are divided by it (unscale fused in), as torch's fused kernels do
  T decay;             // AdamW: p *= 1 - lr * wd
  T wd;                // Adam: g += wd * p
  T lerp_w;            // exp_avg.lerp_(g, 1 - beta1)
  T beta2, one_minus_beta2;
  T bc2_sqrt, eps, neg_step_size;
  bool lerp_low;       // torch's lerp uses a different formula when the weight is >= 0.5
};

template <typename T>
Coeffs<T> coeffs_for(const AdamHyper& h, double step) {
  Coeffs<T> c;
  c.scale = static_cast<T>(h.grad_scale);
  c.decay = static_cast<T>(1.0 - h.lr * h.weight_decay);
  c.wd = static_cast<T>(h.weight_decay);
  const double w = 1.0 - h.beta1;
  c.lerp_w = static_cast<T>(w);
  c.lerp_low = std::abs(w) < 0.5;
  c.beta2 = static_cast<T>(h.beta2);
  c.one_minus_beta2 = static_cast<T>(1.0 - h.beta2);
  const double bc1 = 1.0 - std::pow(h.beta1, step);
  const double bc2 = 1.0 - std::pow(h.beta2, step);
  c.bc2_sqrt = static_cast<T>(std::sqrt(bc2));
  c.eps = static_cast<T>(h.eps);
  c.neg_step_size = static_cast<T>(-(h.lr / bc1));
  return c;
}

// The scalars of one chunk's update, hoisted out of the loops.
template <typename T>
struct Loop {
  T scale, sign, decay, wd, lerp_a, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size;
  bool lerp_low;
};

template <typename T>
Loop<T> loop_for(const Coeffs<T>& c, const AdamHyper& h) {
  // Optional steps become exact no-ops (divide by 1, multiply by +-1 or 1) so the loops are
  // branch-free; amsgrad and Adam's coupled decay, which change what is read, are template flags.
  Loop<T> l;
  l.scale = h.has_scale ? c.scale : T(1);
  l.sign = h.maximize ? T(-1) : T(1);
  l.decay = (h.decoupled && h.weight_decay != 0) ? c.decay : T(1);
  l.wd = c.wd;
  l.lerp_low = c.lerp_low;
  l.lerp_a = c.lerp_low ? c.lerp_w : c.lerp_w - T(1);
  l.beta2 = c.beta2;
  l.one_minus_beta2 = c.one_minus_beta2;
  l.bc2_sqrt = c.bc2_sqrt;
  l.eps = c.eps;
  l.neg_step_size = c.neg_step_size;
  return l;
}

// Elements [0, n) of one chunk, one at a time.
template <bool kAmsgrad, bool kCoupled, typename scalar_t, typename T>
void adam_scalar(scalar_t* p, const scalar_t* g, T* m, T* v, T* vmax, int64_t n, const Loop<T>& l) {
  for (int64_t i = 0; i < n; ++i) {
    T gi = static_cast<T>(g[i]) / l.scale * l.sign;
    T pi = static_cast<T>(p[i]) * l.decay;
    if constexpr (kCoupled) gi = gi + l.wd * pi;
    const T mo = m[i];
    // torch's vectorized lerp: one fused multiply-add from the nearer end.
    const T mi = std::fma(l.lerp_a, gi - mo, l.lerp_low ? mo : gi);
    m[i] = mi;
    T vi = v[i] * l.beta2;
    vi = vi + l.one_minus_beta2 * gi * gi;
    v[i] = vi;
    T vx = vi;
    if constexpr (kAmsgrad) {
      const T vo = vmax[i];
      vx = (vo > vi || vo != vo) ? vo : vi;  // torch.maximum propagates NaN
      vmax[i] = vx;
    }
    const T denom = std::sqrt(vx) / l.bc2_sqrt + l.eps;
    pi = pi + l.neg_step_size * mi / denom;
    p[i] = static_cast<scalar_t>(pi);
  }
}

#ifdef ACCEL_AVX512
// The same operations, in the same order, 16 floats at a time. The extension is built for the
// baseline x86-64 ISA, so this path is compiled for AVX-512 by attribute and chosen at run time.
#define ACCEL_AVX512_FN __attribute__((target("avx512f"))) inline

ACCEL_AVX512_FN __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
ACCEL_AVX512_FN __m512 load16(const at::BFloat16* x) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
ACCEL_AVX512_FN __m512 load16(const at::Half* x) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
}
ACCEL_AVX512_FN void store16(float* x, __m512 v) { _mm512_storeu_ps(x, v); }
ACCEL_AVX512_FN void store16(at::BFloat16* x, __m512 v) {
  // Round to nearest even on the bits, NaN to the canonical quiet NaN: c10::BFloat16's rounding.
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(x), _mm512_cvtepi32_epi16(r));
}
ACCEL_AVX512_FN void store16(at::Half* x, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(x), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// Returns how many leading elements it updated (a multiple of 16); the caller does the rest.
template <bool kAmsgrad, bool kCoupled, typename scalar_t>
__attribute__((target("avx512f"))) int64_t adam_avx512(scalar_t* p, const scalar_t* g, float* m, float* v,
                                                       float* vmax, int64_t n, const Loop<float>& l) {
  const __m512 scale = _mm512_set1_ps(l.scale), sign = _mm512_set1_ps(l.sign), decay = _mm512_set1_ps(l.decay);
  const __m512 wd = _mm512_set1_ps(l.wd), lerp_a = _mm512_set1_ps(l.lerp_a), beta2 = _mm512_set1_ps(l.beta2);
  const __m512 omb2 = _mm512_set1_ps(l.one_minus_beta2), bc2 = _mm512_set1_ps(l.bc2_sqrt);
  const __m512 eps = _mm512_set1_ps(l.eps), nss = _mm512_set1_ps(l.neg_step_size);
  const int64_t end = n - n % 16;
  for (int64_t i = 0; i < end; i += 16) {
    __m512 gi = _mm512_mul_ps(_mm512_div_ps(load16(g + i), scale), sign);
    __m512 pi = _mm512_mul_ps(load16(p + i), decay);
    if constexpr (kCoupled) gi = _mm512_add_ps(gi, _mm512_mul_ps(wd, pi));
    const __m512 mo = _mm512_loadu_ps(m + i);
    const __m512 mi = _mm512_fmadd_ps(lerp_a, _mm512_sub_ps(gi, mo), l.lerp_low ? mo : gi);
    _mm512_storeu_ps(m + i, mi);
    __m512 vi = _mm512_mul_ps(_mm512_loadu_ps(v + i), beta2);
    vi = _mm512_add_ps(vi, _mm512_mul_ps(_mm512_mul_ps(omb2, gi), gi));
    _mm512_storeu_ps(v + i, vi);
    __m512 vx = vi;
    if constexpr (kAmsgrad) {
      const __m512 vo = _mm512_loadu_ps(vmax + i);
      const __mmask16 keep = _mm512_cmp_ps_mask(vo, vi, _CMP_GT_OQ) | _mm512_cmp_ps_mask(vo, vo, _CMP_UNORD_Q);
      vx = _mm512_mask_blend_ps(keep, vi, vo);
      _mm512_storeu_ps(vmax + i, vx);
    }
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vx), bc2), eps);
    pi = _mm512_add_ps(pi, _mm512_div_ps(_mm512_mul_ps(nss, mi), denom));
    store16(p + i, pi);
  }
  return end;
}

bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
}
#endif

template <bool kAmsgrad, bool kCoupled, typename scalar_t, typename T>
void adam_chunk(scalar_t* p, const scalar_t* g, T* m, T* v, T* vm, int64_t n, const Loop<T>& l) {
  int64_t done = 0;
#ifdef ACCEL_AVX512
  if constexpr (std::is_same_v<T, float>) {
    if (cpu_has_avx512()) done = adam_avx512<kAmsgrad, kCoupled, scalar_t>(p, g, m, v, vm, n, l);
  }
#endif
  adam_scalar<kAmsgrad, kCoupled, scalar_t, T>(p + done, g + done, m + done, v + done,
                                               kAmsgrad ? vm + done : vm, n - done, l);
}

template <typename scalar_t, typename T>
void run_span(scalar_t* p, const scalar_t* g, T* m, T* v, T* vm, int64_t n, const Coeffs<T>& c, const AdamHyper& h) {
  const Loop<T> l = loop_for(c, h);
  const bool coupled = !h.decoupled && h.weight_decay != 0;
  if (h.amsgrad) {
    if (coupled) adam_chunk<true, true>(p, g, m, v, vm, n, l);
    else adam_chunk<true, false>(p, g, m, v, vm, n, l);
  } else {
    if (coupled) adam_chunk<false, true>(p, g, m, v, vm, n, l);
    else adam_chunk<false, false>(p, g, m, v, vm, n, l);
  }
}

using namespace fused_adam_host;

void fused_adam_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                         at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList steps,
                         double lr, const std::optional<at::Tensor>& lr_tensor, double beta1, double beta2,
                         double eps, double weight_decay, bool amsgrad, bool maximize,
                         bool decoupled_weight_decay, const std::optional<at::Tensor>& grad_scale,
                         const std::optional<at::Tensor>& found_inf, int64_t chunk_size) {
  check_lists(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, amsgrad, chunk_size);
  // A non-zero found_inf skips the whole step, step counters included (GradScaler's contract).
  if (found_inf.has_value() && found_inf->defined() && found_inf->item<double>() != 0.0) return;

  AdamHyper h{};
  h.lr = (lr_tensor.has_value() && lr_tensor->defined()) ? lr_tensor->item<double>() : lr;
  h.beta1 = beta1;
  h.beta2 = beta2;
  h.eps = eps;
  h.weight_decay = weight_decay;
  h.amsgrad = amsgrad;
  h.maximize = maximize;
  h.decoupled = decoupled_weight_decay;
  h.has_scale = grad_scale.has_value() && grad_scale->defined();
  h.grad_scale = h.has_scale ? grad_scale->item<double>() : 1.0;

  const size_t n = params.size();
  std::vector<Work> work(n);
  std::vector<double> step_after(n);
  for (size_t i = 0; i < n; ++i) {
    auto c = [](const at::Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); };
    work[i] = Work{c(params[i]), c(grads[i]), c(exp_avgs[i]), c(exp_avg_sqs[i]),
                   amsgrad ? c(max_exp_avg_sqs[i]) : at::Tensor()};
    float* s = steps[i].mutable_data_ptr<float>();
    *s += 1.0f;
    step_after[i] = static_cast<double>(*s);
  }

  // (tensor, first element) of every chunk.
  std::vector<std::pair<int64_t, int64_t>> items;
  for (size_t i = 0; i < n; ++i) {
    const int64_t numel = work[i].p.numel();
    for (int64_t b = 0; b < numel; b += chunk_size) items.emplace_back(static_cast<int64_t>(i), b);
  }

  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) {
      const auto [t, begin] = items[k];
      Work& w = work[t];
      const int64_t len = std::min(chunk_size, w.p.numel() - begin);
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, w.p.scalar_type(), "fused_adam_step_cpu", [&] {
        using T = at::opmath_type<scalar_t>;
        const Coeffs<T> c = coeffs_for<T>(h, step_after[t]);
        T* vm = amsgrad ? w.vm.mutable_data_ptr<T>() + begin : nullptr;
        run_span<scalar_t, T>(w.p.mutable_data_ptr<scalar_t>() + begin, w.g.const_data_ptr<scalar_t>() + begin,
                              w.m.mutable_data_ptr<T>() + begin, w.v.mutable_data_ptr<T>() + begin, vm, len, c, h);
      });
    }
  });

  write_back(work, params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, amsgrad);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(accel, m) {
  m.def(
      "fused_adam_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] steps, float lr, Tensor? lr_tensor, float beta1, float beta2, "
      "float eps, float weight_decay, bool amsgrad, bool maximize, bool decoupled_weight_decay, "
      "Tensor? grad_scale, Tensor? found_inf, int chunk_size) -> ()");
}

TORCH_LIBRARY_IMPL(accel, CPU, m) {
  m.impl("fused_adam_step", &fused_adam_step_cpu);
}

}  // namespace accel
