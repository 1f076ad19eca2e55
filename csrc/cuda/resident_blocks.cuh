// How many blocks of a kernel a GPU keeps resident at once, for grids sized to it (persistent blocks that
// loop over the work: a grid past what stays resident runs a second, partial wave, whose blocks all finish
// late). Used by csrc/cuda/layer_norm.cu and csrc/cuda/fmha.cu.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace accel {

// Blocks of `kernel` all SMs of the current device hold at `threads` a block (its registers and shared memory
// decide), asked of the runtime once per kernel and block size, not on every call (the first device's answer
// per SM serves every device; the SM count is the current device's).
// Assumptions: threads is a multiple of 32 in [32, 1024]; `kernel` takes no dynamic shared memory.
template <auto kernel>
int64_t resident_blocks(int threads) {
  static std::atomic<int> cached[1024 / 32 + 1] = {};
  std::atomic<int>& c = cached[threads / 32];
  int n = c.load(std::memory_order_relaxed);
  if (n == 0) {
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, 0));
    n = std::max(n, 1);
    c.store(n, std::memory_order_relaxed);
  }
  return n * static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->multiProcessorCount);
}

}  // namespace accel
