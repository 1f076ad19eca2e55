"""SDPA without a mask for batches without padding, under torch.compile too.

A batch with no padding needs no attention mask, and SDPA without one may take its fastest kernels
(FlashAttention takes no mask on CUDA). transformers skips the mask of a model with "sdpa" attention when the
[B, L] padding mask is absent or all ones, but only outside a traced graph: while Dynamo traces, torch 2.9-2.13
answer True to `torch.compiler.is_exporting()` (pytorch/pytorch#176347, fixed in 2.14 by #176499), so
transformers builds a [B, 1, L, L] mask of ones even for a call without any mask, and every compiled step runs
its attention masked.

Two parts remove that mask, each exact:
- the model's attention becomes ACCEL_SDPA: transformers' own SDPA attention function, registered under
  another name beside a mask builder that returns no mask when there is no padding mask, in an encoder's
  bidirectional attention, and otherwise builds transformers' SDPA mask (`AttentionInterface` and
  `AttentionMaskInterface`, transformers' documented registries for custom attention);
- for a loop that passes a mask of ones, the loader can drop it while the batch is still on the host
  (opt-in: dataloader.drop_full_masks, accel.data.full_mask).
Padded batches keep their masks and their results; tests/compiler/test_unpadded_attention.py compares both
against the model with "sdpa" attention given the mask.

ACCEL_SDPA also honours the attention module's own dropout layer when it is not torch's nn.Dropout (accelerate()
swaps in accel's PhiloxDropout where its kernel wins, accel.runtime.policy): SDPA would draw the dropout of the
probabilities itself and ignore that layer, so while training with dropout the attention is computed in plain
ops, as transformers' eager attention does, with the layer applied to the probabilities. On the CPU that is also
what SDPA computes whenever it drops (its fused CPU kernels take no dropout): only the mask's source changes.

On the CPU, a bidirectional training attention in bf16/fp16 (an encoder's, or an encoder-decoder's
cross-attention) may also be computed in those plain ops (accelerate()'s
compute.cpu_attention, `unpadded_attention(model, plain_training=True)`): torch's 16-bit CPU flash kernel is slow
backwards on a CPU without AMX. A 2-core AMD EPYC with AVX512-BF16 (Zen 5), torch 2.9, 2026-11-27, [B, 12, L, 64]
bf16 forward + backward: unmasked, plain ops compiled 2.8-5.7x SDPA's speed at L = 128-197, 1.5x at 577, 1.1x
at 1024; with a padding mask 3.1x at 128, 1.8x at 256, 1.6x at 384, 1.5x at 512, 5.1x at 64 (forward alone
0.9-1.0x, so calls without gradients keep SDPA; fp32 0.92-0.99x). `plain_attention_speedup` measures it on the
machine at hand. A decoder's causal attention (`plain_causal`, its own probe: SDPA's causal kernel skips the
blocks above the diagonal) gains less: 1.86x at 256 tokens, 1.60x at 512, 0.92x at 1024 (8 query heads over 4
key/value heads, repeated for the plain products), hence MAX_PLAIN_CAUSAL_LENGTH. Under bf16 autocast a Llama's
attention gets fp32 queries (its rotary embedding's cos/sin are fp32), which autocast casts to bf16 for SDPA and for
the plain ops' products alike: such a call counts as 16-bit.
Packed rows' per-sample attention takes plain products too, for the backward of short samples (varlen_attention's
`plain`), causal or not: there a sample's products are what the flash kernel computes anyway.
"""
from __future__ import annotations

import functools
import inspect

import torch
from torch import nn
from torch.nn.modules.dropout import Dropout as _TorchDropout

from accel.compiler.flex_rows import flex_document_attention, flex_fits
from accel.utils.timing import best_time
from accel.utils.transformers_models import is_transformers_model

