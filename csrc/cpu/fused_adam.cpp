// Fused Adam / AdamW step on CPU: one op call updates every parameter of a group.
//
// Work is split into (tensor, chunk) items of `chunk_size` elements that at::parallel_for spreads
// over the threads, so one big embedding and a hundred small biases balance alike. All sizes and
// offsets are int64 (tensors of 2^31 elements and more). The per-element math is adam_element in
// fused_adam_host.h (shared with the CUDA kernel; torch.optim.Adam's single-tensor path with a pinned
// rounding sequence); fp16/bf16 parameters are computed in fp32 against fp32 state and rounded
// once on store.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include "cpu/vec_math.h"
#include "fused_adam_host.h"

#include <cmath>
#include <vector>

namespace accel {
namespace {

using namespace fused_adam_host;

// Elements [0, n) of one chunk, one at a time, through the update shared with the CUDA kernel. The
// state (state_t) is the math type T, or compact in the param's dtype: widened on load, rounded on store.
template <bool kAmsgrad, bool kCoupled, typename scalar_t, typename state_t, typename T>
void adam_scalar(scalar_t* p, const scalar_t* g, state_t* m, state_t* v, state_t* vmax, int64_t n,
                 const Coeffs<T>& c) {
  for (int64_t i = 0; i < n; ++i) {
    // locals, so the compiler need not assume the stores alias the next loads
    T pi = static_cast<T>(p[i]), mi = static_cast<T>(m[i]), vi = static_cast<T>(v[i]);
    T xi = kAmsgrad ? static_cast<T>(vmax[i]) : T(0);
    adam_element<T>(pi, static_cast<T>(g[i]), mi, vi, xi, c, kAmsgrad, kCoupled);
    p[i] = static_cast<scalar_t>(pi);
    m[i] = static_cast<state_t>(mi);
    v[i] = static_cast<state_t>(vi);
    if constexpr (kAmsgrad) vmax[i] = static_cast<state_t>(xi);
  }
}

#if ACCEL_HAVE_X86_INTRINSICS
// The same operations, in the same order, 16 floats at a time. The extension may be built for the
// baseline x86-64 ISA, so this path is compiled for AVX-512 by attribute and chosen at run time.
namespace avx512 = vec::avx512;

// Returns how many leading elements it updated (a multiple of 16); the caller does the rest.
// adam_element's operations one for one (fused_adam_host.h), so both loops give the same bits.
template <bool kAmsgrad, bool kCoupled, typename scalar_t, typename state_t>
ACCEL_AVX512 int64_t adam_avx512(scalar_t* p, const scalar_t* g, state_t* m, state_t* v, state_t* vmax, int64_t n,
                                 const Coeffs<float>& c) {
  const __m512 scale = _mm512_set1_ps(c.scale), sign = _mm512_set1_ps(c.sign), decay = _mm512_set1_ps(c.decay);
  const __m512 wd = _mm512_set1_ps(c.wd), lerp_a = _mm512_set1_ps(c.lerp_a), beta2 = _mm512_set1_ps(c.beta2);
  const __m512 omb2 = _mm512_set1_ps(c.one_minus_beta2), bc2 = _mm512_set1_ps(c.bc2_sqrt);
  const __m512 eps = _mm512_set1_ps(c.eps), nss = _mm512_set1_ps(c.neg_step_size);
  const bool scaled = c.scale != 1.f;
  const int64_t end = n - n % 16;
  for (int64_t i = 0; i < end; i += 16) {
    __m512 gi = avx512::load(g + i);
    if (scaled) gi = _mm512_div_ps(gi, scale);  // as adam_element: g / 1 is g
    gi = _mm512_mul_ps(gi, sign);
    const __m512 pi = avx512::load(p + i);
    if constexpr (kCoupled) gi = _mm512_fmadd_ps(wd, pi, gi);
    const __m512 mo = avx512::load(m + i);
    const __m512 mi = _mm512_fmadd_ps(lerp_a, _mm512_sub_ps(gi, mo), c.lerp_low ? mo : gi);
    avx512::store(m + i, mi);
    const __m512 vi = _mm512_fmadd_ps(omb2, _mm512_mul_ps(gi, gi), _mm512_mul_ps(avx512::load(v + i), beta2));
    avx512::store(v + i, vi);
    __m512 vx = vi;
    if constexpr (kAmsgrad) {
      const __m512 vo = avx512::load(vmax + i);
      const __mmask16 keep = _mm512_cmp_ps_mask(vo, vi, _CMP_GT_OQ) | _mm512_cmp_ps_mask(vo, vo, _CMP_UNORD_Q);
      vx = _mm512_mask_blend_ps(keep, vi, vo);
      avx512::store(vmax + i, vx);
    }
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vx), bc2), eps);
    avx512::store(p + i, _mm512_fmadd_ps(pi, decay, _mm512_div_ps(_mm512_mul_ps(nss, mi), denom)));
  }
  return end;
}
#endif

