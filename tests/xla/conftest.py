import os

# torch_xla reads PJRT_DEVICE when it first starts its runtime: set it before any test imports it.
os.environ.setdefault("PJRT_DEVICE", "CPU")
