"""``torchacc.torch_xla.amp``: autocast, GradScaler and the sync-free optimizers."""
from accel.amp import GradScaler, autocast, syncfree

__all__ = ["GradScaler", "autocast", "syncfree"]
