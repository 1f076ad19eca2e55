// Fused Adam / AdamW step on CUDA: a multi-tensor kernel.
//
// One update launch covers a dtype group of up to kMaxTensors tensors: their device pointers, sizes
// and the prefix sum of their chunk counts travel in the kernel-argument struct (no metadata copy, no
// host sync). Each block takes chunks of `chunk_size` elements in a grid-stride loop and finds a
// chunk's tensor by binary search over the prefix sums (uniform across the block, served by the
// constant cache), so one launch covers any number of chunks. With CUDA >= 12.1, a driver >= 530 and
// Volta or newer, kernels may take 32 KB of arguments and kMaxTensors is several hundred: one launch
// per dtype for any real model. Otherwise the 4 KB limit allows 32 tensors a launch.
//
// The update kernels take `*step + 1` as the step of the bias corrections; one advance kernel after
// all of them (same stream) increments every step counter of every dtype.
//
// found_inf and grad_scale are read from device memory: a non-zero found_inf returns before any
// write, so a skipped step never waits for the host. All sizes and offsets are int64.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>
#include <torch/types.h>

#include "fused_adam_host.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace accel {
namespace {

constexpr int kThreads = 256;

// Kernel-argument capacity. 4 KB is the classic limit; CUDA 12.1 raised it to 32764 bytes on Volta
// and newer with a driver >= 530. A binary built against 12.1+ may still meet an older driver
// (minor-version compatibility), so both capacities are built and the driver version picks one at
// run time. A pre-Volta target cannot compile a kernel with large arguments at all: when any
// compiled architecture is older, the "large" capacities equal the small ones.
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12010 && defined(__CUDA_ARCH_LIST__)
constexpr int kCompiledArchs[] = {__CUDA_ARCH_LIST__};
constexpr bool all_volta_or_newer() {
  for (const int arch : kCompiledArchs) {
    if (arch < 700) return false;
  }
  return true;
}
constexpr bool kHaveLargeArgs = all_volta_or_newer();
#else
constexpr bool kHaveLargeArgs = false;
#endif

constexpr int kMaxTensorsSmall = 32;
constexpr int kMaxStepsSmall = 480;
constexpr int kMaxTensorsLarge = kHaveLargeArgs ? 480 : kMaxTensorsSmall;
constexpr int kMaxStepsLarge = kHaveLargeArgs ? 3968 : kMaxStepsSmall;

// The non-empty tensors of one update launch, all of one dtype (64 bytes a tensor).
template <int N>
struct TensorListMeta {
  void* p[N];
  const void* g[N];
  void* m[N];
  void* v[N];
  void* vm[N];
  const float* step[N];
  int64_t numel[N];
  int64_t chunk_start[N + 1];  // chunk_start[t]: first chunk of tensor t; [n]: total
  int n;
};

// The step counters of one advance launch.
template <int N>
struct StepList {
  float* step[N];
  int n;
};

// What every block needs besides the tensor list. lr, grad_scale and found_inf may live in device
// memory (read there, never by the host).
struct AdamArgs {
  fused_adam_host::Hyper h;
  double lr;
  const double* lr_ptr;       // device lr when the user passed a device tensor, else null
  const float* grad_scale;    // null: grads are not scaled
  const float* found_inf;     // null: never skip
  int64_t chunk_size;
  bool amsgrad;
};

// Bytes of kernel parameters (A, B), with the padding between them.
template <typename A, typename B>
constexpr size_t args_bytes() {
  return (sizeof(A) + alignof(B) - 1) / alignof(B) * alignof(B) + sizeof(B);
}
static_assert(args_bytes<TensorListMeta<kMaxTensorsSmall>, AdamArgs>() <= 4000, "update args exceed 4 KB");
static_assert(args_bytes<StepList<kMaxStepsSmall>, const float*>() <= 4000, "advance args exceed 4 KB");
static_assert(args_bytes<TensorListMeta<kMaxTensorsLarge>, AdamArgs>() <= 32000, "update args exceed 32 KB");
static_assert(args_bytes<StepList<kMaxStepsLarge>, const float*>() <= 32000, "advance args exceed 32 KB");

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// The bytes of the accesses that move N elements of X: 16, or all N at once where they are fewer.
template <typename X, int N>
constexpr int kPieceBytes = N * sizeof(X) < 16 ? N * sizeof(X) : 16;

template <typename X, int N>
__device__ __forceinline__ bool aligned_for(const X* ptr) {
  return reinterpret_cast<uintptr_t>(ptr) % kPieceBytes<X, N> == 0;
}

// N elements between registers and an address aligned to kPieceBytes, in accesses of that many bytes (two
// 16-byte ones for 8 fp32 values: a 32-byte Pack would assume an alignment that views of allocations do not
// have).
template <typename X, int N>
__device__ __forceinline__ void load_pieces(X (&r)[N], const X* src) {
  constexpr int kPiece = kPieceBytes<X, N> / sizeof(X);
  static_assert(N % kPiece == 0, "whole pieces only");
#pragma unroll
  for (int i = 0; i < N / kPiece; ++i) {
    const Pack<X, kPiece> piece = reinterpret_cast<const Pack<X, kPiece>*>(src)[i];
#pragma unroll
    for (int j = 0; j < kPiece; ++j) r[i * kPiece + j] = piece.v[j];
  }
}

template <typename X, int N>
__device__ __forceinline__ void store_pieces(X* dst, const X (&r)[N]) {
  constexpr int kPiece = kPieceBytes<X, N> / sizeof(X);
  static_assert(N % kPiece == 0, "whole pieces only");
#pragma unroll
  for (int i = 0; i < N / kPiece; ++i) {
    Pack<X, kPiece> piece;
#pragma unroll
    for (int j = 0; j < kPiece; ++j) piece.v[j] = r[i * kPiece + j];
    reinterpret_cast<Pack<X, kPiece>*>(dst)[i] = piece;
  }
}

// One Adam step over the chunks of up to N tensors of one dtype. The per-element math is
// fused_adam_host::adam_element, the CPU kernel's own: both devices give the same bits (its
// rounding sequence is pinned against FMA contraction).
//
// Assumptions:
//  - blockDim == (kThreads, 1, 1) (the launch bounds).
//  - Any gridDim.x >= 1: blocks take chunks in a grid-stride loop. Chunk c belongs to the tensor t
//    with chunk_start[t] <= c < chunk_start[t + 1] and covers its elements from
//    (c - chunk_start[t]) * chunk_size on, at most chunk_size of them.
//  - meta.n >= 1, chunk_start[0] == 0 and chunk_start is non-decreasing.
//  - No alignment: a chunk whose p, g, m, v (and vm) are aligned for their accesses (kPieceBytes) takes kVec
//    elements a thread and iteration; any other chunk the scalar loop.
//  - state_t (m, v, vm) is the math type T, or scalar_t itself (compact state, torch.optim's layout):
//    widened to T on load, rounded on store.
//  - *step[t] holds the count before this step: the advance kernel, launched after every update
//    kernel on the same stream, increments it.
//  - kVariant kPlain / kPlainCoupled: no amsgrad and no grad_scale (the common AdamW and Adam steps), and
//    the weight decay is decoupled or none (kPlain) or Adam's L2 term (kPlainCoupled): all three are then
//    compile-time constants and their work (a division, the vmax conversions) is compiled out (H200: the
//    plain AdamW step 1.09-1.10x the general kernel, kernels_ab_cuda_h200_run3.json). kGeneral reads them
//    from `a`. The elements get the same bits in every variant.
enum Variant : int { kGeneral, kPlain, kPlainCoupled };
template <typename scalar_t, typename state_t, int N, int kVariant>
__global__ void __launch_bounds__(kThreads) fused_adam_kernel(const TensorListMeta<N> meta, const AdamArgs a) {
  constexpr bool kFixed = kVariant != kGeneral;  // amsgrad, grad_scale and coupled known at compile time
  using T = at::opmath_type<scalar_t>;
  using fused_adam_host::adam_element;
  // Elements a thread takes an iteration: 16 bytes of fp32/fp64 params; 4 of 16-bit ones (8 bytes of p and g, 16
  // of fp32 state), as fp32's packs: packs of 8 16-bit elements, whose next pack was loaded during this one's
  // math, held 69-80 registers a thread (3 blocks an SM) and ran at 49-70% of an H200's copy bandwidth where
  // fp32's packs of 4 (40 registers) reached 83-87% (kernels_cuda_h200_run5_fmha_adam.json); packs of 4 take
  // 38-42 registers in the plain kernels. To be A/B'd on the next GPU (against 3280faa).
  constexpr int kVec = sizeof(scalar_t) == 2 ? 4 : 16 / sizeof(scalar_t);
  if (a.found_inf != nullptr && *a.found_inf != 0.f) return;
  const bool coupled = kFixed ? kVariant == kPlainCoupled : a.h.coupled();
  const bool amsgrad = !kFixed && a.amsgrad;
  const double lr = a.lr_ptr != nullptr ? *a.lr_ptr : a.lr;
  const double scale = !kFixed && a.grad_scale != nullptr ? static_cast<double>(*a.grad_scale) : 1.0;
  const int64_t total = meta.chunk_start[meta.n];
  for (int64_t chunk = blockIdx.x; chunk < total; chunk += gridDim.x) {
    // The chunk's tensor by binary search: O(log n) a chunk, however many tensors the launch has.
    int t = 0;
    for (int hi = meta.n - 1; t < hi;) {
      const int mid = (t + hi + 1) / 2;
      if (meta.chunk_start[mid] <= chunk) t = mid;
      else hi = mid - 1;
    }
    const int64_t begin = (chunk - meta.chunk_start[t]) * a.chunk_size;
    const int64_t n = min(a.chunk_size, meta.numel[t] - begin);
    scalar_t* p = static_cast<scalar_t*>(meta.p[t]) + begin;
    const scalar_t* g = static_cast<const scalar_t*>(meta.g[t]) + begin;
    state_t* m = static_cast<state_t*>(meta.m[t]) + begin;
    state_t* v = static_cast<state_t*>(meta.v[t]) + begin;
    state_t* vm = amsgrad ? static_cast<state_t*>(meta.vm[t]) + begin : nullptr;
    // torch increments the count before the bias corrections; the counter itself advances later.
    const fused_adam_host::Coeffs<T> c =
        fused_adam_host::coeffs_for<T>(a.h, lr, scale, static_cast<double>(*meta.step[t] + 1.f));

    // A chunk of a view that starts mid-vector takes the scalar loop below for all its elements.
    const bool vec = aligned_for<scalar_t, kVec>(p) && aligned_for<scalar_t, kVec>(g) && aligned_for<state_t, kVec>(m) &&
                     aligned_for<state_t, kVec>(v) && (vm == nullptr || aligned_for<state_t, kVec>(vm));
    int64_t done = 0;
    if (vec) {
      const int64_t packs = n / kVec;
      // One pack's update from its loaded values, stored back at element i.
      const auto update = [&](int64_t i, scalar_t(&pr)[kVec], const scalar_t(&gr)[kVec], state_t(&mr)[kVec],
                              state_t(&vr)[kVec], state_t(&xr)[kVec]) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          T pj = static_cast<T>(pr[j]), mj = static_cast<T>(mr[j]), vj = static_cast<T>(vr[j]);
          T xj = static_cast<T>(xr[j]);
          adam_element<T>(pj, static_cast<T>(gr[j]), mj, vj, xj, c, amsgrad, coupled, kFixed);
          pr[j] = static_cast<scalar_t>(pj);
          mr[j] = static_cast<state_t>(mj);
          vr[j] = static_cast<state_t>(vj);
          xr[j] = static_cast<state_t>(xj);
        }
        store_pieces(p + i, pr);
        store_pieces(m + i, mr);
        store_pieces(v + i, vr);
        if (vm != nullptr) store_pieces(vm + i, xr);
      };
      for (int64_t k = threadIdx.x; k < packs; k += blockDim.x) {
        const int64_t i = k * kVec;
        scalar_t pr[kVec], gr[kVec];
        state_t mr[kVec], vr[kVec], xr[kVec] = {};
        load_pieces(pr, p + i);
        load_pieces(gr, g + i);
        load_pieces(mr, m + i);
        load_pieces(vr, v + i);
        if (vm != nullptr) load_pieces(xr, vm + i);
        update(i, pr, gr, mr, vr, xr);
      }
      done = packs * kVec;
    }
    for (int64_t i = done + threadIdx.x; i < n; i += blockDim.x) {
      T pi = static_cast<T>(p[i]);
      T mi = static_cast<T>(m[i]), vi = static_cast<T>(v[i]);
      T xi = vm != nullptr ? static_cast<T>(vm[i]) : T(0);
      adam_element<T>(pi, static_cast<T>(g[i]), mi, vi, xi, c, amsgrad, coupled, kFixed);
      p[i] = static_cast<scalar_t>(pi);
      m[i] = static_cast<state_t>(mi);
      v[i] = static_cast<state_t>(vi);
      if (vm != nullptr) vm[i] = static_cast<state_t>(xi);
    }
  }
}

