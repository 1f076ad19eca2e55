// Autograd of accel::window_process_partition and accel::window_process_reverse in C++, so a call
// costs what one of torch's own ops costs: a gradient registered from Python
// (torch.library.register_autograd) runs Python code on every forward and backward, several times the
// kernel's own time for the feature maps of a Swin block.
//
// Both ops are permutations and each one's gradient is the other with the opposite shift. The backward
// calls the other op through the dispatcher: below autograd for an ordinary backward, with autograd
// (this file's other function) when the backward is itself differentiated (create_graph=True), so
// second and higher derivatives follow.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>

#include "autograd/backward_guard.h"
#include <torch/library.h>
#include <torch/types.h>

namespace accel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor partition_op(const at::Tensor& x, int64_t window_size, int64_t shift) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("accel::window_process_partition", "")
                       .typed<at::Tensor(const at::Tensor&, int64_t, int64_t)>();
  return op.call(x, window_size, shift);
}

at::Tensor reverse_op(const at::Tensor& windows, int64_t H, int64_t W, int64_t window_size, int64_t shift) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("accel::window_process_reverse", "")
                       .typed<at::Tensor(const at::Tensor&, int64_t, int64_t, int64_t, int64_t)>();
  return op.call(windows, H, W, window_size, shift);
}

class PartitionFunction : public torch::autograd::Function<PartitionFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t window_size, int64_t shift) {
    at::AutoDispatchBelowADInplaceOrView guard;
    // H and W as symbolic sizes: torch.compile traces this with dynamic shapes; the reverse op takes
    // them as ints, so the backward specializes them, as passing them to the op from Python did.
    ctx->saved_data["H"] = x.sym_size(1);
    ctx->saved_data["W"] = x.sym_size(2);
    ctx->saved_data["window_size"] = window_size;
    ctx->saved_data["shift"] = shift;
    return partition_op(x, window_size, shift);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const int64_t H = ctx->saved_data["H"].toSymInt().guard_int(__FILE__, __LINE__);
    const int64_t W = ctx->saved_data["W"].toSymInt().guard_int(__FILE__, __LINE__);
    BackwardOpGuard guard;  // below autograd unless create_graph
    at::Tensor dx = reverse_op(grads[0], H, W, ctx->saved_data["window_size"].toInt(),
                               -ctx->saved_data["shift"].toInt());
    return {dx, at::Tensor(), at::Tensor()};
  }
};

class ReverseFunction : public torch::autograd::Function<ReverseFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& windows, int64_t H, int64_t W,
                            int64_t window_size, int64_t shift) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->saved_data["window_size"] = window_size;
    ctx->saved_data["shift"] = shift;
    return reverse_op(windows, H, W, window_size, shift);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    BackwardOpGuard guard;  // below autograd unless create_graph
    at::Tensor dwindows =
        partition_op(grads[0], ctx->saved_data["window_size"].toInt(), -ctx->saved_data["shift"].toInt());
    return {dwindows, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor partition_autograd(const at::Tensor& x, int64_t window_size, int64_t shift) {
  return PartitionFunction::apply(x, window_size, shift);
}

at::Tensor reverse_autograd(const at::Tensor& windows, int64_t H, int64_t W, int64_t window_size, int64_t shift) {
  return ReverseFunction::apply(windows, H, W, window_size, shift);
}

}  // namespace

TORCH_LIBRARY_IMPL(accel, Autograd, m) {
  m.impl("window_process_partition", &partition_autograd);
  m.impl("window_process_reverse", &reverse_autograd);
}

}  // namespace accel
