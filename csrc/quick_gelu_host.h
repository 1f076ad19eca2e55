// Host-side layout helpers shared by csrc/cpu/quick_gelu.cpp and csrc/cuda/quick_gelu.cu, so both lay out
// their results as torch's elementwise ops do: the output has x's strides when x is non-overlapping and
// dense (contiguous, channels-last, any permutation of dims), at::empty_like(x)'s dense strides in x's
// order of dims otherwise (a slice with gaps). Every tensor a kernel reads or writes then fills the
// numel() elements from its data pointer in one and the same order, so the kernels run over memory in
// storage order, whatever that order is.
#pragma once

#include <torch/types.h>

namespace accel {
namespace quick_gelu_host {

// x itself when it is non-overlapping and dense, else a copy laid out as at::empty_like(x) (the clone
// of torch's default preserve_format).
inline at::Tensor dense(const at::Tensor& x) { return x.is_non_overlapping_and_dense() ? x : x.clone(); }

// t (of like's shape) if it has the strides of like (dense), else a copy with like's strides. Strides of
// size-1 dims are never used, so they need not agree.
inline at::Tensor strided_like(const at::Tensor& t, const at::Tensor& like) {
  for (int64_t d = 0; d < like.dim(); ++d) {
    if (like.size(d) != 1 && t.stride(d) != like.stride(d)) {
      auto copy = at::empty_like(like);
      copy.copy_(t);
      return copy;
    }
  }
  return t;
}

}  // namespace quick_gelu_host
}  // namespace accel
