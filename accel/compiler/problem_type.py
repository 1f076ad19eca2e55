"""A sequence classifier's problem_type settled before its first compiled call, so the second call does not compile
the model again.

transformers' sequence classifiers pick their loss at their first call with labels and write the choice into the
model's config: `config.problem_type` goes from None to "regression" (one label), "single_label_classification"
(integer labels) or "multi_label_classification" (other labels). Dynamo guards on that attribute, so the second
call of a compiled classifier failed its guard and compiled the whole model again (BERT-base on the CPU: two
compilations in every bert_base.py accel row). `settle_problem_type(model, hf)` runs the same rule in front of
the compiled call (plain Python, accel.compiler.compiled_call) while the attribute is None and a call brings
labels: the first trace already sees the choice the model would have made. Only for models whose forward writes
the attribute by that rule, inline (BERT, DistilBERT, RoBERTa, ...) or through transformers'
ForSequenceClassification loss (Llama, Mistral, Qwen2, ...); a model with rules of its own (DeBERTa's loss for
problem_type None is another) is left alone.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

from accel.compiler.compiled_call import wrap_compiled_call

_INLINE_RULE = 'problem_type = "single_label_classification"'


def _writes_problem_type(hf: nn.Module) -> bool:
    config = getattr(hf, "config", None)
    if config is None or not hasattr(config, "problem_type"):
        return False
    try:
        source = inspect.getsource(type(hf).forward)
    except (OSError, TypeError):
        return False
    return _INLINE_RULE in source or (
        "self.loss_function(" in source and getattr(hf, "loss_type", None) == "ForSequenceClassification")


def problem_type_for(num_labels: int, labels: torch.Tensor) -> str:
    """transformers' rule (its sequence classifiers' forward, loss_utils.ForSequenceClassificationLoss)."""
    if num_labels == 1:
        return "regression"
    if num_labels > 1 and labels.dtype in (torch.long, torch.int):
        return "single_label_classification"
    return "multi_label_classification"


def settle_problem_type(model: nn.Module, hf: nn.Module) -> bool:
    """Put the problem_type rule of `hf` (the transformers model inside `model`, which is compiled) in front of
    `model`'s compiled call. Returns whether it did (False: `hf` does not write problem_type by that rule, or its
    config has one already)."""
    config = getattr(hf, "config", None)
    if getattr(config, "problem_type", "") is not None or not _writes_problem_type(hf):
        return False

    def wrap(compiled):
        def call(*args, **kwargs):
            labels = kwargs.get("labels")
            if config.problem_type is None and isinstance(labels, torch.Tensor):
                config.problem_type = problem_type_for(getattr(hf, "num_labels", config.num_labels), labels)
            return compiled(*args, **kwargs)

        return call

    wrap_compiled_call(model, wrap)
    return True
