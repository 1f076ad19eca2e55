// Fused bias-dropout-add, out = residual + dropout(x + bias, p), and its backward, on CPU.
//
// The dropout mask is never stored. Element i of the flattened (contiguous) x is kept when the
// 32-bit Philox-4x32-10 draw for it is below (1 - p) * 2^32; the draws for elements 4g..4g+3 are the
// four words of Philox(key = seed, counter = (offset, g)). The forward returns (seed, offset) as a
// 2-element int64 tensor and the backward regenerates the same mask from it, so a training step keeps
// 16 bytes per call instead of a mask the size of x. The CUDA kernels (csrc/cuda/bias_dropout_add.cu)
// use the same mapping, so a (seed, offset) pair means the same mask on both devices.
//
// Randomness comes from torch's default CPU generator (reproducible under torch.manual_seed): one
// 64-bit draw, taken under the generator's mutex, becomes the Philox key; the offset is 0.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>
#include <torch/types.h>

#include <cmath>
#include <mutex>
#include <vector>

#include "bias_dropout_add_host.h"
#include "cpu/vec_math.h"

namespace accel {
namespace {

using namespace bias_dropout_add_host;

// Philox-4x32-10 for kBatch consecutive blocks g0 .. g0+kBatch-1 at once: word k of block g0+j
// goes to out[4j + k], i.e. the draw of element 4 g0 + i is out[i]. Bit-identical to
// at::Philox4_32(seed, g, offset) (the CUDA kernels use that engine). Written as a loop over blocks
// around fully unrolled rounds so the compiler vectorizes the 32x32->64 multiplies across blocks:
// at::Philox4_32 one block at a time made this op ~5x slower than its memory traffic.
constexpr int kBatch = 16;
constexpr int64_t kChunk = 4 * kBatch;  // elements per batch of draws

inline void philox_batch(uint64_t seed, uint64_t offset, int64_t g0, uint32_t* __restrict__ out) {
  const uint32_t s0 = static_cast<uint32_t>(seed), s1 = static_cast<uint32_t>(seed >> 32);
  const uint32_t o0 = static_cast<uint32_t>(offset), o1 = static_cast<uint32_t>(offset >> 32);
  for (int j = 0; j < kBatch; ++j) {
    const uint64_t g = static_cast<uint64_t>(g0) + j;
    uint32_t c0 = o0, c1 = o1, c2 = static_cast<uint32_t>(g), c3 = static_cast<uint32_t>(g >> 32);
    uint32_t k0 = s0, k1 = s1;
#pragma GCC unroll 10
    for (int round = 0; round < 10; ++round) {
      const uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * c0;
      const uint64_t p1 = static_cast<uint64_t>(0xCD9E8D57u) * c2;
      const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
      const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
      c1 = static_cast<uint32_t>(p1);
      c3 = static_cast<uint32_t>(p0);
      c0 = n0;
      c2 = n2;
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    out[4 * j + 0] = c0;
    out[4 * j + 1] = c1;
    out[4 * j + 2] = c2;
    out[4 * j + 3] = c3;
  }
}

// Per-element multipliers of elements [base, base + kChunk) (base a multiple of kChunk):
// scale where kept, 0 where dropped.
template <typename opmath_t>
inline void keep_multipliers(uint64_t seed, uint64_t offset, int64_t base, uint64_t threshold, opmath_t scale,
                             opmath_t (&mult)[kChunk]) {
  uint32_t draws[kChunk];
  philox_batch(seed, offset, base / 4, draws);
  for (int i = 0; i < kChunk; ++i) mult[i] = static_cast<uint64_t>(draws[i]) < threshold ? scale : opmath_t(0);
}

// Inputs made contiguous and checked against x; bias broadcasts over x's last dim.
struct Inputs {
  at::Tensor x, bias, residual;
  int64_t n = 0, cols = 1;
  bool has_bias = false;
};

Inputs prepare(const at::Tensor& x, const std::optional<at::Tensor>& bias, const at::Tensor& residual) {
  Inputs in;
  in.x = x.contiguous();
  in.residual = residual.contiguous();
  TORCH_CHECK(in.residual.sizes() == in.x.sizes(), "bias_dropout_add: residual and x differ in shape");
  TORCH_CHECK(in.residual.scalar_type() == in.x.scalar_type(), "bias_dropout_add: residual and x differ in dtype");
  in.n = in.x.numel();
  in.has_bias = bias.has_value() && bias->defined();
  if (in.has_bias) {
    in.bias = bias->contiguous();
    TORCH_CHECK(in.x.dim() >= 1 && in.bias.dim() == 1 && in.bias.size(0) == in.x.size(-1),
                "bias_dropout_add: bias must have shape (x.size(-1),)");
    TORCH_CHECK(in.bias.scalar_type() == in.x.scalar_type(), "bias_dropout_add: bias and x differ in dtype");
    in.cols = std::max<int64_t>(in.bias.size(0), 1);
  }
  return in;
}

// Parallel grain in chunks of kChunk elements (32K elements).
constexpr int64_t kGrainChunks = 512;

template <typename scalar_t, bool kDropout>
void forward_loop(const Inputs& in, at::Tensor& out, uint64_t seed, uint64_t offset, double p) {
  using opmath_t = at::opmath_type<scalar_t>;
  const scalar_t* x = in.x.const_data_ptr<scalar_t>();
  const scalar_t* r = in.residual.const_data_ptr<scalar_t>();
  const scalar_t* b = in.has_bias ? in.bias.const_data_ptr<scalar_t>() : nullptr;
  scalar_t* o = out.mutable_data_ptr<scalar_t>();
  const int64_t n = in.n, cols = in.cols;
  const uint64_t threshold = keep_threshold(p);
  const opmath_t scale = static_cast<opmath_t>(keep_scale(p));
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  at::parallel_for(0, chunks, kGrainChunks, [&](int64_t begin, int64_t end) {
    int64_t col = (begin * kChunk) % cols;
    opmath_t mult[kChunk];
    for (int64_t c = begin; c < end; ++c) {
      const int64_t base = c * kChunk;
      if constexpr (kDropout) keep_multipliers<opmath_t>(seed, offset, base, threshold, scale, mult);
      const int64_t stop = std::min<int64_t>(base + kChunk, n);
      // runs that do not wrap around the bias, so the inner loop vectorizes
      for (int64_t i = base; i < stop;) {
        const int64_t run = b != nullptr ? std::min<int64_t>(stop - i, cols - col) : stop - i;
        for (int64_t k = i; k < i + run; ++k) {
          opmath_t v = static_cast<opmath_t>(x[k]);
          if (b != nullptr) v += static_cast<opmath_t>(b[col + (k - i)]);
          if constexpr (kDropout) v *= mult[k - base];
          o[k] = static_cast<scalar_t>(static_cast<opmath_t>(r[k]) + v);
        }
        i += run;
        if (b != nullptr) {
          col += run;
          if (col == cols) col = 0;
        }
      }
    }
  });
}

#if ACCEL_HAVE_X86_INTRINSICS
// The same loops with AVX-512 intrinsics for float, half and bfloat16, ~5x faster than the portable
// ones above, whose time goes to Philox (auto-vectorized with twice the instructions these need,
// plus scattered stores of the words) and, for half, to one-at-a-time conversions. Here Philox runs 16
// blocks (64 elements) at once and yields the keep decisions as a 64-bit mask. The masks, and so the
// backward, are bit-identical to the portable loops'. The forward rounds exactly as torch's
// residual + (x + bias) * mult does; the portable loops may differ in the last bit where the compiler
// fuses that multiply and add.
namespace avx512 = vec::avx512;

// Bit j: whether the low word of lane j of [a, b] (lanes 0-7 of a, then of b) is below t.
ACCEL_AVX512 inline uint64_t below(__m512i a, __m512i b, __m512i t) {
  const __m512i low_words = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  return _mm512_cmplt_epu32_mask(_mm512_permutex2var_epi32(a, low_words, b), t);
}

// Bit i of the result: whether element 4 g0 + i (i < 64) is kept, i.e. its draw is below threshold.
// The rounds of philox_batch for blocks g0 .. g0 + 15, as two sets of 8 blocks with each 32-bit word
// in the low half of a 64-bit lane: mul_epu32 then gives the full 32x32-bit products (hi = the upper
// half, lo = the product itself). The upper halves of the words are never cleared: mul_epu32 and the
// compare ignore them and xor keeps the halves apart, so they cannot reach a low half.
ACCEL_AVX512 inline uint64_t keep_bits(uint64_t seed, uint64_t offset, uint64_t g0, uint64_t threshold) {
  if (threshold > 0xFFFFFFFFull) return ~0ull;  // p = 0: every draw is below 2^32
  const __m512i m0 = _mm512_set1_epi64(0xD2511F53);
  const __m512i m1 = _mm512_set1_epi64(0xCD9E8D57);
  const __m512i w0 = _mm512_set1_epi64(0x9E3779B9);
  const __m512i w1 = _mm512_set1_epi64(0xBB67AE85);
  __m512i k0 = _mm512_set1_epi64(static_cast<int64_t>(seed & 0xFFFFFFFFu));
  __m512i k1 = _mm512_set1_epi64(static_cast<int64_t>(seed >> 32));
  const __m512i blockA = _mm512_add_epi64(_mm512_set1_epi64(static_cast<int64_t>(g0)),
                                          _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0));
  const __m512i blockB = _mm512_add_epi64(blockA, _mm512_set1_epi64(8));
  // counter = (offset lo, offset hi, block lo, block hi)
  __m512i a0 = _mm512_set1_epi64(static_cast<int64_t>(offset & 0xFFFFFFFFu)), b0 = a0;
  __m512i a1 = _mm512_set1_epi64(static_cast<int64_t>(offset >> 32)), b1 = a1;
  __m512i a2 = blockA, b2 = blockB;
  __m512i a3 = _mm512_srli_epi64(blockA, 32), b3 = _mm512_srli_epi64(blockB, 32);
#pragma GCC unroll 10
  for (int round = 0; round < 10; ++round) {
    const __m512i pa0 = _mm512_mul_epu32(a0, m0), pa1 = _mm512_mul_epu32(a2, m1);
    const __m512i pb0 = _mm512_mul_epu32(b0, m0), pb1 = _mm512_mul_epu32(b2, m1);
    a0 = _mm512_ternarylogic_epi64(_mm512_srli_epi64(pa1, 32), a1, k0, 0x96);  // hi(c2 m1) ^ c1 ^ k0
    a2 = _mm512_ternarylogic_epi64(_mm512_srli_epi64(pa0, 32), a3, k1, 0x96);  // hi(c0 m0) ^ c3 ^ k1
    b0 = _mm512_ternarylogic_epi64(_mm512_srli_epi64(pb1, 32), b1, k0, 0x96);
    b2 = _mm512_ternarylogic_epi64(_mm512_srli_epi64(pb0, 32), b3, k1, 0x96);
    a1 = pa1;  // lo(c2 m1)
    a3 = pa0;  // lo(c0 m0)
    b1 = pb1;
    b3 = pb0;
    k0 = _mm512_add_epi64(k0, w0);  // the key words' upper halves carry junk too; only the low ones are used
    k1 = _mm512_add_epi64(k1, w1);
  }
  const __m512i t = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(threshold)));
  // bit j of word k's mask is element 4j + k
  return _pdep_u64(below(a0, b0, t), 0x1111111111111111ull) | _pdep_u64(below(a1, b1, t), 0x2222222222222222ull) |
         _pdep_u64(below(a2, b2, t), 0x4444444444444444ull) | _pdep_u64(below(a3, b3, t), 0x8888888888888888ull);
}

