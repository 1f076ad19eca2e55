// Pieces shared by csrc/cpu/fused_adam.cpp and csrc/cuda/fused_adam.cu: the argument checks (so both
// devices accept exactly the same lists), the contiguous work copies, and the per-element update
// itself (host and device), so that both devices compute the same values bit for bit.
#pragma once

#include <c10/macros/Macros.h>
#include <torch/types.h>

#include <math.h>

#include <unordered_map>
#include <vector>

namespace accel {
namespace fused_adam_host {

inline at::ScalarType state_dtype_for(at::ScalarType param) {
  return param == at::kDouble ? at::kDouble : at::kFloat;
}

// ---------------------------------------------------------------------------------------------
// The update of one element.
//
// The rounding sequence is pinned: every a*b+c is an explicit fused multiply-add and no other
// product feeds an addition, so a compiler that contracts a*b+c on its own (GCC does in C++ with
// -march=native, nvcc does by default) has nothing left whose value it could change. The CPU
// scalar loop, the CPU AVX-512 loop and the CUDA kernel therefore agree exactly, whatever the
// chunking or alignment. It follows torch.optim.Adam's single-tensor path operation by operation,
// except that AdamW's p * (1 - lr*wd) and v * beta2 are fused into the multiply-add that consumes
// them (at most one rounding apart from torch per step).

C10_HOST_DEVICE inline float fused_mul_add(float a, float b, float c) { return fmaf(a, b, c); }
C10_HOST_DEVICE inline double fused_mul_add(double a, double b, double c) { return fma(a, b, c); }
C10_HOST_DEVICE inline float square_root(float a) { return sqrtf(a); }
C10_HOST_DEVICE inline double square_root(double a) { return sqrt(a); }

// Per-tensor scalars of one step in the math type T. Optional operations are exact no-ops when
// off (divide by 1, multiply by +1, decay 1), so the element update has no data-dependent branch.
template <typename T>
struct Coeffs {
  T scale;          // grads are divided by it (GradScaler's unscale fused in); 1 when unscaled
  T sign;           // -1 for maximize
  T decay;          // AdamW: 1 - lr * wd; 1 otherwise
  T wd;             // Adam (coupled): g += wd * p
  T lerp_a;         // exp_avg.lerp_(g, 1 - beta1) as one multiply-add from the nearer end
  T beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size;
  bool lerp_low;    // torch's lerp switches formula at weight 0.5
};

struct Hyper {
  double beta1, beta2, eps, weight_decay;
  bool decoupled, maximize;
  // Adam's L2 term (g += wd * p) is on; AdamW decays p instead.
  C10_HOST_DEVICE bool coupled() const { return !decoupled && weight_decay != 0.0; }
};

// a * b rounded on its own, as Python rounds it. nvcc (--fmad) and GCC (-ffp-contract=fast, with
// -march=native) would otherwise fuse the product into the subtraction that consumes it.
C10_HOST_DEVICE inline double unfused_mul(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dmul_rn(a, b);
#else
  const volatile double product = a * b;
  return product;
#endif
}

// Rounded from double exactly where torch rounds its Python-scalar arguments. `step` is the
// already incremented count (torch increments before computing the bias corrections). The device's
// pow is not correctly rounded, so a bias correction may differ from the host's in the last bit of
// double; rounding to float almost always absorbs that, float64 params keep it.
template <typename T>
C10_HOST_DEVICE inline Coeffs<T> coeffs_for(const Hyper& h, double lr, double grad_scale, double step) {
  Coeffs<T> c;
  c.scale = static_cast<T>(grad_scale);
  c.sign = h.maximize ? T(-1) : T(1);
  c.decay = (h.decoupled && h.weight_decay != 0.0) ? static_cast<T>(1.0 - unfused_mul(lr, h.weight_decay)) : T(1);
  c.wd = static_cast<T>(h.weight_decay);
  const T w = static_cast<T>(1.0 - h.beta1);
  // torch decides on the weight in the math type, so do we (w = 0.5 - 1e-9 is 0.5f in float)
  c.lerp_low = (w < T(0) ? -w : w) < T(0.5);
  c.lerp_a = c.lerp_low ? w : w - T(1);
  c.beta2 = static_cast<T>(h.beta2);
  c.one_minus_beta2 = static_cast<T>(1.0 - h.beta2);
  const double bc1 = 1.0 - pow(h.beta1, step);
  const double bc2 = 1.0 - pow(h.beta2, step);
  c.bc2_sqrt = static_cast<T>(sqrt(bc2));
  c.eps = static_cast<T>(h.eps);
  c.neg_step_size = static_cast<T>(-(lr / bc1));
  return c;
}

// Updates p, m, v (and vmax when amsgrad) of one element in place. `coupled`: Adam's L2 term
// (weight_decay != 0 and not decoupled). `unscaled`: the caller knows c.scale is 1. Callers pass
// compile-time constants where they can.
template <typename T>
C10_HOST_DEVICE inline void adam_element(T& p, T g, T& m, T& v, T& vmax, const Coeffs<T>& c, bool amsgrad,
                                         bool coupled, bool unscaled = false) {
  // g / 1 is g: an unscaled step skips the division (the same bits, a third of the element's divisions)
  T gi = (unscaled || c.scale == T(1) ? g : g / c.scale) * c.sign;  // exact product (sign is +-1): no contraction
  if (coupled) gi = fused_mul_add(c.wd, p, gi);
  const T mo = m;
  m = fused_mul_add(c.lerp_a, gi - mo, c.lerp_low ? mo : gi);
  v = fused_mul_add(c.one_minus_beta2, gi * gi, v * c.beta2);
  T vx = v;
  if (amsgrad) {
    vx = (vmax > v || vmax != vmax) ? vmax : v;  // torch.maximum propagates NaN
    vmax = vx;
  }
  const T denom = square_root(vx) / c.bc2_sqrt + c.eps;
  p = fused_mul_add(p, c.decay, c.neg_step_size * m / denom);
}

// ---------------------------------------------------------------------------------------------
// Host-side argument checks and work copies.

// The kernels work on contiguous memory; a strided tensor is updated through a contiguous copy
// that is written back afterwards (rare: torch hands out dense grads and we create dense state).
struct Work {
  at::Tensor p, g, m, v, vm;
};

inline void check_lists(const at::TensorList& params, const at::TensorList& grads, const at::TensorList& exp_avgs,
                 const at::TensorList& exp_avg_sqs, const at::TensorList& max_exp_avg_sqs,
                 const at::TensorList& steps, bool amsgrad, int64_t chunk_size) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && steps.size() == n,
              "fused_adam_step: params, grads, exp_avgs, exp_avg_sqs and steps must have the same length");
  TORCH_CHECK(!amsgrad || max_exp_avg_sqs.size() == n,
              "fused_adam_step: amsgrad needs one max_exp_avg_sq per param");
  TORCH_CHECK(chunk_size > 0, "fused_adam_step: chunk_size must be positive, got ", chunk_size);
  for (size_t i = 0; i < n; ++i) {
    const auto dt = params[i].scalar_type();
    TORCH_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16 || dt == at::kDouble,
                "fused_adam_step: params[", i, "] has unsupported dtype ", dt);
    TORCH_CHECK(grads[i].scalar_type() == dt, "fused_adam_step: grads[", i, "] dtype differs from its param");
    TORCH_CHECK(grads[i].sizes() == params[i].sizes(), "fused_adam_step: grads[", i, "] shape differs from its param");
    // the state in the compute type, or compact in the param's own dtype (torch.optim's layout)
    const auto st = exp_avgs[i].scalar_type();
    TORCH_CHECK((st == state_dtype_for(dt) || st == dt) && exp_avg_sqs[i].scalar_type() == st,
                "fused_adam_step: state of params[", i, "] must be ", state_dtype_for(dt), " or ", dt,
                ", exp_avg and exp_avg_sq alike");
    TORCH_CHECK(exp_avgs[i].numel() == params[i].numel() && exp_avg_sqs[i].numel() == params[i].numel(),
                "fused_adam_step: state of params[", i, "] has the wrong size");
    if (amsgrad) {
      TORCH_CHECK(max_exp_avg_sqs[i].scalar_type() == st && max_exp_avg_sqs[i].numel() == params[i].numel(),
                  "fused_adam_step: max_exp_avg_sqs[", i, "] has the wrong dtype or size");
    }
    TORCH_CHECK(steps[i].numel() == 1 && steps[i].scalar_type() == at::kFloat,
                "fused_adam_step: steps[", i, "] must be a one-element float32 tensor");
  }
  // One counter per param: a shared one would advance once per param on the CPU (one param after the
  // other) and race on the GPU, where every update reads it before the single advance launch.
  std::unordered_map<const void*, size_t> counter_of;
  counter_of.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const auto [it, fresh] = counter_of.emplace(steps[i].const_data_ptr(), i);
    TORCH_CHECK(fresh, "fused_adam_step: steps[", it->second, "] and steps[", i,
                "] are the same counter: every param needs its own step tensor");
  }
}

