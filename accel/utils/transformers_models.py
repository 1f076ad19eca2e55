"""Recognising a transformers model without importing transformers (it is optional)."""
from __future__ import annotations

import sys

# Class-name endings of transformers' causal language models (LlamaForCausalLM, GPT2LMHeadModel, BertLMHeadModel):
# a per-token loss on shifted labels.
CAUSAL_LM_HEADS = ("ForCausalLM", "LMHeadModel")


def is_transformers_model(model) -> bool:
    """Whether `model` is an instance of a class defined in transformers and carries a `.config`."""
    return getattr(model, "config", None) is not None and type(model).__module__.startswith("transformers.")


def kv_cache_types() -> tuple[type, ...]:
    """transformers' key/value cache base class, as a tuple for isinstance; () while transformers.cache_utils is
    not loaded (no cache can exist before it is)."""
    cache = getattr(sys.modules.get("transformers.cache_utils"), "Cache", None)
    return (cache,) if isinstance(cache, type) else ()


def name_the_default_loss(model) -> None:
    """Give each transformers causal LM in `model` whose loss_type transformers could not read from its class name
    (GPT2LMHeadModel's is None) the loss transformers falls back to anyway, "ForCausalLM". Its fallback logs a
    warning (logger.warning_once) inside every forward that computes a loss, where torch.compile breaks the graph
    (3 breaks a GPT-2 training step); with the name set the loss is the same function, without the call."""
    for module in model.modules():
        if (is_transformers_model(module) and type(module).__name__.endswith(CAUSAL_LM_HEADS)
                and hasattr(type(module), "loss_function") and getattr(module, "loss_type", "") is None):
            module.loss_type = "ForCausalLM"
