"""Which of the kernel library's hooks help on a device, decided by measurement and written down here.

accelerate() applies a hook only where a side-by-side benchmark showed it faster than what the
backend already does; everywhere else the hook steps aside (a speed-up toolkit must not slow a model
down). Each entry names its evidence; change the table when a new measurement says otherwise.

Evidence (same data and seed in one process):
- CUDA, H100, torch 2.11, bf16, BERT-base batch 32 seq 128 step (issue 8 table): eager 40.9 ms vs fused
  LayerNorm + fused AdamW 46.2 ms (the ops' Python/dispatch cost exceeds what their kernels save); under
  torch.compile 21.5 ms vs 23.7 ms (the custom ops block Inductor's own fusions). fused Adam alone:
  0.79-0.94x torch's fused=True (issue 9).
- CPU fp32, AMD EPYC without AVX-512, torch 2.9 (2026-11-23): LayerNorm [8, 128, 768] forward + backward
  2.5 ms against torch's 1.2 ms; Adam/AdamW over BERT-base's 109.5M parameters 311 ms a step against
  torch's fused=True 75 ms (accelerate() switches torch's Adam to that kernel instead:
  accel.compiler.optimizer). Since the -fno-math-errno build (the loop vectorizes on AVX2) ours takes
  61-112 ms against torch's 64-78 ms in the same runs (0.68-1.11x): a tie within this machine's noise,
  not a win, so torch's stays. The earlier "hooks 1.06-1.13x faster" was fused Adam against torch's default
  per-tensor loop (391 ms), not against torch's best.
- XLA: custom C++/CUDA ops do not run on XLA tensors.
- Under torch.compile FusedLayerNorm steps aside for plain ops (CPU fp32, Linear + dropout + residual +
  LayerNorm [1024, 768] forward + backward: 1.28x slower with the kernel, which Inductor cannot fuse).
- Per-call host cost (benchmarks/host_cost.py, 2026-11-23): the ops' autograd moved from Python to C++;
  LayerNorm on 2x8 (all host cost) forward + backward went from 2.6x torch's time to ~1.3x. 2026-11-26
  (AVX-512 CPU): LayerNorm's backward is a hand-written node like torch's generated ones (no
  torch::autograd::Function wrappers): FusedLayerNorm 6.8-6.9 us a call against nn.LayerNorm's 7.3 (was
  0.88x), forward + backward 1.00-1.02x (was 0.83x) in three runs. PhiloxDropout's eager call is the mask
  op and accel::masked_scale (one CPU pass, a C++ node) from a C++ entry: 4.2 us against nn.Dropout's 9.3
  (was 0.56x), forward + backward 1.13x (was 0.60x); on [8, 128, 768] forward + backward 1.9 ms (was 3.3;
  torch's 6.3). Every op's call now costs the host no more than torch's (1.02-3.3x).
- Dropout, CPU fp32, AMD EPYC without AVX-512, torch 2.9 (2026-11-24): Inductor's CPU code draws each random
  number with a scalar Philox of its own (~10 ns an element; one kernel drawing every mask of the graph took
  0.41 s of a 3.7 s compiled BERT-base 8x128 step), torch's eager bernoulli_ ~8 ns. accel::dropout_mask
  draws 64 at a time: softmax + dropout [8, 12, 128, 128] 3.5 ms compiled against 10.4 ms, eager dropout
  3.7 ms against 12.6 ms. BERT-base 8x128 training step through accelerate() (accel_sdpa, AdamW), same
  process, alternating: compiled 3.41 s against 3.76 s (1.10x), eager 3.30 s against 3.45 s (1.05x).
  On CUDA torch's dropout kernels and Inductor's Triton code draw vectorised Philox already: off (below).
  2026-11-28 (2-core Zen 5, AVX512-BF16): compiled graphs draw the masks of F.dropout calls with the same kernel
  (accel.compiler.cpu_dropout; BART, OPT, Whisper call the function, not a layer): a small BART's (hidden 256, 2 + 2
  layers, 8x128) bf16 training step 98.7 -> 80.1 ms (1.23x), alternating steps in one process. Found the same day:
  AOTAutograd's common-subexpression pass had merged compiled accel::dropout_mask calls of one shape and p (its
  nondeterministic_seeded tag does not stop it), so a compiled training step drew one mask per shape (every BERT
  layer's attention dropout the same mask); the op now takes a `call` number per call site. The compiled
  figures above drew fewer masks than they should have; the masks are a small part of the step (re-measured:
  benchmarks/results/bert_base_cpu_bf16_recheck_s29.json).
- CUDA, H200, torch 2.11 (2026-11-26, benchmarks/results/*_h200*): eager philox_dropout 0.69-0.86x
  F.dropout's time (a mask kernel and a scale kernel against torch's one) and 0.83x its host cost per call;
  inside a compiled softmax + dropout 0.96-1.60x. The eager call has since become one op whose CUDA kernel
  draws the mask and writes both outputs in one pass (accel::dropout_fwd): to measure before it goes on. fused Adam over 109.5M parameters 1.04x torch's
  fused=True in fp32, 0.76-0.78x with bf16 parameters (fp32 moments against torch's bf16 ones).
  Since 2026-11-27 compiled code on CUDA takes torch's dropout instead of the opaque mask op, whatever the
  hooks (accel.runtime.nn.bias_dropout_add._inductor_draws), so the compiled row can no longer lose.
  LayerNorm's kernels alone 0.97-3.27x forward and 1.24-2.56x backward, but no BERT step A/B with the hook
  on the GPU since the H100 run above: off until one shows a win.
- CUDA, H200, second run (2026-11-26, bert_base_cuda_h200_guide.json): the guide workload in eager bf16 with
  all three hooks (accel-kernels) 1.08x eager-amp (120.7 against 128.1 ms a step). Not yet evidence for any
  one hook: eager-amp steps torch.optim.Adam's default (foreach) path, and accelerate() already switches
  Adam to torch's fused=True; dropout_fwd (one kernel) and the eager call's host cost are in that figure too.
  A per-hook A/B on the GPU decides. H200, 2026-11-27 (bert_base_cuda_h200_run3_32x128.json), BERT-base
  32x128: accel-kernels 1.22x eager-amp (34.3 against 42.0 ms a step), with the same caveat.
- CPU with AVX-512 and AVX512-BF16 (AMD EPYC, 2 cores), torch 2.9 (2026-11-26), where accel's AVX-512 loops
  run: LayerNorm alone 1.0-1.8x torch's forward and 0.95-2.6x its backward (bf16 [4096, 768] backward
  2.6x); fused Adam over 109.5M fp32 parameters 0.66-1.00x torch's fused=True (bf16 parameters 1.1-1.3x,
  but autocast keeps parameters fp32). Yet in BERT-base 8x128 eager training, alternating steps with and
  without the LayerNorm hook, three runs gave 1.04x, 1.00x (bf16 autocast) and 1.02x (fp32): 25 LayerNorms
  are a few ms of a 2.2-3.7 s step, inside this host's +-4% noise. Not a measured win, so still off.
- Under torch.compile, ops whose plain reference Inductor fuses with its neighbours step aside for it
  (benchmarks/kernels.py compiled rows: kernels_cpu_avx512_compiled.json and two runs before it, 2-core
  AVX512-BF16 CPU, 2026-11-27, fwd + bwd, the op in the graph against the plain ops): quick_gelu after a
  bias add 0.56-0.86x, so it traces as plain ops (_common.use_kernel_eagerly); LayerNorm + window partition
  + reverse 0.19-0.54x in fp32 but 1.5-3.1x in bf16 at Swin stage 1 (0.79-0.94x at stage 3, a quarter of
  the bytes), so window_process keeps its ops in compiled CPU code for 16-bit dtypes only. Those that win in
  a compiled graph keep their op there: bias_dropout_add before a LayerNorm 1.3-7.4x, softmax +
  philox_dropout 3.0-10.4x (Inductor's scalar Philox, above); Swin's q k^T + fmha + @ v 1.17-1.19x fp32,
  1.99x bf16 (an A/B script). On CUDA dropout and window_process step aside too (not yet measured there:
  the next kernels run has the compiled rows). The kernels benchmark's compiled peers of runs before
  2026-11-27 (the H200 ones too) ran eagerly past the 8th shape of a case module: its cases share one
  lambda's code object, past Dynamo's recompile limit (kernels.py now raises it: accel.utils.dynamo).
- oneDNN's fp32 products (OneDNNLinear, hooks.enable_onednn_linear) are not in this table: compute.cpu_gemm
  decides them, by a probe on the machine itself (accel.runtime.nn.onednn_mm). AMD EPYC Zen 5, 2026-11-27:
  BERT-base 8x128 fp32 eager with the hooks 1.84x eager, accelerate() 2.29-2.35x (bert_base_cpu_fp32_simulated*).
- Attention on the CPU is not a hook either: compute.cpu_attention decides, by a probe on the machine itself
  (accel.compiler.unpadded_attention.plain_attention_speedup), whether an encoder's bidirectional 16-bit training
  attention runs in plain ops instead of SDPA, whose bf16 CPU flash kernel is slow backwards without AMX (2-core
  Zen 5, 2026-11-27: ViT-base training 1.20-1.22x; packed causal LM 1.08x through varlen_attention's plain backward).
So the one hook of this table that wins today is PhiloxDropout on the CPU, compiled or not. This table is where the
kernel-library issue (9) turns the others on, device by device, as each one beats torch's best in a
measured run.
"""
from __future__ import annotations

import torch

LAYER_NORM = "fused_layer_norm"
DROPOUT = "philox_dropout"
ADAM = "fused_adam"


def helpful_kernels(device_type: str, compiled: bool, dtype: torch.dtype | None) -> frozenset[str]:
    """The hooks that make a training step faster for this device type, compilation and autocast dtype
    (None = fp32)."""
    if device_type == "cpu":
        return frozenset({DROPOUT})  # fp32 and autocast alike: the mask does not depend on the dtype
    return frozenset()
