"""Argument checks with one rule for all of accel's public constructors.

* a value of the wrong type raises TypeError, a value of the right type that is out of range
  raises ValueError;
* NaN is out of every range (comparisons with NaN are all False, so a plain ``lr < 0`` check
  lets it through and the first step then turns every weight into NaN);
* infinities are refused unless a check asks for them: no hyper-parameter here means anything
  when infinite;
* bools are not numbers: ``lr=True`` is nearly always an argument in the wrong position;
* every message starts with the argument's name.

Each helper returns the value converted to the checked type, so callers can store what was
validated.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Optional, Union

import torch

__all__ = ["check_bool", "check_float", "check_float_or_tensor", "check_int", "check_one_element_tensor",
           "check_sequence"]


def _type_name(value: Any) -> str:
    return type(value).__name__


def _number(x) -> str:
    return str(x) if isinstance(x, int) else format(x, "g")  # ints in full: 2**63 - 1, not 9.22337e+18


def _bounds(min, max, min_inclusive: bool, max_inclusive: bool) -> str:
    if min is not None and max is not None:
        return f"in {'[' if min_inclusive else '('}{_number(min)}, {_number(max)}{']' if max_inclusive else ')'}"
    if min is not None:
        return f"{'>=' if min_inclusive else '>'} {_number(min)}"
    if max is not None:
        return f"{'<=' if max_inclusive else '<'} {_number(max)}"
    return ""


def _check_range(name: str, value, what: str, min, max, min_inclusive: bool, max_inclusive: bool,
                 shown: Any = None) -> None:
    low_ok = min is None or (value >= min if min_inclusive else value > min)
    high_ok = max is None or (value <= max if max_inclusive else value < max)
    if not (low_ok and high_ok):
        shown = value if shown is None else shown
        raise ValueError(f"{name}: expected {what} {_bounds(min, max, min_inclusive, max_inclusive)}, got {shown!r}")


def check_bool(name: str, value: Any) -> bool:
    """A real bool: truthy strings such as 'no' would silently mean True."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {_type_name(value)} {value!r}")
    return value


def check_int(name: str, value: Any, *, min: Optional[int] = None, max: Optional[int] = None) -> int:
    """An integer (numpy integers included, bools and floats such as 2.0 not)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {_type_name(value)} {value!r}")
    converted = int(value)
    _check_range(name, converted, "an int", min, max, True, True, shown=value)
    return converted


def check_float(
    name: str,
    value: Any,
    *,
    min: Optional[float] = None,
    max: Optional[float] = None,
    min_inclusive: bool = True,
    max_inclusive: bool = True,
    allow_inf: bool = False,
) -> float:
    """A real number (int, float, numpy float; not bool), never NaN, finite unless ``allow_inf``,
    within the bounds (each inclusive unless told otherwise)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a float, got {_type_name(value)} {value!r}")
    converted = float(value)
    what = "a float" if allow_inf else "a finite float"
    if math.isnan(converted) or (math.isinf(converted) and not allow_inf):
        bounds = _bounds(min, max, min_inclusive, max_inclusive)
        raise ValueError(f"{name}: expected {what}{' ' + bounds if bounds else ''}, got {value!r}")
    _check_range(name, converted, what, min, max, min_inclusive, max_inclusive, shown=value)
    return converted


def check_one_element_tensor(name: str, value: Any, *, floating: bool = False) -> torch.Tensor:
    """A tensor holding one value (of any shape: () and (1,) are both accepted)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a one-element tensor, got {_type_name(value)} {value!r}")
    if floating and not value.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got dtype {value.dtype}")
    if value.numel() != 1:
        raise ValueError(f"{name}: expected a one-element tensor, got shape {tuple(value.shape)}")
    return value


def check_float_or_tensor(name: str, value: Any, **bounds: Any) -> Union[float, torch.Tensor]:
    """A float as in check_float, or a one-element floating-point tensor (e.g. a learning rate
    that a scheduler updates in place). A CPU tensor's value is checked too; reading one on an
    accelerator would wait for the device, so there only its shape and dtype are checked.
    Returns the tensor unchanged."""
    if isinstance(value, torch.Tensor):
        check_one_element_tensor(name, value, floating=True)
        if value.device.type == "cpu":
            check_float(name, value.item(), **bounds)
        return value
    return check_float(name, value, **bounds)


def check_sequence(name: str, value: Any, length: int) -> tuple:
    """A tuple or list of exactly ``length`` items (its items are the caller's to check)."""
    if not isinstance(value, (tuple, list)):
        raise TypeError(f"{name}: expected a tuple of {length} values, got {_type_name(value)} {value!r}")
    if len(value) != length:
        raise ValueError(f"{name}: expected a tuple of {length} values, got {len(value)}: {value!r}")
    return tuple(value)
