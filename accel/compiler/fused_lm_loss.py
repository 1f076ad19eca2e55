"""A language model's training loss without its logits (accelerate()'s memory.fused_lm_loss).

A *ForCausalLM's or *ForMaskedLM's forward with labels makes [B, L, vocabulary] logits and takes their cross
entropy: the logits, their fp32 copy and their gradient are the largest tensors of a step once the vocabulary is
large (Llama 3's 128k tokens, Gemma's 256k; BERT's 30k over 512-token rows). `fuse_lm_loss(model)` gives the model a
forward that, in training calls with labels, computes the loss from the hidden states the head's last linear
layer reads, with accel.runtime.nn.linear_cross_entropy (the product and the cross entropy a slice of the
vocabulary at a time; on the CPU only for the tokens whose label is not ignored: a masked LM's 15%).
- a causal LM: its base model's last hidden states and lm_head (the labels shifted, as transformers does);
- a masked LM: the model's own forward without labels, its output embeddings (BERT's decoder after the head's
  dense layer, activation and LayerNorm) returning their input for that call, so every head that works as
  `decoder(transform(hidden))` (BERT, RoBERTa, DistilBERT, ALBERT, ELECTRA, ...) keeps its own transform.
The output is the model's own output class with the loss and without logits (`logits` is None); hidden states
and attentions are there when asked for. Every other call (no labels, no gradients: evaluation, generation)
is the model's own forward, logits included, and so is a call passing more than input_ids by position (the
head's and the base model's positional arguments differ past the first).

Installed only where it computes what the model's own forward computes: the head must be a plain nn.Linear
(`get_output_embeddings()`), and a probe at install time (4 tokens, no gradients, eval mode) compares the
model's logits and loss with the head's product of those hidden states and its cross entropy; a model whose head
does more (Gemma 2's logit soft-capping, logit scaling, auxiliary losses of mixture-of-experts models) keeps its
forward, with a warning. Hooks on the head, added later, also send calls to the model's own forward.
"""
from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from accel.compiler.first_token import last_layer_rows, sees_every_position
from accel.runtime.nn.linear_cross_entropy import IGNORE_INDEX, linear_cross_entropy
from accel.runtime.nn.onednn_mm import PLAIN_LINEARS
from accel.utils.instance_forward import InstanceForward, stacked_forward
from accel.utils.transformers_models import CAUSAL_LM_HEADS, MASKED_LM_HEADS, is_transformers_model

# Arguments of a *ForCausalLM's forward that its base model does not take.
_HEAD_ONLY = ("labels", "shift_labels", "num_items_in_batch", "logits_to_keep", "return_dict")
_PROBE_TOLERANCE = 1e-5  # the loss: the same sum, in other order


def _plain_head(head: nn.Module) -> bool:
    """Whether `head` computes F.linear(x, weight, bias) alone: a plain Linear without hooks."""
    return type(head) in PLAIN_LINEARS and not (head._forward_hooks or head._forward_pre_hooks)


def _fused_call(kwargs: dict, args: tuple) -> bool:
    """Whether a call takes the fused loss: a training call (gradients on) with labels, input_ids alone by
    position."""
    return ((kwargs.get("labels") is not None or kwargs.get("shift_labels") is not None)
            and torch.is_grad_enabled() and len(args) <= 1)


def _output(output_type: type, loss: torch.Tensor, out, return_dict):
    """The model's output class with `loss`, no logits, and what else `out` holds; a tuple for return_dict=False."""
    fields = {"loss": loss, **{k: getattr(out, k, None) for k in ("past_key_values", "hidden_states", "attentions")}}
    result = output_type(**{k: v for k, v in fields.items() if k in output_type.__dataclass_fields__})
    return result if return_dict is not False else result.to_tuple()


class _FusedLossForward(InstanceForward):
    """A causal LM's forward with the fused head and loss for training calls with labels (an instance forward:
    accel.utils.instance_forward)."""

    def __init__(self, model: nn.Module, output_type: type):
        super().__init__(model)
        self.output_type = output_type

    def __call__(self, *args, **kwargs):
        head = self.module.get_output_embeddings()
        if not _fused_call(kwargs, args) or not _plain_head(head):
            return self.own(*args, **kwargs)
        out = self.module.base_model(*args, **{k: v for k, v in kwargs.items() if k not in _HEAD_ONLY})
        loss = causal_lm_loss(out[0], head, kwargs.get("labels"), kwargs.get("shift_labels"),
                              kwargs.get("num_items_in_batch"))
        return _output(self.output_type, loss, out, kwargs.get("return_dict"))


