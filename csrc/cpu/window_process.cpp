// Swin Transformer window ops on CPU: cyclic shift (torch.roll over H and W) fused with window
// partition, and window merge fused with the cyclic shift back.
//
// Both ops are pure permutations of "pixels", runs of C contiguous elements, so the kernel copies bytes
// with memcpy and never looks at the values: one implementation serves every dtype. The unit of work is a
// window row: the ws pixels of row i of one window, contiguous in the windows tensor and, in the image,
// ws consecutive pixels of one image row that wrap around at W in at most one place, so one or two
// memcpy calls of up to ws pixels each, located with three divisions (a copy per pixel, four divisions
// each, took 5-13% longer on bf16 Swin stage 3 windows; fp32 rows alike within a 2-core host's noise).
//   partition: window (b, wh, ww) row i <- x[b, (wh*ws + i - shift) mod H, (ww*ws - shift) mod W, ...]
//   reverse:   out[b, (wh*ws + i + shift) mod H, (ww*ws + shift) mod W, ...] <- window (b, wh, ww) row i
// (torch.roll(x, s)[h] == x[(h - s) mod H]: reverse rolls the merged image forward by shift.)
// The backward of each op is the other op with the opposite shift, so no separate kernels exist.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
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

// Copies every window row between the windows tensor and the image: into the windows (partition) or out
// of them (reverse). Window (b, wh, ww) row i is image row (wh*ws + i + dh) mod H from column
// (ww*ws + dw) mod W on, dh in [0, H) and dw in [0, W).
template <bool kIntoWindows>
void copy_window_rows(const at::Tensor& src, at::Tensor& dst, const Geometry& g, int64_t dh, int64_t dw) {
  const int64_t pixel_bytes = dst.numel() == 0 ? 0 : dst.numel() / (g.B * g.H * g.W) * dst.element_size();
  if (pixel_bytes == 0) return;
  const char* in = static_cast<const char*>(src.const_data_ptr());
  char* out = static_cast<char*>(dst.mutable_data_ptr());
  const int64_t run = g.ws * pixel_bytes;  // one window row
  const int64_t window_rows = g.B * g.nWh * g.nWw * g.ws;
  // give each task ~64 KiB of copying
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / run);
  at::parallel_for(0, window_rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t i = r % g.ws;
      int64_t t = r / g.ws;
      const int64_t ww = t % g.nWw;
      t /= g.nWw;
      const int64_t wh = t % g.nWh;
      const int64_t b = t / g.nWh;
      int64_t h = wh * g.ws + i + dh;
      if (h >= g.H) h -= g.H;
      int64_t w = ww * g.ws + dw;
      if (w >= g.W) w -= g.W;
      const int64_t image_row = (b * g.H + h) * g.W;  // in pixels
      const int64_t head = std::min(g.ws, g.W - w) * pixel_bytes;  // the pixels before the wrap at W
      const int64_t window = r * run, image = (image_row + w) * pixel_bytes, wrapped = image_row * pixel_bytes;
      if constexpr (kIntoWindows) {
        std::memcpy(out + window, in + image, static_cast<size_t>(head));
        if (head < run) std::memcpy(out + window + head, in + wrapped, static_cast<size_t>(run - head));
      } else {
        std::memcpy(out + image, in + window, static_cast<size_t>(head));
        if (head < run) std::memcpy(out + wrapped, in + window + head, static_cast<size_t>(run - head));
      }
    }
  });
}

at::Tensor partition_cpu(const at::Tensor& x_, int64_t window_size, int64_t shift) {
  TORCH_CHECK(x_.dim() == 4, "window_process_partition: x must be [B, H, W, C], got ", x_.sizes());
  auto x = x_.contiguous();
  const int64_t B = x.size(0), H = x.size(1), W = x.size(2), C = x.size(3);
  const Geometry g = geometry(B, H, W, window_size, shift);
  auto out = at::empty({B * g.nWh * g.nWw, window_size, window_size, C}, x.options());
  copy_window_rows<true>(x, out, g, g.sh == 0 ? 0 : H - g.sh, g.sw == 0 ? 0 : W - g.sw);
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
  copy_window_rows<false>(windows, out, g, g.sh, g.sw);
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
