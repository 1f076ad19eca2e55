// Branch-free float math that GCC/Clang auto-vectorize at -O3 (std::exp does not vectorize without
// libmvec/-ffast-math, which made scalar CPU kernels ~10x slower than ATen's SLEEF-based ones), a
// tiled loop that runs such float math over half/bfloat16 storage, and AVX-512 helpers (accel::vec::
// avx512) for kernels whose portable loops the compiler cannot vectorize well (half conversions,
// 32x32->64-bit multiplies, masked row tails).
#pragma once

#include <ATen/Parallel.h>
#include <c10/macros/Macros.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <type_traits>
#include <cstring>

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cpuid.h>
#include <immintrin.h>
#define ACCEL_HAVE_X86_INTRINSICS 1
#else
#define ACCEL_HAVE_X86_INTRINSICS 0
#endif

namespace accel {
namespace vec {

// `cond ? a : b` without a branch. GCC (with its default -ftrapping-math) keeps a float ternary that
// feeds further float math as a branch: it threads the constant arm of a clamp through the code that
// follows, then may not if-convert the floating-point operations left behind on one path (they could
// trap), and the loop stays scalar. Selecting the bits with a mask leaves nothing to thread.
C10_ALWAYS_INLINE float select(bool cond, float a, float b) {
  int32_t ai, bi;
  std::memcpy(&ai, &a, sizeof(ai));
  std::memcpy(&bi, &b, sizeof(bi));
  const int32_t m = -static_cast<int32_t>(cond);
  const int32_t ri = (ai & m) | (bi & ~m);
  float r;
  std::memcpy(&r, &ri, sizeof(r));
  return r;
}

// exp(x) for float over float's whole range, the one float exponential of accel's CPU kernels
// (avx512::exp below is the same method in intrinsics): |relative error| < 2 ulp where the result is
// a normal float; like std::exp it overflows to inf past ln(FLT_MAX) ~ 88.72, goes through the
// subnormals to 0 below -87.3, and gives 0 for -inf, inf for inf, NaN for NaN. (Callers such as
// sigmoid = 1 / (1 + exp(-x)) rely on the overflow: a clamped exp made them saturate at a wrong,
// finite value.)
// exp(x) = 2^n * exp(r), n = round(x / ln2), r = x - n ln2 in [-ln2/2, ln2/2] (Cody-Waite split of
// ln2), exp(r) by a degree-6 minimax polynomial, 2^n assembled in the exponent bits.
C10_ALWAYS_INLINE float exp(float x) {
  // Past [-104, 89] the result is 0 or inf whatever the argument, so the math runs on x clamped
  // there; the clamp also turns NaN into a number (a NaN n would reach the int conversion, which is
  // undefined behaviour), and NaN is put back at the end.
  float c = select(x > -104.0f, x, -104.0f);
  c = select(c < 89.0f, c, 89.0f);
  // round to nearest by the 1.5 * 2^23 trick: floorf/rintf would block vectorization in GCC.
  const float n = (c * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = c - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // n in [-150, 128] reaches past a normal float's exponents [-126, 127], so 2^n is applied as two
  // normal factors 2^h * 2^(n-h), h = floor(n / 2): p * 2^h is exact, and the second product rounds
  // once, into the subnormals or to inf where the true result lies there.
  const int32_t ni = static_cast<int32_t>(n);
  const int32_t h = ni >> 1;  // an arithmetic shift (GCC, Clang): the floor for negative n too
  const int32_t bits_lo = (h + 127) << 23;
  const int32_t bits_hi = (ni - h + 127) << 23;
  float scale_lo, scale_hi;
  std::memcpy(&scale_lo, &bits_lo, sizeof(scale_lo));
  std::memcpy(&scale_hi, &bits_hi, sizeof(scale_hi));
  const float e = (p * scale_lo) * scale_hi;
  return select(x == x, e, x);
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

// Whether the AVX-512 code paths may run: the CPU (and OS) support AVX-512 F/BW/VL/DQ with BMI2 and
// FMA, and ATEN_CPU_CAPABILITY, torch's own switch for its CPU kernels, does not ask for a lower level
// ("default", "avx2"; it also lets tests run the portable paths on an AVX-512 machine). The paths are
// compiled with target attributes, not -mavx512*, so an ahead-of-time build for baseline x86-64 has
// them too and picks them at run time.
inline bool avx512_enabled() {
#if ACCEL_HAVE_X86_INTRINSICS
  static const bool enabled = [] {
    __builtin_cpu_init();
    const bool cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                     __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                     __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("fma");
    const char* cap = std::getenv("ATEN_CPU_CAPABILITY");
    return cpu && (cap == nullptr || *cap == '\0' || std::strncmp(cap, "avx512", 6) == 0);
  }();
  return enabled;
#else
  return false;
#endif
}

// Whether the CPU converts half <-> float 8 at a time (F16C, with AVX). F16C is read from CPUID
// itself: __builtin_cpu_supports knows "f16c" only from GCC 11 on, and torch extensions still build
// with GCC 9 and 10.
inline bool f16c_enabled() {
#if ACCEL_HAVE_X86_INTRINSICS
  static const bool enabled = [] {
    __builtin_cpu_init();
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    return __builtin_cpu_supports("avx") && __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
  }();
  return enabled;
#else
  return false;
#endif
}

#if ACCEL_HAVE_X86_INTRINSICS
// Functions using AVX-512 intrinsics carry this attribute and run only when avx512_enabled(). A lambda
// does not inherit it, so at::parallel_for bodies call such functions rather than hold intrinsics.
#define ACCEL_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,bmi2,fma,f16c")))

namespace avx512 {

// Lanes [0, n) of a 16-lane vector (n >= 16: all).
ACCEL_AVX512 inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : n <= 0 ? static_cast<__mmask16>(0)
                                                          : static_cast<__mmask16>((1u << n) - 1u);
}

// 16 values as float; lanes outside k read nothing and are 0.
ACCEL_AVX512 inline __m512 load(const float* p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
ACCEL_AVX512 inline __m512 load(const c10::Half* p, __mmask16 k) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p));
}
ACCEL_AVX512 inline __m512 load(const c10::BFloat16* p, __mmask16 k) {  // bfloat16 is float's top half
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}
ACCEL_AVX512 inline __m512 load(const float* p) { return _mm512_loadu_ps(p); }
ACCEL_AVX512 inline __m512 load(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
ACCEL_AVX512 inline __m512 load(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// float -> half/bfloat16 rounded to nearest even, as c10::Half / c10::BFloat16 round (bfloat16: NaN
// becomes 0x7FC0, the rest bits + 0x7FFF + lsb, truncated).
ACCEL_AVX512 inline __m256i to_half_bits(__m512 v) {
  return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
ACCEL_AVX512 inline __m256i to_bfloat16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}
ACCEL_AVX512 inline void store(float* p, __m512 v, __mmask16 k) { _mm512_mask_storeu_ps(p, k, v); }
ACCEL_AVX512 inline void store(c10::Half* p, __m512 v, __mmask16 k) {
  _mm256_mask_storeu_epi16(p, k, to_half_bits(v));
}
ACCEL_AVX512 inline void store(c10::BFloat16* p, __m512 v, __mmask16 k) {
  _mm256_mask_storeu_epi16(p, k, to_bfloat16_bits(v));
}
ACCEL_AVX512 inline void store(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
ACCEL_AVX512 inline void store(c10::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_half_bits(v));
}
ACCEL_AVX512 inline void store(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bfloat16_bits(v));
}

// exp(x) lane-wise: vec::exp above with fused multiply-adds and 2^n applied by scalef (which gives the
// subnormal results and the overflow itself), for kernels written in intrinsics; same results up to
// the rounding the fused multiply-adds save. exp(x) = 0 for x <= -150 (also -inf), inf for x >= 89
// (also inf), NaN for NaN.
ACCEL_AVX512 inline __m512 exp(__m512 x) {
  x = _mm512_min_ps(_mm512_set1_ps(89.0f), _mm512_max_ps(_mm512_set1_ps(-150.0f), x));  // NaN stays x
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));  // p r^2 + r + 1
  return _mm512_scalef_ps(p, n);
}

}  // namespace avx512
#endif  // ACCEL_HAVE_X86_INTRINSICS

}  // namespace vec
}  // namespace accel