// Elements [64 begin, min(64 end, n)) of the forward; bias_ext is the bias in float, repeated so that
// bias_ext[c .. c + 64) are the biases of 64 elements from column c (nullptr: no bias).
template <typename scalar_t, bool kDropout>
ACCEL_AVX512 void forward_chunks_avx512(const scalar_t* x, const scalar_t* r, const float* bias_ext, scalar_t* o,
                                        int64_t n, int64_t cols, int64_t begin, int64_t end, uint64_t seed,
                                        uint64_t offset, uint64_t threshold, float scale) {
  const __m512 vscale = _mm512_set1_ps(scale);
  int64_t col = (begin * kChunk) % cols;
  const int64_t step = kChunk % cols;
  for (int64_t c = begin; c < end; ++c) {
    const int64_t base = c * kChunk;
    const uint64_t keep = kDropout ? keep_bits(seed, offset, static_cast<uint64_t>(base / 4), threshold) : 0;
    for (int q = 0; q < 4; ++q) {
      const int64_t at = base + 16 * q;
      const int64_t len = n - at;
      if (len <= 0) break;
      __m512 v, res;
      if (len >= 16) {
        v = avx512::load(x + at);
        res = avx512::load(r + at);
      } else {
        v = avx512::load(x + at, avx512::first_lanes(len));
        res = avx512::load(r + at, avx512::first_lanes(len));
      }
      if (bias_ext != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias_ext + col + 16 * q));
      if constexpr (kDropout) {  // (mul_round: a plain multiply could be fused with the add below)
        v = _mm512_mul_round_ps(v, _mm512_maskz_mov_ps(static_cast<__mmask16>(keep >> (16 * q)), vscale),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      }
      v = _mm512_add_ps(res, v);
      if (len >= 16) {
        avx512::store(o + at, v);
      } else {
        avx512::store(o + at, v, avx512::first_lanes(len));
      }
    }
    col += step;
    if (col >= cols) col -= cols;
  }
}

