// Deformable convolution, DCNv1 and the modulated DCNv2 (torchvision.ops.deform_conv2d semantics), on
// CUDA. Schemas: csrc/cpu/dcn_v2.cpp. Checks, sampling arithmetic, batch chunking and the GEMMs
// (at::matmul over the whole chunk, cuBLAS batched): csrc/dcn_v2_host.h.
//
// The original dcn_v2 loops over the batch on the host, one im2col / col2im launch and one GEMM per
// sample. Here each direction is one sampling kernel over the whole chunk (normally the whole batch)
// and one batched GEMM per product. A thread owns one (sample, offset group, channel slice, tap,
// output pixel): it computes the sampling point once and walks the slice's channels, so a slice
// reuses its bilinear weights; consecutive threads take consecutive output pixels, so offset, mask
// and column accesses coalesce. The slices are as long as the grid allows while still filling the
// GPU. The backward is one kernel: grad_input by atomic adds (taps of different pixels share input
// pixels), grad_offset and grad_mask summed over the slice in registers, then stored (one slice per
// group) or atomically added (several), and the grad columns overwritten in place with the forward's
// columns for grad_weight's GEMM. float16/bfloat16 are read as such and computed in float32, and so are
// the backward's columns and GEMMs; the forward's columns and GEMM are float16/bfloat16 (tensor cores,
// float32 accumulation, as torchvision's), float32 and float64 stay in their own type.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/Atomic.cuh>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "dcn_v2_host.h"

#include <algorithm>
#include <cstdint>

namespace accel {
namespace {

using namespace dcn_v2_host;

constexpr int kThreads = 256;

// Columns per chunk (elements): 512 MiB of float32; below that a chunk is the whole batch of any
// usual layer (8 x 256 channels x 9 taps x 100x100 is 184M).
constexpr int64_t kMaxCols = int64_t(1) << 27;

// Work items for about two waves of fully occupied SMs; fewer items than that leave SMs idle, more
// only shorten the slices (more sampling-point arithmetic and offset atomics per channel).
int64_t slices_for(const Geometry& g, int64_t nb) {
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t want = sms * 2048 * 2;
  const int64_t per_slice = std::max<int64_t>(1, nb * g.G * g.K() * g.L());
  return (want + per_slice - 1) / per_slice;  // Geometry::shape clamps it to [1, C/G]
}

unsigned blocks_for(int64_t n) {
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, sms * 32));
}

// The work item `idx` of a chunk: sample b, b * G + offset group bg, channels [c0, c1), tap k, pixel l.
struct Item {
  int64_t b, bg, c0, c1, k, l;
};

// Assumptions:
// - called from the kernels below with 0 <= idx < nb * s.G * s.slices * s.K * s.L;
// - s.slices * s.slice_len >= s.Cg (Geometry::shape), so the slices cover every channel of a group.
__device__ __forceinline__ Item item_of(const Shape& s, int64_t idx) {
  Item it;
  it.l = idx % s.L;
  int64_t r = idx / s.L;
  it.k = r % s.K;
  r /= s.K;
  const int64_t slice = r % s.slices;
  it.bg = r / s.slices;
  const int64_t g = it.bg % s.G;
  it.b = it.bg / s.G;
  it.c0 = g * s.Cg + slice * s.slice_len;
  const int64_t end = (g + 1) * s.Cg;
  it.c1 = it.c0 + s.slice_len < end ? it.c0 + s.slice_len : end;
  return it;
}

