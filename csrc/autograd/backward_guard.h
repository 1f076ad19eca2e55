// Shared by csrc/autograd/<op>_autograd.cpp: how a C++ backward calls an op's backward op.
#pragma once

#include <ATen/core/grad_mode.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/util/Optional.h>

namespace accel {

// In an ordinary backward nothing records the backward op, so it is called below autograd: its
// gradient (registered from Python, accel/runtime/nn/<op>.py) never runs, and neither does any Python.
// When the backward is itself differentiated (create_graph=True, gradient penalties) grad mode is on
// and the call goes through autograd, so second derivatives come from the backward op's own gradient.
class BackwardOpGuard {
 public:
  BackwardOpGuard() {
    if (!at::GradMode::is_enabled()) below_.emplace();
  }

 private:
  c10::optional<at::AutoDispatchBelowADInplaceOrView> below_;
};

}  // namespace accel
