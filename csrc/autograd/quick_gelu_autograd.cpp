// Autograd of accel::quick_gelu_fwd in C++, so a call costs what one of torch's own ops costs: a
// gradient registered from Python (torch.library.register_autograd) runs Python code on every forward
// and backward, several times the kernel's own time on the small and mid-sized activations of a model.
//
// The backward calls accel::quick_gelu_bwd through the dispatcher. That op's own gradient stays in
// Python (accel/runtime/nn/quick_gelu.py): it runs only when the backward is itself differentiated
// (create_graph=True), where second derivatives must be right rather than fast; an ordinary backward
// calls the op below autograd and runs no Python.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>

#include "autograd/backward_guard.h"
#include <torch/library.h>
#include <torch/types.h>

namespace accel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor fwd_op(const at::Tensor& x) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("accel::quick_gelu_fwd", "")
                       .typed<at::Tensor(const at::Tensor&)>();
  return op.call(x);
}

at::Tensor bwd_op(const at::Tensor& grad, const at::Tensor& x) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("accel::quick_gelu_bwd", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  return op.call(grad, x);
}

class QuickGeluFunction : public torch::autograd::Function<QuickGeluFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({x});
    return fwd_op(x);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    BackwardOpGuard guard;  // below autograd unless create_graph
    return {bwd_op(grads[0], saved[0])};
  }
};

at::Tensor quick_gelu_fwd_autograd(const at::Tensor& x) {
  return QuickGeluFunction::apply(x);
}

}  // namespace

TORCH_LIBRARY_IMPL(accel, Autograd, m) {
  m.impl("quick_gelu_fwd", &quick_gelu_fwd_autograd);
}

}  // namespace accel
