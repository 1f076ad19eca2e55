"""A causal language model's training loss without its logits (accelerate()'s memory.fused_lm_loss).

A *ForCausalLM's forward with labels makes [B, L, vocabulary] logits and takes their cross entropy: the logits,
their fp32 copy and their gradient are the largest tensors of a step once the vocabulary is large (Llama 3's
128k tokens, Gemma's 256k). `fuse_lm_loss(model)` gives the model a forward that, in training calls with labels,
runs the base model and computes the loss from its last hidden states with
accel.runtime.nn.linear_cross_entropy (the head's product and the cross entropy a slice of the vocabulary at a
time).
The output is the model's own output class with the loss and without logits (`logits` is None); hidden states
and attentions are there when asked for. Every other call (no labels, no gradients: evaluation, generation)
is the model's own forward, logits included, and so is a call passing more than input_ids by position (the
head's and the base model's positional arguments differ past the first).

Installed only where it computes what the model's own forward computes: the head must be a plain nn.Linear
(`get_output_embeddings()`), and a probe at install time (4 tokens, no gradients, eval mode) compares the
model's logits and loss with lm_head(base model's hidden states) and its cross entropy; a model whose head does
more (Gemma 2's logit soft-capping, logit scaling, auxiliary losses of mixture-of-experts models) keeps its
forward, with a warning. Hooks on the head, added later, also send calls to the model's own forward.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from accel.runtime.nn.linear_cross_entropy import IGNORE_INDEX, linear_cross_entropy
from accel.runtime.nn.onednn_mm import PLAIN_LINEARS
from accel.utils.instance_forward import InstanceForward, installed_forward
from accel.utils.transformers_models import CAUSAL_LM_HEADS, is_transformers_model

# Arguments of a *ForCausalLM's forward that its base model does not take.
_HEAD_ONLY = ("labels", "shift_labels", "num_items_in_batch", "logits_to_keep", "return_dict")
_PROBE_TOLERANCE = 1e-5  # the loss: the same sum, in other order


class _FusedLossForward(InstanceForward):
    """The model's forward with the fused head and loss for training calls with labels (an instance forward:
    accel.utils.instance_forward)."""

    def __init__(self, model: nn.Module, output_type: type):
        super().__init__(model)
        self.output_type = output_type

    def __call__(self, *args, **kwargs):
        head = self.module.get_output_embeddings()
        if (kwargs.get("labels") is None and kwargs.get("shift_labels") is None) or not torch.is_grad_enabled() \
                or len(args) > 1 or type(head) not in PLAIN_LINEARS or head._forward_hooks or head._forward_pre_hooks:
            return self.own(*args, **kwargs)
        labels, shift_labels = kwargs.get("labels"), kwargs.get("shift_labels")
        items, return_dict = kwargs.get("num_items_in_batch"), kwargs.get("return_dict")
        base_kwargs = {k: v for k, v in kwargs.items() if k not in _HEAD_ONLY}
        out = self.module.base_model(*args, **base_kwargs)
        hidden = out[0]
        loss = causal_lm_loss(hidden, head, labels, shift_labels, items)
        fields = {"loss": loss, **{k: getattr(out, k, None) for k in ("past_key_values", "hidden_states",
                                                                       "attentions")}}
        result = self.output_type(**{k: v for k, v in fields.items()
                                     if k in self.output_type.__dataclass_fields__})
        return result if return_dict is not False else result.to_tuple()


def causal_lm_loss(hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor | None,
                   shift_labels: torch.Tensor | None = None, num_items_in_batch=None) -> torch.Tensor:
    """transformers' causal-LM loss (ForCausalLMLoss) of `head(hidden)`, computed without the logits.

    Args:
        hidden: [B, L, H] the base model's last hidden states.
        head: the nn.Linear language-model head ([V, H] weight).
        labels: [B, L] token ids, -100 ignored; the logits at t predict labels[t + 1]. Not used when
            shift_labels is given.
        shift_labels: optional [B, L], already shifted (the logits at t predict shift_labels[t]).
        num_items_in_batch: optional count of labelled tokens over all micro-batches: the loss is then the sum
            divided by it (transformers' gradient-accumulation convention), else the mean over the labelled
            tokens.

    Returns:
        The fp32 scalar loss.
    """
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    target = shift_labels.reshape(-1).to(hidden.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), head.weight, target, head.bias,
                                reduction=reduction)
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def _probe(model: nn.Module, head: nn.Linear) -> tuple[type | None, str]:
    """(the model's output class, "") where its forward with labels is lm_head(base model) plus the causal-LM
    loss on 4 tokens, else (None, what differs). No gradients, every module in eval mode, modes restored."""
    modes = [(m, m.training) for m in model.modules()]
    device = head.weight.device
    ids = (torch.arange(1, 5, device=device) % head.out_features).unsqueeze(0)
    try:
        model.eval()
        with torch.no_grad():
            own = type(model).forward(model, input_ids=ids, labels=ids, use_cache=False, return_dict=True)
            hidden = model.base_model(input_ids=ids, use_cache=False, return_dict=True)[0]
            logits = F.linear(hidden, head.weight, head.bias)
            loss = causal_lm_loss(hidden, head, ids)
    finally:
        for module, training in modes:
            module.training = training
    # The same product of the same hidden states is the same bits: anything the head does after it (Gemma 2's
    # soft-capping of small random-weight logits changes them by 1e-6) shows.
    if getattr(own, "logits", None) is None or not torch.equal(own.logits, logits):
        return None, "its logits are not lm_head(base model's hidden states)"
    if getattr(own, "loss", None) is None or not torch.allclose(own.loss.float(), loss.float(),
                                                                rtol=_PROBE_TOLERANCE, atol=_PROBE_TOLERANCE):
        return None, "its loss is not the cross entropy of the shifted labels alone"
    return type(own), ""


def _is_causal_lm(module: nn.Module) -> bool:
    return is_transformers_model(module) and type(module).__name__.endswith(CAUSAL_LM_HEADS)


def fuse_lm_loss(model: nn.Module) -> bool:
    """Give a transformers causal language model the fused head and loss for its training calls with labels.

    Args:
        model: a transformers *ForCausalLM / *LMHeadModel, or a module holding one (a user's wrapper, an adapter
            library's model around it): the outermost one found gets it, so calls that reach its forward
            through the wrapper are fused too.

    Returns:
        Whether it was installed. Where it is not, a warning says why (no causal LM found, or one whose head
        or loss is not the plain one).
    """
    lm = next((m for m in model.modules() if _is_causal_lm(m)), None)
    if lm is None:
        warnings.warn(f"memory.fused_lm_loss: {type(model).__name__} holds no transformers causal language model "
                      f"(*{', *'.join(CAUSAL_LM_HEADS)}); nothing changed", stacklevel=3)
        return False
    if isinstance(installed_forward(lm), _FusedLossForward):
        return True
    name = type(lm).__name__
    head = lm.get_output_embeddings()
    why = ""
    if type(head) not in PLAIN_LINEARS:
        why = f"its output embeddings are a {type(head).__name__}, not a plain nn.Linear"
    elif lm.base_model is lm:
        why = "it has no base model apart from its head"
    else:
        output_type, why = _probe(lm, head)
    if why:
        warnings.warn(f"memory.fused_lm_loss: {name} keeps its own head and loss: {why}", stacklevel=3)
        return False
    _FusedLossForward(lm, output_type).install()
    return True
