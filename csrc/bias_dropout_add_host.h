// The keep rule shared by csrc/cpu/bias_dropout_add.cpp and csrc/cuda/bias_dropout_add.cu: both
// draw the same Philox numbers for one rng_state, so with one rule they drop the same elements.
#pragma once

#include <torch/types.h>

#include <cmath>
#include <cstdint>

namespace accel {
namespace bias_dropout_add_host {

// keep <=> draw < threshold, with threshold in [0, 2^32]: p = 0 keeps all, p = 1 keeps none.
inline uint64_t keep_threshold(double p) {
  return static_cast<uint64_t>(std::floor((1.0 - p) * 4294967296.0));
}

inline double keep_scale(double p) { return p < 1.0 ? 1.0 / (1.0 - p) : 0.0; }

inline void check_p(double p) {
  TORCH_CHECK(p >= 0.0 && p <= 1.0, "bias_dropout_add: p must be in [0, 1], got ", p);
}

inline void check_bwd_args(const at::Tensor& grad, const at::Tensor& rng_state, double p, bool bias_grad) {
  check_p(p);
  TORCH_CHECK(rng_state.scalar_type() == at::kLong && rng_state.numel() == 2,
              "bias_dropout_add_bwd: rng_state must be 2 int64 values");
  TORCH_CHECK(!bias_grad || grad.dim() >= 1, "bias_dropout_add_bwd: bias_grad needs a grad with a last dim");
}

// masked_scale's arguments: mask a bool tensor of x's shape on x's device.
inline void check_masked_scale(const at::Tensor& x, const at::Tensor& mask) {
  TORCH_CHECK(mask.scalar_type() == at::kBool, "masked_scale: mask: expected a bool tensor, got ", mask.scalar_type());
  TORCH_CHECK(mask.sym_sizes() == x.sym_sizes(), "masked_scale: mask: expected x's shape ", x.sym_sizes(), ", got ",
              mask.sym_sizes());
  TORCH_CHECK(mask.device() == x.device(), "masked_scale: mask: expected a tensor on ", x.device(), ", got ",
              mask.device());
}

// dropout_fwd's arguments: x floating point, p in [0, 1].
inline void check_dropout_fwd(const at::Tensor& x, double p) {
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "dropout_fwd: x: expected a floating-point tensor, got ",
              x.scalar_type());
  TORCH_CHECK(p >= 0.0 && p <= 1.0, "dropout_fwd: p: expected a float in [0, 1], got ", p);
}

// The bias gradient from a dx (or from the output's gradient when nothing is dropped): dx summed over
// every dim but the last, accumulated in fp32 for fp16/bf16, in dx's dtype. No reshape to (-1, cols),
// which has no answer for zero columns; sizes stay symbolic (torch.compile traces the C++ gradient that
// calls this with dynamic shapes).
inline at::Tensor sum_rows(const at::Tensor& dx) {
  const auto acc = dx.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor rows = dx.dim() == 1 ? dx.unsqueeze(0) : dx.flatten(0, -2);
  return rows.sum({0}, false, acc).to(dx.scalar_type());
}

// The backward op's second output from its dx: the bias gradient when asked for, else an empty tensor.
inline at::Tensor bias_grad_of(const at::Tensor& dx, bool bias_grad) {
  return bias_grad ? sum_rows(dx) : at::empty({0}, dx.options());
}

}  // namespace bias_dropout_add_host
}  // namespace accel
