// Autograd of accel::fmha_swin_fwd in C++, so a call costs what one of torch's own ops costs: a
// gradient registered from Python (torch.library.register_autograd) runs Python code on every forward
// and backward, several times the kernel's own time for Swin's small windows.
//
// The backward calls accel::fmha_swin_bwd through the dispatcher. That op's own gradient stays in
// Python (accel/runtime/nn/fmha.py): it runs only when the backward is itself differentiated
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

at::Tensor fwd_op(const at::Tensor& attn, const at::Tensor& bias, const c10::optional<at::Tensor>& mask,
                  int64_t window_num) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("accel::fmha_swin_fwd", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                                         int64_t)>();
  return op.call(attn, bias, mask, window_num);
}

std::tuple<at::Tensor, at::Tensor> bwd_op(const at::Tensor& grad, const at::Tensor& out) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("accel::fmha_swin_bwd", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&)>();
  return op.call(grad, out);
}

// Gradients of attn and of the bias (in the bias's dtype); the mask and window_num get none. The
// backward needs only the softmax output.
class FmhaSwinFunction : public torch::autograd::Function<FmhaSwinFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& attn, const at::Tensor& bias,
                               const c10::optional<at::Tensor>& mask, int64_t window_num) {
    at::AutoDispatchBelowADInplaceOrView guard;
    at::Tensor out = fwd_op(attn, bias, mask, window_num);
    ctx->save_for_backward({out});
    ctx->saved_data["bias_dtype"] = bias.scalar_type();
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor out = ctx->get_saved_variables()[0];
    // needs_input_grad counts tensor inputs only: attn is edge 0, the bias edge 1 (then the mask)
    const bool need_dattn = ctx->needs_input_grad(0), need_dbias = ctx->needs_input_grad(1);
    at::Tensor dattn, dbias;
    if (grads[0].defined() && (need_dattn || need_dbias)) {
      BackwardOpGuard guard;  // below autograd unless create_graph
      std::tie(dattn, dbias) = bwd_op(grads[0], out);
      dbias = dbias.to(ctx->saved_data["bias_dtype"].toScalarType());
    }
    return {need_dattn ? dattn : at::Tensor(), need_dbias ? dbias : at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor fmha_swin_fwd_autograd(const at::Tensor& attn, const at::Tensor& bias,
                                  const c10::optional<at::Tensor>& mask, int64_t window_num) {
  return FmhaSwinFunction::apply(attn, bias, mask, window_num)[0];
}

}  // namespace

TORCH_LIBRARY_IMPL(accel, Autograd, m) {
  m.impl("fmha_swin_fwd", &fmha_swin_fwd_autograd);
}

}  // namespace accel