// Elements [64 begin, min(64 end, n)) of the backward: dx = g * (kept ? scale : 0).
template <typename scalar_t>
ACCEL_AVX512 void backward_chunks_avx512(const scalar_t* g, scalar_t* dx, int64_t n, int64_t begin, int64_t end,
                                         uint64_t seed, uint64_t offset, uint64_t threshold, float scale) {
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t c = begin; c < end; ++c) {
    const int64_t base = c * kChunk;
    const uint64_t keep = keep_bits(seed, offset, static_cast<uint64_t>(base / 4), threshold);
    for (int q = 0; q < 4; ++q) {
      const int64_t at = base + 16 * q;
      const int64_t len = n - at;
      if (len <= 0) break;
      const __m512 mult = _mm512_maskz_mov_ps(static_cast<__mmask16>(keep >> (16 * q)), vscale);
      if (len >= 16) {
        avx512::store(dx + at, _mm512_mul_ps(avx512::load(g + at), mult));
      } else {
        const __mmask16 lanes = avx512::first_lanes(len);
        avx512::store(dx + at, _mm512_mul_ps(avx512::load(g + at, lanes), mult), lanes);
      }
    }
  }
}
#endif  // ACCEL_HAVE_X86_INTRINSICS

// Run the forward (backward) with the AVX-512 loops when they apply: float, half or bfloat16 on a CPU
// that has AVX-512. Returns whether it ran.
template <typename scalar_t>
bool forward_avx512(const Inputs& in, at::Tensor& out, bool dropout, uint64_t seed, uint64_t offset, double p) {
#if ACCEL_HAVE_X86_INTRINSICS
  if constexpr (std::is_same_v<at::opmath_type<scalar_t>, float>) {
    if (!vec::avx512_enabled()) return false;
    const scalar_t* x = in.x.const_data_ptr<scalar_t>();
    const scalar_t* r = in.residual.const_data_ptr<scalar_t>();
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    std::vector<float> bias_ext;
    if (in.has_bias) {
      const scalar_t* b = in.bias.const_data_ptr<scalar_t>();
      bias_ext.resize(static_cast<size_t>(in.cols + kChunk));
      for (int64_t i = 0; i < in.cols + kChunk; ++i) bias_ext[i] = static_cast<float>(b[i % in.cols]);
    }
    const float* be = in.has_bias ? bias_ext.data() : nullptr;
    const uint64_t threshold = keep_threshold(p);
    const float scale = static_cast<float>(keep_scale(p));
    at::parallel_for(0, (in.n + kChunk - 1) / kChunk, kGrainChunks, [&](int64_t begin, int64_t end) {
      if (dropout) {
        forward_chunks_avx512<scalar_t, true>(x, r, be, o, in.n, in.cols, begin, end, seed, offset, threshold, scale);
      } else {
        forward_chunks_avx512<scalar_t, false>(x, r, be, o, in.n, in.cols, begin, end, 0, 0, 0, 0.0f);
      }
    });
    return true;
  }
#endif
  return false;
}

