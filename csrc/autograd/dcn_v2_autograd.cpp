// Autograd of accel::dcn_v2_fwd in C++, so a call costs what one of torch's own ops costs: a gradient
// registered from Python (torch.library.register_autograd) runs Python code on every forward and
// backward, several times the kernels' own time for the small feature maps of a detector's head.
//
// The backward calls accel::dcn_v2_bwd through the dispatcher. That op has no gradient of its own
// (double backward is not supported, as in torchvision): an ordinary backward calls it below
// autograd and runs no Python; a differentiated one (create_graph=True) calls it through autograd
// as the Python gradient did, where torch's fallback for ops without an autograd kernel warns.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>

#include "autograd/backward_guard.h"
#include <torch/library.h>
#include <torch/types.h>

namespace accel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor fwd_op(const at::Tensor& input, const at::Tensor& offset, const at::Tensor& weight,
                  const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& mask, c10::IntArrayRef stride,
                  c10::IntArrayRef padding, c10::IntArrayRef dilation) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("accel::dcn_v2_fwd", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&,
                                         c10::IntArrayRef, c10::IntArrayRef, c10::IntArrayRef)>();
  return op.call(input, offset, weight, bias, mask, stride, padding, dilation);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> bwd_op(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& offset, const at::Tensor& weight,
    const c10::optional<at::Tensor>& mask, c10::IntArrayRef stride, c10::IntArrayRef padding,
    c10::IntArrayRef dilation) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("accel::dcn_v2_bwd", "")
                       .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const c10::optional<at::Tensor>&, c10::IntArrayRef, c10::IntArrayRef,
                           c10::IntArrayRef)>();
  return op.call(grad_output, input, offset, weight, mask, stride, padding, dilation);
}

class DcnV2Function : public torch::autograd::Function<DcnV2Function> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& offset,
                               const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                               const c10::optional<at::Tensor>& mask, c10::IntArrayRef stride,
                               c10::IntArrayRef padding, c10::IntArrayRef dilation) {
    at::AutoDispatchBelowADInplaceOrView guard;
    at::Tensor out = fwd_op(input, offset, weight, bias, mask, stride, padding, dilation);
    ctx->save_for_backward({input, offset, weight, mask.value_or(at::Tensor())});
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    ctx->saved_data["stride"] = stride.vec();
    ctx->saved_data["padding"] = padding.vec();
    ctx->saved_data["dilation"] = dilation.vec();
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &input = saved[0], &offset = saved[1], &weight = saved[2], &mask = saved[3];
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const std::vector<int64_t> stride = ctx->saved_data["stride"].toIntVector();
    const std::vector<int64_t> padding = ctx->saved_data["padding"].toIntVector();
    const std::vector<int64_t> dilation = ctx->saved_data["dilation"].toIntVector();
    at::Tensor gi, goff, gmask, gw, gb;
    {
      BackwardOpGuard guard;  // below autograd unless create_graph
      std::tie(gi, goff, gmask, gw, gb) =
          bwd_op(grads[0], input, offset, weight, mask.defined() ? c10::optional<at::Tensor>(mask) : c10::nullopt,
                 stride, padding, dilation);
    }
    // needs_input_grad counts tensor inputs only: an absent bias moves mask to edge 3
    const bool need_db = has_bias && ctx->needs_input_grad(3);
    const bool need_dmask = mask.defined() && ctx->needs_input_grad(has_bias ? 4 : 3);
    return {ctx->needs_input_grad(0) ? gi : at::Tensor(), ctx->needs_input_grad(1) ? goff : at::Tensor(),
            ctx->needs_input_grad(2) ? gw : at::Tensor(), need_db ? gb : at::Tensor(),
            need_dmask ? gmask : at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor dcn_v2_fwd_autograd(const at::Tensor& input, const at::Tensor& offset, const at::Tensor& weight,
                               const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& mask,
                               c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation) {
  return DcnV2Function::apply(input, offset, weight, bias, mask, stride, padding, dilation)[0];
}

}  // namespace

TORCH_LIBRARY_IMPL(accel, Autograd, m) {
  m.impl("dcn_v2_fwd", &dcn_v2_fwd_autograd);
}

}  // namespace accel
