// Autograd of accel::bias_dropout_add_fwd in C++, so a call costs what one of torch's own ops costs: a
// gradient registered from Python (torch.library.register_autograd) runs Python code on every forward
// and backward, several times the kernel's own time on the small and mid-sized activations of a model.
//
// The forward's outputs are (out, rng_state): only out is differentiable; rng_state, the Philox
// (seed, offset) the mask was drawn with, is saved for the backward, which regenerates the mask by
// calling accel::bias_dropout_add_bwd through the dispatcher. That op's own gradient stays in Python
// (accel/runtime/nn/bias_dropout_add.py): it runs only when the backward is itself differentiated
// (create_graph=True); an ordinary backward calls the op below autograd and runs no Python.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>

#include "autograd/backward_guard.h"
#include <torch/library.h>
#include <torch/types.h>

namespace accel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::tuple<at::Tensor, at::Tensor> fwd_op(const at::Tensor& x, const c10::optional<at::Tensor>& bias,
                                          const at::Tensor& residual, double p, bool train) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("accel::bias_dropout_add_fwd", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const c10::optional<at::Tensor>&,
                                                                 const at::Tensor&, double, bool)>();
  return op.call(x, bias, residual, p, train);
}

at::Tensor bwd_op(const at::Tensor& grad, const at::Tensor& rng_state, double p) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("accel::bias_dropout_add_bwd", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
  return op.call(grad, rng_state, p);
}

class BiasDropoutAddFunction : public torch::autograd::Function<BiasDropoutAddFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const c10::optional<at::Tensor>& bias,
                               const at::Tensor& residual, double p, bool train) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, rng_state] = fwd_op(x, bias, residual, p, train);
    ctx->save_for_backward({rng_state});
    ctx->saved_data["p"] = p;
    ctx->saved_data["dropout"] = train && p > 0.0;
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    ctx->mark_non_differentiable({rng_state});
    ctx->set_materialize_grads(false);
    return {out, rng_state};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor& grad_out = grads[0];
    if (!grad_out.defined()) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    // needs_input_grad counts tensor inputs only: an absent bias moves residual to edge 1
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const bool need_dx = ctx->needs_input_grad(0);
    const bool need_dbias = has_bias && ctx->needs_input_grad(1);
    const bool need_dres = ctx->needs_input_grad(has_bias ? 2 : 1);
    at::Tensor grad_x, grad_bias;
    if (need_dx || need_dbias) {
      if (ctx->saved_data["dropout"].toBool()) {
        const at::Tensor rng_state = ctx->get_saved_variables()[0];
        BackwardOpGuard guard;  // below autograd unless create_graph
        grad_x = bwd_op(grad_out, rng_state, ctx->saved_data["p"].toDouble());
      } else {
        grad_x = grad_out;
      }
    }
    if (need_dbias) {
      // accumulate in fp32 for fp16/bf16: the sum runs over every row (symbolic sizes: torch.compile
      // traces this with dynamic shapes)
      const auto acc = grad_x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
      grad_bias = grad_x.reshape_symint({-1, grad_x.sym_size(-1)}).sum({0}, false, acc).to(grad_x.scalar_type());
    }
    return {need_dx ? grad_x : at::Tensor(), grad_bias, need_dres ? grad_out : at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> bias_dropout_add_fwd_autograd(const at::Tensor& x,
                                                                 const c10::optional<at::Tensor>& bias,
                                                                 const at::Tensor& residual, double p, bool train) {
  auto out = BiasDropoutAddFunction::apply(x, bias, residual, p, train);
  return {out[0], out[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(accel, Autograd, m) {
  m.impl("bias_dropout_add_fwd", &bias_dropout_add_fwd_autograd);
}

}  // namespace accel
