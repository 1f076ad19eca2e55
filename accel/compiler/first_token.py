"""Classifiers that read one token: the encoder's last layer computes only that token.

A BERT-family classifier reads a single position of its encoder's output: BertForSequenceClassification's
pooler and RoBERTa's or ELECTRA's classification head take hidden_states[:, 0], as ViT's and DeiT's image
classifiers take the [CLS] token (their layers pre-norm: the LayerNorm before the attention runs on every position,
for the keys and values). The last layer's other positions
(their queries, attention, output projection, feed-forward and LayerNorms) are computed and then dropped: in
BERT-base that is 10/12 of the last of 12 layers, ~7% of a training step's arithmetic. `first_token_only(model)`
makes the last layer compute position 0 alone, from the keys and values of every position. The model's logits,
loss and gradients stay those of the full computation (tests/compiler/test_first_token.py); only attention
dropout draws other random numbers (the same distribution).

The full layer still runs where the difference could be seen: a call asking for hidden states or attentions
(they show every position of every layer), a call of the encoder outside the model's own forward (e.g.
`model.bert(...)` directly), masks that cannot be cut to the first query (FlexAttention's BlockMask; only
"sdpa", accel's "accel_sdpa" and "eager" attention qualify), and decoders or cross-attention.

The choice is made per call of the model: a forward pre-hook switches the last layer to one token, and a
forward hook that runs even when the forward raises switches it back. Apply it after activation checkpointing
(accelerate() does): a checkpointed layer recomputes its forward in the backward, after the model's call.

Packed rows (accel.compiler.packed) hold several samples, and their classifier reads each sample's first token:
`last_layer_rows(model)` gives the same last-layer forward, through which PackedModel asks for those positions
([B, S] indices) instead of position 0.
"""
from __future__ import annotations

import sys

import torch
from torch import nn

from accel.compiler.unpadded_attention import ACCEL_SDPA, SDPA
from accel.utils.instance_forward import InstanceForward

# Heads that read position 0 of the encoder's last layer and nothing else of it (and that return no per-token
# output): a pooler over hidden_states[:, 0] or a classification head over features[:, 0, :].
# Image classifiers that read the [CLS] token alone (ViT's and DeiT's; DINOv2's also averages the patches, DeiT's
# distilled one reads two tokens) over pre-norm layers (layernorm_before, attention, layernorm_after, mlp).
IMAGE_HEADS = frozenset({"ViTForImageClassification", "DeiTForImageClassification"})
FIRST_TOKEN_HEADS = frozenset({
    "BertForSequenceClassification", "BertForMultipleChoice", "BertForNextSentencePrediction",
    "RobertaForSequenceClassification", "XLMRobertaForSequenceClassification", "ElectraForSequenceClassification",
}) | IMAGE_HEADS
# Attention implementations whose mask is None or a tensor with a query dimension that can be cut.
_ATTENTION = (SDPA, ACCEL_SDPA, "eager")