// Increments the step counters of a whole fused_adam_step call, every dtype at once.
//
// Assumptions:
//  - One thread a counter: 1-D blocks and grid with blockDim.x * gridDim.x >= list.n; extra
//    threads do nothing.
//  - Launched after every update kernel that reads these counters, on the same stream.
//  - The counters are distinct tensors (one increment each, no atomics).
template <int N>
__global__ void __launch_bounds__(kThreads) advance_steps_kernel(const StepList<N> list, const float* found_inf) {
  if (found_inf != nullptr && *found_inf != 0.f) return;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < list.n) *list.step[i] += 1.f;
}

// Whether kernels with up to 32 KB of arguments can launch here (see kHaveLargeArgs).
bool large_args_ok() {
  if (!kHaveLargeArgs) return false;
  static const bool driver_ok = [] {
    int version = 0;
    return cudaDriverGetVersion(&version) == cudaSuccess && version >= 12010;
  }();
  return driver_ok && at::cuda::getCurrentDeviceProperties()->major >= 7;
}

using namespace fused_adam_host;

// The update launches of one dtype group: `idx` lists its non-empty tensors, N a launch; `compact`: their
// state is in the param dtype.
template <int N>
void launch_updates(at::ScalarType dt, bool compact, const std::vector<size_t>& idx, const std::vector<Work>& work,
                    const std::vector<float*>& steps, const AdamArgs& a, int64_t max_blocks, cudaStream_t stream) {
  for (size_t i = 0; i < idx.size();) {
    TensorListMeta<N> meta{};
    for (; i < idx.size() && meta.n < N; ++i) {
      const Work& w = work[idx[i]];
      const int k = meta.n++;
      meta.p[k] = w.p.data_ptr();
      meta.g[k] = w.g.const_data_ptr();
      meta.m[k] = w.m.data_ptr();
      meta.v[k] = w.v.data_ptr();
      meta.vm[k] = a.amsgrad ? w.vm.data_ptr() : nullptr;
      meta.step[k] = steps[idx[i]];
      meta.numel[k] = w.p.numel();
      meta.chunk_start[k + 1] = meta.chunk_start[k] + chunk_count(w.p.numel(), a.chunk_size);
    }
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(meta.chunk_start[meta.n], max_blocks));
    const Variant variant = a.amsgrad || a.grad_scale != nullptr ? kGeneral
                            : a.h.coupled()                         ? kPlainCoupled
                                                                    : kPlain;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dt, "fused_adam_step_cuda", [&] {
      const auto launch = [&](auto state) {
        using state_t = decltype(state);
        if (variant == kPlain)
          fused_adam_kernel<scalar_t, state_t, N, kPlain><<<blocks, kThreads, 0, stream>>>(meta, a);
        else if (variant == kPlainCoupled)
          fused_adam_kernel<scalar_t, state_t, N, kPlainCoupled><<<blocks, kThreads, 0, stream>>>(meta, a);
        else fused_adam_kernel<scalar_t, state_t, N, kGeneral><<<blocks, kThreads, 0, stream>>>(meta, a);
      };
      if (compact) launch(scalar_t());
      else launch(at::opmath_type<scalar_t>());
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// Advances every step counter, N a launch: one launch for any real model.
template <int N>
void launch_advance(const std::vector<float*>& steps, const float* found_inf, cudaStream_t stream) {
  for (size_t i = 0; i < steps.size();) {
    StepList<N> list{};
    for (; i < steps.size() && list.n < N; ++i) list.step[list.n++] = steps[i];
    const unsigned blocks = static_cast<unsigned>((list.n + kThreads - 1) / kThreads);
    advance_steps_kernel<N><<<blocks, kThreads, 0, stream>>>(list, found_inf);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

void fused_adam_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                          at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList steps,
                          double lr, const std::optional<at::Tensor>& lr_tensor, double beta1, double beta2,
                          double eps, double weight_decay, bool amsgrad, bool maximize,
                          bool decoupled_weight_decay, const std::optional<at::Tensor>& grad_scale,
                          const std::optional<at::Tensor>& found_inf, int64_t chunk_size) {
  check_lists(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, amsgrad, chunk_size);
  const size_t n = params.size();
  if (n == 0) return;
  const auto device = params[0].device();
  c10::cuda::CUDAGuard guard(device);
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK(params[i].device() == device && grads[i].device() == device && exp_avgs[i].device() == device &&
                    exp_avg_sqs[i].device() == device && steps[i].device() == device &&
                    (!amsgrad || max_exp_avg_sqs[i].device() == device),
                "fused_adam_step: every tensor must be on ", device, " (params[", i, "] or its state is not)");
    const int64_t chunks = chunk_count(params[i].numel(), chunk_size);
    TORCH_CHECK(chunks < (int64_t(1) << 40), "fused_adam_step: chunk_size ", chunk_size, " is too small");
  }

  // Flags and a device lr as device scalars of the kernel's types; these copies are asynchronous.
  auto device_scalar = [&](const std::optional<at::Tensor>& t, at::ScalarType dt) -> at::Tensor {
    if (!t.has_value() || !t->defined()) return at::Tensor();
    TORCH_CHECK(t->numel() == 1, "fused_adam_step: grad_scale, found_inf and lr_tensor must have one element");
    return t->reshape({}).to(device, dt, /*non_blocking=*/true);
  };
  at::Tensor lr_dev, scale_dev = device_scalar(grad_scale, at::kFloat), inf_dev = device_scalar(found_inf, at::kFloat);
  if (lr_tensor.has_value() && lr_tensor->defined()) {
    if (lr_tensor->is_cpu()) lr = lr_tensor->item<double>();  // a host value: no device sync
    else lr_dev = device_scalar(lr_tensor, at::kDouble);
  }

  AdamArgs a{};
  a.h = Hyper{beta1, beta2, eps, weight_decay, decoupled_weight_decay, maximize};
  a.lr = lr;
  a.lr_ptr = lr_dev.defined() ? lr_dev.const_data_ptr<double>() : nullptr;
  a.grad_scale = scale_dev.defined() ? scale_dev.const_data_ptr<float>() : nullptr;
  a.found_inf = inf_dev.defined() ? inf_dev.const_data_ptr<float>() : nullptr;
  a.chunk_size = chunk_size;
  a.amsgrad = amsgrad;

  // Strided tensors go through contiguous copies written back at the end.
  const std::vector<Work> work = make_work(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, amsgrad);
  std::vector<float*> step_ptrs(n);
  for (size_t i = 0; i < n; ++i) step_ptrs[i] = steps[i].mutable_data_ptr<float>();

  auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t max_blocks = at::cuda::getCurrentDeviceProperties()->multiProcessorCount * int64_t(8);
  const bool large = large_args_ok();
  const at::ScalarType dtypes[] = {at::kFloat, at::kHalf, at::kBFloat16, at::kDouble};
  for (const auto dt : dtypes) {
    for (const bool compact : {false, true}) {  // fp32/fp64 state is the param dtype: never "compact"
      std::vector<size_t> idx;  // empty tensors have no chunks; only their steps advance, as in torch
      for (size_t i = 0; i < n; ++i) {
        const bool in_dtype = exp_avgs[i].scalar_type() == dt && state_dtype_for(dt) != dt;
        if (params[i].scalar_type() == dt && in_dtype == compact && params[i].numel() > 0) idx.push_back(i);
      }
      if (idx.empty()) continue;
      if (large) launch_updates<kMaxTensorsLarge>(dt, compact, idx, work, step_ptrs, a, max_blocks, stream);
      else launch_updates<kMaxTensorsSmall>(dt, compact, idx, work, step_ptrs, a, max_blocks, stream);
    }
  }
  // After every update launch, which read the counts before this step.
  if (large) launch_advance<kMaxStepsLarge>(step_ptrs, a.found_inf, stream);
  else launch_advance<kMaxStepsSmall>(step_ptrs, a.found_inf, stream);

  write_back(work, params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, amsgrad);
}

}  // namespace

TORCH_LIBRARY_IMPL(accel, CUDA, m) {
  m.impl("fused_adam_step", &fused_adam_step_cuda);
}

}  // namespace accel
