"""FlexAttention over packed rows on CUDA: each sample's attention, the blocks no sample sees skipped.

With compute.cuda_packed_attention="flex" (and "auto", the default, for a decoder's rows of AUTO_MIN_ROW tokens or
more), PackedModel gives the "accel_sdpa" attention of a packed batch its rows' document BlockMasks
(accel.compiler.packed.document_mask with "flex_attention", built once a forward: one for full attention, and one
for the model's sliding window where it has one), and the attention calls FlexAttention with them wherever the
call fits (`flex_fits`); other calls keep SDPA with the dense document mask. Why: SDPA with a [B, 1, L, L] mask
computes every block of the row, so its cost grows with the row's length squared, not with its samples'. On an
H200 (2026-11-28, bf16 forward + backward, causal, 32 heads of 128): rows of 1024 holding 49 samples 1.94 ms with
the mask, 0.79 ms FlexAttention; rows of 4096 12.8 against 2.10 ms (benchmarks/results/
kernels_cuda_h200_run4_varlen_lce.json); a packed 1B Llama's training step at rows of 4096 61.0 ms against 84.3
(benchmarks/results/causal_lm_cuda_h200_run5_1b.json).
"""
from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

# Inductor's FlexAttention lowering on CUDA refuses narrower heads ("NYI: embedding dimension of the query, key,
# and value must be at least 16", torch 2.11)
MIN_HEAD_DIM = 16

# compute.cuda_packed_attention="auto" takes FlexAttention for causal rows this long or longer, where it won (H200,
# 2026-11-28, bf16 forward + backward, 32 heads of 128: causal rows of 1024 0.79 ms against SDPA with the mask's
# 1.94; a packed 1B Llama's step at rows of 4096 1.38x). Bidirectional rows of 512 lost (0.80 against 0.57 ms).
AUTO_MIN_ROW = 1024


def route_for(route: str, causal: bool, row_length: int) -> str:
    """The route of compute.cuda_packed_attention `route` for packed rows of `row_length` tokens: "auto" is "flex"
    for causal rows of AUTO_MIN_ROW tokens or more, else "mask"; the others are themselves."""
    if route != "auto":
        return route
    return "flex" if causal and row_length >= AUTO_MIN_ROW else "mask"


def flex_runs_on(device: torch.device) -> bool:
    """Whether packed rows take FlexAttention on `device`: CUDA (on the CPU Inductor has no FlexAttention backward
    in torch 2.9, pytorch/pytorch#169224, and packed samples take accel's own per-sample attention there)."""
    return device.type == "cuda"


def flex_fits(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether flex_document_attention takes these [B, H, L, D] queries and keys: a device it runs on,
    self-attention over one length, heads of MIN_HEAD_DIM or more, key heads dividing the query heads."""
    return (query.shape[-1] >= MIN_HEAD_DIM and query.shape[2] == key.shape[2] and query.shape[1] % key.shape[1] == 0
            and flex_runs_on(query.device))


@functools.cache
def _compiled_flex_attention(dynamic_lengths: bool):
    # Outside a compiled graph FlexAttention runs its unfused reference (every score materialised), so the calls of
    # an uncompiled model take it compiled. On CUDA with Dynamo's automatic dynamic shapes (flex_document_attention
    # turns them on for the call: importing torch_xla turns them off for the process): a new row length compiles
    # one graph of symbolic lengths that later lengths reuse. With dynamic=False each length compiled a graph of
    # its own, and rows of ever-changing lengths (a user's flattened rows without buckets) reached Dynamo's
    # recompile limit after 8 and fell back to the unfused reference for the rest of the process. The CPU (where
    # only tests let FlexAttention through, flex_runs_on) stays static: Inductor's CPU FlexAttention template does
    # not compile symbolic lengths (torch 2.9 and 2.14: "'cur_qSplitSize8' was not declared").
    return torch.compile(flex_attention, dynamic=None if dynamic_lengths else False)


def flex_document_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: BlockMask,
                            scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T scale) v over the keys block_mask allows each query (grouped key/value heads shared by
    their query heads).

    Args:
        query: [B, H, L, D]; key, value: [B, Hkv, L, D] with Hkv dividing H (flex_fits).
        block_mask: a BlockMask of shape (B, 1, L, L) (every head alike).
        scale: the scores' factor; None: 1 / sqrt(D).

    Returns:
        [B, H, L, D] in the products' dtype: autocast's where it is on (FlexAttention is not an autocast op, and a
        Llama's rotary embedding may hand it fp32 queries beside 16-bit values), else the queries'.
    """
    device = query.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype
    query, key, value = (t.to(dtype) for t in (query, key, value))
    options = dict(block_mask=block_mask, scale=scale, enable_gqa=query.shape[1] != key.shape[1])
    if torch.compiler.is_compiling():
        return flex_attention(query, key, value, **options)
    symbolic = device == "cuda"
    with torch._dynamo.config.patch(automatic_dynamic_shapes=symbolic):
        return _compiled_flex_attention(symbolic)(query, key, value, **options)
