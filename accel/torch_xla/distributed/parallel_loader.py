"""``torchacc.torch_xla.distributed.parallel_loader`` as ``pl``."""
from accel.data import MpDeviceLoader

__all__ = ["MpDeviceLoader"]
