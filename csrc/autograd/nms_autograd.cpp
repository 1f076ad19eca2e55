// Autograd of accel::nms_soft in C++, so a call costs what one of torch's own ops costs: a gradient
// registered from Python (torch.library.register_autograd) runs Python code on every call, several
// times the kernel's own time for the few hundred boxes a detector keeps per image.
//
// Soft-NMS is not differentiable (as mmcv's and torchvision's NMS): both outputs, the kept indices
// and the rescored scores, are marked non-differentiable, so scores that require grad (a detector's
// head, in training) give rescored scores that do not, and no backward ever runs. Without an autograd
// kernel torch's fallback would make the rescored scores require grad through a node that only warns
// and backpropagates nothing (and opcheck's AOTAutograd check, trying to differentiate them, failed).
// accel::nms (hard NMS) returns int64 indices only, which never require grad: it needs none.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>
#include <torch/types.h>

namespace accel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::tuple<at::Tensor, at::Tensor> soft_op(const at::Tensor& boxes, const at::Tensor& scores,
                                           const c10::optional<at::Tensor>& labels, double iou_threshold,
                                           double sigma, double min_score, int64_t method) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("accel::nms_soft", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                 const c10::optional<at::Tensor>&, double, double,
                                                                 double, int64_t)>();
  return op.call(boxes, scores, labels, iou_threshold, sigma, min_score, method);
}

class SoftNmsFunction : public torch::autograd::Function<SoftNmsFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& boxes, const at::Tensor& scores,
                               const c10::optional<at::Tensor>& labels, double iou_threshold, double sigma,
                               double min_score, int64_t method) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [inds, new_scores] = soft_op(boxes, scores, labels, iou_threshold, sigma, min_score, method);
    ctx->mark_non_differentiable({inds, new_scores});
    return {inds, new_scores};
  }

  static variable_list backward(AutogradContext* /*ctx*/, variable_list /*grads*/) {
    // unreachable: no output needs a gradient
    TORCH_CHECK(false, "accel::nms_soft is not differentiable");
    return {};
  }
};

std::tuple<at::Tensor, at::Tensor> nms_soft_autograd(const at::Tensor& boxes, const at::Tensor& scores,
                                                     const c10::optional<at::Tensor>& labels, double iou_threshold,
                                                     double sigma, double min_score, int64_t method) {
  auto out = SoftNmsFunction::apply(boxes, scores, labels, iou_threshold, sigma, min_score, method);
  return {out[0], out[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(accel, Autograd, m) {
  m.impl("nms_soft", &nms_soft_autograd);
}

}  // namespace accel
