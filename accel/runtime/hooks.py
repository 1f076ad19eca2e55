"""Swap torch's LayerNorm, Dropout, Linear and Adam/AdamW for accel's in code you do not control.

    from accel.runtime import hooks
    hooks.enable_fused_layer_norm()   # nn.LayerNorm(...) now builds FusedLayerNorm
    hooks.enable_philox_dropout()     # nn.Dropout(...) now builds PhiloxDropout
    hooks.enable_onednn_linear()      # nn.Linear(...) now builds OneDNNLinear, where oneDNN wins on this CPU
    hooks.enable_fused_adam()         # torch.optim.Adam/AdamW(...) now build FusedAdam/FusedAdamW

Model code such as transformers' BertLayer looks `nn.LayerNorm` up on the torch.nn module when it
builds a model, so replacing that attribute reaches every model built afterwards (modules already
built keep their class). Each enable_* is idempotent and has a disable_* counterpart that puts
back the exact objects found before the first enable.

What is patched, and what deliberately is not:
- torch.nn.LayerNorm and torch.nn.modules.LayerNorm (Dropout and Linear likewise), but not
  torch.nn.modules.normalization.LayerNorm (torch.nn.modules.dropout.Dropout): pickle finds a class
  through its defining module and refuses to save instances if that name points elsewhere, so
  torch.save of a model holding an original LayerNorm keeps working while the hook is on.
  FusedLayerNorm (PhiloxDropout) subclasses that original class, so isinstance(m, nn.LayerNorm)
  stays true for fused modules and nothing recurses.
- torch.optim.Adam and torch.optim.AdamW, not torch.optim.adam.Adam / torch.optim.adamw.AdamW,
  for the same reason.
"""
from __future__ import annotations

import threading

import torch

_lock = threading.Lock()
# (namespace, attribute) -> the object found there before we replaced it
_originals: dict[tuple[object, str], object] = {}


def _nn_targets(name: str):
    return [(torch.nn, name), (torch.nn.modules, name)]


def _adam_targets():
    return [(torch.optim, "Adam"), (torch.optim, "AdamW")]


def _patch(namespace, name: str, replacement) -> None:
    key = (namespace, name)
    if key not in _originals:  # a second enable must not record our own class as "original"
        _originals[key] = getattr(namespace, name)
    setattr(namespace, name, replacement)


def _restore(namespace, name: str) -> None:
    original = _originals.pop((namespace, name), None)
    if original is not None:
        setattr(namespace, name, original)


def _patch_all(targets, replacement_for) -> None:
    """Replace every (namespace, name) of targets with replacement_for(name)."""
    with _lock:
        for namespace, name in targets:
            _patch(namespace, name, replacement_for(name))


def _restore_all(targets) -> None:
    with _lock:
        for namespace, name in targets:
            _restore(namespace, name)


def _patched(namespace, name: str) -> bool:
    with _lock:
        return (namespace, name) in _originals


def enable_fused_layer_norm() -> None:
    """Make nn.LayerNorm construct accel's FusedLayerNorm (same arguments, parameters, state_dict)."""
    from accel.runtime.nn.layer_norm import FusedLayerNorm

    _patch_all(_nn_targets("LayerNorm"), lambda name: FusedLayerNorm)


def disable_fused_layer_norm() -> None:
    """Put torch's own nn.LayerNorm back (a no-op when the hook is off)."""
    _restore_all(_nn_targets("LayerNorm"))


def fused_layer_norm_enabled() -> bool:
    return _patched(torch.nn, "LayerNorm")


def enable_philox_dropout() -> None:
    """Make nn.Dropout construct accel's PhiloxDropout (same arguments; the mask from accel's Philox kernel)."""
    from accel.runtime.nn.bias_dropout_add import PhiloxDropout

    _patch_all(_nn_targets("Dropout"), lambda name: PhiloxDropout)


def disable_philox_dropout() -> None:
    """Put torch's own nn.Dropout back (a no-op when the hook is off)."""
    _restore_all(_nn_targets("Dropout"))


def philox_dropout_enabled() -> bool:
    return _patched(torch.nn, "Dropout")


def enable_onednn_linear(where_faster: bool = True) -> bool:
    """Make nn.Linear construct accel's OneDNNLinear (same constructor, parameters, state_dict), whose large fp32
    CPU products run on oneDNN where it measured faster for their shape (accel.runtime.nn.onednn_mm). With
    where_faster (the default) only where the once-per-process probe found oneDNN faster than torch's BLAS on
    this CPU at all; elsewhere nothing changes.

    Returns:
        whether the hook is on.
    """
    from accel.runtime.nn.onednn_mm import OneDNNLinear, onednn_available, onednn_wins

    if not (onednn_wins() if where_faster else onednn_available()):
        return onednn_linear_enabled()
    _patch_all(_nn_targets("Linear"), lambda name: OneDNNLinear)
    return True


def disable_onednn_linear() -> None:
    """Put torch's own nn.Linear back (a no-op when the hook is off)."""
    _restore_all(_nn_targets("Linear"))


def onednn_linear_enabled() -> bool:
    return _patched(torch.nn, "Linear")


def enable_fused_adam() -> None:
    """Make torch.optim.Adam / AdamW construct accel's FusedAdam / FusedAdamW (same constructor)."""
    from accel.runtime.optim import FusedAdam, FusedAdamW

    _patch_all(_adam_targets(), {"Adam": FusedAdam, "AdamW": FusedAdamW}.__getitem__)


def disable_fused_adam() -> None:
    """Put torch's own Adam / AdamW back (a no-op when the hook is off)."""
    _restore_all(_adam_targets())


def fused_adam_enabled() -> bool:
    return _patched(torch.optim, "Adam")