class _InputThrough(InstanceForward):
    """A masked LM's output embeddings (a Linear) returning their input while `through` is set: the model's own
    forward then yields, as its logits, the hidden states the product would read. The flag is set and cleared
    around one call by _MaskedFusedLossForward (Dynamo traces the attribute's writes as side effects)."""

    def __init__(self, module: nn.Module):
        super().__init__(module)
        self.through = False

    def __call__(self, *args, **kwargs):
        if self.through:
            return args[0]
        return self.own(*args, **kwargs)


class _MaskedFusedLossForward(InstanceForward):
    """A masked LM's forward with the fused head and loss for training calls with labels (an instance forward).

    On the CPU its last layer computes only the positions whose label is not ignored, where that layer can be cut
    (accel.compiler.first_token.last_layer_rows: BERT, RoBERTa, ELECTRA, DistilBERT): each row's labelled
    positions first, then unlabelled ones up to labelled_rows(labels) positions a row; their labels follow them,
    and the loss is the same sum over the same labelled tokens. A compiled model cannot count the labels inside its
    graph (its shapes are static): the count is set in front of its compiled call (count_labels_before_calls), and
    a compiled call without it computes every position.
    """

    def __init__(self, model: nn.Module, output_type: type, head: _InputThrough, takes_items: bool):
        super().__init__(model)
        self.output_type = output_type
        self.head = head
        self.takes_items = takes_items  # whether the model's own loss divides by num_items_in_batch
        self.last_layer = last_layer_rows(model)  # None: not a layer that can be cut
        self.kept: int | None = None  # positions a row for the compiled call in progress (count_labels_before_calls)

    def __call__(self, *args, **kwargs):
        head = self.module.get_output_embeddings()
        if (not _fused_call(kwargs, args) or kwargs.get("labels") is None or not _plain_head(head)
                or head is not self.head.module):  # a head set since (resize_token_embeddings) would not pass its input
            return self.own(*args, **kwargs)
        labels = kwargs["labels"]
        rows = self._labelled_rows(labels, kwargs)
        if rows is not None:
            self.last_layer.rows, labels = rows, labels.gather(1, rows)
        self.head.through = True
        try:
            out = self.own(*args, **{k: v for k, v in kwargs.items() if k not in ("labels", "return_dict")},
                           return_dict=True)
        finally:
            self.head.through = False
            if rows is not None:
                self.last_layer.rows = None
        items = kwargs.get("num_items_in_batch") if self.takes_items else None
        loss = token_loss(out.logits, head, labels, items)
        return _output(self.output_type, loss, out, kwargs.get("return_dict"))

    def _labelled_rows(self, labels: torch.Tensor, kwargs: dict) -> torch.Tensor | None:
        """[B, R] positions for the last layer to compute, each row's labelled ones first; None: every position (no
        layer to cut, a call that shows every position, one that another caller cuts already, or no count:
        labelled_rows' cases, and a compiled call nobody counted for)."""
        layer = self.last_layer
        if layer is None or layer.rows is not None or sees_every_position(self.module.config, kwargs):
            return None
        # compiled, the count was made in front of the call from these labels (count_labels_before_calls)
        kept = self.kept if torch.compiler.is_compiling() else labelled_rows(labels)
        if kept is None:
            return None
        unlabelled = (labels == IGNORE_INDEX).to(torch.uint8)
        return torch.sort(unlabelled, dim=1, stable=True).indices[:, :kept]