SDPA = "sdpa"
ACCEL_SDPA = "accel_sdpa"
# The keyword arguments PackedModel passes down to ACCEL_SDPA's attention: the rows' [B, L] segment ids, and
# whether its document mask is causal (a decoder's).
SEGMENT_IDS = "accel_segment_ids"
SEGMENTS_CAUSAL = "accel_segments_causal"
# On CUDA, with compute.cuda_packed_attention "varlen": the rows' static cu_seqlens (accel.data.packing.static_cu_seqlens)
CU_SEQLENS = "accel_cu_seqlens"
# With "flex": the rows' document BlockMasks by sliding window (None: full attention; accel.compiler.flex_rows)
FLEX_MASKS = "accel_flex_masks"
# Set by unpadded_attention on a model's modules that hold its config or a sub-config (its attention modules among
# them): whether their bidirectional 16-bit training attention on the CPU takes plain ops (see the module docstring).
PLAIN_TRAINING = "_accel_plain_training"
# The same for a causal (decoder's) training attention: a marker of its own, as its probe differs
PLAIN_CAUSAL = "_accel_plain_causal"
# Longer sequences keep SDPA: plain ops keep [B, H, L, L] probabilities for the backward.
MAX_PLAIN_LENGTH = 1024
# Causal: SDPA's flash kernel skips the blocks above the diagonal, so plain ops lead by less and stop leading
# sooner (bf16 fwd+bwd, 8 heads of 64 over 4 key/value heads, compiled: 1.86x at 256, 1.60x at 512, 0.92x at 1024;
# benchmarks/results/kernels_cpu_avx512_cpu_attention.json)
MAX_PLAIN_CAUSAL_LENGTH = 512
# plain_attention_speedup must find plain ops this much faster for compute.cpu_attention="auto" to take them.
MIN_PLAIN_SPEEDUP = 1.25
_PROBE_SHAPE = (4, 12, 256, 64)  # B, H, L, D: a BERT-base / ViT-base layer's attention, a few samples
_NO_DROPOUT = nn.Identity()
# What a call may ask of the attention beyond q, k, v and a mask, which the per-sample and plain ways do not do. A
# sliding window is not among them: transformers puts it in the mask wherever it cuts (SDPA never reads the keyword),
# and the plain ops take the same mask; the per-sample ways, which build no mask, cut it inside each sample.
_SDPA_ONLY_KWARGS = ("softcap", "position_bias", "cache", "s_aux", "head_mask")


def _mask_builder(sdpa_mask):
    """transformers' sdpa_mask, except that bidirectional attention without a padding mask gets no mask."""
    signature = inspect.signature(sdpa_mask)

    def mask(*args, **kwargs):
        # Bound to sdpa_mask's own signature, however this transformers passes them (names differ by version).
        arguments = signature.bind_partial(*args, **kwargs).arguments
        if (arguments.get("attention_mask") is None and arguments.get("allow_is_bidirectional_skip", False)
                and arguments.get("local_size") is None):
            return None
        return sdpa_mask(*args, **kwargs)

    return mask


def _own_dropout(module: nn.Module, p: float) -> nn.Module | None:
    """The attention module's dropout layer when it drops p and is not torch's own (see the module docstring)."""
    layer = getattr(module, "dropout", None)
    if isinstance(layer, _TorchDropout) and type(layer) is not _TorchDropout and layer.p == p:
        return layer
    return None