// cols[b, c*K + k, l] = mask * bilinear(x[b, c], tap k of pixel l), computed in acc_t, stored as col_t.
//
// Assumptions:
// - 1-D grid of 1-D blocks of kThreads threads, any number of blocks: a grid-stride loop covers the
//   n = nb * s.G * s.slices * s.K * s.L work items (n > 0);
// - x [nb, s.C, s.H, s.W], off [nb, s.G * 2 * s.K, s.L], mask [nb, s.G * s.K, s.L] or null, cols
//   [nb, s.C * s.K, s.L]: contiguous, on the current device, each starting at the chunk's first
//   sample; cols does not overlap the inputs;
// - every element of cols is written exactly once (by the thread owning its channel's slice).
template <typename scalar_t, typename acc_t, typename col_t>
__global__ void __launch_bounds__(kThreads)
    im2col_kernel(Shape s, int64_t n, const scalar_t* __restrict__ x, const scalar_t* __restrict__ off,
                  const scalar_t* __restrict__ mask, col_t* __restrict__ cols) {
  const int64_t KL = s.K * s.L, HW = s.H * s.W;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < n;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const Item it = item_of(s, idx);
    const Tap<acc_t> t = tap_at<acc_t>(s, off + it.bg * 2 * KL, it.k, it.l);
    col_t* col = cols + it.b * s.C * KL + it.k * s.L + it.l;
    const scalar_t* x_b = x + it.b * s.C * HW;
    if (!t.inside) {
      for (int64_t c = it.c0; c < it.c1; ++c) col[c * KL] = col_t(0);
      continue;
    }
    const acc_t m = mask ? static_cast<acc_t>(mask[it.bg * KL + it.k * s.L + it.l]) : acc_t(1);
    const Weights<acc_t> wt = weights_of(t);
    if (t.interior()) {
      for (int64_t c = it.c0; c < it.c1; ++c) {
        col[c * KL] = static_cast<col_t>(m * interpolate(corners_interior<acc_t>(x_b + c * HW, t, s.W), wt));
      }
    } else {
      for (int64_t c = it.c0; c < it.c1; ++c) {
        col[c * KL] = static_cast<col_t>(m * interpolate(corners<acc_t>(x_b + c * HW, t), wt));
      }
    }
  }
}

// From the grad columns: grad_input (atomic adds), grad_offset and grad_mask (sums over the slice),
// and the forward's columns written over the grad columns.
//
// Assumptions:
// - launch and x, off, mask as for im2col_kernel;
// - gcols [nb, s.C * s.K, s.L]: the grad columns on entry, the forward's columns on exit; each
//   element is read, then written, by the one thread owning its channel's slice, so in place is safe;
// - gi [nb, s.C, s.H, s.W]: zero-initialised (or holding earlier sums) by the caller; threads add
//   into it atomically, since the taps of neighbouring pixels sample the same input pixels;
// - goff [nb, s.G * 2 * s.K, s.L], gmask [nb, s.G * s.K, s.L] or null (exactly when mask is null):
//   with s.slices == 1 every element is stored once, whatever it held; with s.slices > 1 the caller
//   has zeroed them and each slice adds its partial sum atomically;
// - none of the outputs overlaps another or an input.
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads)
    col2im_kernel(Shape s, int64_t n, const scalar_t* __restrict__ x, const scalar_t* __restrict__ off,
                  const scalar_t* __restrict__ mask, acc_t* __restrict__ gcols, acc_t* __restrict__ gi,
                  acc_t* __restrict__ goff, acc_t* __restrict__ gmask) {
  const int64_t KL = s.K * s.L, HW = s.H * s.W;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < n;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const Item it = item_of(s, idx);
    const Tap<acc_t> t = tap_at<acc_t>(s, off + it.bg * 2 * KL, it.k, it.l);
    acc_t* col = gcols + it.b * s.C * KL + it.k * s.L + it.l;
    acc_t gy = 0, gx = 0, gm = 0;
    if (!t.inside) {
      for (int64_t c = it.c0; c < it.c1; ++c) col[c * KL] = acc_t(0);
    } else {
      const scalar_t* x_b = x + it.b * s.C * HW;
      acc_t* gi_b = gi + it.b * s.C * HW;
      const acc_t m = mask ? static_cast<acc_t>(mask[it.bg * KL + it.k * s.L + it.l]) : acc_t(1);
      const Weights<acc_t> wt = weights_of(t);
      const bool interior = t.interior();
      for (int64_t c = it.c0; c < it.c1; ++c) {
        const acc_t gc = col[c * KL];
        const scalar_t* plane = x_b + c * HW;
        const Corners<acc_t> v = interior ? corners_interior<acc_t>(plane, t, s.W) : corners<acc_t>(plane, t);
        const acc_t val = interpolate(v, wt);
        const acc_t gcm = gc * m;
        gm += gc * val;
        gy += gcm * d_dy(v, t);
        gx += gcm * d_dx(v, t);
        acc_t* gp = gi_b + c * HW;
        if (t.y0ok && t.x0ok) gpuAtomicAdd(gp + t.i00, gcm * wt.w00);
        if (t.y0ok && t.x1ok) gpuAtomicAdd(gp + t.i01, gcm * wt.w01);
        if (t.y1ok && t.x0ok) gpuAtomicAdd(gp + t.i10, gcm * wt.w10);
        if (t.y1ok && t.x1ok) gpuAtomicAdd(gp + t.i11, gcm * wt.w11);
        col[c * KL] = m * val;
      }
    }
    acc_t* oy = goff + it.bg * 2 * KL + 2 * it.k * s.L + it.l;
    acc_t* ox = oy + s.L;
    acc_t* om = gmask ? gmask + it.bg * KL + it.k * s.L + it.l : nullptr;
    if (s.slices == 1) {
      *oy = gy;
      *ox = gx;
      if (om) *om = gm;
    } else if (t.inside) {  // outside, every partial is 0 and the zeroed outputs stay right
      gpuAtomicAdd(oy, gy);
      gpuAtomicAdd(ox, gx);
      if (om) gpuAtomicAdd(om, gm);
    }
  }
}