// The chunks of chunk_size elements that cover numel elements ((numel + chunk_size - 1) / chunk_size would
// overflow for a chunk_size near 2^63).
inline int64_t chunk_count(int64_t numel, int64_t chunk_size) {
  return numel / chunk_size + (numel % chunk_size != 0 ? 1 : 0);
}

// Contiguous stand-ins (the tensors themselves where already contiguous).
inline std::vector<Work> make_work(const at::TensorList& params, const at::TensorList& grads,
                                   const at::TensorList& exp_avgs, const at::TensorList& exp_avg_sqs,
                                   const at::TensorList& max_exp_avg_sqs, bool amsgrad) {
  auto dense = [](const at::Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); };
  std::vector<Work> work(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    work[i] = Work{dense(params[i]), dense(grads[i]), dense(exp_avgs[i]), dense(exp_avg_sqs[i]),
                   amsgrad ? dense(max_exp_avg_sqs[i]) : at::Tensor()};
  }
  return work;
}

// Copies the results of strided tensors' contiguous stand-ins back into them.
inline void write_back(const std::vector<Work>& work, const at::TensorList& params, const at::TensorList& exp_avgs,
                       const at::TensorList& exp_avg_sqs, const at::TensorList& max_exp_avg_sqs, bool amsgrad) {
  const size_t n = work.size();
  for (size_t i = 0; i < n; ++i) {
    if (!work[i].p.is_same(params[i])) params[i].copy_(work[i].p);
    if (!work[i].m.is_same(exp_avgs[i])) exp_avgs[i].copy_(work[i].m);
    if (!work[i].v.is_same(exp_avg_sqs[i])) exp_avg_sqs[i].copy_(work[i].v);
    if (amsgrad && !work[i].vm.is_same(max_exp_avg_sqs[i])) max_exp_avg_sqs[i].copy_(work[i].vm);
  }
}

}  // namespace fused_adam_host
}  // namespace accel