class _LastLayerForward(InstanceForward):
    """The last layer's forward: only the positions a classifier reads while asked to, else the layer's own
    forward (an instance forward: accel.utils.instance_forward).

    `active` (set by first_token_only's hooks around a call of the model) asks for position 0; `rows` (set by
    PackedModel around its call of the encoder) asks for the positions in a [B, S] index tensor, and the layer
    then always returns [B, S, H]: those rows of the full layer where the layer cannot be cut.
    """

    def __init__(self, layer: nn.Module):
        super().__init__(layer)
        self.pre_norm = not _bert_layer(layer)  # else a _pre_norm_layer (last_layer_rows checked it is one)
        self.active = False
        self.rows: torch.Tensor | None = None
        self.hooked = False  # first_token_only has put its hooks on the model

    # -- the switch, as forward hooks of the classifier ---------------------------------------------------------
    def enter(self, model: nn.Module, args, kwargs) -> None:
        self.active = not sees_every_position(model.config, kwargs)

    def leave(self, model: nn.Module, args, output) -> None:
        self.active = False

    # -- the layer --------------------------------------------------------------------------------------------------
    def __call__(self, hidden_states, attention_mask=None, *args, **kwargs):
        rows = self.rows
        encoder_states = args[0] if args else kwargs.get("encoder_hidden_states")
        if ((self.active or rows is not None) and len(args) <= 1 and encoder_states is None
                and kwargs.get("past_key_values") is None and kwargs.get("encoder_attention_mask") is None
                and _cuttable(attention_mask) and self.attention.config._attn_implementation in _ATTENTION):
            rest = {k: v for k, v in kwargs.items()
                    if k not in ("encoder_hidden_states", "encoder_attention_mask", "past_key_values")}
            return self.first_token(hidden_states, attention_mask, rows, **rest)
        out = self.own(hidden_states, attention_mask, *args, **kwargs)
        if rows is None:
            return out
        if isinstance(out, tuple):  # transformers before 5 returns (hidden_states, ...)
            return (_take_rows(out[0], rows),) + out[1:]
        return _take_rows(out, rows)

    @property
    def attention(self) -> nn.Module:
        """The module that calls the attention function (BertSelfAttention; ViTAttention)."""
        return self.module.attention if self.pre_norm else self.module.attention.self

    def first_token(self, hidden_states: torch.Tensor, attention_mask, rows: torch.Tensor | None = None,
                    **kwargs) -> torch.Tensor:
        """The layer's forward (BertLayer's, or a pre-norm layer's as ViTLayer) for the queries at position 0
        ([B, S, H] -> [B, 1, H]) or, given rows [B, R], at those positions ([B, S, H] -> [B, R, H])."""
        from accel.compiler.fused_qkv import fused_projections, runs_fused  # it imports this module

        layer, attn = self.module, self.attention
        batch, length = hidden_states.shape[:2]
        picked = hidden_states[:, :1] if rows is None else _take_rows(hidden_states, rows)
        if self.pre_norm:  # the queries' and the keys' and values' input: the LayerNorm before the attention
            normed = layer.layernorm_before(hidden_states)
            inputs, names, head = normed, ("q_proj", "k_proj", "v_proj"), attn.head_dim
            queries_in = normed[:, :1] if rows is None else _take_rows(normed, rows)
        else:
            inputs, names, head, queries_in = hidden_states, ("query", "key", "value"), attn.attention_head_size, picked
        query = getattr(attn, names[0])(queries_in).view(batch, picked.shape[1], -1, head).transpose(1, 2)
        if runs_fused(attn):
            key, value = fused_projections(attn, inputs, names[1:])
        else:
            key, value = (getattr(attn, name)(inputs).view(batch, length, -1, head).transpose(1, 2)
                          for name in names[1:])
        if attention_mask is not None and attention_mask.shape[-2] != 1:
            # [B, 1|heads, S, S] -> the rows of the queries kept
            if rows is None:
                attention_mask = attention_mask[:, :, :1]
            else:
                index = rows[:, None, :, None].expand(-1, attention_mask.shape[1], -1, attention_mask.shape[-1])
                attention_mask = attention_mask.gather(2, index)
        context, _ = attend(attn, query, key, value, attention_mask, **kwargs)
        context = context.reshape(batch, picked.shape[1], -1).contiguous()
        if not self.pre_norm:
            return layer.feed_forward_chunk(layer.attention.output(context, picked))
        # ViTLayer.forward from here: dropout and residual after the attention and after the MLP
        hidden = layer.dropout(attn.o_proj(context)) + picked
        return layer.dropout(layer.mlp(layer.layernorm_after(hidden))) + hidden


def sees_every_position(config, kwargs: dict) -> bool:
    """Whether a call asks for hidden states or attentions, which show every position of every layer."""
    return bool(kwargs.get("output_hidden_states") or kwargs.get("output_attentions")
                or getattr(config, "output_hidden_states", False) or getattr(config, "output_attentions", False))


def _take_rows(hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """hidden [B, S, H] at rows [B, R] -> [B, R, H]."""
    return hidden.gather(1, rows.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))


def _eager_attention(attn: nn.Module):
    """The eager attention function of the attention module's own model file (each defines one), or None."""
    return getattr(sys.modules.get(type(attn).__module__), "eager_attention_forward", None)


def attention_function(attn: nn.Module):
    """The attention function attn's model calls for its config's implementation (the eager one of the model's
    own file for "eager"), or None where there is none."""
    implementation = attn.config._attn_implementation
    if implementation == "eager":
        return _eager_attention(attn)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[implementation] if implementation in ALL_ATTENTION_FUNCTIONS else None


def _attention_dropout(attn: nn.Module) -> float:
    """The attention probabilities' dropout: BertSelfAttention's dropout layer, ViTAttention's attention_dropout."""
    layer = getattr(attn, "dropout", None)
    return layer.p if isinstance(layer, nn.Dropout) else float(getattr(attn, "attention_dropout", 0.0))


