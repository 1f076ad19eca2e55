// Fused Adam / AdamW step on CUDA: a multi-tensor kernel.
//
// One launch covers up to kMaxTensors tensors of one dtype: their device pointers, sizes and the
// prefix sum of their chunk counts travel in the kernel-argument struct (no metadata copy, no host
// sync). Each block takes chunks of `chunk_size` elements in a grid-stride loop and finds the chunk's
// tensor by scanning the prefix sums (uniform across the block, served by the constant cache), so
// one launch can cover any number of chunks. A group of T tensors takes ceil(T / kMaxTensors)
// launches plus as many one-block launches that advance the step counters.
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

#include <cstdint>
#include <vector>

namespace accel {
namespace {

constexpr int kMaxTensors = 32;   // keeps TensorListMeta ~2 KB, well under the 4 KB argument limit
constexpr int kThreads = 256;
constexpr int kILP = 4;           // elements per thread per iteration: 16-byte loads for fp32

struct TensorListMeta {
  void* p[kMaxTensors];
  const void* g[kMaxTensors];
  void* m[kMaxTensors];
  void* v[kMaxTensors];
  void* vm[kMaxTensors];
  float* step[kMaxTensors];
  int64_t numel[kMaxTensors];
  int64_t chunk_start[kMaxTensors + 1];  // chunk_start[t]: first chunk of tensor t; [n]: total
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

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <typename P>
__device__ __forceinline__ bool aligned_for(const void* ptr) {
  return reinterpret_cast<uintptr_t>(ptr) % (sizeof(P) * kILP) == 0;
}

// The per-element math is fused_adam_host::adam_element, the CPU kernel's own: both devices give
// the same bits (its rounding sequence is pinned against FMA contraction).
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) fused_adam_kernel(const TensorListMeta meta, const AdamArgs a) {
  using T = at::opmath_type<scalar_t>;
  using fused_adam_host::adam_element;
  if (a.found_inf != nullptr && *a.found_inf != 0.f) return;
  const bool coupled = a.h.coupled();
  const double lr = a.lr_ptr != nullptr ? *a.lr_ptr : a.lr;
  const double scale = a.grad_scale != nullptr ? static_cast<double>(*a.grad_scale) : 1.0;
  const int64_t total = meta.chunk_start[meta.n];
  int t = 0;  // a block's chunks only grow, so the tensor search resumes where it stopped
  for (int64_t chunk = blockIdx.x; chunk < total; chunk += gridDim.x) {
    while (chunk >= meta.chunk_start[t + 1]) ++t;
    const int64_t begin = (chunk - meta.chunk_start[t]) * a.chunk_size;
    const int64_t n = min(a.chunk_size, meta.numel[t] - begin);
    scalar_t* p = static_cast<scalar_t*>(meta.p[t]) + begin;
    const scalar_t* g = static_cast<const scalar_t*>(meta.g[t]) + begin;
    T* m = static_cast<T*>(meta.m[t]) + begin;
    T* v = static_cast<T*>(meta.v[t]) + begin;
    T* vm = a.amsgrad ? static_cast<T*>(meta.vm[t]) + begin : nullptr;
    const fused_adam_host::Coeffs<T> c =
        fused_adam_host::coeffs_for<T>(a.h, lr, scale, static_cast<double>(*meta.step[t]));

    // 16-byte accesses (8 for half/bfloat16 params) when every pointer of the chunk allows them;
    // a chunk of a view that starts mid-vector takes the scalar loop below for all its elements.
    const bool vec = aligned_for<scalar_t>(p) && aligned_for<scalar_t>(g) && aligned_for<T>(m) &&
                     aligned_for<T>(v) && (vm == nullptr || aligned_for<T>(vm));
    int64_t done = 0;
    if (vec) {
      const int64_t packs = n / kILP;
      for (int64_t k = threadIdx.x; k < packs; k += blockDim.x) {
        Pack<scalar_t, kILP> pp = reinterpret_cast<const Pack<scalar_t, kILP>*>(p)[k];
        const Pack<scalar_t, kILP> gp = reinterpret_cast<const Pack<scalar_t, kILP>*>(g)[k];
        Pack<T, kILP> mp = reinterpret_cast<const Pack<T, kILP>*>(m)[k];
        Pack<T, kILP> vp = reinterpret_cast<const Pack<T, kILP>*>(v)[k];
        Pack<T, kILP> xp{};
        if (vm != nullptr) xp = reinterpret_cast<const Pack<T, kILP>*>(vm)[k];
#pragma unroll
        for (int j = 0; j < kILP; ++j) {
          T pj = static_cast<T>(pp.v[j]);
          adam_element<T>(pj, static_cast<T>(gp.v[j]), mp.v[j], vp.v[j], xp.v[j], c, a.amsgrad, coupled);
          pp.v[j] = static_cast<scalar_t>(pj);
        }
        reinterpret_cast<Pack<scalar_t, kILP>*>(p)[k] = pp;
        reinterpret_cast<Pack<T, kILP>*>(m)[k] = mp;
        reinterpret_cast<Pack<T, kILP>*>(v)[k] = vp;
        if (vm != nullptr) reinterpret_cast<Pack<T, kILP>*>(vm)[k] = xp;
      }
      done = packs * kILP;
    }
    for (int64_t i = done + threadIdx.x; i < n; i += blockDim.x) {
      T pi = static_cast<T>(p[i]);
      T mi = m[i], vi = v[i];
      T xi = vm != nullptr ? vm[i] : T(0);
      adam_element<T>(pi, static_cast<T>(g[i]), mi, vi, xi, c, a.amsgrad, coupled);
      p[i] = static_cast<scalar_t>(pi);
      m[i] = mi;
      v[i] = vi;
      if (vm != nullptr) vm[i] = xi;
    }
  }
}

// Runs before the update kernel of the same tensors (same stream), which reads the new count.
__global__ void advance_steps_kernel(const TensorListMeta meta, const float* found_inf) {
  if (found_inf != nullptr && *found_inf != 0.f) return;
  const int i = threadIdx.x;
  if (i < meta.n) *meta.step[i] += 1.f;
}

using namespace fused_adam_host;

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
    const int64_t chunks = (params[i].numel() + chunk_size - 1) / chunk_size;
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

  auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const at::ScalarType dtypes[] = {at::kFloat, at::kHalf, at::kBFloat16, at::kDouble};
  for (const auto dt : dtypes) {
    size_t i = 0;
    while (i < n) {
      TensorListMeta meta{};
      meta.chunk_start[0] = 0;
      for (; i < n && meta.n < kMaxTensors; ++i) {
        if (params[i].scalar_type() != dt) continue;
        const Work& w = work[i];
        const int k = meta.n++;
        meta.p[k] = w.p.data_ptr();
        meta.g[k] = w.g.const_data_ptr();
        meta.m[k] = w.m.data_ptr();
        meta.v[k] = w.v.data_ptr();
        meta.vm[k] = amsgrad ? w.vm.data_ptr() : nullptr;
        meta.step[k] = steps[i].mutable_data_ptr<float>();
        meta.numel[k] = w.p.numel();
        meta.chunk_start[k + 1] = meta.chunk_start[k] + (w.p.numel() + chunk_size - 1) / chunk_size;
      }
      if (meta.n == 0) break;
      advance_steps_kernel<<<1, kMaxTensors, 0, stream>>>(meta, a.found_inf);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      const int64_t total = meta.chunk_start[meta.n];
      if (total == 0) continue;  // only empty tensors: their steps still advance, as in torch
      const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(total, sms * 8));
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dt, "fused_adam_step_cuda", [&] {
        fused_adam_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(meta, a);
      });
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }

  write_back(work, params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, amsgrad);
}

}  // namespace

TORCH_LIBRARY_IMPL(accel, CUDA, m) {
  m.impl("fused_adam_step", &fused_adam_step_cuda);
}

}  // namespace accel
