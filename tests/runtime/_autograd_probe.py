"""What a call of an accel op runs on the host: used by the tests that check an op's gradient is C++
(csrc/autograd/<op>_autograd.cpp) and that neither the forward nor an ordinary backward runs Python."""
import sys

import torch

# Python that must not run per call: torch.library's gradient wrappers, and accel's own op code.
LIBRARY = "torch/_library/"
ACCEL_RUNTIME = "accel/runtime/"


def python_calls(fn):
    """fn's result and the files of the Python functions it called on this thread. The CPU autograd
    engine runs a CPU graph on the calling thread, so a backward's Python is seen too."""
    files = set()

    def profile(frame, event, arg):
        if event == "call":
            files.add(frame.f_code.co_filename.replace("\\", "/"))

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        out = fn()
    finally:
        sys.setprofile(previous)
    return out, files


def autograd_kernel(op: str) -> str:
    """The line of the dispatcher's table naming where op's Autograd kernel was registered."""
    return next(line for line in torch._C._dispatch_dump(op).splitlines() if line.startswith("Autograd"))


def ran(files, *parts) -> list[str]:
    """The files among `files` whose path contains one of `parts`."""
    return sorted(f for f in files if any(p in f for p in parts))
