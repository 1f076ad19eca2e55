// Autograd of accel::bias_dropout_add_fwd in C++, so a call costs what one of torch's own ops costs: a
// gradient registered from Python (torch.library.register_autograd) runs Python code on every forward
// and backward, several times the kernel's own time on the small and mid-sized activations of a model.
//
// The forward's outputs are (out, rng_state): only out is differentiable; rng_state, the Philox
// (seed, offset) the mask was drawn with, is saved for the backward, which regenerates the mask by
// calling accel::bias_dropout_add_bwd through the dispatcher. That op's own gradient stays in Python
// (accel/runtime/nn/bias_dropout_add.py): it runs only when the backward is itself differentiated
// (create_graph=True); an ordinary backward calls the op below autograd and runs no Python.
//
// Also here: accel::masked_scale (x * mask * scale, the scaling half of philox_dropout), whose gradient is
// a hand-written node (autograd/node.h) calling the same op; accel::dropout_fwd (mask and scaled x in one
// op, philox_dropout's eager forward), whose y takes the same node; and philox_dropout's C++ entry.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <mutex>

#include "autograd/backward_guard.h"
#include "autograd/node.h"
#include "autograd/python_entry.h"
#include "bias_dropout_add_host.h"
#include <torch/library.h>
#include <torch/types.h>

namespace accel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

std::tuple<at::Tensor, at::Tensor> fwd_op(const at::Tensor& x, const c10::optional<at::Tensor>& bias,
                                          const at::Tensor& residual, double p, bool train) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("accel::bias_dropout_add_fwd", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const c10::optional<at::Tensor>&,
                                                                 const at::Tensor&, double, bool)>();
  return op.call(x, bias, residual, p, train);
}

std::tuple<at::Tensor, at::Tensor> bwd_op(const at::Tensor& grad, const at::Tensor& rng_state, double p,
                                          bool bias_grad) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("accel::bias_dropout_add_bwd", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, double, bool)>();
  return op.call(grad, rng_state, p, bias_grad);
}

at::Tensor masked_scale_op(const at::Tensor& x, const at::Tensor& mask, double scale) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("accel::masked_scale", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
  return op.call(x, mask, scale);
}

std::tuple<at::Tensor, at::Tensor> dropout_fwd_op(const at::Tensor& x, double p) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("accel::dropout_fwd", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, double)>();
  return op.call(x, p);
}

// masked_scale's kernel on every backend without one of its own (CUDA): ATen's native_dropout_backward,
// x * mask * scale with torch's rounding (mask * x exact, one rounding of the product with scale), one
// kernel on CUDA. The CPU has its own (csrc/cpu/bias_dropout_add.cpp): ATen's takes two passes there.
at::Tensor masked_scale(const at::Tensor& x, const at::Tensor& mask, double scale) {
  bias_dropout_add_host::check_masked_scale(x, mask);
  return at::native_dropout_backward(x, mask, scale);
}

// The gradient of masked_scale for x: the same op on the incoming gradient (linear in x, so a
// differentiated backward takes this node again, through masked_scale's Autograd kernel).
struct MaskedScaleBackward final : public torch::autograd::Node {
  SavedVariable mask_;
  double scale_ = 1.0;

  std::string name() const override { return "accel::MaskedScaleBackward"; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);  // as generated nodes do (retain_graph and threads)
    mask_.reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!grads[0].defined() || !task_should_compute_output(0)) return {at::Tensor()};
    const at::Tensor mask = mask_.unpack();
    BackwardOpGuard guard;  // below autograd unless create_graph
    return {masked_scale_op(grads[0], mask, scale_)};
  }
};

// y = x * mask * scale made differentiable in x: y's gradient is MaskedScaleBackward (x, mask, scale as the
// forward had them).
void attach_masked_scale_backward(const at::Tensor& x, const at::Tensor& mask, double scale, at::Tensor& y) {
  namespace ag = torch::autograd;
  if (!ag::compute_requires_grad(x)) return;
  auto node = make_node<MaskedScaleBackward>();
  node->set_next_edges(ag::collect_next_edges(x));
  node->mask_ = SavedVariable(mask, false);
  node->scale_ = scale;
  ag::set_history(y, node);
}

void refuse_forward_ad(const at::Tensor& x, const char* op) {
  TORCH_CHECK_NOT_IMPLEMENTED(!torch::autograd::isFwGradDefined(x), op,
                              ": forward-mode AD (torch.func.jvp, dual tensors) is not supported");
}

at::Tensor masked_scale_autograd(const at::Tensor& x, const at::Tensor& mask, double scale) {
  refuse_forward_ad(x, "accel::masked_scale");
  at::Tensor y;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    y = masked_scale_op(x, mask, scale);
  }
  attach_masked_scale_backward(x, mask, scale, y);
  return y;
}

