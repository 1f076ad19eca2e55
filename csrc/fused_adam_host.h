// Host-side pieces shared by csrc/cpu/fused_adam.cpp and csrc/cuda/fused_adam.cu: the argument
// checks (so both devices accept exactly the same lists) and the contiguous work copies.
#pragma once

#include <torch/types.h>

#include <vector>

namespace accel {
namespace fused_adam_host {

inline at::ScalarType state_dtype_for(at::ScalarType param) {
  return param == at::kDouble ? at::kDouble : at::kFloat;
}

// The kernel works on contiguous memory; a strided tensor is updated through a contiguous copy
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
    const auto st = state_dtype_for(dt);
    TORCH_CHECK(exp_avgs[i].scalar_type() == st && exp_avg_sqs[i].scalar_type() == st,
                "fused_adam_step: state of params[", i, "] must be ", st);
    TORCH_CHECK(exp_avgs[i].numel() == params[i].numel() && exp_avg_sqs[i].numel() == params[i].numel(),
                "fused_adam_step: state of params[", i, "] has the wrong size");
    if (amsgrad) {
      TORCH_CHECK(max_exp_avg_sqs[i].scalar_type() == st && max_exp_avg_sqs[i].numel() == params[i].numel(),
                  "fused_adam_step: max_exp_avg_sqs[", i, "] has the wrong dtype or size");
    }
    TORCH_CHECK(steps[i].numel() == 1 && steps[i].scalar_type() == at::kFloat,
                "fused_adam_step: steps[", i, "] must be a one-element float32 tensor");
  }
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
