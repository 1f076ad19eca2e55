// Shared by csrc/cpu/dcn_v2.cpp and csrc/cuda/dcn_v2.cu: argument checks, the bilinear sampling
// arithmetic (host and device) and the batch-chunked drivers around the two GEMMs, so that both
// devices accept the same inputs, sample identically and differ only in their sampling kernels.
//
// Layouts (torchvision.ops.deform_conv2d's): input [B, C, H, W]; offset [B, 2*G*K, Ho, Wo] with
// the (dy, dx) pair of kernel tap k of offset group g at channels g*2K + 2k and g*2K + 2k + 1;
// mask [B, G*K, Ho, Wo]; weight [Co, C/groups, kh, kw]. K = kh*kw, L = Ho*Wo. The G offset groups
// split the input channels into blocks of C/G channels that share one offset field.
//
// Columns ("cols") are [nb, C*K, L], row c*K + k holding input channel c sampled at tap k (sampled in
// the accumulation type; stored in it, or on CUDA for float16/bfloat16 in the input's dtype, see forward); with the groups split out ([nb, groups, C/groups*K, L]) they line up with
// weight viewed as [groups, Co/groups, C/groups*K], so each direction is one batched at::matmul
// over the whole chunk of nb samples rather than a GEMM per sample.
#pragma once

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <c10/macros/Macros.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <utility>

