// Host-side shape, dtype and dispatch helpers shared by csrc/cpu/layer_norm.cpp and
// csrc/cuda/layer_norm.cu, so both kernels accept exactly the same inputs.
#pragma once

#include <ATen/Dispatch.h>
#include <torch/types.h>

#include <type_traits>

namespace accel {
namespace layer_norm_host {

struct Rows {
  int64_t M;
  int64_t N;
};

inline Rows rows_of(const at::Tensor& x, int64_t normalized_ndim) {
  TORCH_CHECK(normalized_ndim >= 1 && normalized_ndim <= x.dim(),
              "layer_norm: normalized_ndim must be in [1, x.dim()], got ", normalized_ndim);
  int64_t M = 1, N = 1;
  const int64_t lead = x.dim() - normalized_ndim;
  for (int64_t d = 0; d < x.dim(); ++d) (d < lead ? M : N) *= x.size(d);
  return {M, N};
}

inline void check_params(const at::Tensor& x, const c10::optional<at::Tensor>& weight,
                  const c10::optional<at::Tensor>& bias, int64_t N) {
  const bool reduced = x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16;
  c10::optional<at::ScalarType> param_type;
  for (const auto* p : {&weight, &bias}) {
    if (!p->has_value()) continue;
    const at::Tensor& t = **p;
    TORCH_CHECK(t.numel() == N, "layer_norm: weight/bias must have ", N, " elements, got ", t.numel());
    TORCH_CHECK(t.device() == x.device(), "layer_norm: weight/bias must be on x's device");
    TORCH_CHECK(t.scalar_type() == x.scalar_type() || (reduced && t.scalar_type() == at::kFloat),
                "layer_norm: weight/bias must have x's dtype or (for half/bfloat16 x) float32");
    TORCH_CHECK(!param_type || *param_type == t.scalar_type(), "layer_norm: weight and bias dtypes differ");
    param_type = t.scalar_type();
  }
}

// The params' dtype: x's unless a float32 weight/bias is given with half/bfloat16 x.
inline at::ScalarType param_type_of(const at::Tensor& x, const c10::optional<at::Tensor>& weight,
                             const c10::optional<at::Tensor>& bias) {
  if (weight.has_value()) return weight->scalar_type();
  if (bias.has_value()) return bias->scalar_type();
  return x.scalar_type();
}

inline at::ScalarType stat_type_of(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// Calls f.template operator()<T, P>() for x's dtype T and the params' dtype P.
template <typename F>
void dispatch_types(at::ScalarType xt, at::ScalarType pt, F&& f) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, xt, "layer_norm", [&] {
    using T = scalar_t;
    if (pt == xt) {
      f(T(), T());
      return;
    }
    // fp32 params beside fp16/bf16 x only (check_params refuses other mixes)
    if constexpr (std::is_same_v<T, at::Half> || std::is_same_v<T, at::BFloat16>) {
      if (pt == at::kFloat) {
        f(T(), float());
        return;
      }
    }
    TORCH_CHECK(false, "layer_norm: unsupported weight/bias dtype ", pt, " for x of dtype ", xt);
  });
}

template <typename P>
const P* data_or_null(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? t->const_data_ptr<P>() : nullptr;
}

// The backward's inputs must be what the forward produced for x (stats of M rows in stat_type_of(x)).
inline void check_bwd_args(const at::Tensor& dy_, const at::Tensor& x_, const at::Tensor& mean_,
                           const at::Tensor& rstd_, const c10::optional<at::Tensor>& weight_,
                           const c10::optional<at::Tensor>& bias_, int64_t M, bool need_dweight, bool need_dbias) {
  TORCH_CHECK(dy_.sizes() == x_.sizes(), "layer_norm_bwd: dy and x differ in shape");
  TORCH_CHECK(mean_.numel() == M && rstd_.numel() == M, "layer_norm_bwd: mean/rstd must have ", M, " elements");
  TORCH_CHECK(mean_.scalar_type() == stat_type_of(x_) && rstd_.scalar_type() == stat_type_of(x_),
              "layer_norm_bwd: mean/rstd have the wrong dtype");
  TORCH_CHECK(!need_dweight || weight_.has_value(), "layer_norm_bwd: need_dweight without weight");
  TORCH_CHECK(!need_dbias || bias_.has_value(), "layer_norm_bwd: need_dbias without bias");
}

}  // namespace layer_norm_host
}  // namespace accel
