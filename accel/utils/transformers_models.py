"""Recognising a transformers model without importing transformers (it is optional)."""
from __future__ import annotations


def is_transformers_model(model) -> bool:
    """Whether `model` is an instance of a class defined in transformers and carries a `.config`."""
    return getattr(model, "config", None) is not None and type(model).__module__.startswith("transformers.")