// dropout_fwd: (y, mask) from one kernel; y's gradient is masked_scale's node with that mask, so a dropout
// drawn this way differentiates (twice, too) exactly as dropout_mask + masked_scale would.
std::tuple<at::Tensor, at::Tensor> dropout_fwd_autograd(const at::Tensor& x, double p) {
  refuse_forward_ad(x, "accel::dropout_fwd");
  at::Tensor y, mask;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    std::tie(y, mask) = dropout_fwd_op(x, p);
  }
  attach_masked_scale_backward(x, mask, bias_dropout_add_host::keep_scale(p), y);
  return {y, mask};
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
        // the op sums dbias in the pass that writes dx (on CUDA; one read of grad instead of two)
        const at::Tensor rng_state = ctx->get_saved_variables()[0];
        BackwardOpGuard guard;  // below autograd unless create_graph
        std::tie(grad_x, grad_bias) = bwd_op(grad_out, rng_state, ctx->saved_data["p"].toDouble(), need_dbias);
      } else {
        grad_x = grad_out;
        if (need_dbias) grad_bias = bias_dropout_add_host::sum_rows(grad_out);
      }
    }
    if (!need_dbias) grad_bias = at::Tensor();
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

namespace py = pybind11;

// bias_dropout_add(x, bias, residual, prob, training) -> out for the call a model makes every step, or
// None for anything else (python_entry.h): x a float tensor on the CPU or a GPU, residual of x's shape,
// dtype and device, bias None or of shape (x.shape[-1],) in x's dtype on x's device, prob a float in
// [0, 1] and training a bool.
py::object bias_dropout_add_entry(py::handle x_obj, py::handle bias_obj, py::handle res_obj, py::handle p_obj,
                                  py::handle train_obj) {
  using namespace python_entry;
  const at::Tensor* x = plain_tensor(x_obj.ptr());
  const at::Tensor* residual = plain_tensor(res_obj.ptr());
  double p = 0;
  if (x == nullptr || residual == nullptr || x->is_nested() || x->layout() != at::kStrided || !kernel_device(*x) ||
      !float_type(x->scalar_type()) || !python_float(p_obj.ptr(), &p) || !(p >= 0.0 && p <= 1.0) ||
      !PyBool_Check(train_obj.ptr()) || residual->scalar_type() != x->scalar_type() ||
      residual->device() != x->device() || residual->layout() != at::kStrided || residual->sizes() != x->sizes())
    return py::none();
  c10::optional<at::Tensor> bias;
  if (!bias_obj.is_none()) {
    const at::Tensor* b = plain_tensor(bias_obj.ptr());
    if (b == nullptr || x->dim() == 0 || b->dim() != 1 || b->size(0) != x->size(-1) ||
        b->scalar_type() != x->scalar_type() || b->device() != x->device() || b->layout() != at::kStrided)
      return py::none();
    bias = *b;
  }
  const bool train = train_obj.ptr() == Py_True;
  at::Tensor out;
  {
    py::gil_scoped_release no_gil;
    out = std::get<0>(fwd_op(*x, bias, *residual, p, train));  // through the dispatcher: autograd applies
  }
  return python_entry::wrap(out);
}

// dropout(x, p) -> y of accel::dropout_fwd (the mask of accel::dropout_mask, y = masked_scale(x, mask,
// 1 / (1 - p))): philox_dropout's call in training, or None for anything else (python_entry.h): x a float
// tensor on the CPU or a GPU, p a float in (0, 1). One op and one autograd node, as torch's own dropout.
py::object dropout_entry(py::handle x_obj, py::handle p_obj) {
  using namespace python_entry;
  const at::Tensor* x = plain_tensor(x_obj.ptr());
  double p = 0;
  if (x == nullptr || x->is_nested() || x->layout() != at::kStrided || !kernel_device(*x) ||
      !float_type(x->scalar_type()) || !python_float(p_obj.ptr(), &p) || !(p > 0.0 && p < 1.0))
    return py::none();
  at::Tensor y;
  {
    py::gil_scoped_release no_gil;
    y = std::get<0>(dropout_fwd_op(*x, p));  // through the dispatcher: autograd applies
  }
  return python_entry::wrap(y);
}

void bind(py::module_& m) {
  m.def("bias_dropout_add", &bias_dropout_add_entry, "bias_dropout_add's common call, or None: see python_entry.h");
  m.def("dropout", &dropout_entry, "philox_dropout's common call in training, or None: see python_entry.h");
}

const python_entry::Register register_entry(&bind);

}  // namespace

TORCH_LIBRARY_IMPL(accel, Autograd, m) {
  m.impl("bias_dropout_add_fwd", &bias_dropout_add_fwd_autograd);
  m.impl("masked_scale", &masked_scale_autograd);
  m.impl("dropout_fwd", &dropout_fwd_autograd);
}

TORCH_LIBRARY_IMPL(accel, CompositeExplicitAutograd, m) {
  m.impl("masked_scale", &masked_scale);
}

}  // namespace accel