template <bool kAmsgrad, bool kCoupled, typename scalar_t, typename state_t, typename T>
void adam_chunk(scalar_t* p, const scalar_t* g, state_t* m, state_t* v, state_t* vm, int64_t n, const Coeffs<T>& c) {
  int64_t done = 0;
#if ACCEL_HAVE_X86_INTRINSICS
  if constexpr (std::is_same_v<T, float>) {
    if (vec::avx512_enabled()) done = adam_avx512<kAmsgrad, kCoupled, scalar_t, state_t>(p, g, m, v, vm, n, c);
  }
#endif
  adam_scalar<kAmsgrad, kCoupled, scalar_t, state_t, T>(p + done, g + done, m + done, v + done,
                                                        kAmsgrad ? vm + done : vm, n - done, c);
}

// amsgrad and Adam's coupled decay change what is read: template flags, one loop each.
template <typename scalar_t, typename state_t, typename T>
void run_span(scalar_t* p, const scalar_t* g, state_t* m, state_t* v, state_t* vm, int64_t n, const Coeffs<T>& c,
              bool amsgrad, bool coupled) {
  if (amsgrad) {
    if (coupled) adam_chunk<true, true>(p, g, m, v, vm, n, c);
    else adam_chunk<true, false>(p, g, m, v, vm, n, c);
  } else {
    if (coupled) adam_chunk<false, true>(p, g, m, v, vm, n, c);
    else adam_chunk<false, false>(p, g, m, v, vm, n, c);
  }
}

void fused_adam_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                         at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList steps,
                         double lr, const std::optional<at::Tensor>& lr_tensor, double beta1, double beta2,
                         double eps, double weight_decay, bool amsgrad, bool maximize,
                         bool decoupled_weight_decay, const std::optional<at::Tensor>& grad_scale,
                         const std::optional<at::Tensor>& found_inf, int64_t chunk_size) {
  check_lists(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, amsgrad, chunk_size);
  // A non-zero found_inf skips the whole step, step counters included (GradScaler's contract).
  if (found_inf.has_value() && found_inf->defined() && found_inf->item<double>() != 0.0) return;

  const Hyper h{beta1, beta2, eps, weight_decay, decoupled_weight_decay, maximize};
  const bool coupled = h.coupled();
  if (lr_tensor.has_value() && lr_tensor->defined()) lr = lr_tensor->item<double>();
  const double scale = (grad_scale.has_value() && grad_scale->defined()) ? grad_scale->item<double>() : 1.0;

  const size_t n = params.size();
  std::vector<Work> work = make_work(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, amsgrad);
  std::vector<double> step_after(n);
  for (size_t i = 0; i < n; ++i) {
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
        const Coeffs<T> c = coeffs_for<T>(h, lr, scale, step_after[t]);
        auto span = [&](auto state_type) {
          using state_t = decltype(state_type);
          state_t* vm = amsgrad ? w.vm.mutable_data_ptr<state_t>() + begin : nullptr;
          run_span<scalar_t, state_t, T>(w.p.mutable_data_ptr<scalar_t>() + begin,
                                         w.g.const_data_ptr<scalar_t>() + begin,
                                         w.m.mutable_data_ptr<state_t>() + begin,
                                         w.v.mutable_data_ptr<state_t>() + begin, vm, len, c, amsgrad, coupled);
        };
        if (w.m.scalar_type() == w.p.scalar_type()) span(scalar_t{});  // compact state (or fp32/fp64 params)
        else span(T{});
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