def attend(attn: nn.Module, query, key, value, attention_mask, **kwargs):
    """What a BertSelfAttention-like (or ViTAttention-like) module does after its projections: its model's attention
    function over [B, heads, L, D] queries, keys and values, with the module's dropout (while training) and
    scaling. Returns (context [B, Lq, heads, D], attention weights or None)."""
    return attention_function(attn)(attn, query, key, value, attention_mask,
                                    dropout=_attention_dropout(attn) if attn.training else 0.0,
                                    scaling=attn.scaling, **kwargs)


def _cuttable(mask) -> bool:
    return mask is None or (isinstance(mask, torch.Tensor) and mask.dim() == 4)


def _bert_layer(layer: nn.Module) -> bool:
    """Whether `layer` is built like BertLayer (self-attention query/key/value, its output, a feed-forward)."""
    attention = getattr(layer, "attention", None)
    attn = getattr(attention, "self", None)
    return (attn is not None and all(isinstance(getattr(attn, n, None), nn.Linear) for n in ("query", "key", "value"))
            and hasattr(attn, "attention_head_size") and hasattr(attn, "scaling")
            and isinstance(getattr(attn, "dropout", None), nn.Dropout)
            and not getattr(attention, "is_cross_attention", False) and hasattr(attention, "output")
            and callable(getattr(layer, "feed_forward_chunk", None))
            and not getattr(layer, "add_cross_attention", False) and not getattr(layer, "is_decoder", False)
            and _eager_attention(attn) is not None)


def _pre_norm_layer(layer: nn.Module) -> bool:
    """Whether `layer` is built like ViTLayer of transformers 5: layernorm_before, an attention module with
    q_proj/k_proj/v_proj/o_proj, layernorm_after, mlp and one dropout layer. Their order is not visible in the
    attributes: the heads that come here (IMAGE_HEADS) are ViT's and DeiT's, whose layers run them in that order
    (tests/compiler/test_first_token.py compares each with the full layer)."""
    attn = getattr(layer, "attention", None)
    return (all(isinstance(getattr(layer, n, None), nn.LayerNorm) for n in ("layernorm_before", "layernorm_after"))
            and isinstance(getattr(layer, "mlp", None), nn.Module)
            and isinstance(getattr(layer, "dropout", None), nn.Dropout)
            and all(isinstance(getattr(attn, n, None), nn.Linear) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
            and hasattr(attn, "head_dim") and hasattr(attn, "scaling") and hasattr(attn, "config")
            and not getattr(attn, "is_causal", False) and _eager_attention(attn) is not None)


def _encoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The encoder's layers: base_model.encoder.layer (BERT) or base_model.layers (ViT in transformers 5)."""
    base = getattr(model, "base_model", None)
    layers = getattr(getattr(base, "encoder", None), "layer", None)
    if layers is None:
        layers = getattr(base, "layers", None)
    return layers if isinstance(layers, nn.ModuleList) and len(layers) > 0 else None


def last_layer_rows(model: nn.Module) -> _LastLayerForward | None:
    """The last encoder layer's selecting forward (installed, idle until asked), or None where that layer is not
    built like BertLayer or ViTLayer. Set `.rows` to [B, R] positions around a call of the encoder and the layer
    returns those rows alone, [B, R, H]; set it back to None after the call (PackedModel does both)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_decoder", False) or getattr(config, "is_encoder_decoder", False):
        return None
    layers = _encoder_layers(model)
    if layers is None or not (_bert_layer(layers[-1]) or _pre_norm_layer(layers[-1])):
        return None
    layer = layers[-1]
    forward = layer.__dict__.get("forward")
    if not isinstance(forward, _LastLayerForward):
        forward = _LastLayerForward(layer).install()
    return forward


def first_token_only(model: nn.Module) -> bool:
    """Make the last encoder layer of a first-token classifier compute position 0 only (see the module docstring).

    Args:
        model: a transformers model whose class is in FIRST_TOKEN_HEADS (anything else is left alone).

    Returns:
        Whether the model now computes its last layer for one token. A second call changes nothing.
    """
    if not isinstance(model, nn.Module) or type(model).__name__ not in FIRST_TOKEN_HEADS:
        return False
    forward = last_layer_rows(model)
    if forward is None:
        return False
    if forward.hooked:
        return True
    forward.hooked = True
    model.register_forward_pre_hook(forward.enter, with_kwargs=True)
    model.register_forward_hook(forward.leave, always_call=True)
    return True
