"""Training a transformers model on packed rows, every sample computed as if it were alone.

A packed row (accel.data.packing) holds several samples back to back in one static shape. Position ids that
restart per sample are not enough to keep them apart: attention would still mix the samples, and a
sequence-classification head pools only the row's first token, so a row would get one prediction instead of
one per sample. `document_mask` keeps attention inside each sample (a FlexAttention BlockMask, or a 4-D mask
for SDPA and eager attention; transformers' mask builders return any 4-D mask unchanged, so it reaches every
attention layer as built), and `PackedModel` runs the model with that mask and the restarting position ids.
For sequence classification it pools each sample's first token (a decoder's classifier: scores its last token)
and takes the loss over the samples. For a
causal language model the mask is causal within each sample too, and the label of each sample's first token
is ignored: the model's loss shifts the labels by one, so that label is what the previous sample's last token
would otherwise be trained to predict. A packed batch then gives each sample the same logits, loss and
gradients as running the samples one at a time (tests/compiler/test_packed.py). torch 2.9 has no varlen
attention module (torch.nn.attention.varlen) and transformers does not dispatch to one, so varlen kernels are
not a backend here.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from accel.compiler import flex_rows
from accel.compiler.first_token import last_layer_rows, sees_every_position
from accel.compiler.unpadded_attention import (
    ACCEL_SDPA,
    CU_SEQLENS,
    FLEX_MASKS,
    SDPA,
    SEGMENT_IDS,
    SEGMENTS_CAUSAL,
)
from accel.config import CUDA_PACKED_ATTENTION
from accel.data.packing import LABEL_PAD, block_diagonal_mask, static_cu_seqlens
from accel.runtime.nn import varlen_attention
from accel.utils.modules import acts_as_linear
from accel.utils.transformers_models import CAUSAL_LM_HEADS, MASKED_LM_HEADS, transformers_model

FLEX = "flex_attention"
BACKENDS = (FLEX, SDPA, ACCEL_SDPA, "eager")
# Heads whose loss is already per token: with attention kept per sample, the model's own loss over the packed
# per-token labels is the loss over the same tokens unpacked.
_TOKEN_HEADS = MASKED_LM_HEADS + ("ForTokenClassification",)
_SEQUENCE_HEAD = "ForSequenceClassification"
# Models whose ALiBi attention biases count positions in the [B, L] padding mask, not in position ids: packed rows
# cannot restart them per sample (Falcon says so with config.alibi).
_ALIBI_MODEL_TYPES = ("bloom", "mpt")


def document_mask(segment_ids: torch.Tensor, backend: str, dtype: torch.dtype = torch.float32,
                  causal: bool = False, window: int | None = None) -> BlockMask | torch.Tensor:
    """The attention mask that lets each token of a packed batch see only its own sample.

    Padding (segment 0) attends to padding only, so no softmax row is empty and padding never reaches a sample.

    Args:
        segment_ids: [B, L] integer tensor, 1, 2, ... per packed sample and 0 for the padding tail.
        backend: the model's `config._attn_implementation`: "flex_attention", "sdpa", "accel_sdpa" or "eager".
        dtype: the model's floating dtype; used only by the additive mask for "eager".
        causal: each token sees only its own sample's tokens up to itself (a decoder's attention).
        window: with causal, each token sees only the last `window` of those, itself included (sliding-window
            attention: transformers' Mistral, Gemma's local layers).

    Returns:
        "flex_attention": a BlockMask of shape (B, 1, L, L) on segment_ids' device.
        "sdpa", "accel_sdpa": a bool tensor [B, 1, L, L], True where attention is allowed. Bool rather than
            additive because SDPA needs a float mask in the query's dtype, which under autocast is not the
            model's dtype.
        "eager": an additive float tensor [B, 1, L, L] in `dtype`: 0 where allowed, dtype's minimum elsewhere.
    """
    if window is not None and (not causal or isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be None or a positive int, with causal=True; got {window!r}")
    if not isinstance(segment_ids, torch.Tensor) or segment_ids.dim() != 2:
        shape = tuple(segment_ids.shape) if isinstance(segment_ids, torch.Tensor) else type(segment_ids).__name__
        raise ValueError(f"segment_ids must be a [B, L] tensor, got {shape}")
    if segment_ids.dtype.is_floating_point or segment_ids.dtype.is_complex or segment_ids.dtype == torch.bool:
        raise ValueError(f"segment_ids must hold integers, got dtype {segment_ids.dtype}")
    if backend == FLEX:
        batch, length = segment_ids.shape

        def same_segment(b, h, q_idx, kv_idx):
            return segment_ids[b, q_idx] == segment_ids[b, kv_idx]

        def same_segment_causal(b, h, q_idx, kv_idx):
            return (segment_ids[b, q_idx] == segment_ids[b, kv_idx]) & (q_idx >= kv_idx)

        def same_segment_window(b, h, q_idx, kv_idx):
            return same_segment_causal(b, h, q_idx, kv_idx) & (q_idx - kv_idx < window)

        mask_mod = same_segment_window if window is not None else same_segment_causal if causal else same_segment
        # H=None: one mask shared by every head.
        return create_block_mask(mask_mod, batch, None, length, length, device=segment_ids.device)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating dtype, got {dtype}")
    allowed = block_diagonal_mask(segment_ids, "bool").unsqueeze(1)  # [B, 1, L, L]
    if causal:
        length = segment_ids.shape[1]
        ones = torch.ones(length, length, dtype=torch.bool, device=allowed.device)
        allowed = allowed & (ones.tril() if window is None else ones.tril() & ones.triu(1 - window))
    if backend in (SDPA, ACCEL_SDPA):
        return allowed
    # Built from the bool mask on segment_ids' device (block_diagonal_mask's additive form allocates on the CPU).
    zero = torch.zeros((), dtype=dtype, device=segment_ids.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


def flex_document_masks(segment_ids: torch.Tensor, causal: bool, window: int | None) -> dict:
    """FLEX_MASKS for unpadded_attention: the rows' document BlockMask under None, and with a sliding window (which
    must be causal) the windowed one under the window."""
    masks = {None: document_mask(segment_ids, FLEX, causal=causal)}
    if window is not None:
        masks[window] = document_mask(segment_ids, FLEX, causal=True, window=window)
    return masks


def sliding_window(config, row_length: int | None = None) -> tuple[int | None, bool]:
    """(window, whether every layer slides) of a transformers decoder with sliding-window attention, else
    (None, False): Mistral's layers all slide, Gemma's alternate local (sliding) and global layers
    (config.layer_types), Qwen2 slides only with use_sliding_window. With `row_length`, a window at least that long
    is none (a shorter row is within any window)."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None, False
    if row_length is not None and window >= row_length:
        return None, False
    types = getattr(config, "layer_types", None)
    if not types:
        return window, True
    sliding = [t == "sliding_attention" for t in types]
    return (window, all(sliding)) if any(sliding) else (None, False)


