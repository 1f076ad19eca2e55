"""Input pipeline for the custom path: the TorchAcc guide's Prefetcher."""
from accel.runtime.io.prefetcher import Prefetcher

__all__ = ["Prefetcher"]