template <typename scalar_t>
bool backward_avx512(const at::Tensor& grad, at::Tensor& dx, uint64_t seed, uint64_t offset, double p) {
#if ACCEL_HAVE_X86_INTRINSICS
  if constexpr (std::is_same_v<at::opmath_type<scalar_t>, float>) {
    if (!vec::avx512_enabled()) return false;
    const scalar_t* g = grad.const_data_ptr<scalar_t>();
    scalar_t* o = dx.mutable_data_ptr<scalar_t>();
    const int64_t n = grad.numel();
    const uint64_t threshold = keep_threshold(p);
    const float scale = static_cast<float>(keep_scale(p));
    at::parallel_for(0, (n + kChunk - 1) / kChunk, kGrainChunks, [&](int64_t begin, int64_t end) {
      backward_chunks_avx512(g, o, n, begin, end, seed, offset, threshold, scale);
    });
    return true;
  }
#endif
  return false;
}

// A Philox key: one 64-bit draw from torch's default CPU generator, under its mutex.
uint64_t draw_seed() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return at::check_generator<at::CPUGeneratorImpl>(gen)->random64();
}

// Returns (out, rng_state). rng_state = [seed, offset] as int64 (the seed's bits reinterpreted);
// with training off or p == 0 nothing is drawn and rng_state is [0, 0].
std::tuple<at::Tensor, at::Tensor> bias_dropout_add_fwd_cpu(const at::Tensor& x,
                                                            const std::optional<at::Tensor>& bias,
                                                            const at::Tensor& residual, double p, bool train) {
  check_p(p);
  Inputs in = prepare(x, bias, residual);
  auto out = at::empty_like(in.x);
  auto rng_state = at::zeros({2}, x.options().dtype(at::kLong));
  const bool dropout = train && p > 0.0;
  const uint64_t seed = dropout ? draw_seed() : 0;
  int64_t* state = rng_state.mutable_data_ptr<int64_t>();
  state[0] = static_cast<int64_t>(seed);
  state[1] = 0;
  if (in.n == 0) return {out, rng_state};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, in.x.scalar_type(), "bias_dropout_add_fwd_cpu", [&] {
    if (forward_avx512<scalar_t>(in, out, dropout, seed, 0, p)) return;
    if (dropout) {
      forward_loop<scalar_t, true>(in, out, seed, 0, p);
    } else {
      forward_loop<scalar_t, false>(in, out, 0, 0, p);
    }
  });
  return {out, rng_state};
}