def takes_var_keywords(fn) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())


def _pools_first_token(pooler: nn.Module, hidden_size: int) -> bool:
    """Whether pooler([N, T, H]) is [N, H] and depends on token 0 only (what BERT's pooler does)."""
    weight = next(pooler.parameters(), None)
    if weight is None or weight.device.type == "meta":
        return True  # nothing to run it on; trust the structural checks
    probe = torch.linspace(-1.0, 1.0, 2 * 3 * hidden_size, dtype=weight.dtype, device=weight.device)
    probe = probe.view(2, 3, hidden_size)
    was_training = pooler.training
    pooler.eval()
    try:
        with torch.no_grad():
            full, first = pooler(probe), pooler(probe[:, :1])
    finally:
        pooler.train(was_training)
    return (isinstance(full, torch.Tensor) and full.shape == (2, hidden_size)
            and torch.allclose(full, first, rtol=1e-4, atol=1e-5))


def _distilbert_head(model: nn.Module) -> bool:
    """Whether the sequence classifier's head is DistilBERT's: no pooler, pre_classifier -> ReLU -> dropout ->
    classifier over the first token."""
    return (getattr(model.base_model, "pooler", None) is None and type(model).__name__.startswith("DistilBert")
            and all(acts_as_linear(getattr(model, n, None)) for n in ("pre_classifier", "classifier"))
            and isinstance(getattr(model, "dropout", None), nn.Dropout))


