// Autograd of accel::layer_norm_fwd in C++, so a call costs what one of torch's own ops costs: a
// gradient registered from Python (torch.library.register_autograd) runs Python code on every forward
// and backward, several times the kernel's own time for the small and mid-sized rows of a transformer.
// The backward node is written as torch's generated ones are (autograd/node.h): with a
// torch::autograd::Function a FusedLayerNorm call cost the host more than nn.LayerNorm's.
//
// The backward calls accel::layer_norm_bwd through the dispatcher. That op's own gradient stays in
// Python (accel/runtime/nn/layer_norm.py): it runs only when the backward is itself differentiated
// (create_graph=True), where second derivatives must be right rather than fast; an ordinary backward
// calls the op below autograd and runs no Python.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <mutex>

#include "autograd/backward_guard.h"
#include "autograd/node.h"
#include "autograd/python_entry.h"
#include "layer_norm_host.h"
#include <torch/library.h>
#include <torch/types.h>

namespace accel {
namespace {

using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd_op(const at::Tensor& x, const c10::optional<at::Tensor>& weight,
                                                      const c10::optional<at::Tensor>& bias, int64_t ndim,
                                                      double eps) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("accel::layer_norm_fwd", "")
                       .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                           const at::Tensor&, const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&,
                           int64_t, double)>();
  return op.call(x, weight, bias, ndim, eps);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_op(const at::Tensor& dy, const at::Tensor& x,
                                                      const at::Tensor& mean, const at::Tensor& rstd,
                                                      const c10::optional<at::Tensor>& weight,
                                                      const c10::optional<at::Tensor>& bias, int64_t ndim,
                                                      bool need_dweight, bool need_dbias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("accel::layer_norm_bwd", "")
                       .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&, int64_t, bool,
                           bool)>();
  return op.call(dy, x, mean, rstd, weight, bias, ndim, need_dweight, need_dbias);
}

c10::optional<at::Tensor> opt(const at::Tensor& t) {
  return t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt;
}

// The gradient of x through the row statistics mean = sum(x) / D and rstd = (var + eps)^-1/2:
// d mean / dx = 1 / D, d rstd / dx = -rstd^3 (x - mean) / D, in the statistics' dtype. Only a
// differentiated backward (gradient penalties) sends gradients to mean and rstd.
// (Symbolic sizes throughout: torch.compile traces this with dynamic shapes.)
at::Tensor stats_backward(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& rstd,
                          const at::Tensor& grad_mean, const at::Tensor& grad_rstd) {
  const c10::SymInt M = mean.sym_numel();
  const c10::SymInt D = M == 0 ? c10::SymInt(0) : x.sym_numel() / M;
  const std::vector<c10::SymInt> rows{M, 1}, full{M, D};
  at::Tensor out;
  if (grad_mean.defined()) out = (grad_mean.reshape_symint(rows) / D).expand_symint(full);
  if (grad_rstd.defined()) {
    const at::Tensor r = rstd.reshape_symint(rows);
    const at::Tensor xc = x.reshape_symint(full).to(mean.scalar_type()) - mean.reshape_symint(rows);
    // grouped so that no factor under- or overflows on rows of huge magnitude (rstd^3 underflows in
    // float once the row's std passes ~1e13; xc * rstd is O(1))
    const at::Tensor term = -(grad_rstd.reshape_symint(rows) * r) * ((xc * r) * r) / D;
    out = out.defined() ? out + term : term;
  }
  return out.reshape_symint(x.sym_sizes());
}

// The gradient of (y, mean, rstd) = layer_norm_fwd(x, weight, bias) for x, weight and bias (its next
// edges, in that order; an absent weight or bias has an empty edge). Holds what the backward reads.
struct LayerNormBackward final : public torch::autograd::Node {
  SavedVariable x_, mean_, rstd_, weight_, bias_;
  int64_t ndim_ = 0;

  std::string name() const override { return "accel::LayerNormBackward"; }

  // Both lock Node's mutex_, as generated nodes do: two threads may run the backward of one graph
  // kept with retain_graph=True while a third frees its saved tensors.
  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    x_.reset_data();
    mean_.reset_data();
    rstd_.reset_data();
    weight_.reset_data();
    bias_.reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    // mean and rstd are outputs of this node: unpacking them names it (saved outputs hold no reference
    // to their grad_fn, which would be a cycle)
    const auto self = getptr();
    const at::Tensor x = x_.unpack(), mean = mean_.unpack(self), rstd = rstd_.unpack(self);
    const at::Tensor weight = weight_.unpack(), bias = bias_.unpack();
    const bool need_dw = weight.defined() && task_should_compute_output(1);
    const bool need_db = bias.defined() && task_should_compute_output(2);
    at::Tensor dx, dw, db;
    if (grads[0].defined()) {
      BackwardOpGuard guard;  // below autograd unless create_graph
      std::tie(dx, dw, db) = bwd_op(grads[0], x, mean, rstd, opt(weight), opt(bias), ndim_, need_dw, need_db);
    }
    if (grads[1].defined() || grads[2].defined()) {
      const at::Tensor stats = stats_backward(x, mean, rstd, grads[1], grads[2]);
      dx = (dx.defined() ? dx.to(stats.scalar_type()) + stats : stats).to(x.scalar_type());
    }
    return {dx, need_dw ? dw : at::Tensor(), need_db ? db : at::Tensor()};
  }
};

