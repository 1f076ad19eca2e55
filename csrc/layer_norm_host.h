// Host-side checks, tensor preparation (contiguous inputs, allocated outputs) and dtype dispatch
// shared by csrc/cpu/layer_norm.cpp and csrc/cuda/layer_norm.cu, so both kernels accept exactly
// the same inputs and each file keeps only its kernels.
#pragma once

#include <ATen/Dispatch.h>
#include <torch/types.h>

#include <cmath>
#include <type_traits>

namespace accel {
namespace layer_norm_host {

// Accumulation type: float for float/half/bfloat16, double for double.
template <typename T> struct AccOf { using type = float; };
template <> struct AccOf<double> { using type = double; };

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

// The params' dtypes the kernels take: x's, or fp32 beside fp16/bf16 x (master weights).
inline bool param_type_ok(at::ScalarType x_type, at::ScalarType p_type) {
  return p_type == x_type || ((x_type == at::kHalf || x_type == at::kBFloat16) && p_type == at::kFloat);
}

inline void check_params(const at::Tensor& x, const c10::optional<at::Tensor>& weight,
                  const c10::optional<at::Tensor>& bias, int64_t N) {
  c10::optional<at::ScalarType> param_type;
  for (const auto* p : {&weight, &bias}) {
    if (!p->has_value()) continue;
    const at::Tensor& t = **p;
    TORCH_CHECK(t.numel() == N, "layer_norm: weight/bias must have ", N, " elements, got ", t.numel());
    TORCH_CHECK(t.device() == x.device(), "layer_norm: weight/bias must be on x's device");
    TORCH_CHECK(param_type_ok(x.scalar_type(), t.scalar_type()),
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

// The backward's inputs must be what the forward produced for x (stats of M rows in stat_type_of(x)),
// on x's device: the CUDA kernel would otherwise be handed host or other-GPU pointers.
inline void check_bwd_args(const at::Tensor& dy_, const at::Tensor& x_, const at::Tensor& mean_,
                           const at::Tensor& rstd_, const c10::optional<at::Tensor>& weight_,
                           const c10::optional<at::Tensor>& bias_, int64_t M, bool need_dweight, bool need_dbias) {
  TORCH_CHECK(dy_.sizes() == x_.sizes(), "layer_norm_bwd: dy and x differ in shape");
  TORCH_CHECK(dy_.device() == x_.device() && mean_.device() == x_.device() && rstd_.device() == x_.device(),
              "layer_norm_bwd: dy, mean and rstd must be on x's device ", x_.device());
  TORCH_CHECK(mean_.numel() == M && rstd_.numel() == M, "layer_norm_bwd: mean/rstd must have ", M, " elements");
  TORCH_CHECK(mean_.scalar_type() == stat_type_of(x_) && rstd_.scalar_type() == stat_type_of(x_),
              "layer_norm_bwd: mean/rstd have the wrong dtype");
  TORCH_CHECK(!need_dweight || weight_.has_value(), "layer_norm_bwd: need_dweight without weight");
  TORCH_CHECK(!need_dbias || bias_.has_value(), "layer_norm_bwd: need_dbias without bias");
}

// rstd of an empty row (N == 0): var = 0, so 1/sqrt(eps); the same value on every device.
inline double empty_row_rstd(double eps) { return 1.0 / std::sqrt(eps); }

// The forward's checked inputs in contiguous memory and its outputs, allocated (y, mean, rstd).
struct Fwd {
  int64_t M, N;
  at::Tensor x, y, mean, rstd;
  c10::optional<at::Tensor> weight, bias;
};

// Checks, contiguous copies and outputs of the forward. Rows of zero elements are finished here
// (mean 0, rstd 1/sqrt(eps)); a kernel has work only when M > 0 and N > 0.
inline Fwd prepare_fwd(const at::Tensor& x_, const c10::optional<at::Tensor>& weight_,
                       const c10::optional<at::Tensor>& bias_, int64_t normalized_ndim, double eps) {
  const Rows shape = rows_of(x_, normalized_ndim);
  check_params(x_, weight_, bias_, shape.N);
  Fwd f{shape.M, shape.N, x_.contiguous(), {}, {}, {}, {}, {}};
  if (weight_.has_value()) f.weight = weight_->contiguous();
  if (bias_.has_value()) f.bias = bias_->contiguous();
  f.y = at::empty_like(f.x, at::MemoryFormat::Contiguous);
  f.mean = at::empty({f.M}, f.x.options().dtype(stat_type_of(f.x)));
  f.rstd = at::empty({f.M}, f.x.options().dtype(stat_type_of(f.x)));
  if (f.M > 0 && f.N == 0) {
    f.mean.zero_();
    f.rstd.fill_(empty_row_rstd(eps));
  }
  return f;
}

// Typed pointers into a prepared forward, as the kernels take them (T: x's type, P: the params').
template <typename T, typename P>
struct FwdPtrs {
  using acc_t = typename AccOf<T>::type;
  const T* x;
  const P* w;  // null without weight
  const P* b;  // null without bias
  T* y;
  acc_t* mean;
  acc_t* rstd;
};

template <typename T, typename P>
FwdPtrs<T, P> ptrs_of(const Fwd& f) {
  using acc_t = typename AccOf<T>::type;
  return {f.x.const_data_ptr<T>(), data_or_null<P>(f.weight), data_or_null<P>(f.bias), f.y.mutable_data_ptr<T>(),
          f.mean.mutable_data_ptr<acc_t>(), f.rstd.mutable_data_ptr<acc_t>()};
}

// The backward's checked inputs in contiguous memory (dy in x's dtype) and its outputs: dx, and
// dweight/dbias where asked for (empty tensors of the params' dtype where not).
struct Bwd {
  int64_t M, N;
  at::Tensor x, dy, mean, rstd;
  c10::optional<at::Tensor> weight;
  at::ScalarType param_type;
  at::Tensor dx, dweight, dbias;
};

// Typed pointers into a prepared backward (dweight/dbias are written by each kernel's reduction).
template <typename T, typename P>
struct BwdPtrs {
  using acc_t = typename AccOf<T>::type;
  const T* x;
  const T* dy;
  const acc_t* mean;
  const acc_t* rstd;
  const P* w;  // null without weight
  T* dx;
};

template <typename T, typename P>
BwdPtrs<T, P> ptrs_of(const Bwd& b) {
  using acc_t = typename AccOf<T>::type;
  return {b.x.const_data_ptr<T>(), b.dy.const_data_ptr<T>(), b.mean.const_data_ptr<acc_t>(),
          b.rstd.const_data_ptr<acc_t>(), data_or_null<P>(b.weight), b.dx.mutable_data_ptr<T>()};
}

// Checks, contiguous copies and outputs of the backward. With no element to reduce (M or N zero)
// the parameter gradients are zero and finished here; a kernel has work only when M > 0 and N > 0.
inline Bwd prepare_bwd(const at::Tensor& dy_, const at::Tensor& x_, const at::Tensor& mean_, const at::Tensor& rstd_,
                       const c10::optional<at::Tensor>& weight_, const c10::optional<at::Tensor>& bias_,
                       int64_t normalized_ndim, bool need_dweight, bool need_dbias) {
  const Rows shape = rows_of(x_, normalized_ndim);
  check_params(x_, weight_, bias_, shape.N);
  check_bwd_args(dy_, x_, mean_, rstd_, weight_, bias_, shape.M, need_dweight, need_dbias);
  Bwd b{shape.M, shape.N, x_.contiguous(), {}, mean_.contiguous(), rstd_.contiguous(), {},
        param_type_of(x_, weight_, bias_), {}, {}, {}};
  b.dy = dy_.to(b.x.scalar_type()).contiguous();
  if (weight_.has_value()) b.weight = weight_->contiguous();
  b.dx = at::empty_like(b.x, at::MemoryFormat::Contiguous);
  b.dweight = need_dweight ? at::empty_like(*weight_, at::MemoryFormat::Contiguous)
                           : at::empty({0}, b.x.options().dtype(b.param_type));
  b.dbias = need_dbias ? at::empty_like(*bias_, at::MemoryFormat::Contiguous)
                       : at::empty({0}, b.x.options().dtype(b.param_type));
  if (b.M == 0 || b.N == 0) {
    if (need_dweight) b.dweight.zero_();
    if (need_dbias) b.dbias.zero_();
  }
  return b;
}

}  // namespace layer_norm_host
}  // namespace accel