def _move_keys(mapping: dict, old_prefix: str, new_prefix: str) -> None:
    """Renames keys old_prefix + rest to new_prefix + rest in place, keeping their order."""
    # Pop all first, then insert: a renamed key may equal a key not yet renamed (a wrapped model with a
    # child named "model" has both "model.x" and "model.model.x" here).
    moved = [(key, mapping.pop(key)) for key in [k for k in mapping if k.startswith(old_prefix)]]
    for key, value in moved:
        mapping[new_prefix + key[len(old_prefix):]] = value


def _state_dict_without_wrapper(module, state_dict, prefix, local_metadata) -> None:
    _move_keys(state_dict, prefix + "model.", prefix)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        _move_keys(metadata, prefix + "model.", prefix)
        if prefix + "model" in metadata:
            metadata[prefix[:-1]] = metadata.pop(prefix + "model")


def _load_state_dict_into_wrapper(module, state_dict, prefix, *args) -> None:
    _move_keys(state_dict, prefix, prefix + "model.")


class PackedModel(nn.Module):
    """Runs a transformers model on packed rows so each sample is computed as if it were alone.

    Supported: encoder models whose class name ends in ForMaskedLM or ForTokenClassification (the model's own
    per-token loss is used), or ForSequenceClassification with a BERT-style head (`model.base_model.pooler`
    pooling the first token, then `model.dropout` and `model.classifier`) or DistilBERT's (the first token through
    `model.pre_classifier`, a ReLU, `model.dropout` and `model.classifier`), single-label classification only;
    causal language models whose class name ends in ForCausalLM or LMHeadModel (the model's own loss on its
    shifted labels, each sample's first label ignored), and a decoder's ForSequenceClassification (a `score`
    layer over each sample's last token, as GPT-2's, Llama's or Mistral's; single-label); attention
    "flex_attention", "sdpa", "accel_sdpa" or "eager". A decoder with sliding-window attention keeps its window
    inside each sample (Mistral: every layer; Gemma: its local layers, through transformers' mask per kind of
    layer). Encoder-decoder models are not supported.

    The wrapped model is `self.model`, unchanged, and shares its parameters. `state_dict()` and
    `load_state_dict()` use the wrapped model's keys (no "model." prefix), so checkpoints move freely between
    the two; `named_parameters()` keeps the prefix, as for any submodule. Other attributes the wrapper lacks
    (generate, save_pretrained, ...) are the wrapped model's.

    A sequence classifier reads one position per sample of the last layer (an encoder's first token, a
    decoder's last), so with `first_tokens_only` that layer computes those positions alone
    (accel.compiler.first_token; where the layer is built like BertLayer, or LlamaDecoderLayer in a Llama, Mistral
    or Qwen model, and the attention is "sdpa", "accel_sdpa" or "eager"), the rest of the row only as keys and
    values.

    Args:
        model: the transformers model to wrap, or a PEFT model around one whose adapters sit in its layers (LoRA):
            called as it is, its transformers model read for the rest.
        first_tokens_only: let a sequence classifier's last layer compute only the samples' tokens its head reads
            (accelerate()'s compute.first_token_only). Outputs and gradients are the same either way.
        cuda_attention: how an "accel_sdpa" model's self-attention keeps packed samples apart on CUDA
            (accelerate()'s compute.cuda_packed_attention): "mask" (SDPA with the document mask), "varlen" (each
            sample alone by torch's FlashAttention varlen kernel, torch 2.10+ and compute capability 8.0+, for
            batches that carry seq_lens), "flex" (FlexAttention with the rows' document BlockMask,
            accel.compiler.flex_rows) or "auto" ("flex" for a decoder's rows of flex_rows.AUTO_MIN_ROW tokens or
            more, else "mask"), each where the call allows it (no attention dropout while training; varlen:
            16-bit, heads up to 256; flex: heads of 16 or more); elsewhere the document mask.

    Raises:
        ValueError: an encoder-decoder model, ALiBi attention, a PEFT prompt-learning model, an encoder head on a
            decoder, an attention implementation not in BACKENDS, a head it cannot pack, or a sequence classifier
            for regression / multi-label or without a first-token pooler.
    """

    def __init__(self, model: nn.Module, first_tokens_only: bool = True, cuda_attention: str = "auto"):
        super().__init__()
        config = getattr(model, "config", None)
        if not isinstance(model, nn.Module) or config is None:
            raise ValueError("model must be a transformers model (an nn.Module with .config), "
                             f"got {type(model).__name__}")
        peft_config = getattr(model, "active_peft_config", None)
        if getattr(peft_config, "is_prompt_learning", False):
            raise ValueError(f"model is a PEFT {peft_config.peft_type} model, which adds virtual tokens to every call; "
                             "packed rows hold several samples, so PackedModel packs PEFT models whose adapters sit in "
                             "the layers (LoRA, IA3, ...) only")
        # A PEFT (LoRA) model is called as it is; what PackedModel reads of the model (its class, head, layers) is
        # the transformers model inside it, whose layers hold the adapters.
        wrapper, model = model, transformers_model(model)
        name = type(model).__name__
        if getattr(config, "is_encoder_decoder", False):
            raise ValueError(f"model {name} is an encoder-decoder; PackedModel supports encoders and causal "
                             "language models")
        if getattr(config, "model_type", None) in _ALIBI_MODEL_TYPES or getattr(config, "alibi", False) is True:
            raise ValueError(f"model {name} has ALiBi attention, whose positions come from the [B, L] padding mask: "
                             "packed rows cannot restart them per sample")
        backend = getattr(config, "_attn_implementation", None)
        if backend not in BACKENDS:
            raise ValueError(f"model's attention implementation must be one of {BACKENDS}, got {backend!r}")
        if name.endswith(CAUSAL_LM_HEADS):
            self.head = "causal"
        elif getattr(config, "is_decoder", False):
            raise ValueError(f"model {name} is a decoder with an encoder's head; PackedModel packs decoders as "
                             f"causal language models (*{', *'.join(CAUSAL_LM_HEADS)})")
        elif name.endswith(_TOKEN_HEADS):
            self.head = "token"
        elif name.endswith(_SEQUENCE_HEAD):
            # a decoder's classifier scores its last token (GPT-2, Llama, Mistral: `score`, no pooler)
            scores_last = isinstance(getattr(model, "score", None), nn.Module) and getattr(
                model.base_model, "pooler", None) is None
            self.head = "last_token" if scores_last else "sequence"
            self._check_sequence_head(model, self.head)
        else:
            raise ValueError(f"model {name} has an unsupported head; PackedModel supports "
                             f"*{', *'.join(_TOKEN_HEADS + CAUSAL_LM_HEADS)} and *{_SEQUENCE_HEAD}")
        self.model = wrapper
        self._inner = (model,)  # a tuple: not a second registration of the same submodule
        if cuda_attention not in CUDA_PACKED_ATTENTION:
            raise ValueError(f"cuda_attention: expected one of {', '.join(map(repr, CUDA_PACKED_ATTENTION))}, "
                             f"got {cuda_attention!r}")
        self.cuda_attention = cuda_attention
        # Whether extra keyword arguments reach the attention functions (transformers 5's **kwargs)
        self._passes_kwargs = all(takes_var_keywords(type(m).forward)
                                  for m in dict.fromkeys((wrapper, model, model.base_model)))
        # The selecting forward of the last layer (a plain object, not a submodule), or None: the full layer.
        self._last_layer = last_layer_rows(model) if first_tokens_only and self.head in ("sequence", "last_token") \
            else None
        self._distilbert_head = self.head == "sequence" and _distilbert_head(model)  # else a BERT-style pooler
        self.register_state_dict_post_hook(_state_dict_without_wrapper)
        self.register_load_state_dict_pre_hook(_load_state_dict_into_wrapper)

    @staticmethod
    def _check_sequence_head(model: nn.Module, head: str) -> None:
        name, config = type(model).__name__, model.config
        problem = getattr(config, "problem_type", None)
        if config.num_labels < 2 or problem in ("regression", "multi_label_classification"):
            raise ValueError(f"model {name} is set up for {problem or 'regression'} (num_labels="
                             f"{config.num_labels}); PackedModel supports single-label classification only, as "
                             "packed rows carry one class id per sample")
        if head == "last_token" or _distilbert_head(model):
            return
        pooler = getattr(model.base_model, "pooler", None)
        if not isinstance(pooler, nn.Module):
            raise ValueError(f"model {name} has no pooler on its base model; PackedModel's sequence "
                             "classification needs a BERT-style pooler (model.base_model.pooler) or DistilBERT's "
                             "head (pre_classifier -> ReLU -> dropout -> classifier)")
        for part in ("dropout", "classifier"):
            if not isinstance(getattr(model, part, None), nn.Module):
                raise ValueError(f"model {name} has no .{part}; PackedModel's sequence classification needs "
                                 "the BERT head pooler -> dropout -> classifier")
        if not _pools_first_token(pooler, config.hidden_size):
            raise ValueError(f"model {name}'s pooler ({type(pooler).__name__}) does not pool the first token "
                             "of [N, T, H] into [N, H]; PackedModel cannot pool each packed sample with it")

    @property
    def config(self):
        return self.model.config

    def __getattr__(self, name: str):
        """What the wrapped model has and the wrapper does not (generate, save_pretrained,
        get_input_embeddings, ...), from the wrapped model: it is what users call them on."""
        try:
            return super().__getattr__(name)  # parameters, buffers and submodules (self.model among them)
        except AttributeError:
            if name.startswith("__") or "model" not in self._modules:  # pickling, or before __init__ set it
                raise
            return getattr(self._modules["model"], name)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                segment_ids: torch.Tensor | None = None, token_type_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, seq_lens: torch.Tensor | None = None, **kwargs):
        """Runs the packed batch; takes a PackedCollator(mask="none", keep_segment_info=True) batch as **batch.
        A batch without segment_ids (an ordinary one, padded or not: evaluation, inference) goes to the wrapped
        model as it is, with its own outputs.

        Args:
            input_ids, position_ids, segment_ids: [B, L] from PackedDataset (position ids restart at 0 per
                sample, segment ids 1, 2, ... per sample and 0 for padding).
            token_type_ids: optional [B, L].
            labels: token heads and causal language models: per-token [B, L], -100 ignored (a causal model's
                loss predicts each token's label from the token before it, as unpacked). Sequence
                classification: one class id per segment [B, S] in segment order, -100 for missing segments.
            seq_lens: optional [B, S] sample lengths in row order, 0-padded (from PackedDataset, agreeing with
                segment_ids). Its shape fixes S for sequence classification without labels (otherwise S =
                segment_ids.max(), a host sync that also breaks a torch.compile graph); with cuda_attention
                "varlen" its values give the kernel's sample offsets.
            **kwargs: passed to the model (e.g. output_hidden_states). attention_mask, cu_seqlens and
                max_seqlen are refused: the mask is built here from segment_ids.

        Returns:
            Token heads and causal language models: the model's own output (loss over the labelled tokens,
            logits [B, L, ...]); a causal model runs without its key/value cache unless use_cache is passed.
            Sequence classification: a SequenceClassifierOutput with logits [B, S, num_labels] (zeros where a
            row has no segment s) and loss, the cross entropy averaged over the segments whose label is not
            -100, i.e. `model(**unpacked).loss` over the same samples.
        """
        if segment_ids is None and seq_lens is None:  # not packed rows
            if token_type_ids is not None:
                kwargs["token_type_ids"] = token_type_ids
            return self.model(input_ids=input_ids, position_ids=position_ids, labels=labels, **kwargs)
        for key in ("attention_mask", "cu_seqlens", "max_seqlen"):
            if key in kwargs:
                raise ValueError(f"{key} must not be passed: PackedModel builds the attention mask from "
                                 "segment_ids; make batches with PackedCollator(mask='none', keep_segment_info=True)")
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError("input_ids must be a [B, L] tensor")
        for arg, value in (("position_ids", position_ids), ("segment_ids", segment_ids),
                           ("token_type_ids", token_type_ids)):
            if value is not None and (not isinstance(value, torch.Tensor) or value.shape != input_ids.shape):
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"{arg} must have input_ids' shape {tuple(input_ids.shape)}, got {shape}")
        if position_ids is None or segment_ids is None:
            raise ValueError("position_ids and segment_ids are required (from PackedDataset)")

        backend = self.model.config._attn_implementation
        if (backend == FLEX and input_ids.device.type == "cpu" and torch.is_grad_enabled()
                and any(p.requires_grad for p in self.model.parameters())):
            # transformers always torch.compiles flex_attention, and Inductor has no FlexAttention backward on
            # CPU (torch 2.9 fails with "InductorError: IndexError", pytorch/pytorch#169224). Forward under
            # torch.no_grad() works.
            raise RuntimeError("flex_attention cannot train on the CPU: Inductor has no FlexAttention backward "
                               "there (pytorch/pytorch#169224); use attn_implementation='sdpa' on the CPU, or "
                               "run the forward under torch.no_grad()")
        decoder = self.head in ("causal", "last_token")
        mask = document_mask(segment_ids, backend, dtype=self.model.dtype, causal=decoder)
        window, every_layer = sliding_window(self.model.config, input_ids.shape[1]) if decoder else (None, False)
        if window is not None:
            local = document_mask(segment_ids, backend, dtype=self.model.dtype, causal=True, window=window)
            # transformers' models with local and global layers take one mask per kind of layer
            mask = local if every_layer else {"full_attention": mask, "sliding_attention": local}
        per_sample = backend == ACCEL_SDPA and self._passes_kwargs
        route = flex_rows.route_for(self.cuda_attention, decoder, input_ids.shape[1])
        if (per_sample and route == "varlen" and seq_lens is not None
                and varlen_attention.flash_varlen_runs_on(input_ids.device)):
            # ACCEL_SDPA's attention computes each sample alone on CUDA by FlashAttention's varlen kernel, over
            # offsets of a static shape; the mask stays for the calls that kernel does not take (attention dropout,
            # a first-token-only last layer)
            if seq_lens.dim() != 2 or seq_lens.shape[0] != input_ids.shape[0]:
                raise ValueError(f"seq_lens must be [B={input_ids.shape[0]}, S], got {tuple(seq_lens.shape)}")
            kwargs[SEGMENT_IDS], kwargs[SEGMENTS_CAUSAL] = segment_ids, decoder
            kwargs[CU_SEQLENS] = static_cu_seqlens(seq_lens, input_ids.shape[1])
        elif per_sample and route == "flex" and flex_rows.flex_runs_on(input_ids.device):
            # ACCEL_SDPA's attention takes FlexAttention with these BlockMasks where the call fits, the dense mask
            # elsewhere (attention dropout, a first-token-only last layer, narrow heads)
            kwargs[SEGMENT_IDS], kwargs[SEGMENTS_CAUSAL] = segment_ids, decoder
            kwargs[FLEX_MASKS] = flex_document_masks(segment_ids, decoder, window)
        elif per_sample and input_ids.device.type == "cpu":
            # and on the CPU by accel.runtime.nn.varlen_attention: the work of the samples, not of the whole row
            # masked; a layer with a sliding window (Gemma's local layers: each names its window, as every
            # transformers model with local layers does) cuts it inside each sample
            kwargs[SEGMENT_IDS], kwargs[SEGMENTS_CAUSAL] = segment_ids, decoder
        if token_type_ids is not None:  # not every model takes them (Llama does not)
            kwargs["token_type_ids"] = token_type_ids
        if decoder:
            # A training step has no use for the key/value cache, and a checkpointed layer would append to it
            # again when recomputed.
            kwargs.setdefault("use_cache", False)
        if self.head in ("token", "causal"):
            if labels is not None and labels.shape != input_ids.shape:
                raise ValueError(f"labels must be per-token {tuple(input_ids.shape)} for {type(self.model).__name__}"
                                 f", got {tuple(labels.shape)}")
            if self.head == "causal" and labels is not None:
                # The loss pairs the logits at t with the label at t + 1: a sample's first label is the target of
                # the previous sample's last token, which must not learn across the boundary.
                previous = F.pad(segment_ids[:, :-1], (1, 0), value=-1)
                labels = labels.masked_fill(segment_ids != previous, LABEL_PAD)
            return self.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, labels=labels,
                              **kwargs)
        return self._classify(input_ids, position_ids, segment_ids, labels, seq_lens, mask, kwargs)

    def _classify(self, input_ids, position_ids, segment_ids, labels, seq_lens, mask, kwargs):
        from transformers.modeling_outputs import SequenceClassifierOutput

        batch, length = input_ids.shape
        if seq_lens is not None:
            if seq_lens.dim() != 2 or seq_lens.shape[0] != batch:
                raise ValueError(f"seq_lens must be [B={batch}, S], got {tuple(seq_lens.shape)}")
            segments = seq_lens.shape[1]
        elif labels is not None:
            segments = labels.shape[-1]
        else:
            segments = int(segment_ids.max())
        if labels is not None and labels.shape != (batch, segments):
            raise ValueError(f"labels must be one class id per segment, [B, S] = {(batch, segments)}, "
                             f"got {tuple(labels.shape)}")

        # The token the head reads in segment s of each row (the first for a BERT pooler, the last for a
        # decoder's score), from comparisons rather than a scatter: static shapes, and a segment id above S cannot
        # index out of bounds. A row without segment s reads a stand-in token.
        positions = torch.arange(length, device=segment_ids.device)
        wanted = torch.arange(1, segments + 1, device=segment_ids.device).view(1, segments, 1)
        in_segment = segment_ids.unsqueeze(1) == wanted  # [B, S, L]
        present = in_segment.any(dim=-1)  # [B, S]
        if self.head == "sequence":
            rows = torch.where(in_segment, positions, length - 1).amin(dim=-1)
        else:
            rows = torch.where(in_segment, positions, 0).amax(dim=-1)

        model = self._inner[0]
        base = model.base_model
        # The last layer computes only the rows the pooler reads (see __init__), unless the call asks to see
        # every position of every layer.
        last = self._last_layer if not sees_every_position(self.model.config, kwargs) else None
        if last is not None:
            last.rows = rows
        try:
            out = base(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, return_dict=True, **kwargs)
        finally:
            if last is not None:
                last.rows = None
        hidden = out.last_hidden_state  # [B, S, H] from the cut last layer, else [B, L, H]
        read = hidden if last is not None else hidden.gather(
            1, rows.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))  # [B, S, H]
        if self.head == "last_token":
            logits = model.score(read)
        elif self._distilbert_head:  # DistilBertForSequenceClassification's head, on each sample's first token
            logits = model.classifier(model.dropout(F.relu(model.pre_classifier(read))))
        else:
            # The pooler takes token 0 of each [1, H] "sequence": one pooled vector per sample.
            pooled = base.pooler(read.reshape(batch * segments, 1, hidden.shape[-1]))
            logits = model.classifier(model.dropout(pooled)).view(batch, segments, -1)
        # No sample there: zeros rather than logits computed from a stand-in token.
        logits = logits.masked_fill(~present.unsqueeze(-1), 0.0)

        loss = None
        if labels is not None:
            labels = labels.to(logits.device).masked_fill(~present, LABEL_PAD)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=LABEL_PAD)
        return SequenceClassifierOutput(loss=loss, logits=logits, hidden_states=getattr(out, "hidden_states", None),
                                        attentions=getattr(out, "attentions", None))
