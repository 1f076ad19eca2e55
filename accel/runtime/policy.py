"""Which of the kernel library's hooks help on a device, decided by measurement and written down here.

accelerate() applies a hook only where a side-by-side benchmark showed it faster than what the
backend already does; everywhere else the hook steps aside (a speed-up toolkit must not slow a model
down). Each entry names its evidence; change the table when a new measurement says otherwise.

Evidence (BERT-base training step, same data and seed in one process):
- CUDA, H100, torch 2.11, bf16, batch 32 seq 128 (issue 8 table): eager 40.9 ms vs fused LayerNorm +
  fused AdamW 46.2 ms (the ops' Python/dispatch cost exceeds what their kernels save); under
  torch.compile 21.5 ms vs 23.7 ms (the custom ops block Inductor's own fusions). So: none on CUDA,
  compiled or not, until issue 9 makes them win.
- CPU fp32 eager, AMD EPYC without AVX-512, torch 2.9: 5.5-5.8 s vs 5.17 s with fused LayerNorm +
  fused AdamW (1.06-1.13x): both help eagerly. Under torch.compile on the CPU Inductor generates its
  own fused LayerNorm and, through the compiled optimizer step, its own Adam loop: the hooks would
  only cut those fusions, so none when compiled (benchmarks/bert_base.py measures both rows).
- bf16/fp16 on CPU: the fused LayerNorm's reduced-precision path has not been measured against
  torch's; no hook there.
- XLA: custom C++/CUDA ops do not run on XLA tensors; none.
"""
from __future__ import annotations

import torch

LAYER_NORM = "fused_layer_norm"
ADAM = "fused_adam"


def helpful_kernels(device_type: str, compiled: bool, dtype: torch.dtype | None) -> frozenset[str]:
    """The hooks that make a training step faster for this device type, compilation and autocast dtype
    (None = fp32)."""
    if device_type == "cpu" and not compiled and dtype is None:
        return frozenset({LAYER_NORM, ADAM})
    return frozenset()
