// The pybind11 module linked into every op's extension (one per op: accel_<op>).
// The kernels themselves register with torch.library (TORCH_LIBRARY_FRAGMENT(accel, ...)) when the
// module is loaded, so Python reaches them as torch.ops.accel.<name>, which composes with autograd
// and torch.compile. The module reports what it was built with and holds the ops' Python entries
// (csrc/autograd/python_entry.h): the light path of a model's common call.
#include <pybind11/pybind11.h>

#include "autograd/python_entry.h"

#define ACCEL_STR2(x) #x
#define ACCEL_STR(x) ACCEL_STR2(x)

namespace accel {
namespace python_entry {

std::vector<Binder>& binders() {
  static std::vector<Binder> all;  // filled by static initializers of the op's files, before the module is made
  return all;
}

}  // namespace python_entry
}  // namespace accel

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "accel kernels; the ops are torch.ops.accel.*";
#ifdef WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  m.attr("name") = ACCEL_STR(TORCH_EXTENSION_NAME);
  for (auto bind : accel::python_entry::binders()) bind(m);
}
