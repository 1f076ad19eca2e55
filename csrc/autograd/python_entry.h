// The Python entry of an op's common call: a function of the op's pybind11 module that takes the
// call exactly as a model makes it (tensors, a tuple of sizes, floats), checks it in C++ and calls the
// op through the dispatcher, so autograd, autocast, inference mode and dispatch modes apply as they do
// to torch.ops.accel.<op>.
//
// Why: torch.ops.accel.<op>(...) parses its arguments against the schema in Python-facing C++ and
// boxes them (~3 us a call), and the Python checks before it cost ~2 us more: together they doubled
// the host cost of a small LayerNorm against torch's own. A pybind11 call with typed arguments costs
// what torch's generated bindings cost.
//
// An entry returns None for any call it does not recognise as valid and common (a Tensor subclass, a
// TorchFunctionMode on, another device, mixed dtypes, a bad value): the op's Python wrapper then takes
// its general path, which explains errors and handles the rare cases. The wrapper calls the entry only
// outside torch.compile; Dynamo traces the general path, which calls torch.ops.accel.<op>.
//
// Ops with an entry: layer_norm, bias_dropout_add and philox_dropout (in bias_dropout_add's extension),
// the calls that cost more than torch's own in benchmarks/host_cost.py (LayerNorm module forward 21 us
// against 9, with the entry 11; PhiloxDropout 17 us against nn.Dropout's 10). The others' wrappers (a
// Python predicate, then torch.ops) already cost less than the torch code they replace.
#pragma once

#include <ATen/PythonTorchFunctionTLS.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/python_variable.h>

#include <vector>

namespace accel {
namespace python_entry {

using Binder = void (*)(pybind11::module_&);

// The entries of the ops linked into this extension; csrc/bindings.cpp adds them to its module.
std::vector<Binder>& binders();

// At namespace scope in an op's file: `static python_entry::Register reg(&bind);` adds bind's entries.
struct Register {
  explicit Register(Binder bind) { binders().push_back(bind); }
};

// The tensor in `obj` when it is a plain Tensor or Parameter, which torch's own functions take as is
// (no __torch_function__ of a subclass to honour), and no TorchFunctionMode is active; else null.
inline const at::Tensor* plain_tensor(PyObject* obj) {
  if (!THPVariable_CheckExact(obj) || at::impl::torch_function_mode_enabled()) return nullptr;
  return &THPVariable_Unpack(obj);
}

// The kernels serve CPU and CUDA tensors; other devices (XLA) take the general path.
inline bool kernel_device(const at::Tensor& t) { return t.is_cpu() || t.is_cuda(); }

inline bool float_type(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble;
}

// A Python float (not int, not bool: those take the general path, which validates them), its value in *out.
inline bool python_float(PyObject* obj, double* out) {
  if (!PyFloat_CheckExact(obj)) return false;
  *out = PyFloat_AS_DOUBLE(obj);
  return true;
}

inline pybind11::object wrap(const at::Tensor& t) {
  return pybind11::reinterpret_steal<pybind11::object>(THPVariable_Wrap(t));
}

}  // namespace python_entry
}  // namespace accel
