"""Recognising a transformers model without importing transformers (it is optional)."""
from __future__ import annotations

import sys

# Class-name endings of transformers' causal language models (LlamaForCausalLM, GPT2LMHeadModel, BertLMHeadModel):
# a per-token loss on shifted labels.
CAUSAL_LM_HEADS = ("ForCausalLM", "LMHeadModel")
# ... and of its masked language models (BertForMaskedLM, RobertaForMaskedLM): a per-token loss on unshifted labels.
MASKED_LM_HEADS = ("ForMaskedLM",)


def is_transformers_model(model) -> bool:
    """Whether `model` is an instance of a class defined in transformers and carries a `.config`."""
    return getattr(model, "config", None) is not None and type(model).__module__.startswith("transformers.")


def transformers_model(model):
    """The transformers model that `model` runs: `model` itself, or the one inside a PEFT model whose adapters sit
    in the model's own layers (LoRA, IA3, ...: peft injects them in place, and PeftModel.forward calls the model
    with the caller's arguments), so what accel does to a transformers model (packing, its attention, the last
    layer's cut, the fused loss) applies to it with the adapters in. A prompt-learning PEFT model (prefix or
    prompt tuning: virtual tokens added to every call) comes back as it is."""
    peft = sys.modules.get("peft")  # not imported: no PEFT model can exist
    base = getattr(peft, "PeftModel", None) if peft is not None else None
    if base is not None and isinstance(model, base) and not model.active_peft_config.is_prompt_learning:
        return model.get_base_model()
    return model


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