// grad * keep * scale, the mask regenerated from rng_state (grad contiguous).
at::Tensor dropout_grad(const at::Tensor& grad, const at::Tensor& rng_state, double p) {
  auto dx = at::empty_like(grad);
  const int64_t n = grad.numel();
  if (n == 0) return dx;
  auto state = rng_state.cpu().contiguous();
  const uint64_t seed = static_cast<uint64_t>(state.const_data_ptr<int64_t>()[0]);
  const uint64_t offset = static_cast<uint64_t>(state.const_data_ptr<int64_t>()[1]);
  const uint64_t threshold = keep_threshold(p);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "bias_dropout_add_bwd_cpu", [&] {
    if (backward_avx512<scalar_t>(grad, dx, seed, offset, p)) return;
    using opmath_t = at::opmath_type<scalar_t>;
    const opmath_t scale = static_cast<opmath_t>(keep_scale(p));
    const scalar_t* g = grad.const_data_ptr<scalar_t>();
    scalar_t* o = dx.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, (n + kChunk - 1) / kChunk, kGrainChunks, [&](int64_t begin, int64_t end) {
      opmath_t mult[kChunk];
      for (int64_t c = begin; c < end; ++c) {
        const int64_t base = c * kChunk;
        keep_multipliers<opmath_t>(seed, offset, base, threshold, scale, mult);
        const int64_t stop = std::min<int64_t>(base + kChunk, n);
        for (int64_t i = base; i < stop; ++i) {
          o[i] = static_cast<scalar_t>(static_cast<opmath_t>(g[i]) * mult[i - base]);
        }
      }
    });
  });
  return dx;
}

