// Integer division by a divisor fixed at launch, for index maps in CUDA kernels: a 32-bit (or, worse,
// 64-bit) division is a long instruction sequence on the GPU, this is a multiply-high, an add and a
// shift. Used by csrc/cuda/window_process.cu and csrc/cuda/fmha.cu.
#pragma once

#include <cstdint>

namespace accel {

// n / d for n < 2^31 and 1 <= d < 2^31 (Granlund-Montgomery with shift = ceil(log2 d) and a 33-bit
// magic number whose top bit is the explicit "+ n"; n < 2^31 keeps that add within 32 bits).
// Built on the host, passed by value to the kernel.
struct FastDiv32 {
  uint32_t d, magic, shift;
  explicit FastDiv32(uint32_t divisor) : d(divisor), shift(0) {
    while ((uint64_t{1} << shift) < divisor) ++shift;
    magic = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << shift) - divisor)) / divisor + 1);
  }
  __device__ __forceinline__ uint32_t div(uint32_t n) const { return (__umulhi(n, magic) + n) >> shift; }
};

}  // namespace accel