def labelled_rows(labels) -> int | None:
    """How many positions of each row a masked LM's cut last layer computes for `labels` ([B, L] on the CPU): the
    most labelled tokens any row has, rounded up to a multiple of L / 8 (a compiled model then has a graph for
    each of a few counts: 15% of 128 tokens takes 32 positions in nearly every batch, 48 in the rest); None where
    that is the whole row, or `labels` is not such a tensor (labels off the CPU: counting them would wait for their
    device)."""
    if not isinstance(labels, torch.Tensor) or labels.device.type != "cpu" or labels.dim() != 2 or labels.numel() == 0:
        return None
    length = labels.shape[1]
    step = -(-length // 8)
    most = int((labels != IGNORE_INDEX).sum(1).max())
    kept = max(step, -(-most // step) * step)
    return kept if kept < length else None


def count_labels_before_calls(model: nn.Module, lm: nn.Module) -> bool:
    """In front of `model`'s compiled call (accel.compiler.compiled_call), count the labels of each call for the cut
    last layer of the masked LM `lm` inside it (see _MaskedFusedLossForward). Only where the call's labels are the
    ones that reach `lm`'s forward: `model` is `lm` (autocast's forward passes them on) or accel's PackedModel
    around it (a masked LM's packed labels go to it unchanged). Returns whether it was put there."""
    from accel.compiler.compiled_call import wrap_compiled_call
    from accel.compiler.packed import PackedModel

    forward = stacked_forward(lm, _MaskedFusedLossForward)
    if (forward is None or forward.last_layer is None
            or not (model is lm or (isinstance(model, PackedModel) and model.model is lm))):
        return False

    def wrap(compiled):
        def call(*args, **kwargs):
            forward.kept = labelled_rows(kwargs.get("labels")) if torch.is_grad_enabled() else None
            try:
                return compiled(*args, **kwargs)
            finally:
                forward.kept = None

        return call

    wrap_compiled_call(model, wrap)
    return True


def token_loss(hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
    """The cross entropy of `head(hidden)` at each token against its own label (a masked LM's loss, transformers'
    ForMaskedLMLoss), computed without the logits.

    Args:
        hidden: [B, L, H] the hidden states the head's linear layer reads.
        head: the nn.Linear ([V, H] weight, optional [V] bias).
        labels: [B, L] token ids, -100 ignored.
        num_items_in_batch: optional count of labelled tokens over all micro-batches: the loss is then the sum
            divided by it (transformers' gradient-accumulation convention), else the mean over the labelled
            tokens.

    Returns:
        The fp32 scalar loss.
    """
    target = labels.reshape(-1).to(hidden.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), head.weight, target, head.bias,
                                reduction=reduction)
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def causal_lm_loss(hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor | None,
                   shift_labels: torch.Tensor | None = None, num_items_in_batch=None) -> torch.Tensor:
    """transformers' causal-LM loss (ForCausalLMLoss) of `head(hidden)`, computed without the logits.

    Args:
        hidden: [B, L, H] the base model's last hidden states.
        head: the nn.Linear language-model head ([V, H] weight).
        labels: [B, L] token ids, -100 ignored; the logits at t predict labels[t + 1]. Not used when
            shift_labels is given.
        shift_labels: optional [B, L], already shifted (the logits at t predict shift_labels[t]).
        num_items_in_batch: as token_loss's.

    Returns:
        The fp32 scalar loss.
    """
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    return token_loss(hidden, head, shift_labels, num_items_in_batch)


@contextlib.contextmanager
def _eval_no_grad(model: nn.Module):
    """Every module of `model` in eval mode and gradients off, modes restored after (the probes' calls)."""
    modes = [(m, m.training) for m in model.modules()]
    try:
        with torch.no_grad():
            model.eval()
            yield
    finally:
        for module, training in modes:
            module.training = training


def _probe_ids(head: nn.Linear) -> torch.Tensor:
    return (torch.arange(1, 5, device=head.weight.device) % head.out_features).unsqueeze(0)


def _compare(own, logits: torch.Tensor, loss: torch.Tensor, logits_are: str, loss_is: str) -> str:
    """"" where the model's own output has these logits and this loss, else what differs."""
    # The same product of the same hidden states is the same bits: anything the head does after it (Gemma 2's
    # soft-capping of small random-weight logits changes them by 1e-6) shows.
    if getattr(own, "logits", None) is None or not torch.equal(own.logits, logits):
        return f"its logits are not {logits_are}"
    if getattr(own, "loss", None) is None or not torch.allclose(own.loss.float(), loss.float(),
                                                                rtol=_PROBE_TOLERANCE, atol=_PROBE_TOLERANCE):
        return f"its loss is not {loss_is}"
    return ""


def _probe(model: nn.Module, head: nn.Linear) -> tuple[type | None, str]:
    """(the model's output class, "") where its forward with labels is lm_head(base model) plus the causal-LM
    loss on 4 tokens, else (None, what differs)."""
    ids = _probe_ids(head)
    with _eval_no_grad(model):
        own = type(model).forward(model, input_ids=ids, labels=ids, use_cache=False, return_dict=True)
        hidden = model.base_model(input_ids=ids, use_cache=False, return_dict=True)[0]
        why = _compare(own, F.linear(hidden, head.weight, head.bias), causal_lm_loss(hidden, head, ids),
                       "lm_head(base model's hidden states)", "the cross entropy of the shifted labels alone")
    return (None, why) if why else (type(own), "")


def _probe_masked(model: nn.Module, head: nn.Linear) -> tuple[type | None, bool, str]:
    """(the model's output class, whether its loss divides by num_items_in_batch, "") where its forward with
    labels is its output embeddings' product of what they read plus the cross entropy of the labels, on 4 tokens;
    else (None, False, what differs)."""
    ids = _probe_ids(head)
    labels = ids.clone()
    labels[0, 0] = IGNORE_INDEX  # 3 labelled tokens: a mean, a sum and a sum over 1 item differ
    with _eval_no_grad(model), _random_bias(head):
        own = type(model).forward(model, input_ids=ids, labels=labels, return_dict=True)
        handle = head.register_forward_hook(lambda module, args, output: args[0])
        try:
            hidden = type(model).forward(model, input_ids=ids, return_dict=True).logits
        finally:
            handle.remove()
        why = _compare(own, F.linear(hidden, head.weight, head.bias), token_loss(hidden, head, labels),
                       "its output embeddings' product of their input", "the cross entropy of the labels alone")
        if why:
            return None, False, why
        try:
            items = type(model).forward(model, input_ids=ids, labels=labels, return_dict=True,
                                        num_items_in_batch=torch.tensor(1.0, device=ids.device)).loss
        except TypeError:  # the forward takes no such argument
            return type(own), False, ""
        takes_items = torch.allclose(items.float(), token_loss(hidden, head, labels, 1.0).float(),
                                     rtol=_PROBE_TOLERANCE, atol=_PROBE_TOLERANCE)
    return type(own), takes_items, ""


@contextlib.contextmanager
def _random_bias(head: nn.Linear):
    """The head's bias filled with random values for the probe, then restored. With the bias it starts with (BERT's
    zeros) a model that scales its logits after the head, logits = s * head(x), would pass the probe, as
    head(s * x) = s * head(x) then, and differ once training moves the bias."""
    if head.bias is None:  # head(s * x) = s * head(x) for every weight
        yield
        return
    saved = head.bias.detach().clone()
    head.bias.detach().copy_(torch.randn(saved.shape, generator=torch.Generator().manual_seed(0)))  # any device
    try:
        yield
    finally:
        head.bias.detach().copy_(saved)


def _kind(module: nn.Module) -> str | None:
    """"causal" or "masked" for a transformers language model of that kind, else None."""
    if not is_transformers_model(module):
        return None
    name = type(module).__name__
    return "causal" if name.endswith(CAUSAL_LM_HEADS) else "masked" if name.endswith(MASKED_LM_HEADS) else None


def fuse_lm_loss(model: nn.Module) -> bool:
    """Give a transformers causal or masked language model the fused head and loss for its training calls with
    labels.

    Args:
        model: a transformers *ForCausalLM / *LMHeadModel / *ForMaskedLM, or a module holding one (a user's wrapper,
            an adapter library's model around it): the outermost one found gets it, so calls that reach its
            forward through the wrapper are fused too.

    Returns:
        Whether it was installed. Where it is not, a warning says why (no language model found, or one whose head
        or loss is not the plain one).
    """
    lm = next((m for m in model.modules() if _kind(m)), None)
    if lm is None:
        warnings.warn(f"memory.fused_lm_loss: {type(model).__name__} holds no transformers causal or masked "
                      f"language model (*{', *'.join(CAUSAL_LM_HEADS + MASKED_LM_HEADS)}); nothing changed",
                      stacklevel=3)
        return False
    if stacked_forward(lm, (_FusedLossForward, _MaskedFusedLossForward)) is not None:
        return True
    name, kind = type(lm).__name__, _kind(lm)
    head = lm.get_output_embeddings()
    why = ""
    if type(head) not in PLAIN_LINEARS:
        why = f"its output embeddings are a {type(head).__name__}, not a plain nn.Linear"
    elif kind == "causal" and lm.base_model is lm:
        why = "it has no base model apart from its head"
    elif kind == "causal":
        output_type, why = _probe(lm, head)
    else:
        output_type, takes_items, why = _probe_masked(lm, head)
    if why:
        warnings.warn(f"memory.fused_lm_loss: {name} keeps its own head and loss: {why}", stacklevel=3)
        return False
    if kind == "causal":
        _FusedLossForward(lm, output_type).install()
    else:
        _MaskedFusedLossForward(lm, output_type, _InputThrough(head).install(), takes_items).install()
    return True
