"""Classifiers that read one token: the encoder's last layer computes only that token.

A BERT-family classifier reads a single position of its encoder's output: BertForSequenceClassification's
pooler and RoBERTa's, ELECTRA's or DistilBERT's classification head take hidden_states[:, 0] (DistilBERT: 6
layers, so its last is 1/6 of the encoder), as ViT's and DeiT's image
classifiers take the [CLS] token (their layers pre-norm: the LayerNorm before the attention runs on every position,
for the keys and values). The last layer's other positions
(their queries, attention, output projection, feed-forward and LayerNorms) are computed and then dropped: in
BERT-base that is 10/12 of the last of 12 layers, ~7% of a training step's arithmetic. `first_token_only(model)`
makes the last layer compute position 0 alone, from the keys and values of every position. The model's logits,
loss and gradients stay those of the full computation (tests/compiler/test_first_token.py); only attention
dropout draws other random numbers (the same distribution).

The full layer still runs where the difference could be seen: a call asking for hidden states or attentions
(they show every position of every layer), a call of the encoder outside the model's own forward (e.g.
`model.bert(...)` directly), attention implementations other than "sdpa", accel's "accel_sdpa", "eager" and
"flex_attention" (whose BlockMask is rebuilt for the kept queries: their rows of the original mask_mod), and
cross-attention.

The choice is made per call of the model: a forward pre-hook switches the last layer to one token, and a
forward hook that runs even when the forward raises switches it back. Apply it after activation checkpointing
(accelerate() does): a checkpointed layer recomputes its forward in the backward, after the model's call.

A decoder's sequence classifier (Llama's, Mistral's, Qwen2's, Qwen3's, Gemma's, Phi-3's: transformers'
GenericForSequenceClassification, LAST_TOKEN_HEADS) reads one position too: each row's last token that is not
padding (the rightmost token whose id is not pad_token_id, transformers' own rule, left or right padding). Its last decoder layer (RMSNorm, attention with
rotary positions, RMSNorm, MLP) computes that token alone, from the keys and values of every position, and returns
it in place in a [B, L, H] tensor of zeros: the model's own norm, score and pooling then read the same row as
before. In a reward model of 16 layers that is ~1/16 of the step's arithmetic.

Packed rows (accel.compiler.packed) hold several samples, and their classifier reads each sample's first token
(an encoder's) or last token (a decoder's): `last_layer_rows(model)` gives the same last-layer forward, through
which PackedModel asks for those positions ([B, S] indices) instead, and a masked LM's fused loss
(accel.compiler.fused_lm_loss, on the CPU) for the positions whose label is not ignored.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from accel.compiler.unpadded_attention import ACCEL_SDPA, SDPA
from accel.utils.instance_forward import InstanceForward, installed_forward
from accel.utils.modules import acts_as_linear

# Heads that read position 0 of the encoder's last layer and nothing else of it (and that return no per-token
# output): a pooler over hidden_states[:, 0] or a classification head over features[:, 0, :].
# Image classifiers that read the [CLS] token alone (ViT's and DeiT's; DINOv2's also averages the patches, DeiT's
# distilled one reads two tokens) over pre-norm layers (layernorm_before, attention, layernorm_after, mlp).
IMAGE_HEADS = frozenset({"ViTForImageClassification", "DeiTForImageClassification"})
FIRST_TOKEN_HEADS = frozenset({
    "BertForSequenceClassification", "BertForMultipleChoice", "BertForNextSentencePrediction",
    "RobertaForSequenceClassification", "XLMRobertaForSequenceClassification", "ElectraForSequenceClassification",
    "DistilBertForSequenceClassification", "DistilBertForMultipleChoice",
}) | IMAGE_HEADS
# Decoder classifiers that score the last token that is not padding, over layers built as LlamaDecoderLayer; the
# model types are named because the layer's attributes do not show what its attention does (Olmo's clips q, k, v).
LAST_TOKEN_HEADS = frozenset({"LlamaForSequenceClassification", "MistralForSequenceClassification",
                              "Qwen2ForSequenceClassification", "Qwen3ForSequenceClassification",
                              "GemmaForSequenceClassification", "Phi3ForSequenceClassification"})
DECODER_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "phi3"})
# Phi-3's decoder layer: Llama's, with one fused query/key/value projection and a dropout on each residual branch
_PHI3_LAYER = ("resid_attn_dropout", "resid_mlp_dropout")
# Attention implementations whose mask is None, a tensor with a query dimension that can be cut, or a BlockMask
# (rebuilt for the kept queries).
_ATTENTION = (SDPA, ACCEL_SDPA, "eager", "flex_attention")
_CACHE_KWARGS = ("cache", "past_key_values")  # the key/value cache's keyword in transformers >= 5.24, and before


class _LastLayerForward(InstanceForward):
    """The last layer's forward: only the positions a classifier reads while asked to, else the layer's own
    forward (an instance forward: accel.utils.instance_forward).

    `active` (set by first_token_only's hooks around a call of an encoder classifier) asks for position 0;
    `rows` (set by PackedModel around its call of the base model, or by the hooks of a decoder classifier) asks
    for the positions in a [B, R] index tensor, and the layer then returns [B, R, H] (those rows of the full layer
    where the layer cannot be cut) or, with `spread`, [B, L, H] with those rows in place and zeros elsewhere.
    """

    def __init__(self, layer: nn.Module):
        super().__init__(layer)
        # "bert", "pre_norm" (a ViTLayer), "post_norm" (DistilBERT's TransformerBlock) or "decoder" (a
        # LlamaDecoderLayer); last_layer_rows checked it is one
        self.kind = ("bert" if _bert_layer(layer) else "pre_norm" if _pre_norm_layer(layer)
                     else "post_norm" if _post_norm_layer(layer) else "decoder")
        self.active = False
        self.rows: torch.Tensor | None = None
        self.spread = False
        self.read: tuple | None = None  # a decoder classifier's call: last_token_rows' arguments
        self.hooked = False  # first_token_only has put its hooks on the model

    # -- the switch, as forward hooks of the classifier ---------------------------------------------------------
    def enter(self, model: nn.Module, args, kwargs) -> None:
        if sees_every_position(model.config, kwargs):
            return
        if self.kind != "decoder":
            self.active = True
            return
        # the positions are computed in the layer's call, inside the model's graph when compiled (a hook is
        # traced as a graph of its own)
        self.read = read_token(model, args, kwargs)

    def leave(self, model: nn.Module, args, output) -> None:
        self.active, self.rows, self.spread, self.read = False, None, False, None

    # -- the layer --------------------------------------------------------------------------------------------------
    def __call__(self, hidden_states, attention_mask=None, *args, **kwargs):
        if self.read is not None:
            self.rows, self.spread, self.read = last_token_rows(*self.read).unsqueeze(-1), True, None
        rows = self.rows
        if (self.active or rows is not None) and self._cuttable(attention_mask, args, kwargs):
            rest = {k: v for k, v in kwargs.items()
                    if k not in ("encoder_hidden_states", "encoder_attention_mask") + _CACHE_KWARGS}
            if self.kind != "decoder":
                return self.first_token(hidden_states, attention_mask, rows, **rest)
            cache = next((kwargs[k] for k in _CACHE_KWARGS if kwargs.get(k) is not None), None)
            out = self.decoder_rows(hidden_states, attention_mask, rows, cache, **rest)
            if not self.spread:
                return out
            index = rows.unsqueeze(-1).expand(-1, -1, out.shape[-1])
            return out.new_zeros(hidden_states.shape).scatter(1, index, out)
        out = self.own(hidden_states, attention_mask, *args, **kwargs)
        if rows is None or self.spread:
            return out
        if isinstance(out, tuple):  # transformers before 5 returns (hidden_states, ...)
            return (_take_rows(out[0], rows),) + out[1:]
        return _take_rows(out, rows)

    def _cuttable(self, attention_mask, args, kwargs) -> bool:
        """Whether this call's attention can be computed for some queries alone: self-attention through an
        implementation that takes a [B, 1|heads, Lq, Lk] mask (flex_attention: a BlockMask), and a decoder's rotary
        positions given."""
        implementation = self.attention.config._attn_implementation
        if implementation not in _ATTENTION or (implementation == "flex_attention"
                                                and not isinstance(attention_mask, BlockMask)):
            return False
        if self.kind == "decoder":
            # no mask: SDPA's own causal attention (transformers leaves the mask out only for SDPA)
            return (not args and kwargs.get("position_embeddings") is not None
                    and (_cuttable(attention_mask) if attention_mask is not None else implementation != "eager"))
        encoder_states = args[0] if args else kwargs.get("encoder_hidden_states")
        return (len(args) <= 1 and encoder_states is None and kwargs.get("encoder_attention_mask") is None
                and all(kwargs.get(k) is None for k in _CACHE_KWARGS) and _cuttable(attention_mask))

    @property
    def attention(self) -> nn.Module:
        """The module that calls the attention function (BertSelfAttention; ViTAttention; LlamaAttention)."""
        if self.kind == "decoder":
            return self.module.self_attn
        return self.module.attention.self if self.kind == "bert" else self.module.attention

    def first_token(self, hidden_states: torch.Tensor, attention_mask, rows: torch.Tensor | None = None,
                    **kwargs) -> torch.Tensor:
        """The layer's forward (BertLayer's, a pre-norm layer's as ViTLayer, or DistilBERT's post-norm block) for the
        queries at position 0 ([B, S, H] -> [B, 1, H]) or, given rows [B, R], at those positions ([B, S, H] ->
        [B, R, H])."""
        from accel.compiler.fused_qkv import fused_projections, runs_fused  # it imports this module

        layer, attn = self.module, self.attention
        batch, length = hidden_states.shape[:2]
        picked = hidden_states[:, :1] if rows is None else _take_rows(hidden_states, rows)
        if self.kind == "pre_norm":  # the queries' and the keys' and values' input: the LayerNorm before attention
            normed = layer.layernorm_before(hidden_states)
            inputs, names, head = normed, ("q_proj", "k_proj", "v_proj"), attn.head_dim
            queries_in = normed[:, :1] if rows is None else _take_rows(normed, rows)
        else:
            names = ("query", "key", "value") if self.kind == "bert" else ("q_lin", "k_lin", "v_lin")
            inputs, head, queries_in = hidden_states, attn.attention_head_size, picked
        query = getattr(attn, names[0])(queries_in).view(batch, picked.shape[1], -1, head).transpose(1, 2)
        if runs_fused(attn):
            key, value = fused_projections(attn, inputs, names[1:])
        else:
            key, value = (getattr(attn, name)(inputs).view(batch, length, -1, head).transpose(1, 2)
                          for name in names[1:])
        if attention_mask is not None:
            attention_mask = _mask_rows(attention_mask, batch, rows)
        context, _ = attend(attn, query, key, value, attention_mask, **kwargs)
        context = context.reshape(batch, picked.shape[1], -1).contiguous()
        if self.kind == "bert":
            return layer.feed_forward_chunk(layer.attention.output(context, picked))
        if self.kind == "post_norm":  # DistilBERT's TransformerBlock.forward from here
            hidden = layer.sa_layer_norm(attn.out_lin(context) + picked)
            return layer.output_layer_norm(layer.ffn(hidden) + hidden)
        # ViTLayer.forward from here: dropout and residual after the attention and after the MLP
        hidden = layer.dropout(attn.o_proj(context)) + picked
        return layer.dropout(layer.mlp(layer.layernorm_after(hidden))) + hidden

    def decoder_rows(self, hidden_states: torch.Tensor, attention_mask, rows: torch.Tensor, cache=None,
                     position_embeddings=None, **kwargs) -> torch.Tensor:
        """LlamaDecoderLayer.forward for the queries at rows [B, R] alone: [B, L, H] -> [B, R, H]. The keys and values
        of every position go through the rotary embedding and the cache (if any) as the full layer's do."""
        layer, attn = self.module, self.attention
        batch, length = hidden_states.shape[:2]
        rotate = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        normed = layer.input_layernorm(hidden_states)
        cos, sin = (t.expand(batch, -1, -1) for t in position_embeddings)  # [B | 1, L, D]
        query = _decoder_heads(attn, "q", _take_rows(normed, rows))
        query, _ = rotate(query, query, _take_rows(cos, rows), _take_rows(sin, rows))
        key = _decoder_heads(attn, "k", normed)
        _, key = rotate(key, key, cos, sin)
        value = _decoder_heads(attn, "v", normed)
        if cache is not None:
            key, value = cache.update(key, value, attn.layer_idx)
        if attention_mask is None:  # SDPA's causal attention (a cache before this call shifts the diagonal)
            keys = torch.arange(key.shape[2], device=rows.device)
            attention_mask = keys <= (rows + key.shape[2] - length).view(batch, 1, -1, 1)
        else:
            attention_mask = _mask_rows(attention_mask, batch, rows)
        # Mistral's attention passes its config's window, Qwen's each layer's own (None on full-attention layers)
        window = getattr(attn, "sliding_window") if hasattr(attn, "sliding_window") else getattr(
            attn.config, "sliding_window", None)
        if window is not None:
            kwargs["sliding_window"] = window
        context, _ = attend(attn, query, key, value, attention_mask, **kwargs)
        attn_dropout, mlp_dropout = (getattr(layer, name, _identity) for name in _PHI3_LAYER)
        hidden = _take_rows(hidden_states, rows) + attn_dropout(attn.o_proj(context.reshape(batch, rows.shape[1], -1)))
        return hidden + mlp_dropout(layer.mlp(layer.post_attention_layernorm(hidden)))


