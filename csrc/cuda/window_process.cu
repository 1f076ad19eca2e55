// Swin Transformer window ops on CUDA: cyclic shift fused with window partition, and window merge
// fused with the cyclic shift back (see csrc/cpu/window_process.cpp for the index maps and schemas).
//
// Both ops permute pixel rows of C elements without reading the values, so the kernel moves raw
// "words": the widest of 16/8/4/2/1 bytes that divides a row and the alignment of both pointers.
// One thread per output word on a 1-D grid-stride loop: window counts are unbounded (no gridDim.y/z).
// The row -> source map costs four integer divisions per word; with 32-bit indices they are done by
// multiply-shift (precomputed magic numbers), so the copy stays memory-bound. Tensors of 2^31 words
// or more take a 64-bit path with plain division.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>
#include <torch/types.h>

#include "cuda/fast_div.cuh"

#include <cstdint>
#include <limits>

namespace accel {
namespace {

// Plain 64-bit division, for tensors past FastDiv32's range.
struct Div64 {
  uint64_t d;
  explicit Div64(uint64_t divisor) : d(divisor) {}
  __device__ __forceinline__ uint64_t div(uint64_t n) const { return n / d; }
};

template <typename Div>
struct Geometry {
  Div words_per_row, ws, nWh, nWw, H, W;
  uint32_t sh, sw;  // shifts reduced to [0, H) and [0, W)
};

template <typename index_t, typename Div>
__device__ __forceinline__ index_t partition_source(index_t row, const Geometry<Div>& g) {
  index_t t = g.ws.div(row);
  const index_t j = row - t * g.ws.d;
  index_t t2 = g.ws.div(t);
  const index_t i = t - t2 * g.ws.d;
  t = g.nWw.div(t2);
  const index_t ww = t2 - t * g.nWw.d;
  const index_t b = g.nWh.div(t);
  const index_t wh = t - b * g.nWh.d;
  // h = (wh*ws + i - sh) mod H without signed arithmetic: both terms lie in [0, H)
  index_t h = wh * g.ws.d + i;
  index_t w = ww * g.ws.d + j;
  h = h >= g.sh ? h - g.sh : h + g.H.d - g.sh;
  w = w >= g.sw ? w - g.sw : w + g.W.d - g.sw;
  return (b * g.H.d + h) * g.W.d + w;
}

template <typename index_t, typename Div>
__device__ __forceinline__ index_t reverse_source(index_t row, const Geometry<Div>& g) {
  index_t t = g.W.div(row);
  index_t w = row - t * g.W.d;
  const index_t b = g.H.div(t);
  index_t h = t - b * g.H.d;
  h = h >= g.sh ? h - g.sh : h + g.H.d - g.sh;
  w = w >= g.sw ? w - g.sw : w + g.W.d - g.sw;
  const index_t wh = g.ws.div(h), ww = g.ws.div(w);
  const index_t window = (b * g.nWh.d + wh) * g.nWw.d + ww;
  return (window * g.ws.d + (h - wh * g.ws.d)) * g.ws.d + (w - ww * g.ws.d);
}

template <typename word_t, typename index_t, typename Div, bool kReverse>
__global__ void window_copy_kernel(const word_t* __restrict__ src, word_t* __restrict__ dst, index_t n,
                                   Geometry<Div> g) {
  const index_t stride = static_cast<index_t>(gridDim.x) * blockDim.x;
  for (index_t idx = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < n; idx += stride) {
    const index_t row = g.words_per_row.div(idx);
    const index_t k = idx - row * g.words_per_row.d;
    const index_t from = kReverse ? reverse_source<index_t>(row, g) : partition_source<index_t>(row, g);
    dst[idx] = src[from * g.words_per_row.d + k];
  }
}

inline int64_t positive_mod(int64_t v, int64_t n) {
  const int64_t r = v % n;
  return r < 0 ? r + n : r;
}

template <typename word_t, typename index_t, typename Div>
void launch_typed(const at::Tensor& src, at::Tensor& dst, int64_t rows, int64_t H, int64_t W, int64_t ws,
                  int64_t shift, bool reverse) {
  const int64_t row_words = dst.numel() / rows * dst.element_size() / static_cast<int64_t>(sizeof(word_t));
  const int64_t n = rows * row_words;
  Geometry<Div> g{Div(row_words), Div(ws), Div(H / ws), Div(W / ws), Div(H), Div(W),
                  static_cast<uint32_t>(positive_mod(shift, H)), static_cast<uint32_t>(positive_mod(shift, W))};
  constexpr int threads = 256;
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>((n + threads - 1) / threads, sms * 32));
  auto stream = at::cuda::getCurrentCUDAStream();
  const auto* in = static_cast<const word_t*>(src.const_data_ptr());
  auto* out = static_cast<word_t*>(dst.mutable_data_ptr());
  if (reverse) {
    window_copy_kernel<word_t, index_t, Div, true><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
        in, out, static_cast<index_t>(n), g);
  } else {
    window_copy_kernel<word_t, index_t, Div, false><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
        in, out, static_cast<index_t>(n), g);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename word_t>
void launch_word(const at::Tensor& src, at::Tensor& dst, int64_t rows, int64_t H, int64_t W, int64_t ws,
                 int64_t shift, bool reverse) {
  const int64_t words = dst.numel() * dst.element_size() / static_cast<int64_t>(sizeof(word_t));
  // 32-bit path: every index (and idx + grid stride) fits in uint32 and FastDiv32's n < 2^31 holds.
  if (words < (int64_t{1} << 31) - (int64_t{1} << 24)) {
    launch_typed<word_t, uint32_t, FastDiv32>(src, dst, rows, H, W, ws, shift, reverse);
  } else {
    launch_typed<word_t, uint64_t, Div64>(src, dst, rows, H, W, ws, shift, reverse);
  }
}

void launch(const at::Tensor& src, at::Tensor& dst, int64_t rows, int64_t H, int64_t W, int64_t ws,
            int64_t shift, bool reverse) {
  if (dst.numel() == 0) return;  // any geometry of an empty tensor is fine: nothing is indexed
  // The kernel's window geometry is 32-bit (its divisions are FastDiv32 magic numbers).
  TORCH_CHECK(H < std::numeric_limits<int32_t>::max() && W < std::numeric_limits<int32_t>::max(),
              "window_process: H and W must be below 2^31 on CUDA, got H=", H, ", W=", W);
  const int64_t row_bytes = dst.numel() / rows * dst.element_size();
  const auto align = reinterpret_cast<uintptr_t>(src.const_data_ptr()) |
                     reinterpret_cast<uintptr_t>(dst.const_data_ptr());
  auto fits = [&](int64_t w) { return row_bytes % w == 0 && align % w == 0; };
  if (fits(16)) {
    launch_word<uint4>(src, dst, rows, H, W, ws, shift, reverse);
  } else if (fits(8)) {
    launch_word<uint2>(src, dst, rows, H, W, ws, shift, reverse);
  } else if (fits(4)) {
    launch_word<uint32_t>(src, dst, rows, H, W, ws, shift, reverse);
  } else if (fits(2)) {
    launch_word<uint16_t>(src, dst, rows, H, W, ws, shift, reverse);
  } else {
    launch_word<uint8_t>(src, dst, rows, H, W, ws, shift, reverse);
  }
}

void check_geometry(int64_t H, int64_t W, int64_t ws) {
  TORCH_CHECK(ws > 0, "window_process: window_size must be positive, got ", ws);
  TORCH_CHECK(H > 0 && W > 0 && H % ws == 0 && W % ws == 0, "window_process: window_size ", ws,
              " must divide H=", H, " and W=", W);
}

at::Tensor partition_cuda(const at::Tensor& x_, int64_t window_size, int64_t shift) {
  TORCH_CHECK(x_.dim() == 4, "window_process_partition: x must be [B, H, W, C], got ", x_.sizes());
  c10::cuda::CUDAGuard guard(x_.device());
  auto x = x_.contiguous();
  const int64_t B = x.size(0), H = x.size(1), W = x.size(2), C = x.size(3);
  check_geometry(H, W, window_size);
  const int64_t nW = (H / window_size) * (W / window_size);
  auto out = at::empty({B * nW, window_size, window_size, C}, x.options());
  launch(x, out, B * H * W, H, W, window_size, shift, /*reverse=*/false);
  return out;
}

at::Tensor reverse_cuda(const at::Tensor& windows_, int64_t H, int64_t W, int64_t window_size, int64_t shift) {
  TORCH_CHECK(windows_.dim() == 4 && windows_.size(1) == window_size && windows_.size(2) == window_size,
              "window_process_reverse: windows must be [B*nW, window_size, window_size, C], got ",
              windows_.sizes());
  c10::cuda::CUDAGuard guard(windows_.device());
  auto windows = windows_.contiguous();
  check_geometry(H, W, window_size);
  const int64_t nW = (H / window_size) * (W / window_size);
  TORCH_CHECK(windows.size(0) % nW == 0, "window_process_reverse: windows.size(0)=", windows.size(0),
              " is not a multiple of the window count ", nW);
  const int64_t B = windows.size(0) / nW, C = windows.size(3);
  auto out = at::empty({B, H, W, C}, windows.options());
  launch(windows, out, B * H * W, H, W, window_size, shift, /*reverse=*/true);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(accel, CUDA, m) {
  m.impl("window_process_partition", &partition_cuda);
  m.impl("window_process_reverse", &reverse_cuda);
}

}  // namespace accel
