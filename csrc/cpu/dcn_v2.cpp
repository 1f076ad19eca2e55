// Deformable convolution, DCNv1 and the modulated DCNv2 (torchvision.ops.deform_conv2d semantics), on
// CPU; the schemas of accel::dcn_v2_fwd / accel::dcn_v2_bwd live here. Checks, sampling arithmetic,
// batch chunking and the GEMMs: csrc/dcn_v2_host.h.
//
// Both sampling kernels run at::parallel_for over work items (sample, offset group, channel slice).
// An item owns its channels' planes of grad_input outright, so the backward scatters into them
// without atomics or per-thread copies; its offset/mask gradients sum over only its slice and are
// written to a per-slice partial, reduced afterwards (no partials when the slices are whole groups).
// Within an item the sampling point of each (tap, pixel) is computed once and reused for every
// channel of the slice (see kTile). The backward is one pass: grad_input, grad_offset and grad_mask
// from the grad columns, which it overwrites with the forward's columns for grad_weight's GEMM.
// torchvision's CPU kernels, by contrast, run on one thread and sample the input three times.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "dcn_v2_host.h"

#include <algorithm>

namespace accel {
namespace {

using namespace dcn_v2_host;

// Columns per chunk (elements): 64 MiB of float. A chunk's GEMMs are already large at this size
// (a whole batch of 8 for a 64-channel 3x3 layer at 56x56), and the columns of a big layer's whole
// batch need not be resident at once.
constexpr int64_t kMaxCols = int64_t(1) << 24;

// Enough work items for every thread to take a few (the items differ in cost where offsets send
// samples off the image), but slices no finer than needed: each slice of an offset group repeats
// the sampling arithmetic and adds a partial to reduce.
int64_t slices_for(const Geometry& g, int64_t nb) {
  const int64_t want = 4 * static_cast<int64_t>(at::get_num_threads());
  const int64_t items = std::max<int64_t>(1, nb * g.G);
  return (want + items - 1) / items;
}

// Below this many samples (channel x tap x pixel) a work item is too small to be worth a thread:
// at::parallel_for then runs small problems inline instead of waking the pool.
constexpr int64_t kMinSamplesPerTask = int64_t(1) << 15;

int64_t grain_of(const Shape& s) {
  return std::max<int64_t>(1, kMinSamplesPerTask / std::max<int64_t>(1, s.slice_len * s.K * s.L));
}

struct Item {
  int64_t b, bg, c0, c1;  // sample in the chunk, sample * G + offset group, channels [c0, c1)
};

inline Item item_of(const Shape& s, int64_t it) {
  const int64_t slice = it % s.slices, bg = it / s.slices;
  const int64_t g = bg % s.G;
  const int64_t c0 = g * s.Cg + slice * s.slice_len;
  return {bg / s.G, bg, c0, std::min(c0 + s.slice_len, (g + 1) * s.Cg)};
}

// A tile of consecutive output pixels of one tap: their sampling points, computed once and reused
// for every channel of the work item. Channels are the outer loop over a tile, so each channel's
// columns are written in runs of kTile and its plane is the only one being read, whatever the
// strides between planes and column rows; those are often multiples of 4 KiB (64x64 planes), which
// would put the same offset of every channel in one L1 set if the channel loop were innermost.
constexpr int64_t kTile = 64;

template <typename acc_t>
struct TileTap {
  Tap<acc_t> t;
  Weights<acc_t> w;
  acc_t m;  // mask value, 1 without a mask
};

// Fills tile[0, n) for tap k and pixels [l0, l0 + n) of the offset group whose offsets / mask start at
// off_g / mask_g (mask_g null without a mask).
template <typename scalar_t, typename acc_t>
inline void fill_tile(const Shape& s, const scalar_t* off_g, const scalar_t* mask_g, int64_t k, int64_t l0, int64_t n,
                      TileTap<acc_t>* tile) {
  for (int64_t i = 0; i < n; ++i) {
    TileTap<acc_t>& e = tile[i];
    e.t = tap_at<acc_t>(s, off_g, k, l0 + i);
    e.w = e.t.inside ? weights_of(e.t) : Weights<acc_t>{acc_t(0), acc_t(0), acc_t(0), acc_t(0)};
    e.m = mask_g ? static_cast<acc_t>(mask_g[k * s.L + l0 + i]) : acc_t(1);
  }
}

// cols[b, c*K + k, l] = mask * bilinear(input[b, c], tap k of pixel l), for the nb samples the
// pointers start at.
template <typename scalar_t, typename acc_t>
void im2col(const Shape& s, int64_t nb, const scalar_t* x, const scalar_t* off, const scalar_t* mask, acc_t* cols) {
  const int64_t HW = s.H * s.W, KL = s.K * s.L;
  at::parallel_for(0, nb * s.G * s.slices, grain_of(s), [&](int64_t begin, int64_t end) {
    TileTap<acc_t> tile[kTile];
    for (int64_t it = begin; it < end; ++it) {
      const Item w = item_of(s, it);
      const scalar_t* off_g = off + w.bg * 2 * KL;
      const scalar_t* mask_g = mask ? mask + w.bg * KL : nullptr;
      const scalar_t* x_b = x + w.b * s.C * HW;
      acc_t* cols_b = cols + w.b * s.C * KL;
      for (int64_t k = 0; k < s.K; ++k) {
        for (int64_t l0 = 0; l0 < s.L; l0 += kTile) {
          const int64_t n = std::min(kTile, s.L - l0);
          fill_tile(s, off_g, mask_g, k, l0, n, tile);
          for (int64_t c = w.c0; c < w.c1; ++c) {
            const scalar_t* plane = x_b + c * HW;
            acc_t* col = cols_b + c * KL + k * s.L + l0;
            for (int64_t i = 0; i < n; ++i) {
              const TileTap<acc_t>& e = tile[i];
              if (!e.t.inside) {
                col[i] = acc_t(0);
              } else if (e.t.interior()) {
                col[i] = e.m * interpolate(corners_interior<acc_t>(plane, e.t, s.W), e.w);
              } else {
                col[i] = e.m * interpolate(corners<acc_t>(plane, e.t), e.w);
              }
            }
          }
        }
      }
    }
  });
}

// From grad columns gcols [nb, C*K, L] (overwritten with the forward's columns): adds into gi
// [nb, C, H, W] and writes goff [slices][nb, 2*G*K, L] and gmask [slices][nb, G*K, L] (null without
// a mask), each slice's partial `part_off` / `part_mask` elements after the previous one's.
template <typename scalar_t, typename acc_t>
void col2im(const Shape& s, int64_t nb, const scalar_t* x, const scalar_t* off, const scalar_t* mask, acc_t* gcols,
            acc_t* gi, acc_t* goff, acc_t* gmask) {
  const int64_t HW = s.H * s.W, KL = s.K * s.L;
  const int64_t part_off = nb * s.G * 2 * KL, part_mask = nb * s.G * KL;
  at::parallel_for(0, nb * s.G * s.slices, grain_of(s), [&](int64_t begin, int64_t end) {
    TileTap<acc_t> tile[kTile];
    acc_t gy[kTile], gx[kTile], gm[kTile];
    for (int64_t it = begin; it < end; ++it) {
      const Item w = item_of(s, it);
      const int64_t slice = it % s.slices;
      const scalar_t* off_g = off + w.bg * 2 * KL;
      const scalar_t* mask_g = mask ? mask + w.bg * KL : nullptr;
      const scalar_t* x_b = x + w.b * s.C * HW;
      acc_t* cols_b = gcols + w.b * s.C * KL;
      acc_t* gi_b = gi + w.b * s.C * HW;
      acc_t* goff_g = goff + slice * part_off + w.bg * 2 * KL;
      acc_t* gmask_g = gmask ? gmask + slice * part_mask + w.bg * KL : nullptr;
      for (int64_t k = 0; k < s.K; ++k) {
        for (int64_t l0 = 0; l0 < s.L; l0 += kTile) {
          const int64_t n = std::min(kTile, s.L - l0);
          fill_tile(s, off_g, mask_g, k, l0, n, tile);
          std::fill_n(gy, n, acc_t(0));
          std::fill_n(gx, n, acc_t(0));
          std::fill_n(gm, n, acc_t(0));
          for (int64_t c = w.c0; c < w.c1; ++c) {
            const scalar_t* plane = x_b + c * HW;
            acc_t* gp = gi_b + c * HW;
            acc_t* col = cols_b + c * KL + k * s.L + l0;
            for (int64_t i = 0; i < n; ++i) {
              const TileTap<acc_t>& e = tile[i];
              const Tap<acc_t>& t = e.t;
              if (!t.inside) {
                col[i] = acc_t(0);
                continue;
              }
              const bool interior = t.interior();
              const Corners<acc_t> v = interior ? corners_interior<acc_t>(plane, t, s.W) : corners<acc_t>(plane, t);
              const acc_t gc = col[i];
              const acc_t val = interpolate(v, e.w);
              const acc_t gcm = gc * e.m;
              gm[i] += gc * val;
              gy[i] += gcm * d_dy(v, t);
              gx[i] += gcm * d_dx(v, t);
              if (interior || (t.y0ok && t.x0ok)) gp[t.i00] += gcm * e.w.w00;
              if (interior || (t.y0ok && t.x1ok)) gp[t.i01] += gcm * e.w.w01;
              if (interior || (t.y1ok && t.x0ok)) gp[t.i10] += gcm * e.w.w10;
              if (interior || (t.y1ok && t.x1ok)) gp[t.i11] += gcm * e.w.w11;
              col[i] = e.m * val;
            }
          }
          std::copy_n(gy, n, goff_g + 2 * k * s.L + l0);
          std::copy_n(gx, n, goff_g + (2 * k + 1) * s.L + l0);
          if (gmask_g) std::copy_n(gm, n, gmask_g + k * s.L + l0);
        }
      }
    }
  });
}

at::Tensor dcn_v2_fwd_cpu(const at::Tensor& input, const at::Tensor& offset, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& mask,
                          at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation) {
  const Inputs in = prepare("dcn_v2_fwd", input, offset, weight, bias, mask, stride, padding, dilation);
  const Geometry& g = in.g;
  return forward(in, kMaxCols, acc_type_of(input.scalar_type()), [&](int64_t b0, int64_t nb, at::Tensor& cols) {
    const Shape s = g.shape(slices_for(g, nb));
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, in.input.scalar_type(), "dcn_v2_fwd_cpu", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      im2col<scalar_t, acc_t>(s, nb, in.input.const_data_ptr<scalar_t>() + b0 * g.C * g.H * g.W,
                              in.offset.const_data_ptr<scalar_t>() + b0 * 2 * g.G * g.K() * g.L(),
                              in.mask.defined() ? in.mask.const_data_ptr<scalar_t>() + b0 * g.G * g.K() * g.L()
                                                : nullptr,
                              cols.mutable_data_ptr<acc_t>());
    });
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> dcn_v2_bwd_cpu(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& offset, const at::Tensor& weight,
    const std::optional<at::Tensor>& mask, at::IntArrayRef stride, at::IntArrayRef padding,
    at::IntArrayRef dilation) {
  const Inputs in = prepare("dcn_v2_bwd", input, offset, weight, std::nullopt, mask, stride, padding, dilation);
  const Geometry& g = in.g;
  return backward(in, grad_output, kMaxCols,
                  [&](int64_t b0, int64_t nb, at::Tensor& gcols, at::Tensor& gi, at::Tensor& goff, at::Tensor& gmask) {
    const Shape s = g.shape(slices_for(g, nb));
    const bool with_mask = in.mask.defined();
    // one slice per offset group: its sums are complete and go straight into the outputs
    at::Tensor goff_c = goff.narrow(0, b0, nb), gmask_c = with_mask ? gmask.narrow(0, b0, nb) : gmask;
    // every element of goff_c / gmask_c is written: by col2im directly, or by the sum of the partials
    at::Tensor goff_p = goff_c, gmask_p = gmask_c;
    if (s.slices > 1) {
      goff_p = at::empty({s.slices, nb, 2 * g.G * g.K(), g.Ho, g.Wo}, goff.options());
      if (with_mask) gmask_p = at::empty({s.slices, nb, g.G * g.K(), g.Ho, g.Wo}, gmask.options());
    }
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, in.input.scalar_type(), "dcn_v2_bwd_cpu", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      col2im<scalar_t, acc_t>(s, nb, in.input.const_data_ptr<scalar_t>() + b0 * g.C * g.H * g.W,
                              in.offset.const_data_ptr<scalar_t>() + b0 * 2 * g.G * g.K() * g.L(),
                              with_mask ? in.mask.const_data_ptr<scalar_t>() + b0 * g.G * g.K() * g.L() : nullptr,
                              gcols.mutable_data_ptr<acc_t>(), gi.mutable_data_ptr<acc_t>() + b0 * g.C * g.H * g.W,
                              goff_p.mutable_data_ptr<acc_t>(),
                              with_mask ? gmask_p.mutable_data_ptr<acc_t>() : nullptr);
    });
    if (s.slices > 1) {
      goff_c.copy_(goff_p.sum(0));
      if (with_mask) gmask_c.copy_(gmask_p.sum(0));
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(accel, m) {
  m.def(
      "dcn_v2_fwd(Tensor input, Tensor offset, Tensor weight, Tensor? bias, Tensor? mask, int[2] stride, "
      "int[2] padding, int[2] dilation) -> Tensor");
  m.def(
      "dcn_v2_bwd(Tensor grad_output, Tensor input, Tensor offset, Tensor weight, Tensor? mask, int[2] stride, "
      "int[2] padding, int[2] dilation) -> (Tensor grad_input, Tensor grad_offset, Tensor grad_mask, "
      "Tensor grad_weight, Tensor grad_bias)");
}

TORCH_LIBRARY_IMPL(accel, CPU, m) {
  m.impl("dcn_v2_fwd", &dcn_v2_fwd_cpu);
  m.impl("dcn_v2_bwd", &dcn_v2_bwd_cpu);
}

}  // namespace accel
