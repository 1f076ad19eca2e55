// Non-maximum suppression on CUDA: hard NMS (torchvision semantics) and soft-NMS (mmcv semantics,
// optionally per class). Box geometry, decay weights, tie order and argument checks come from
// csrc/nms_host.h, shared with csrc/cpu/nms.cpp, so both kernels select the same boxes (products
// there are __fmul_rn/__dmul_rn on the device: never fused into an FMA).
//
// Hard NMS, the bitmask method:
//   1. sort by score (stable, descending) and gather the boxes in that order;
//   2. nms_mask_kernel: one 64-thread block per (row block, column block) pair with column >= row;
//      thread r writes a 64-bit word whose bit c says "box row_start+r suppresses col_start+c";
//   3. nms_keep_kernel: one block walks the row blocks in order. For each block of 64 boxes it
//      first resolves which of them survive (a sequential 64-step pass over the diagonal words,
//      held in shared memory), then every thread ORs the kept rows into the "removed" words it
//      owns. No mask leaves the device; the only host sync is the size of the result.
//   Mask words with column block < row block are never written and never read.
// Soft-NMS: one block loops over selections; each round decays the live boxes in parallel and
// finds the next (score, lowest index) maximum with a block reduction in the same pass.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "nms_host.h"

#include <algorithm>
#include <cstdint>

