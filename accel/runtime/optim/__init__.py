"""Optimizers of the custom path: multi-tensor fused kernels (csrc/{cpu,cuda}/fused_adam.*)."""
from accel.runtime.optim.fused_adam import FusedAdam, FusedAdamW

__all__ = ["FusedAdam", "FusedAdamW"]