// The Autograd kernel: the forward below autograd, then, when a gradient is wanted, the node and the
// outputs' history, as torch's generated VariableType kernels do it.
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd_autograd(
    const at::Tensor& x, const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
    int64_t ndim, double eps) {
  namespace ag = torch::autograd;
  TORCH_CHECK_NOT_IMPLEMENTED(!ag::isFwGradDefined(x) && !ag::isFwGradDefined(weight) && !ag::isFwGradDefined(bias),
                              "accel::layer_norm_fwd: forward-mode AD (torch.func.jvp, dual tensors) is not supported");
  std::tuple<at::Tensor, at::Tensor, at::Tensor> out;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    out = fwd_op(x, weight, bias, ndim, eps);
  }
  if (!ag::compute_requires_grad(x, weight, bias)) return out;
  auto& [y, mean, rstd] = out;
  auto node = make_node<LayerNormBackward>();
  node->set_next_edges(ag::collect_next_edges(x, weight, bias));
  node->ndim_ = ndim;
  node->x_ = SavedVariable(x, false);
  if (weight) node->weight_ = SavedVariable(*weight, false);
  if (bias) node->bias_ = SavedVariable(*bias, false);
  // mean and rstd differentiable too: a differentiated backward (create_graph) sends gradients through them
  ag::set_history(y, node);
  ag::set_history(mean, node);
  ag::set_history(rstd, node);
  node->mean_ = SavedVariable(mean, true);
  node->rstd_ = SavedVariable(rstd, true);
  return out;
}

namespace py = pybind11;

bool param_ok(const at::Tensor& p, const at::Tensor& x, at::IntArrayRef shape) {
  return p.sizes() == shape && p.device() == x.device() &&
         layer_norm_host::param_type_ok(x.scalar_type(), p.scalar_type());
}

// fused_layer_norm(x, normalized_shape, weight, bias, eps) -> y for the call a model makes every
// step, or None for anything else (python_entry.h): x a float tensor on the CPU or a GPU whose trailing
// dims are normalized_shape (a tuple of ints), weight and bias None or of that shape on x's device in
// one dtype, x's or fp32 beside fp16/bf16 x, and eps a float >= 0.
py::object layer_norm_entry(py::handle x_obj, py::handle shape_obj, py::handle w_obj, py::handle b_obj,
                            py::handle eps_obj) {
  using namespace python_entry;
  const at::Tensor* x = plain_tensor(x_obj.ptr());
  double eps = 0;
  if (x == nullptr || x->is_nested() || x->layout() != at::kStrided || !kernel_device(*x) ||
      !float_type(x->scalar_type()) || !python_float(eps_obj.ptr(), &eps) || !(eps >= 0) ||
      !PyTuple_CheckExact(shape_obj.ptr()))
    return py::none();
  const int64_t nd = PyTuple_GET_SIZE(shape_obj.ptr());
  if (nd < 1 || nd > x->dim()) return py::none();
  const at::IntArrayRef shape = x->sizes().slice(x->dim() - nd);
  for (int64_t i = 0; i < nd; ++i) {
    PyObject* d = PyTuple_GET_ITEM(shape_obj.ptr(), i);
    int overflow = 0;
    if (!PyLong_CheckExact(d) || PyLong_AsLongLongAndOverflow(d, &overflow) != shape[i] || overflow)
      return py::none();
  }
  c10::optional<at::Tensor> weight, bias;
  for (auto [obj, out] : {std::pair{w_obj, &weight}, std::pair{b_obj, &bias}}) {
    if (obj.is_none()) continue;
    const at::Tensor* p = plain_tensor(obj.ptr());
    if (p == nullptr || !param_ok(*p, *x, shape)) return py::none();
    *out = *p;
  }
  if (weight && bias && weight->scalar_type() != bias->scalar_type()) return py::none();
  at::Tensor y;
  {
    py::gil_scoped_release no_gil;
    y = std::get<0>(fwd_op(*x, weight, bias, nd, eps));  // through the dispatcher: autograd applies
  }
  return python_entry::wrap(y);
}

void bind(py::module_& m) {
  m.def("layer_norm", &layer_norm_entry, "fused_layer_norm's common call, or None: see python_entry.h");
}

const python_entry::Register register_entry(&bind);

}  // namespace

TORCH_LIBRARY_IMPL(accel, Autograd, m) {
  m.impl("layer_norm_fwd", &layer_norm_fwd_autograd);
}

}  // namespace accel
