"""One GEMM for the query, key and value projections of an encoder's self-attention.

BertSelfAttention (and RoBERTa's, ELECTRA's... copies of it) projects the same hidden states three times, three
[N, H] x [H, H] matrix products forward and six backward. `fuse_qkv(model)` gives each such module a forward
that runs one [N, H] x [H, 3H] product with the three weights (and biases) concatenated, then splits the result:
forward one GEMM instead of three, backward one for the input's gradient (instead of three and two sums) and one
for the weights'. Small products use a GPU's tensor cores, or a CPU's cores, poorly: one product three times as
wide keeps more of them busy and launches fewer kernels. A last layer cut to the first token
(accel.compiler.first_token) projects its queries for those positions alone and takes keys and values from
one GEMM.

The parameters stay three nn.Linear modules: names, state_dict, optimizers and checkpoints see no change. The
concatenation copies 3 H^2 weights per layer and step (under torch.compile it is one kernel with autocast's cast
to the compute dtype), and its gradient is the split of the product's.

Each output is the same dot product over the same hidden states as before; only the GEMM's blocking, and so the
rounding of its sums, may differ (tests/compiler/test_fused_qkv.py compares logits, loss and gradients with
the unchanged model). The module's own forward runs where the fused one would differ in more than rounding:
a cache or encoder states passed (decoders, cross-attention), hooks on the three projections (which the fused
product would not call), or projections that are not plain nn.Linear (LoRA and quantised layers).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from accel.compiler.first_token import attend, attention_function
from accel.runtime.nn.onednn_mm import PLAIN_LINEARS
from accel.utils.instance_forward import InstanceForward, installed_forward
from accel.utils.transformers_models import is_transformers_model

_PROJECTIONS = ("query", "key", "value")
# Keyword arguments that make the module's forward do more than self-attention over hidden_states.
_OWN_FORWARD_KWARGS = ("cache", "past_key_values", "past_key_value", "encoder_hidden_states",
                       "encoder_attention_mask", "head_mask")


class _FusedQKVForward(InstanceForward):
    """A self-attention module's forward with one projection GEMM (an instance forward:
    accel.utils.instance_forward)."""

    def __call__(self, hidden_states, attention_mask=None, *args, **kwargs):
        attn = self.module
        if args or any(kwargs.get(name) is not None for name in _OWN_FORWARD_KWARGS) or not _plain(attn):
            return self.own(hidden_states, attention_mask, *args, **kwargs)
        kwargs = {k: v for k, v in kwargs.items() if k not in _OWN_FORWARD_KWARGS}
        query, key, value = fused_projections(attn, hidden_states)
        output, weights = attend(attn, query, key, value, attention_mask, **kwargs)
        return output.reshape(*hidden_states.shape[:-1], -1).contiguous(), weights


def fused_projections(attn: nn.Module, hidden_states: torch.Tensor, names: tuple[str, ...] = _PROJECTIONS):
    """The projections `names` (default query, key and value) of hidden_states [..., L, H], each
    [..., heads, L, head_size], from one GEMM."""
    linears = [getattr(attn, name) for name in names]
    weight = torch.cat([linear.weight for linear in linears])
    bias = None if linears[0].bias is None else torch.cat([linear.bias for linear in linears])
    qkv = F.linear(hidden_states, weight, bias)
    shape = (*hidden_states.shape[:-1], -1, attn.attention_head_size)
    return tuple(part.view(shape).transpose(-3, -2) for part in qkv.split([lin.out_features for lin in linears], -1))


def runs_fused(attn: nn.Module) -> bool:
    """Whether fuse_qkv gave attn its forward and the projections still qualify (first_token's last layer,
    which projects its queries for a few positions only, then takes keys and values from one GEMM too)."""
    return isinstance(installed_forward(attn), _FusedQKVForward) and _plain(attn)


def _plain(attn: nn.Module) -> bool:
    """Whether the three projections are plain nn.Linear without hooks, on one input size, all with or all
    without a bias (checked per call: hooks may be added after fuse_qkv)."""
    linears = [getattr(attn, name, None) for name in _PROJECTIONS]
    return (all(type(linear) in PLAIN_LINEARS for linear in linears)
            and len({linear.in_features for linear in linears}) == 1
            and len({linear.bias is None for linear in linears}) == 1
            and len({(linear.weight.dtype, linear.weight.device) for linear in linears}) == 1
            and not any(linear._forward_hooks or linear._forward_pre_hooks for linear in linears))


def _self_attention(module: nn.Module) -> bool:
    """Whether `module` is built like BertSelfAttention of transformers 5 (query/key/value projections, heads of
    attention_head_size, scaling, a dropout, the model's attention function) in an encoder."""
    config = getattr(module, "config", None)
    return (config is not None and not getattr(config, "is_decoder", False)
            and not getattr(module, "is_causal", False) and not getattr(module, "is_cross_attention", False)
            and hasattr(module, "attention_head_size") and hasattr(module, "scaling")
            and isinstance(getattr(module, "dropout", None), nn.Dropout)
            and attention_function(module) is not None and _plain(module))


def fuse_qkv(model: nn.Module) -> int:
    """Give every self-attention of a transformers encoder one projection GEMM (see the module docstring).

    Args:
        model: any module; only the self-attention modules of a transformers 5 model that is neither a decoder
            nor an encoder-decoder change.

    Returns:
        How many self-attention modules now run fused (also those that already did). A second call changes
        nothing.
    """
    if not is_transformers_model(model):
        return 0
    import transformers

    config = model.config
    if (int(transformers.__version__.split(".")[0]) < 5 or getattr(config, "is_decoder", False)
            or getattr(config, "is_encoder_decoder", False)):
        return 0  # transformers 4's self-attention returns another tuple; decoders keep their cache path
    fused = 0
    for module in model.modules():
        if isinstance(installed_forward(module), _FusedQKVForward):
            fused += 1
        elif "forward" not in module.__dict__ and _self_attention(module):  # another instance forward: its own
            _FusedQKVForward(module).install()
            fused += 1
    return fused
