// The pybind11 module linked into every op's extension (one per op: accel_<op>).
// The kernels themselves register with torch.library (TORCH_LIBRARY_FRAGMENT(accel, ...)) when the
// module is loaded, so Python reaches them as torch.ops.accel.<name>, which composes with autograd
// and torch.compile. The module itself only reports what it was built with.
#include <pybind11/pybind11.h>

#define ACCEL_STR2(x) #x
#define ACCEL_STR(x) ACCEL_STR2(x)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "accel kernels; the ops are torch.ops.accel.*";
#ifdef WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  m.attr("name") = ACCEL_STR(TORCH_EXTENSION_NAME);
}
