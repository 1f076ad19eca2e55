// Branch-free float math that GCC/Clang auto-vectorize at -O3 (std::exp does not vectorize without
// libmvec/-ffast-math, which made scalar CPU kernels ~10x slower than ATen's SLEEF-based ones), and
// a tiled loop that runs such float math over half/bfloat16 storage.
#pragma once

#include <ATen/Parallel.h>
#include <c10/macros/Macros.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <type_traits>
#include <cstring>

namespace accel {
namespace vec {

// exp(x) for float, |relative error| < 2 ulp on [-87, 88]; saturates outside.
// exp(x) = 2^n * exp(r), n = round(x / ln2), r = x - n ln2 in [-ln2/2, ln2/2] (Cody-Waite split of
// ln2), exp(r) by a degree-6 minimax polynomial, 2^n assembled in the exponent bits.
C10_ALWAYS_INLINE float exp(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
  // round to nearest by the 1.5 * 2^23 trick: floorf/rintf would block vectorization in GCC.
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

C10_ALWAYS_INLINE double exp(double x) { return __builtin_exp(x); }

template <typename T>
C10_ALWAYS_INLINE T sigmoid(T x) {
  return T(1) / (T(1) + exp(-x));
}

// Runs `fn(ins, out, n)` over [0, numel) in parallel, where ins[k] points at input k. For float or
// double storage fn sees the tensors' own memory; for half/bfloat16 it sees float tiles converted on
// the way in and out, so fn's inner loop stays a plain float loop the compiler vectorizes.
template <typename scalar_t, typename opmath_t, size_t N, typename Fn>
void map_tiles(const std::array<const scalar_t*, N>& ins, scalar_t* out, int64_t numel, Fn fn) {
  constexpr int64_t kTile = 1024;
  at::parallel_for(0, numel, 32768, [&](int64_t begin, int64_t end) {
    if constexpr (std::is_same_v<scalar_t, opmath_t>) {
      std::array<const opmath_t*, N> p;
      for (size_t k = 0; k < N; ++k) p[k] = ins[k] + begin;
      fn(p, out + begin, end - begin);
    } else {
      opmath_t a[N][kTile], b[kTile];
      std::array<const opmath_t*, N> p;
      for (size_t k = 0; k < N; ++k) p[k] = a[k];
      for (int64_t t = begin; t < end; t += kTile) {
        const int64_t len = std::min(kTile, end - t);
        for (size_t k = 0; k < N; ++k)
          for (int64_t i = 0; i < len; ++i) a[k][i] = static_cast<opmath_t>(ins[k][t + i]);
        fn(p, b, len);
        for (int64_t i = 0; i < len; ++i) out[t + i] = static_cast<scalar_t>(b[i]);
      }
    }
  });
}

}  // namespace vec
}  // namespace accel
