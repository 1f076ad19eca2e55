"""Optimizers whose step can be skipped on the device: ``opt.step(found_inf=flag)``.

Unlike torch_xla's versions they accept XLA, CUDA and CPU tensors. accel.amp.GradScaler
hands them its overflow flag, so a mixed-precision step never waits on the device.
"""
from .adam import Adam
from .adamw import AdamW
from .sgd import SGD

__all__ = ["Adam", "AdamW", "SGD"]