namespace accel {
namespace dcn_v2_host {

// ------------------------------------------------------------------------------------------------
// Geometry and checks
// ------------------------------------------------------------------------------------------------

// What the kernels need, by value (a kernel argument on CUDA). `slices` splits each offset group's
// C/G channels into runs of `slice_len` (the last may be shorter) handled by separate work items.
struct Shape {
  int64_t C, H, W;        // input channels and plane
  int64_t G, Cg;          // offset groups, channels per offset group
  int64_t kh, kw, K;      // kernel
  int64_t sh, sw, ph, pw, dh, dw;
  int64_t Ho, Wo, L;      // output plane
  int64_t slices, slice_len;
};

struct Geometry {
  int64_t B, C, H, W, Co, groups, G, kh, kw, sh, sw, ph, pw, dh, dw, Ho, Wo;
  int64_t K() const { return kh * kw; }
  int64_t L() const { return Ho * Wo; }
  int64_t Cpg() const { return C / groups; }   // input channels per weight group
  int64_t Cog() const { return Co / groups; }  // output channels per weight group
  Shape shape(int64_t slices) const {
    const int64_t Cg = C / G;
    slices = std::max<int64_t>(1, std::min<int64_t>(slices, Cg));
    const int64_t len = (Cg + slices - 1) / slices;
    // with len rounded up, fewer slices may already cover Cg: drop the empty ones
    return {C, H, W, G, Cg, kh, kw, K(), sh, sw, ph, pw, dh, dw, Ho, Wo, L(), (Cg + len - 1) / len, len};
  }
};

inline void check_pair(const char* op, const char* name, at::IntArrayRef v, int64_t minimum) {
  TORCH_CHECK(v.size() == 2, op, ": ", name, " must have 2 elements, got ", v.size());
  TORCH_CHECK(v[0] >= minimum && v[1] >= minimum, op, ": ", name, " must be >= ", minimum, ", got ", v);
}

// Every check the Python API makes, again: the ops can be called directly (torch.ops.accel.*), and a
// kernel handed a wrong shape would read out of bounds.
inline Geometry check_args(const char* op, const at::Tensor& input, const at::Tensor& offset, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& mask,
                           at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation) {
  TORCH_CHECK(input.dim() == 4, op, ": input must be [B, C, H, W], got shape ", input.sizes());
  TORCH_CHECK(offset.dim() == 4, op, ": offset must be [B, 2*G*kh*kw, Ho, Wo], got shape ", offset.sizes());
  TORCH_CHECK(weight.dim() == 4, op, ": weight must be [Co, C/groups, kh, kw], got shape ", weight.sizes());
  TORCH_CHECK(at::isFloatingType(input.scalar_type()), op, ": input must be floating point, got ",
              input.scalar_type());
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"offset", &offset}, {"weight", &weight},
                                {"bias", bias.has_value() ? &*bias : nullptr},
                                {"mask", mask.has_value() ? &*mask : nullptr}}) {
    if (t == nullptr) continue;
    TORCH_CHECK(t->scalar_type() == input.scalar_type(), op, ": ", name, " must have input's dtype ",
                input.scalar_type(), ", got ", t->scalar_type());
    TORCH_CHECK(t->device() == input.device(), op, ": ", name, " must be on input's device ", input.device(),
                ", got ", t->device());
  }
  check_pair(op, "stride", stride, 1);
  check_pair(op, "padding", padding, 0);
  check_pair(op, "dilation", dilation, 1);

  Geometry g{};
  g.B = input.size(0);
  g.C = input.size(1);
  g.H = input.size(2);
  g.W = input.size(3);
  g.Co = weight.size(0);
  g.kh = weight.size(2);
  g.kw = weight.size(3);
  g.sh = stride[0];
  g.sw = stride[1];
  g.ph = padding[0];
  g.pw = padding[1];
  g.dh = dilation[0];
  g.dw = dilation[1];
  TORCH_CHECK(weight.size(1) > 0 && g.kh > 0 && g.kw > 0 && g.Co > 0, op,
              ": weight must have non-zero sizes, got shape ", weight.sizes());
  TORCH_CHECK(g.C % weight.size(1) == 0, op, ": input channels (", g.C, ") must be a multiple of weight.size(1) (",
              weight.size(1), ")");
  g.groups = g.C / weight.size(1);
  TORCH_CHECK(g.Co % g.groups == 0, op, ": weight.size(0) (", g.Co, ") must be a multiple of groups (", g.groups, ")");
  const int64_t span_h = g.dh * (g.kh - 1) + 1, span_w = g.dw * (g.kw - 1) + 1;
  TORCH_CHECK(g.H + 2 * g.ph >= span_h && g.W + 2 * g.pw >= span_w, op, ": the padded input (",
              g.H + 2 * g.ph, "x", g.W + 2 * g.pw, ") is smaller than the dilated kernel (", span_h, "x", span_w, ")");
  g.Ho = (g.H + 2 * g.ph - span_h) / g.sh + 1;
  g.Wo = (g.W + 2 * g.pw - span_w) / g.sw + 1;
  const int64_t K = g.K();
  TORCH_CHECK(offset.size(1) > 0 && offset.size(1) % (2 * K) == 0, op, ": offset.size(1) must be a positive ",
              "multiple of 2*kh*kw = ", 2 * K, ", got ", offset.size(1));
  g.G = offset.size(1) / (2 * K);
  TORCH_CHECK(g.C % g.G == 0, op, ": input channels (", g.C, ") must be a multiple of the offset groups (", g.G, ")");
  TORCH_CHECK(offset.size(0) == g.B && offset.size(2) == g.Ho && offset.size(3) == g.Wo, op,
              ": offset must be [", g.B, ", ", offset.size(1), ", ", g.Ho, ", ", g.Wo, "], got ", offset.sizes());
  if (mask.has_value()) {
    TORCH_CHECK(mask->dim() == 4 && mask->size(0) == g.B && mask->size(1) == g.G * K && mask->size(2) == g.Ho &&
                    mask->size(3) == g.Wo,
                op, ": mask must be [", g.B, ", ", g.G * K, ", ", g.Ho, ", ", g.Wo, "], got ", mask->sizes());
  }
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == g.Co, op, ": bias must be [", g.Co, "], got ", bias->sizes());
  }
  return g;
}