def _plain_attention(query, key, value, attention_mask, scaling, dropout_layer: nn.Module) -> torch.Tensor:
    """softmax(q k^T scaling + mask) v with dropout_layer on the probabilities, as transformers' eager attention.
    [B, H, Lq, D] queries, [B, H, Lk, D] keys and values; a bool mask keeps where True. Returns [B, Lq, H, D]."""
    scores = torch.matmul(query, key.transpose(2, 3)) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(attention_mask.logical_not(), torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask
    probs = dropout_layer(scores.softmax(-1, dtype=torch.float32).to(query.dtype))
    return torch.matmul(probs, value).transpose(1, 2).contiguous()


@functools.cache
def plain_attention_speedup(dtype: torch.dtype = torch.bfloat16, causal: bool = False) -> float:
    """How many times faster plain ops train an unmasked bidirectional (or causal) attention (forward + backward,
    [4, 12, 256, 64] in dtype, eager) than F.scaled_dot_product_attention on this CPU. Measured once per process,
    dtype and kind (~0.5 s). Eager plain ops are the slower kind (compiled, Inductor fuses the scaling, the softmax
    and its casts), so where they win the compiled ones win by more: the 2-core Zen 5 above, bf16, with
    memory.keep_freed_memory (accelerate()'s default on the CPU) 2.2-2.8 here in five processes (1.1-1.8
    without it: page faults on the fresh [B, H, L, L] tensors) against 3.6x compiled; causal 1.75-1.8 eager."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.enable_grad():
        gen = torch.Generator().manual_seed(0)
        q, k, v, grad = (torch.randn(_PROBE_SHAPE, generator=gen).to(dtype) for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_()

        def train(attention):
            return lambda: torch.autograd.grad(attention(q, k, v), (q, k, v), grad)

        mask = torch.ones(_PROBE_SHAPE[2], _PROBE_SHAPE[2], dtype=torch.bool).tril() if causal else None

        def plain(q, k, v):  # [B, L, H, D] -> SDPA's [B, H, L, D]
            return _plain_attention(q, k, v, mask, None, _NO_DROPOUT).transpose(1, 2)

        def sdpa(q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

        return best_time(train(sdpa), repeats=5) / best_time(train(plain), repeats=5)


def _plain_training(module: nn.Module, query, key, attention_mask, dropout: float, kwargs: dict) -> bool:
    """Whether this call is a 16-bit training attention on the CPU, unmasked or with a [B, 1|H, Lq, Lk] tensor mask
    (padding, packed rows' document mask), that the module was told to compute in plain ops: bidirectional
    (PLAIN_TRAINING; self-attention, or an encoder-decoder's cross-attention, whose keys are the encoder's
    positions) or, for a module whose attention is causal, causal self-attention (PLAIN_CAUSAL)."""
    causal = getattr(module, "is_causal", False) is True
    longest = MAX_PLAIN_CAUSAL_LENGTH if causal else MAX_PLAIN_LENGTH
    return (getattr(module, PLAIN_CAUSAL if causal else PLAIN_TRAINING, False) and dropout == 0
            and (attention_mask is None or (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4))
            and query.device.type == "cpu" and _sixteen_bit(query) and query.requires_grad
            and query.shape[2] <= longest and key.shape[2] <= longest
            and (query.shape[2] == key.shape[2] or not causal)
            and query.shape[1] % key.shape[1] == 0
            and all(not kwargs.get(name) for name in ("is_causal",) + _SDPA_ONLY_KWARGS))


def _sixteen_bit(query: torch.Tensor) -> bool:
    """Whether the attention's products run in 16 bits: 16-bit queries, or fp32 ones under a 16-bit CPU autocast (a
    Llama's rotary embedding turns its bf16 projections back into fp32; autocast casts them for SDPA, whose 16-bit
    flash kernel is the slow one, as for the plain ops' products)."""
    sixteen = (torch.bfloat16, torch.float16)
    return query.dtype in sixteen or (query.dtype == torch.float32 and torch.is_autocast_enabled("cpu")
                                      and torch.get_autocast_dtype("cpu") in sixteen)


def _plain_module_attention(module: nn.Module, query, key, value, attention_mask, scaling) -> torch.Tensor:
    """_plain_attention for a call _plain_training accepted: grouped key/value heads repeated for their query heads
    (transformers' repeat_kv), and a causal module's missing mask (SDPA's is_causal) made explicit."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    if attention_mask is None and getattr(module, "is_causal", False) is True:
        attention_mask = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool, device=query.device).tril()
    return _plain_attention(query, key, value, attention_mask, scaling, _NO_DROPOUT)


def _sample_windows(module: nn.Module, kwargs: dict) -> list[int]:
    """The sliding windows a call asks for: its sliding_window keyword (Mistral's config's, Qwen's per layer) and
    the module's own."""
    return [w for w in (kwargs.get("sliding_window"), getattr(module, "sliding_window", None)) if w is not None]


def _per_sample(module: nn.Module, query, key, segments, dropout: float, kwargs: dict) -> bool:
    """Whether a call given packed rows' segment ids can compute each sample alone, what its document mask gives:
    self-attention over the whole row, without dropout, soft-capping or a bias (a sliding window is taken along:
    both ways cut it inside each sample)."""
    length = segments.shape[1]
    return (query.shape[2] == key.shape[2] == length and not (dropout > 0 and module.training)
            and all(kwargs.get(name) is None for name in _SDPA_ONLY_KWARGS))


def _attention(sdpa_forward):
    """transformers' SDPA attention function; per sample for packed rows given their segment ids (SEGMENT_IDS,
    from PackedModel): varlen_attention on the CPU, on CUDA torch's FlashAttention varlen kernel given their
    cu_seqlens too (CU_SEQLENS) or FlexAttention given their BlockMasks (FLEX_MASKS); or _plain_attention while
    training with the module's own dropout layer (encoder self-attention with as many key as query heads, nothing
    else asked of SDPA)."""

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        segments, causal = kwargs.pop(SEGMENT_IDS, None), kwargs.pop(SEGMENTS_CAUSAL, False)
        cu_seqlens, flex_masks = kwargs.pop(CU_SEQLENS, None), kwargs.pop(FLEX_MASKS, None)
        windows = _sample_windows(module, kwargs) if segments is not None else []
        if (segments is not None and _per_sample(module, query, key, segments, dropout, kwargs)
                and (causal or not windows)):
            from accel.runtime.nn import varlen_attention as varlen

            # causal as the document mask it replaces is (not as the module says: some do not say); a call's
            # keyword and its module name one window (Mistral's, a Qwen or Gemma layer's) or none
            window = min(windows, default=None)
            block_mask = _window_mask(flex_masks, window, query.shape[2])
            if block_mask is not None and flex_fits(query, key):
                out = flex_document_attention(query, key, value, block_mask, scale=scaling)
                return out.transpose(1, 2).contiguous(), None
            if cu_seqlens is not None and varlen.flash_varlen_fits(query, key):
                out = varlen.flash_varlen_attention(query, key, value, cu_seqlens, is_causal=causal, scale=scaling,
                                                    window=window)
                return out.transpose(1, 2), None
            if query.device.type == "cpu":
                out = varlen.varlen_attention(query, key, value, segments, is_causal=causal, scale=scaling,
                                              plain=getattr(module, PLAIN_CAUSAL if causal else PLAIN_TRAINING, False),
                                              window=window)
                return out.transpose(1, 2).contiguous(), None
        if _plain_training(module, query, key, attention_mask, dropout, kwargs):
            return _plain_module_attention(module, query, key, value, attention_mask, scaling), None
        layer = _own_dropout(module, dropout) if dropout > 0 and module.training else None
        if (layer is None or key.shape[1] != query.shape[1] or getattr(module, "is_causal", False)
                or any(kwargs.get(name) is not None for name in ("is_causal", "position_bias", "cache", "softcap"))):
            return sdpa_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        return _plain_attention(query, key, value, attention_mask, scaling, layer), None

    return attention


def _window_mask(flex_masks: dict | None, window: int | None, length: int):
    """The BlockMask of FLEX_MASKS for a call's sliding window (a window as long as the row cuts nothing), or None
    where there is none for it."""
    if flex_masks is None:
        return None
    return flex_masks.get(window if window is not None and window < length else None)


def _register() -> bool:
    """Registers ACCEL_SDPA with transformers (again: the same entries); False where this transformers has no
    such registries."""
    try:
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:
        return False
    AttentionInterface.register(ACCEL_SDPA, _attention(sdpa_attention_forward))
    AttentionMaskInterface.register(ACCEL_SDPA, _mask_builder(sdpa_mask))
    return True


def switches(model: nn.Module) -> bool:
    """Whether unpadded_attention switches `model` (or has): a transformers model with "sdpa" (or "accel_sdpa")
    attention: an encoder, a decoder or an encoder-decoder (the mask builder changes only a bidirectional
    attention's missing padding mask; causal and cross-attention masks are transformers' own)."""
    return is_transformers_model(model) and getattr(model.config, "_attn_implementation", None) in (SDPA, ACCEL_SDPA)


def causal_kinds(model: nn.Module) -> set[bool]:
    """Which kinds of self-attention the model's switched attention modules compute: False for bidirectional,
    True for causal (their `is_causal`)."""
    return {module.is_causal for module in model.modules()
            if isinstance(getattr(module, "is_causal", None), bool)
            and getattr(getattr(module, "config", None), "_attn_implementation", None) in (SDPA, ACCEL_SDPA)}


def unpadded_attention(model: nn.Module, plain_training: bool = False, plain_causal: bool = False) -> bool:
    """Switch a transformers model with "sdpa" attention to ACCEL_SDPA (see the module docstring).

    Args:
        model: any module; only a transformers model whose config says "sdpa" attention changes.
        plain_training: its bidirectional bf16/fp16 training attention (unmasked or padded) on the CPU is computed
            in plain ops rather than by SDPA (where plain_attention_speedup found them faster; accelerate() decides).
        plain_causal: the same for its causal attention (a Llama-like model: attention modules with is_causal),
            up to MAX_PLAIN_CAUSAL_LENGTH tokens.

    Returns:
        Whether the model now uses ACCEL_SDPA (also True when it already did).
    """
    if not switches(model) or (model.config._attn_implementation == SDPA and not _register()):
        return False
    config = model.config
    config._attn_implementation = ACCEL_SDPA  # transformers sets a composite model's sub-configs too (CLIP's)
    for module in model.modules():  # the modules an attention function is given hold the config they read
        if getattr(getattr(module, "config", None), "_attn_implementation", None) == ACCEL_SDPA:
            setattr(module, PLAIN_TRAINING, plain_training)
            setattr(module, PLAIN_CAUSAL, plain_causal)
    return True