// dx = grad * keep * scale, the mask regenerated from rng_state, and, when bias_grad, dbias = dx summed over
// every dim but the last (else an empty tensor). grad_residual is grad itself; the caller takes it.
std::tuple<at::Tensor, at::Tensor> bias_dropout_add_bwd_cpu(const at::Tensor& grad_, const at::Tensor& rng_state,
                                                            double p, bool bias_grad) {
  check_bwd_args(grad_, rng_state, p, bias_grad);
  auto grad = grad_.contiguous();
  const at::Tensor dx = dropout_grad(grad, rng_state, p);
  return {dx, bias_grad_of(dx, bias_grad)};
}

#if ACCEL_HAVE_X86_INTRINSICS
// Elements [64 begin, min(64 end, n)) of dropout_mask: byte i is 1 where element i is kept.
ACCEL_AVX512 void mask_chunks_avx512(bool* out, int64_t n, int64_t begin, int64_t end, uint64_t seed,
                                     uint64_t threshold) {
  for (int64_t c = begin; c < end; ++c) {
    const int64_t base = c * kChunk;
    const __m512i bytes = _mm512_maskz_set1_epi8(keep_bits(seed, 0, static_cast<uint64_t>(base / 4), threshold), 1);
    const int64_t len = n - base;
    if (len >= kChunk) {
      _mm512_storeu_si512(out + base, bytes);
    } else {
      _mm512_mask_storeu_epi8(out + base, (1ull << len) - 1, bytes);
    }
  }
}
#endif

// dropout_mask(size, p, *, device, call) -> bool tensor of `size`, true where an element is kept: the keep rule
// of the forward above for a fresh rng_state (seed drawn from torch's CPU generator, offset 0), written as
// one byte per element. p = 0 keeps everything and p = 1 nothing, without drawing. `call` is not read (see the
// schema).
at::Tensor dropout_mask_cpu(c10::SymIntArrayRef size, double p, at::Device device, int64_t /*call*/) {
  check_p(p);
  auto mask = at::empty(C10_AS_INTARRAYREF_SLOW(size), at::TensorOptions().dtype(at::kBool).device(device));
  const int64_t n = mask.numel();
  if (n == 0 || p == 0.0 || p == 1.0) return mask.fill_(p == 0.0);
  const uint64_t seed = draw_seed();
  const uint64_t threshold = keep_threshold(p);
  bool* out = mask.mutable_data_ptr<bool>();
  at::parallel_for(0, (n + kChunk - 1) / kChunk, kGrainChunks, [&](int64_t begin, int64_t end) {
#if ACCEL_HAVE_X86_INTRINSICS
    if (vec::avx512_enabled()) return mask_chunks_avx512(out, n, begin, end, seed, threshold);
#endif
    uint32_t draws[kChunk];
    for (int64_t c = begin; c < end; ++c) {
      const int64_t base = c * kChunk;
      philox_batch(seed, 0, base / 4, draws);
      const int64_t len = std::min<int64_t>(kChunk, n - base);
      for (int64_t i = 0; i < len; ++i) out[base + i] = static_cast<uint64_t>(draws[i]) < threshold;
    }
  });
  return mask;
}

// masked_scale(x, mask, scale) = x * mask * scale in one pass (ATen's CPU native_dropout_backward takes
// two: x * mask, then * scale). Each element in x's opmath type, rounded once to x's dtype, as that pair
// gives (x * mask is exact); a dropped element is x * 0, so NaN and inf give NaN as in torch's dropout.
at::Tensor masked_scale_cpu(const at::Tensor& x_, const at::Tensor& mask_, double scale) {
  check_masked_scale(x_, mask_);
  const at::Tensor x = x_.contiguous();
  const at::Tensor mask = mask_.contiguous();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t n = x.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "masked_scale", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* in = x.const_data_ptr<scalar_t>();
    const bool* keep = mask.const_data_ptr<bool>();
    scalar_t* out = y.mutable_data_ptr<scalar_t>();
    const opmath_t s = static_cast<opmath_t>(scale);
    at::parallel_for(0, n, 32768, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        out[i] = static_cast<scalar_t>(static_cast<opmath_t>(in[i]) * static_cast<opmath_t>(keep[i]) * s);
    });
  });
  return y;
}