inline at::ScalarType acc_type_of(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// Samples per chunk: as many as keep one chunk's columns within `max_cols` elements (at least one).
inline int64_t chunk_of(const Geometry& g, int64_t max_cols) {
  const int64_t per_sample = std::max<int64_t>(1, g.C * g.K() * g.L());
  return std::max<int64_t>(1, std::min<int64_t>(g.B, max_cols / per_sample));
}

// ------------------------------------------------------------------------------------------------
// Bilinear sampling (host and device)
// ------------------------------------------------------------------------------------------------

// Assumptions: none (any value, NaN included); host and device.
C10_HOST_DEVICE inline float floor_of(float v) { return floorf(v); }
C10_HOST_DEVICE inline double floor_of(double v) { return floor(v); }

// One sampling point: the four neighbours' offsets into an H*W plane, whether each lies inside the
// plane, and the fractional position. The image is zero outside its plane, so only points in
// [-1, H) x [-1, W) have a neighbour inside; on the lines y = -1 and x = -1 the value is 0 but the
// derivatives are the one-sided ones towards the image, as in torchvision (a DCN with padding 1 and
// zero offsets has its border taps exactly there). The test is written so that a NaN offset lands
// outside too, before any float-to-integer conversion could be undefined.
template <typename acc_t>
struct Tap {
  int64_t i00, i01, i10, i11;  // y0*W + x0, y0*W + x1, y1*W + x0, y1*W + x1
  bool y0ok, y1ok, x0ok, x1ok;
  acc_t ly, lx;  // y - y0, x - x0
  bool inside;
  // All four neighbours in the plane: the common case, which needs no per-corner test.
  // Assumptions: inside (the flags are unset otherwise).
  C10_HOST_DEVICE bool interior() const { return y0ok && y1ok && x0ok && x1ok; }
};

// Assumptions: H, W > 0; y and x any value (NaN and +-inf give !inside). The indices of a neighbour
// are only meaningful where its *ok flags hold.
template <typename acc_t>
C10_HOST_DEVICE inline Tap<acc_t> make_tap(acc_t y, acc_t x, int64_t H, int64_t W) {
  Tap<acc_t> t{};
  t.inside = y >= acc_t(-1) && y < acc_t(H) && x >= acc_t(-1) && x < acc_t(W);
  if (!t.inside) return t;
  const acc_t fy = floor_of(y), fx = floor_of(x);
  const int64_t y0 = static_cast<int64_t>(fy), x0 = static_cast<int64_t>(fx);
  t.ly = y - fy;
  t.lx = x - fx;
  t.y0ok = y0 >= 0;
  t.y1ok = y0 + 1 < H;
  t.x0ok = x0 >= 0;
  t.x1ok = x0 + 1 < W;
  t.i00 = y0 * W + x0;
  t.i01 = t.i00 + 1;
  t.i10 = t.i00 + W;
  t.i11 = t.i10 + 1;
  return t;
}

// The four neighbours of a tap in one plane, 0 where outside the plane.
template <typename acc_t>
struct Corners {
  acc_t v00, v01, v10, v11;
};

// Assumptions: t.inside; plane points at the H*W plane t was made for; reads only neighbours whose
// *ok flags hold.
template <typename acc_t, typename scalar_t>
C10_HOST_DEVICE inline Corners<acc_t> corners(const scalar_t* plane, const Tap<acc_t>& t) {
  Corners<acc_t> c{acc_t(0), acc_t(0), acc_t(0), acc_t(0)};
  if (t.y0ok && t.x0ok) c.v00 = static_cast<acc_t>(plane[t.i00]);
  if (t.y0ok && t.x1ok) c.v01 = static_cast<acc_t>(plane[t.i01]);
  if (t.y1ok && t.x0ok) c.v10 = static_cast<acc_t>(plane[t.i10]);
  if (t.y1ok && t.x1ok) c.v11 = static_cast<acc_t>(plane[t.i11]);
  return c;
}

// corners() of an interior() tap, without the per-corner tests.
// Assumptions: t.inside && t.interior(); plane and W as for the plane t was made for.
template <typename acc_t, typename scalar_t>
C10_HOST_DEVICE inline Corners<acc_t> corners_interior(const scalar_t* plane, const Tap<acc_t>& t, int64_t W) {
  const scalar_t* p = plane + t.i00;
  return {static_cast<acc_t>(p[0]), static_cast<acc_t>(p[1]), static_cast<acc_t>(p[W]), static_cast<acc_t>(p[W + 1])};
}

// The bilinear weights of the four neighbours (also d value / d neighbour, for the input gradient).
template <typename acc_t>
struct Weights {
  acc_t w00, w01, w10, w11;
};

// Assumptions: t.inside (ly, lx in [0, 1)).
template <typename acc_t>
C10_HOST_DEVICE inline Weights<acc_t> weights_of(const Tap<acc_t>& t) {
  const acc_t hy = acc_t(1) - t.ly, hx = acc_t(1) - t.lx;
  return {hy * hx, hy * t.lx, t.ly * hx, t.ly * t.lx};
}

// The interpolated value, with torchvision's weights and order of operations (so float64 agrees to
// the last bits, float32 to rounding).
// Assumptions: c and w from the same inside tap.
template <typename acc_t>
C10_HOST_DEVICE inline acc_t interpolate(const Corners<acc_t>& c, const Weights<acc_t>& w) {
  return w.w00 * c.v00 + w.w01 * c.v01 + w.w10 * c.v10 + w.w11 * c.v11;
}

// d value / d y and d value / d x. At an integer coordinate (zero offsets, the usual start of
// training) these are the one-sided derivatives towards the next pixel, as in torchvision.
// Assumptions: c from corners()/corners_interior() of the inside tap t.
template <typename acc_t>
C10_HOST_DEVICE inline acc_t d_dy(const Corners<acc_t>& c, const Tap<acc_t>& t) {
  return (acc_t(1) - t.lx) * (c.v10 - c.v00) + t.lx * (c.v11 - c.v01);
}

// Assumptions: as d_dy.
template <typename acc_t>
C10_HOST_DEVICE inline acc_t d_dx(const Corners<acc_t>& c, const Tap<acc_t>& t) {
  return (acc_t(1) - t.ly) * (c.v01 - c.v00) + t.ly * (c.v11 - c.v10);
}

// The sampling point of tap k (row-major in the kernel) for output pixel l of an offset group,
// whose 2K offset rows of L values start at `off`.
// Assumptions: 0 <= k < s.K, 0 <= l < s.L; off points at that group's [2 * s.K, s.L] offsets.
template <typename acc_t, typename scalar_t>
C10_HOST_DEVICE inline Tap<acc_t> tap_at(const Shape& s, const scalar_t* off, int64_t k, int64_t l) {
  const int64_t ho = l / s.Wo, wo = l - ho * s.Wo;
  const int64_t ki = k / s.kw, kj = k - ki * s.kw;
  const acc_t y = static_cast<acc_t>(ho * s.sh - s.ph + ki * s.dh) + static_cast<acc_t>(off[(2 * k) * s.L + l]);
  const acc_t x = static_cast<acc_t>(wo * s.sw - s.pw + kj * s.dw) + static_cast<acc_t>(off[(2 * k + 1) * s.L + l]);
  return make_tap<acc_t>(y, x, s.H, s.W);
}

// ------------------------------------------------------------------------------------------------
// Drivers
// ------------------------------------------------------------------------------------------------

// Contiguous inputs of either op; mask undefined when absent.
struct Inputs {
  Geometry g;
  at::Tensor input, offset, weight, mask;
  std::optional<at::Tensor> bias;
};

inline Inputs prepare(const char* op, const at::Tensor& input, const at::Tensor& offset, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& mask,
                      at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation) {
  Inputs in;
  in.g = check_args(op, input, offset, weight, bias, mask, stride, padding, dilation);
  in.input = input.contiguous();
  in.offset = offset.contiguous();
  in.weight = weight.contiguous();
  if (mask.has_value()) in.mask = mask->contiguous();
  if (bias.has_value()) in.bias = bias->contiguous();
  return in;
}

// out = weight (*) columns + bias, a chunk of samples at a time, the GEMM in `cols_type`: the
// accumulation type, or (CUDA) the input's float16/bfloat16, as torchvision does: tensor-core GEMMs,
// which accumulate in float32 and round once, like the output's own rounding; a float32 GEMM left the
// float16 forward at 0.73x torchvision's on an H200.
// im2col(b0, nb, cols) fills cols [nb, C*K, L] (cols_type) for samples [b0, b0 + nb).
template <typename Im2Col>
at::Tensor forward(const Inputs& in, int64_t max_cols, at::ScalarType cols_type, Im2Col&& im2col) {
  const Geometry& g = in.g;
  at::Tensor out = at::empty({g.B, g.Co, g.Ho, g.Wo}, in.input.options());
  if (g.B == 0) return out;
  const at::Tensor w = in.weight.to(cols_type).view({g.groups, g.Cog(), g.Cpg() * g.K()});
  const int64_t chunk = chunk_of(g, max_cols);
  for (int64_t b0 = 0; b0 < g.B; b0 += chunk) {
    const int64_t nb = std::min(chunk, g.B - b0);
    at::Tensor cols = at::empty({nb, g.C * g.K(), g.L()}, in.input.options().dtype(cols_type));
    im2col(b0, nb, cols);
    at::Tensor y = at::matmul(w, cols.view({nb, g.groups, g.Cpg() * g.K(), g.L()})).reshape({nb, g.Co, g.Ho, g.Wo});
    if (in.bias.has_value()) y.add_(in.bias->to(cols_type).view({1, g.Co, 1, 1}));
    if (nb == g.B) return y.to(out.scalar_type());
    out.narrow(0, b0, nb).copy_(y);
  }
  return out;
}

// Gradients of the forward, a chunk of samples at a time: grad columns = weight^T (*) grad_out, then
// col2im(b0, nb, gcols, grad_input, grad_offset, grad_mask) turns them into the gradients of
// input, offset and mask of samples [b0, b0 + nb) (the full-batch tensors in the accumulation
// type: grad_input zero-initialised, to be added into; grad_offset and grad_mask uninitialised, every
// element of the chunk to be written) and overwrites gcols with the forward's columns, from which
// grad_weight follows by a second batched GEMM. Without a mask, grad_mask is an empty [0] tensor (so
// is the result) and must not be touched.
template <typename Col2Im>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward(const Inputs& in,
                                                                               const at::Tensor& grad_out_,
                                                                               int64_t max_cols, Col2Im&& col2im) {
  const Geometry& g = in.g;
  TORCH_CHECK(grad_out_.dim() == 4 && grad_out_.size(0) == g.B && grad_out_.size(1) == g.Co &&
                  grad_out_.size(2) == g.Ho && grad_out_.size(3) == g.Wo,
              "dcn_v2_bwd: grad_output must be [", g.B, ", ", g.Co, ", ", g.Ho, ", ", g.Wo, "], got ",
              grad_out_.sizes());
  TORCH_CHECK(grad_out_.device() == in.input.device(), "dcn_v2_bwd: grad_output must be on input's device ",
              in.input.device(), ", got ", grad_out_.device());
  TORCH_CHECK(at::isFloatingType(grad_out_.scalar_type()), "dcn_v2_bwd: grad_output must be floating point");
  const auto dtype = in.input.scalar_type();
  const auto acc = acc_type_of(dtype);
  const auto acc_opts = in.input.options().dtype(acc);
  const at::Tensor go = grad_out_.to(acc).contiguous();
  at::Tensor gi = at::zeros({g.B, g.C, g.H, g.W}, acc_opts);
  at::Tensor goff = at::empty({g.B, 2 * g.G * g.K(), g.Ho, g.Wo}, acc_opts);
  at::Tensor gmask = in.mask.defined() ? at::empty({g.B, g.G * g.K(), g.Ho, g.Wo}, acc_opts) : at::empty({0}, acc_opts);
  at::Tensor gw = at::zeros({g.groups, g.Cog(), g.Cpg() * g.K()}, acc_opts);
  if (g.B > 0) {
    const at::Tensor wt = in.weight.to(acc).view({g.groups, g.Cog(), g.Cpg() * g.K()}).transpose(1, 2);
    const int64_t chunk = chunk_of(g, max_cols);
    for (int64_t b0 = 0; b0 < g.B; b0 += chunk) {
      const int64_t nb = std::min(chunk, g.B - b0);
      const at::Tensor go_c = go.narrow(0, b0, nb).view({nb, g.groups, g.Cog(), g.L()});
      at::Tensor cols = at::matmul(wt, go_c).contiguous();  // [nb, groups, Cpg*K, L]
      col2im(b0, nb, cols, gi, goff, gmask);
      gw.add_(at::matmul(go_c, cols.transpose(-1, -2)).sum(0));
    }
  }
  at::Tensor gb = go.sum({0, 2, 3});
  return {gi.to(dtype), goff.to(dtype), gmask.to(dtype), gw.view(in.weight.sizes()).to(dtype), gb.to(dtype)};
}

}  // namespace dcn_v2_host
}  // namespace accel