namespace accel {
namespace {

using namespace nms_host;

constexpr int kBoxesPerBlock = 64;  // bits in a mask word
constexpr int kMaxGridY = 65535;

__host__ __device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// ------------------------------------------------------------------------------- hard NMS

template <typename T>
__global__ void nms_mask_kernel(const T* __restrict__ boxes, int64_t n, double iou_threshold,
                                unsigned long long* __restrict__ mask, int64_t col_blocks) {
  const int64_t row_block = blockIdx.x;
  const int64_t col_block = blockIdx.y;
  if (col_block < row_block) return;  // only later boxes can be suppressed
  const int64_t row_start = row_block * kBoxesPerBlock;
  const int64_t col_start = col_block * kBoxesPerBlock;
  const int rows = static_cast<int>(min64(n - row_start, kBoxesPerBlock));
  const int cols = static_cast<int>(min64(n - col_start, kBoxesPerBlock));

  __shared__ T col_box[kBoxesPerBlock][5];
  const int t = threadIdx.x;
  if (t < cols) {
    const T* b = boxes + (col_start + t) * 4;
    col_box[t][0] = b[0];
    col_box[t][1] = b[1];
    col_box[t][2] = b[2];
    col_box[t][3] = b[3];
    col_box[t][4] = box_area(b[0], b[1], b[2], b[3]);
  }
  __syncthreads();
  if (t >= rows) return;

  const T* b = boxes + (row_start + t) * 4;
  const T x1 = b[0], y1 = b[1], x2 = b[2], y2 = b[3];
  const T area = box_area(x1, y1, x2, y2);
  unsigned long long bits = 0;
  for (int c = (row_block == col_block) ? t + 1 : 0; c < cols; ++c) {
    const T inter = intersection(x1, y1, x2, y2, col_box[c][0], col_box[c][1], col_box[c][2], col_box[c][3]);
    if (suppresses(inter, area, col_box[c][4], iou_threshold)) bits |= 1ULL << c;
  }
  mask[(row_start + t) * col_blocks + col_block] = bits;
}

// One block. Word j of `removed` (boxes j*64 .. j*64+63 already suppressed) is owned by thread
// j % blockDim.x: only it writes the word, so kept rows can be OR-ed in without atomics; the
// __syncthreads at the top of each round publishes the owner's writes before the word is read.
__global__ void nms_keep_kernel(const unsigned long long* __restrict__ mask, int64_t n, int64_t col_blocks,
                                unsigned long long* __restrict__ removed, bool* __restrict__ keep) {
  __shared__ unsigned long long diag[kBoxesPerBlock];
  const int t = threadIdx.x;
  const int64_t threads = blockDim.x;
  for (int64_t j = t; j < col_blocks; j += threads) removed[j] = 0;

  for (int64_t nb = 0; nb < col_blocks; ++nb) {
    const int64_t base = nb * kBoxesPerBlock;
    const int cnt = static_cast<int>(min64(n - base, kBoxesPerBlock));
    if (t < cnt) diag[t] = mask[(base + t) * col_blocks + nb];
    __syncthreads();
    // Every thread resolves the block redundantly (shared-memory broadcasts), so all agree on
    // `kept` without another barrier.
    unsigned long long gone = removed[nb];
    unsigned long long kept = 0;
    for (int b = 0; b < cnt; ++b) {
      if (!((gone >> b) & 1ULL)) {
        kept |= 1ULL << b;
        gone |= diag[b];
      }
    }
    if (t < cnt) keep[base + t] = (kept >> t) & 1ULL;
    // First owned word after nb.
    int64_t j = t;
    if (j <= nb) j += ((nb - j) / threads + 1) * threads;
    for (; j < col_blocks; j += threads) {
      unsigned long long acc = removed[j];
      for (unsigned long long rest = kept; rest; rest &= rest - 1) {
        const int b = __ffsll(static_cast<long long>(rest)) - 1;
        acc |= mask[(base + b) * col_blocks + j];
      }
      removed[j] = acc;
    }
    __syncthreads();  // diag is rewritten next round
  }
}

at::Tensor nms_cuda(const at::Tensor& boxes_, const at::Tensor& scores_, double iou_threshold) {
  check_boxes_scores(boxes_, scores_, "nms");
  c10::cuda::CUDAGuard guard(boxes_.device());
  const int64_t n = boxes_.size(0);
  if (n == 0) return at::empty({0}, boxes_.options().dtype(at::kLong));
  const int64_t col_blocks = (n + kBoxesPerBlock - 1) / kBoxesPerBlock;
  TORCH_CHECK(col_blocks <= kMaxGridY, "nms: at most ", int64_t(kMaxGridY) * kBoxesPerBlock,
              " boxes are supported on CUDA, got ", n);

  const ByScore visit = by_score(boxes_, scores_);
  const at::Tensor &order = visit.order, &sorted = visit.boxes;
  at::Tensor mask = at::empty({n * col_blocks}, boxes_.options().dtype(at::kLong));
  at::Tensor removed = at::empty({col_blocks}, boxes_.options().dtype(at::kLong));
  at::Tensor keep = at::empty({n}, boxes_.options().dtype(at::kBool));
  auto stream = at::cuda::getCurrentCUDAStream();
  auto* mask_ptr = reinterpret_cast<unsigned long long*>(mask.mutable_data_ptr<int64_t>());

  AT_DISPATCH_FLOATING_TYPES(sorted.scalar_type(), "nms_cuda", [&] {
    const dim3 grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>(col_blocks));
    nms_mask_kernel<scalar_t><<<grid, kBoxesPerBlock, 0, stream>>>(sorted.const_data_ptr<scalar_t>(), n,
                                                                 iou_threshold, mask_ptr, col_blocks);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // Enough threads to own every word, in whole warps; at least 64 to load a diagonal block.
  const int threads = static_cast<int>(std::min<int64_t>(1024, std::max<int64_t>(64, (col_blocks + 31) / 32 * 32)));
  nms_keep_kernel<<<1, threads, 0, stream>>>(mask_ptr, n, col_blocks,
                                             reinterpret_cast<unsigned long long*>(removed.mutable_data_ptr<int64_t>()),
                                             keep.mutable_data_ptr<bool>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return order.masked_select(keep);
}

// ------------------------------------------------------------------------------- soft-NMS

constexpr int kSoftThreads = 1024;

// (score, index) with index < 0 meaning "none"; otherwise the CPU kernel's order (ranks_before).
template <typename T>
__device__ __forceinline__ bool better(T s, int64_t i, T bs, int64_t bi) {
  if (i < 0) return false;
  return bi < 0 || ranks_before(s, i, bs, bi);
}

// Argmax over the 32 lanes of a warp; lane 0 ends with the warp's best. Lanes whose partner is
// out of range get their own value back and keep it (better(x, x) is false).
template <typename T>
__device__ __forceinline__ void warp_argmax(T& s, int64_t& i) {
  for (int off = 16; off > 0; off >>= 1) {
    const T os = __shfl_down_sync(0xffffffffu, s, off);
    const int64_t oi = __shfl_down_sync(0xffffffffu, i, off);
    if (better(os, oi, s, i)) {
      s = os;
      i = oi;
    }
  }
}

// Block-wide argmax; every thread gets the result. Needs blockDim.x a multiple of 32 (at most
// 1024) with every thread calling it. Two barriers; safe to call back to back: the next call
// rewrites warp_s/best_s only after its first barrier, which every thread reaches after it has
// read this call's result.
template <typename T>
__device__ void block_argmax(T& s, int64_t& i, T* warp_s, int64_t* warp_i, T* best_s, int64_t* best_i) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  warp_argmax(s, i);
  if (lane == 0) {
    warp_s[warp] = s;
    warp_i[warp] = i;
  }
  __syncthreads();
  if (warp == 0) {
    const int warps = blockDim.x >> 5;
    s = lane < warps ? warp_s[lane] : T(0);
    i = lane < warps ? warp_i[lane] : int64_t(-1);
    warp_argmax(s, i);
    if (lane == 0) {
      *best_s = s;
      *best_i = i;
    }
  }
  __syncthreads();
  s = *best_s;
  i = *best_i;
}

// Element i is only ever touched by thread i % blockDim.x, so `score` and `live` need no atomics.
template <typename T>
__global__ void __launch_bounds__(kSoftThreads)
    soft_nms_kernel(const T* __restrict__ boxes, T* __restrict__ score, const int64_t* __restrict__ labels,
                    uint8_t* __restrict__ live, int64_t n, T thr, T sigma, T min_score, int method,
                    int64_t* __restrict__ out_idx, T* __restrict__ out_score, int64_t* __restrict__ out_count) {
  __shared__ T warp_s[32];
  __shared__ int64_t warp_i[32];
  __shared__ T best_s;
  __shared__ int64_t best_i;
  const int64_t threads = blockDim.x;
  const T disjoint = disjoint_weight(static_cast<int64_t>(method), thr);

  T s = T(0);
  int64_t i = -1;
  for (int64_t p = threadIdx.x; p < n; p += threads) {
    const bool ok = score[p] >= min_score;  // also drops NaN scores
    live[p] = ok;
    if (ok && better(score[p], p, s, i)) {
      s = score[p];
      i = p;
    }
  }
  block_argmax(s, i, warp_s, warp_i, &best_s, &best_i);

  int64_t k = 0;
  while (i >= 0) {
    const int64_t sel = i;
    if (threadIdx.x == 0) {
      out_idx[k] = sel;
      out_score[k] = s;
    }
    ++k;
    const T* b = boxes + sel * 4;
    const T bx1 = b[0], by1 = b[1], bx2 = b[2], by2 = b[3];
    const T barea = box_area(bx1, by1, bx2, by2);
    const int64_t blabel = labels ? labels[sel] : 0;

    s = T(0);
    i = -1;
    for (int64_t p = threadIdx.x; p < n; p += threads) {
      if (!live[p]) continue;
      if (p == sel) {
        live[p] = 0;
        continue;
      }
      T sp = score[p];
      if (!labels || labels[p] == blabel) {
        const T* q = boxes + p * 4;
        const T inter = intersection(bx1, by1, bx2, by2, q[0], q[1], q[2], q[3]);
        const T weight =
            soft_weight(static_cast<int64_t>(method), inter, barea, box_area(q[0], q[1], q[2], q[3]), thr, sigma,
                        disjoint);
        if (weight != T(1)) {
          sp = mul_rn(sp, weight);
          score[p] = sp;
          if (!(sp >= min_score)) {  // also drops NaN
            live[p] = 0;
            continue;
          }
        }
      }
      if (better(sp, p, s, i)) {
        s = sp;
        i = p;
      }
    }
    block_argmax(s, i, warp_s, warp_i, &best_s, &best_i);
  }
  if (threadIdx.x == 0) *out_count = k;
}

std::tuple<at::Tensor, at::Tensor> soft_nms_cuda(const at::Tensor& boxes_, const at::Tensor& scores_,
                                                 const std::optional<at::Tensor>& labels_, double iou_threshold,
                                                 double sigma, double min_score, int64_t method) {
  // Checked before the guard: a CPU `boxes_` (with CUDA scores) must get the "must be on" message.
  const SoftNmsInputs in = soft_nms_inputs(boxes_, scores_, labels_, method);
  c10::cuda::CUDAGuard guard(boxes_.device());
  const int64_t n = in.n;
  const at::Tensor &b = in.boxes, &labels = in.labels;
  at::Tensor work = in.scores.clone();  // decayed in place; in.scores may be the caller's tensor
  at::Tensor live = at::empty({n}, b.options().dtype(at::kByte));
  at::Tensor inds = at::empty({n}, b.options().dtype(at::kLong));
  at::Tensor new_scores = at::empty({n}, b.options());
  at::Tensor count = at::zeros({1}, b.options().dtype(at::kLong));
  if (n == 0) return {inds, new_scores};
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(b.scalar_type(), "soft_nms_cuda", [&] {
    soft_nms_kernel<scalar_t><<<1, kSoftThreads, 0, stream>>>(
        b.const_data_ptr<scalar_t>(), work.mutable_data_ptr<scalar_t>(),
        labels.defined() ? labels.const_data_ptr<int64_t>() : nullptr, live.mutable_data_ptr<uint8_t>(), n,
        static_cast<scalar_t>(iou_threshold), static_cast<scalar_t>(sigma), static_cast<scalar_t>(min_score),
        static_cast<int>(method), inds.mutable_data_ptr<int64_t>(), new_scores.mutable_data_ptr<scalar_t>(),
        count.mutable_data_ptr<int64_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int64_t k = count.item<int64_t>();  // the one host sync: the output size
  return {inds.narrow(0, 0, k).clone(), new_scores.narrow(0, 0, k).clone()};
}

}  // namespace

TORCH_LIBRARY_IMPL(accel, CUDA, m) {
  m.impl("nms", &nms_cuda);
  m.impl("nms_soft", &soft_nms_cuda);
}

}  // namespace accel