// dropout_fwd(x, p) -> (y, mask): the mask dropout_mask(x.shape, p) draws and y = masked_scale(x, mask,
// 1 / (1 - p)), the one call of philox_dropout's eager forward. Here the two kernels above, in one op (the
// CUDA kernel writes both in one pass).
std::tuple<at::Tensor, at::Tensor> dropout_fwd_cpu(const at::Tensor& x, double p) {
  check_dropout_fwd(x, p);
  at::Tensor mask = dropout_mask_cpu(x.sym_sizes(), p, x.device(), 0);
  return {masked_scale_cpu(x, mask, keep_scale(p)), mask};
}

// dropout_mask has no tensor argument to dispatch on: pick the backend from its device argument, as
// torch's own factory functions do.
at::Tensor dropout_mask_backend_select(c10::SymIntArrayRef size, double p, at::Device device, int64_t call) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("accel::dropout_mask", "")
                             .typed<at::Tensor(c10::SymIntArrayRef, double, at::Device, int64_t)>();
  return op.redispatch(c10::DispatchKeySet(c10::computeDispatchKey(std::nullopt, std::nullopt, device)), size,
                       p, device, call);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(accel, m) {
  // nondeterministic_seeded: the forward draws from torch's generator, so compilers must neither
  // deduplicate nor recompute it.
  m.def("bias_dropout_add_fwd(Tensor x, Tensor? bias, Tensor residual, float p, bool train) -> (Tensor, Tensor)",
        {at::Tag::nondeterministic_seeded});
  // (dx, dbias): dbias is dx summed over every dim but the last when bias_grad, else an empty tensor
  m.def("bias_dropout_add_bwd(Tensor grad, Tensor rng_state, float p, bool bias_grad) -> (Tensor, Tensor)");
  // The keep mask alone (bool, true = kept), for a dropout written as x * mask / (1 - p) in plain ops
  // that a compiler fuses with their neighbours; nondeterministic_seeded as the forward. device is
  // keyword-only, as in torch's factory functions: a graph that recomputes a random op under activation
  // checkpointing (torch's run_and_save_rng_state) finds the device of an op without tensor inputs there.
  // `call` tells calls apart and is not read: AOTAutograd's common-subexpression pass merges nodes of equal
  // arguments whatever their tags (torch 2.9-2.13 spare only aten's random ops), so two compiled dropouts of one
  // shape and p would share one mask. Compiled callers give each call its own number
  // (accel/runtime/nn/bias_dropout_add.py, accel/compiler/cpu_dropout.py).
  m.def("dropout_mask(SymInt[] size, float p, *, Device device, int call=0) -> Tensor",
        {at::Tag::nondeterministic_seeded});
  // x * mask * scale (mask: bool of x's shape), dropout's scaling half as an op whose gradient is a C++
  // node (csrc/autograd/bias_dropout_add_autograd.cpp) calling the op again: the gradient of dropout_fwd's
  // y. Its own one-pass kernel on the CPU, ATen's native_dropout_backward on every other backend.
  m.def("masked_scale(Tensor x, Tensor mask, float scale) -> Tensor");
  // (y, mask): the mask dropout_mask(x.shape, p) would draw, and y = masked_scale(x, mask, 1 / (1 - p)) (0 for
  // p = 1), drawn and written in one pass on CUDA: philox_dropout's eager forward. y's gradient is
  // masked_scale's node (csrc/autograd/bias_dropout_add_autograd.cpp); the mask is not differentiable.
  m.def("dropout_fwd(Tensor x, float p) -> (Tensor, Tensor)", {at::Tag::nondeterministic_seeded});
}

TORCH_LIBRARY_IMPL(accel, BackendSelect, m) {
  m.impl("dropout_mask", &dropout_mask_backend_select);
}

TORCH_LIBRARY_IMPL(accel, CPU, m) {
  m.impl("bias_dropout_add_fwd", &bias_dropout_add_fwd_cpu);
  m.impl("bias_dropout_add_bwd", &bias_dropout_add_bwd_cpu);
  m.impl("dropout_mask", &dropout_mask_cpu);
  m.impl("masked_scale", &masked_scale_cpu);
  m.impl("dropout_fwd", &dropout_fwd_cpu);
}

}  // namespace accel