def read_token(model: nn.Module, args, kwargs) -> tuple | None:
    """For a decoder classifier's call: the arguments of last_token_rows for its rows, or None where the model
    would refuse the call (several rows and no pad_token_id) or the call has no [B, L] input."""
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    embeds = kwargs.get("inputs_embeds")
    source = input_ids if input_ids is not None else embeds
    if not isinstance(source, torch.Tensor) or source.dim() != (2 if input_ids is not None else 3):
        return None
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    batch, length = source.shape[:2]
    if config.pad_token_id is None and batch != 1:
        return None
    return input_ids, config.pad_token_id, batch, length, source.device


def last_token_rows(input_ids: torch.Tensor | None, pad: int | None, batch: int, length: int,
                    device: torch.device) -> torch.Tensor:
    """[B]: the position a decoder classifier scores in each row, by transformers' rule: the rightmost token whose
    id is not `pad` (left or right padding), the last position without input ids or without a pad id."""
    if pad is None or input_ids is None:
        return torch.full((batch,), length - 1, dtype=torch.long, device=device)
    positions = torch.arange(length, device=device, dtype=torch.int32)
    return (positions * (input_ids != pad).to(torch.int32)).argmax(-1)


def _decoder_heads(attn: nn.Module, name: str, inputs: torch.Tensor) -> torch.Tensor:
    """A Llama-like attention's projection `name` ("q", "k", "v") of [B, L, H] as [B, heads, L, head_dim], through
    its per-head RMSNorm where it has one (Qwen3's q_norm, k_norm). Phi-3's fused qkv_proj holds the queries' rows of
    its weight first, then the keys', then the values': each is computed from its own rows alone."""
    projection = getattr(attn, f"{name}_proj", None)
    if projection is not None:
        states = projection(inputs)
    else:
        queries = attn.config.num_attention_heads * attn.head_dim
        pairs = attn.num_key_value_heads * attn.head_dim
        start, stop = {"q": (0, queries), "k": (queries, queries + pairs), "v": (queries + pairs, None)}[name]
        bias = attn.qkv_proj.bias
        states = F.linear(inputs, attn.qkv_proj.weight[start:stop], None if bias is None else bias[start:stop])
    states = states.view(*inputs.shape[:2], -1, attn.head_dim)
    norm = getattr(attn, f"{name}_norm", None)
    return (states if norm is None else norm(states)).transpose(1, 2)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _mask_rows(attention_mask, batch: int, rows: torch.Tensor | None):
    """[B | 1, 1 | heads, L, Lk] mask -> the rows of the queries kept, [B, 1 | heads, R, Lk] (rows [B, R]; None: the
    first query alone); a BlockMask -> one over those queries, each allowed what its row allowed."""
    if isinstance(attention_mask, BlockMask):
        return _block_mask_rows(attention_mask, batch, rows)
    if rows is None:
        return attention_mask[:, :, :1]
    if attention_mask.shape[-2] == 1:  # one row for every query already
        return attention_mask
    mask = attention_mask.expand(batch, -1, -1, -1)
    index = rows[:, None, :, None].expand(-1, mask.shape[1], -1, mask.shape[-1])
    return mask.gather(2, index)