template <typename scalar_t>
const scalar_t* chunk_ptr(const at::Tensor& t, int64_t b0) {
  return t.defined() ? t.const_data_ptr<scalar_t>() + b0 * (t.numel() / t.size(0)) : nullptr;
}

at::Tensor dcn_v2_fwd_cuda(const at::Tensor& input, const at::Tensor& offset, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& mask,
                           at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation) {
  c10::cuda::CUDAGuard guard(input.device());
  const Inputs in = prepare("dcn_v2_fwd", input, offset, weight, bias, mask, stride, padding, dilation);
  const Geometry& g = in.g;
  // float16/bfloat16 columns for a tensor-core GEMM (see forward); float32/float64 as they are
  const at::ScalarType dt = input.scalar_type();
  return forward(in, kMaxCols, dt, [&](int64_t b0, int64_t nb, at::Tensor& cols) {
    const Shape s = g.shape(slices_for(g, nb));
    const int64_t n = nb * s.G * s.slices * s.K * s.L;
    auto stream = at::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dt, "dcn_v2_fwd_cuda", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      im2col_kernel<scalar_t, acc_t, scalar_t><<<blocks_for(n), kThreads, 0, stream>>>(
          s, n, chunk_ptr<scalar_t>(in.input, b0), chunk_ptr<scalar_t>(in.offset, b0),
          chunk_ptr<scalar_t>(in.mask, b0), cols.mutable_data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> dcn_v2_bwd_cuda(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& offset, const at::Tensor& weight,
    const std::optional<at::Tensor>& mask, at::IntArrayRef stride, at::IntArrayRef padding,
    at::IntArrayRef dilation) {
  c10::cuda::CUDAGuard guard(input.device());
  // grad_input (and, over several slices, grad_offset/grad_mask) sum in whatever order the atomics land
  // (as torchvision's CUDA deform_conv2d backward): refused under torch.use_deterministic_algorithms(True)
  at::globalContext().alertNotDeterministic("dcn_v2_bwd_cuda");
  const Inputs in = prepare("dcn_v2_bwd", input, offset, weight, std::nullopt, mask, stride, padding, dilation);
  const Geometry& g = in.g;
  return backward(in, grad_output, kMaxCols,
                  [&](int64_t b0, int64_t nb, at::Tensor& gcols, at::Tensor& gi, at::Tensor& goff, at::Tensor& gmask) {
    const Shape s = g.shape(slices_for(g, nb));
    const int64_t n = nb * s.G * s.slices * s.K * s.L;
    const bool with_mask = in.mask.defined();
    at::Tensor goff_c = goff.narrow(0, b0, nb);
    at::Tensor gmask_c = with_mask ? gmask.narrow(0, b0, nb) : gmask;
    if (s.slices > 1) {  // the slices add into them
      goff_c.zero_();
      if (with_mask) gmask_c.zero_();
    }
    auto stream = at::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, in.input.scalar_type(), "dcn_v2_bwd_cuda", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      col2im_kernel<scalar_t, acc_t><<<blocks_for(n), kThreads, 0, stream>>>(
          s, n, chunk_ptr<scalar_t>(in.input, b0), chunk_ptr<scalar_t>(in.offset, b0),
          chunk_ptr<scalar_t>(in.mask, b0), gcols.mutable_data_ptr<acc_t>(),
          gi.mutable_data_ptr<acc_t>() + b0 * g.C * g.H * g.W, goff_c.mutable_data_ptr<acc_t>(),
          with_mask ? gmask_c.mutable_data_ptr<acc_t>() : nullptr);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(accel, CUDA, m) {
  m.impl("dcn_v2_fwd", &dcn_v2_fwd_cuda);
  m.impl("dcn_v2_bwd", &dcn_v2_bwd_cuda);
}

}  // namespace accel
