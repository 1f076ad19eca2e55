"""Helpers for model code on the custom path (TorchAcc's accel.runtime.utils)."""
from accel.runtime.utils.misc import multi_apply, multi_apply_multi_stream

__all__ = ["multi_apply", "multi_apply_multi_stream"]
