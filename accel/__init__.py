"""accel: faster PyTorch training with a few changed lines.

Compiler path: accel.xla (PyTorch/XLA), accel.amp, accel.data.
Custom path: accel.runtime (fused C++/CUDA kernels, hooks, prefetcher).
Nothing here imports torch_xla or needs CUDA at import time.
"""
__version__ = "0.1.0"
from accel.accelerate import accelerate
from accel.checkpoint import auto_checkpoint
from accel.compiler.step_graph import graph_step
from accel.config import Config
from accel.distributed import accumulate
from accel.evaluation import gather_for_metrics
from accel.export import save_model, unwrap_model
from accel.state import load_state, save_state, wait_for_save

__all__ = ["Config", "accelerate", "accumulate", "auto_checkpoint", "gather_for_metrics", "graph_step", "load_state",
           "save_model", "save_state", "unwrap_model", "wait_for_save"]