def _block_mask_rows(mask: BlockMask, batch: int, rows: torch.Tensor | None) -> BlockMask:
    """A BlockMask over the kept queries: query r of row b is allowed the keys query rows[b, r] was allowed by
    `mask` (its mask_mod, called with the original query index)."""
    if rows is None:
        rows = torch.zeros(batch, 1, dtype=torch.long, device=mask.kv_indices.device)
    original = mask.mask_mod
    heads = mask.shape[1]

    def kept(b, h, q_idx, kv_idx):
        return original(b, h, rows[b, q_idx], kv_idx)

    return create_block_mask(kept, batch, None if heads == 1 else heads, rows.shape[1], mask.shape[-1],
                             device=rows.device)


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
    return mask is None or (isinstance(mask, torch.Tensor) and mask.dim() == 4) or isinstance(mask, BlockMask)


def _bert_layer(layer: nn.Module) -> bool:
    """Whether `layer` is built like BertLayer (self-attention query/key/value, its output, a feed-forward)."""
    attention = getattr(layer, "attention", None)
    attn = getattr(attention, "self", None)
    return (attn is not None and all(acts_as_linear(getattr(attn, n, None)) for n in ("query", "key", "value"))
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
            and all(acts_as_linear(getattr(attn, n, None)) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
            and hasattr(attn, "head_dim") and hasattr(attn, "scaling") and hasattr(attn, "config")
            and not getattr(attn, "is_causal", False) and _eager_attention(attn) is not None)


def _post_norm_layer(layer: nn.Module) -> bool:
    """Whether `layer` is built like DistilBERT's TransformerBlock of transformers 5: attention (q_lin, k_lin, v_lin,
    out_lin, bidirectional), sa_layer_norm, ffn and output_layer_norm, and nothing else."""
    attn = getattr(layer, "attention", None)
    return ({name for name, _ in layer.named_children()} == {"attention", "sa_layer_norm", "ffn", "output_layer_norm"}
            and all(isinstance(getattr(layer, n), nn.LayerNorm) for n in ("sa_layer_norm", "output_layer_norm"))
            and all(acts_as_linear(getattr(attn, n, None)) for n in ("q_lin", "k_lin", "v_lin", "out_lin"))
            and isinstance(getattr(attn, "dropout", None), nn.Dropout)
            and all(hasattr(attn, n) for n in ("attention_head_size", "scaling", "config"))
            and not getattr(attn, "is_causal", False) and _eager_attention(attn) is not None)


def _decoder_layer(layer: nn.Module) -> bool:
    """Whether `layer` is built like LlamaDecoderLayer: input_layernorm, self_attn (q/k/v/o projections, per-head
    q_norm/k_norm optional, causal, rotary positions from its model file), post_attention_layernorm and mlp, and
    nothing else; or like Phi3DecoderLayer (the same with one qkv_proj and a dropout layer on each residual branch)."""
    attn = getattr(layer, "self_attn", None)
    llama = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
    children = {name for name, _ in layer.named_children()}
    phi3 = children == llama | set(_PHI3_LAYER)
    if attn is None or not (children == llama or phi3):
        return False
    if phi3 and not all(isinstance(getattr(layer, name), nn.Dropout) for name in _PHI3_LAYER):
        return False
    projections = {"qkv_proj", "o_proj"} if phi3 else {"q_proj", "k_proj", "v_proj", "o_proj"}
    return ({name for name, _ in attn.named_children()} in (projections, projections | {"q_norm", "k_norm"})
            # Phi-3's rows of qkv_proj are sliced out of its weight: an adapter over it would be left out
            and all(isinstance(getattr(attn, n), nn.Linear) if phi3 else acts_as_linear(getattr(attn, n)) for n in projections)
            and all(hasattr(attn, n) for n in ("head_dim", "scaling", "layer_idx", "config")
                    + (("num_key_value_heads",) if phi3 else ()))
            and getattr(attn, "is_causal", False) is True and _eager_attention(attn) is not None
            and callable(getattr(sys.modules.get(type(attn).__module__), "apply_rotary_pos_emb", None)))


def _encoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The model's layers: base_model.encoder.layer (BERT), base_model.transformer.layer (DistilBERT) or
    base_model.layers (ViT in transformers 5, Llama)."""
    base = getattr(model, "base_model", None)
    layers = getattr(getattr(base, "encoder", None), "layer", None)
    if layers is None:
        layers = getattr(getattr(base, "transformer", None), "layer", None)
    if layers is None:
        layers = getattr(base, "layers", None)
    return layers if isinstance(layers, nn.ModuleList) and len(layers) > 0 else None


def last_layer_rows(model: nn.Module) -> _LastLayerForward | None:
    """The last layer's selecting forward (installed, idle until asked), or None where that layer is not built like
    BertLayer, ViTLayer or DistilBERT's TransformerBlock, or like LlamaDecoderLayer in a model of DECODER_TYPES. Set `.rows` to [B, R] positions
    around a call of the base model and the layer returns those rows alone, [B, R, H]; set it back to None after
    the call (PackedModel does both)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_decoder", False) or getattr(config, "is_encoder_decoder", False):
        return None
    layers = _encoder_layers(model)
    if layers is None:
        return None
    layer = layers[-1]
    if not (_bert_layer(layer) or _pre_norm_layer(layer) or _post_norm_layer(layer)
            or (getattr(config, "model_type", None) in DECODER_TYPES and _decoder_layer(layer))):
        return None
    forward = installed_forward(layer)
    if not isinstance(forward, _LastLayerForward):
        forward = _LastLayerForward(layer).install()
    return forward


def first_token_only(model: nn.Module, hooks_on: nn.Module | None = None) -> bool:
    """Make the last layer of a classifier that reads one token compute that token only (see the module docstring).

    Args:
        model: a transformers model whose class is in FIRST_TOKEN_HEADS (position 0) or LAST_TOKEN_HEADS (the last
            token that is not padding); anything else is left alone.
        hooks_on: the module whose calls switch the cut on (forward hooks, given the model's arguments); default
            the model. A PEFT model that wraps it: peft calls the model's forward, not the model, so hooks on the
            model itself would not run.

    Returns:
        Whether the model now computes its last layer for one token. A second call changes nothing.
    """
    if not isinstance(model, nn.Module) or type(model).__name__ not in FIRST_TOKEN_HEADS | LAST_TOKEN_HEADS:
        return False
    forward = last_layer_rows(model)
    if forward is None:
        return False
    if forward.hooked:
        return True
    forward.hooked = True
    caller = model if hooks_on is None else hooks_on
    caller.register_forward_pre_hook(forward.enter, with_kwargs=True)
    caller.register_forward_hook(forward.leave, always_call=True)
    return True
