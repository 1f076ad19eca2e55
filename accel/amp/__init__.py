"""Mixed precision for the compiler path (and CUDA/CPU): autocast, GradScaler, sync-free optimizers.

    from accel.amp import autocast, GradScaler, syncfree

    optimizer = syncfree.Adam(model.parameters(), lr=1e-3)
    scaler = GradScaler()
    with autocast():
        loss = model(**inputs)["loss"]
    scaler.scale(loss).backward()
    scaler.step(optimizer)      # skipped on the device if gradients overflowed
    scaler.update()

Nothing here imports torch_xla at import time.
"""
from . import syncfree
from .autocast_mode import autocast
from .grad_scaler import GradScaler

__all__ = ["autocast", "GradScaler", "syncfree"]
