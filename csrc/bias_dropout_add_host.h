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

}  // namespace bias_dropout_add_host
}  // namespace accel
