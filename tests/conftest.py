"""Session-wide set-up shared by every test directory."""
import os

# torch_xla reads PJRT_DEVICE when its runtime starts: set it before anything imports torch_xla.
os.environ.setdefault("PJRT_DEVICE", "CPU")

from accel.utils.xla import xla_available  # noqa: E402

if xla_available():
    # torch's autograd engine sizes its per-device queues at the first backward from each backend's
    # device count; a CPU backward run before the XLA runtime is up leaves no queue for XLA devices
    # (an INTERNAL ASSERT in engine.cpp). Starting the runtime before any test runs a backward avoids it.
    import torch_xla

    torch_xla.device()
