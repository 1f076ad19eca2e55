// Swin Transformer window ops on CPU: cyclic shift (torch.roll over H and W) fused with window
// partition, and window merge fused with the cyclic shift back.
//
// Both ops are pure permutations of "pixels", runs of C contiguous elements, so the kernel copies
// whole pixel rows with memcpy and never looks at the values: one implementation serves every dtype.
// A pixel row of the output is located by its index; the source row follows from the geometry:
//   partition: out row (window, i, j) <- x[b, (wh*ws + i - shift) mod H, (ww*ws + j - shift) mod W]
//   reverse:   out row (b, h, w)      <- windows[b*nW + h'/ws*nWw + w'/ws, h' % ws, w' % ws]
//              with h' = (h - shift) mod H, w' = (w - shift) mod W
// The backward of each op is the other op with the opposite shift, so no separate kernels exist.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <cstring>

namespace accel {
namespace {

// torch.roll's shift, reduced to [0, n): the number of rows a source index lies "before" its target.
inline int64_t positive_mod(int64_t v, int64_t n) {
  const int64_t r = v % n;
  return r < 0 ? r + n : r;
}

struct Geometry {
  int64_t B, H, W, ws, nWh, nWw, sh, sw;
};

Geometry geometry(int64_t B, int64_t H, int64_t W, int64_t ws, int64_t shift) {
  TORCH_CHECK(ws > 0, "window_process: window_size must be positive, got ", ws);
  TORCH_CHECK(H > 0 && W > 0 && H % ws == 0 && W % ws == 0, "window_process: window_size ", ws,
              " must divide H=", H, " and W=", W);
  return Geometry{B, H, W, ws, H / ws, W / ws, positive_mod(shift, H), positive_mod(shift, W)};
}

inline int64_t partition_source(int64_t row, const Geometry& g) {
  const int64_t j = row % g.ws;
  int64_t t = row / g.ws;
  const int64_t i = t % g.ws;
  t /= g.ws;
  const int64_t ww = t % g.nWw;
  t /= g.nWw;
  const int64_t wh = t % g.nWh;
  const int64_t b = t / g.nWh;
  int64_t h = wh * g.ws + i - g.sh;
  int64_t w = ww * g.ws + j - g.sw;
  if (h < 0) h += g.H;
  if (w < 0) w += g.W;
  return (b * g.H + h) * g.W + w;
}

inline int64_t reverse_source(int64_t row, const Geometry& g) {
  int64_t w = row % g.W;
  int64_t t = row / g.W;
  int64_t h = t % g.H;
  const int64_t b = t / g.H;
  h -= g.sh;
  w -= g.sw;
  if (h < 0) h += g.H;
  if (w < 0) w += g.W;
  const int64_t wh = h / g.ws, ww = w / g.ws;
  const int64_t window = (b * g.nWh + wh) * g.nWw + ww;
  return (window * g.ws + (h - wh * g.ws)) * g.ws + (w - ww * g.ws);
}

template <int64_t (*Source)(int64_t, const Geometry&)>
void copy_rows(const at::Tensor& src, at::Tensor& dst, int64_t rows, const Geometry& g) {
  const int64_t row_bytes = dst.numel() == 0 ? 0 : dst.numel() / rows * dst.element_size();
  if (row_bytes == 0) return;
  const char* in = static_cast<const char*>(src.const_data_ptr());
  char* out = static_cast<char*>(dst.mutable_data_ptr());
  // A row is typically a few hundred bytes: give each task ~64 KiB of copying.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / row_bytes);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      std::memcpy(out + r * row_bytes, in + Source(r, g) * row_bytes, static_cast<size_t>(row_bytes));
    }
  });
}

at::Tensor partition_cpu(const at::Tensor& x_, int64_t window_size, int64_t shift) {
  TORCH_CHECK(x_.dim() == 4, "window_process_partition: x must be [B, H, W, C], got ", x_.sizes());
  auto x = x_.contiguous();
  const int64_t B = x.size(0), H = x.size(1), W = x.size(2), C = x.size(3);
  const Geometry g = geometry(B, H, W, window_size, shift);
  auto out = at::empty({B * g.nWh * g.nWw, window_size, window_size, C}, x.options());
  copy_rows<partition_source>(x, out, B * H * W, g);
  return out;
}

at::Tensor reverse_cpu(const at::Tensor& windows_, int64_t H, int64_t W, int64_t window_size, int64_t shift) {
  TORCH_CHECK(windows_.dim() == 4 && windows_.size(1) == window_size && windows_.size(2) == window_size,
              "window_process_reverse: windows must be [B*nW, window_size, window_size, C], got ",
              windows_.sizes());
  auto windows = windows_.contiguous();
  const Geometry g0 = geometry(0, H, W, window_size, shift);
  const int64_t nW = g0.nWh * g0.nWw;
  TORCH_CHECK(windows.size(0) % nW == 0, "window_process_reverse: windows.size(0)=", windows.size(0),
              " is not a multiple of the window count ", nW);
  const int64_t B = windows.size(0) / nW, C = windows.size(3);
  Geometry g = g0;
  g.B = B;
  auto out = at::empty({B, H, W, C}, windows.options());
  copy_rows<reverse_source>(windows, out, B * H * W, g);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(accel, m) {
  // x [B, H, W, C] -> windows [B*nW, ws, ws, C] of torch.roll(x, (shift, shift), (1, 2))
  m.def("window_process_partition(Tensor x, int window_size, int shift) -> Tensor");
  // windows [B*nW, ws, ws, C] -> torch.roll(merged [B, H, W, C], (shift, shift), (1, 2))
  m.def("window_process_reverse(Tensor windows, int H, int W, int window_size, int shift) -> Tensor");
}

TORCH_LIBRARY_IMPL(accel, CPU, m) {
  m.impl("window_process_partition", &partition_cpu);
  m.impl("window_process_reverse", &reverse_cpu);
}

}  // namespace accel
