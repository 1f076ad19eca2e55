"""accel.amp.GradScaler: torch.amp.GradScaler's behaviour without host syncs, for XLA, CUDA and CPU.

torch.amp.GradScaler decides on the host whether to skip a step (``found_inf.item()``),
which on XLA cuts the lazy graph and waits for the device every iteration. Here the
overflow flag never leaves the device:

* unscale_ checks the gradients as they are at that moment (so gradients all-reduced by
  the user beforehand are the ones checked) and, when torch.distributed runs with more
  than one process, sums the flag across processes so every replica skips together;
* step hands the flag to optimizers that take it (``_step_supports_found_inf``, e.g.
  accel.amp.syncfree), to fused torch optimizers through torch's own
  grad_scale/found_inf protocol, and otherwise runs the step under a device-side select;
* update adjusts the scale on the device.

The scale trajectory and the weights equal torch.amp.GradScaler's on the same run.
get_scale(), state_dict() and pickling read the scale and so wait for the device.
"""
from __future__ import annotations

import warnings
from collections import abc, defaultdict
from enum import Enum
from typing import Any, Optional, Union

import torch
from torch import Tensor

from accel.utils import checks
from accel.utils.xla import require_xla

from ._guarded_step import guarded_step
from ._scale_update import update_scale_

__all__ = ["GradScaler", "OptState"]


_FLOAT32_MAX = torch.finfo(torch.float32).max


class OptState(Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


def _fresh_optimizer_state() -> dict[str, Any]:
    return {"stage": OptState.READY, "found_inf": None}


def _check_scale(name: str, value) -> float:
    # The scale is held in float32: a larger finite double would become inf there.
    return checks.check_float(name, value, min=0.0, max=_FLOAT32_MAX, min_inclusive=False)


def _check_growth_factor(name: str, value) -> float:
    return checks.check_float(name, value, min=1.0, min_inclusive=False)


def _check_backoff_factor(name: str, value) -> float:
    return checks.check_float(name, value, min=0.0, max=1.0, min_inclusive=False, max_inclusive=False)


def _distributed_world_size() -> int:
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size()


class GradScaler:
    """Dynamic loss scaling, same constructor and methods as torch.amp.GradScaler.

    Args:
        device: "xla", "cuda", "cpu" or None (default): None takes the device of the first
            tensor passed to :meth:`scale`. As in torch, "cuda" without CUDA warns and disables.
        init_scale: initial scale factor (a finite float > 0, within float32's range).
        growth_factor: multiplies the scale after ``growth_interval`` clean steps (finite, > 1).
        backoff_factor: multiplies the scale after a step with inf/NaN gradients (in (0, 1)).
        growth_interval: clean steps needed before the scale grows (an int >= 1).
        enabled: False makes every method a pass-through, as in torch (a bool).

    Arguments are checked by accel.utils.checks' rule: TypeError for a wrong type (bools are
    not numbers), ValueError for a value out of range (NaN included), naming the argument.
    """

    def __init__(
        self,
        device: Optional[str] = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        if device is not None:
            if isinstance(device, torch.device):
                device = device.type
            if not isinstance(device, str):
                raise TypeError(f"device: expected None or a device type such as 'xla', 'cuda', 'cpu', got {device!r}")
            try:
                device = torch.device(device).type
            except RuntimeError as e:
                raise ValueError(f"device: expected a device type such as 'xla', 'cuda', 'cpu', got {device!r}") from e
        # Stricter than torch.amp.GradScaler, which takes init_scale=True, nan or -1 and any
        # growth_interval: each of those breaks the scale on the first update.
        init_scale = _check_scale("init_scale", init_scale)
        growth_factor = _check_growth_factor("growth_factor", growth_factor)
        backoff_factor = _check_backoff_factor("backoff_factor", backoff_factor)
        growth_interval = checks.check_int("growth_interval", growth_interval, min=1)
        checks.check_bool("enabled", enabled)

        self._device = device
        self._enabled = enabled
        if device == "cuda" and enabled and not torch.cuda.is_available():
            warnings.warn("GradScaler(device='cuda') is enabled, but CUDA is not available. Disabling.", stacklevel=2)
            self._enabled = False
        if device == "xla" and enabled:
            require_xla("GradScaler(device='xla')")

        self._init_scale = init_scale
        self._growth_factor = growth_factor
        self._backoff_factor = backoff_factor
        self._growth_interval = growth_interval
        self._init_growth_tracker = 0
        self._scale: Optional[Tensor] = None
        self._growth_tracker: Optional[Tensor] = None
        self._per_optimizer_states: dict[int, dict[str, Any]] = defaultdict(_fresh_optimizer_state)

    # ------------------------------------------------------------------ scale
    def _lazy_init(self, device: torch.device) -> None:
        self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=device)
        self._growth_tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32, device=device)

    def _require_scale(self, funcname: str) -> tuple[Tensor, Tensor]:
        if self._scale is None or self._growth_tracker is None:
            raise RuntimeError(
                f"Attempted {funcname} but the scale is not set yet: call scaler.scale(loss) earlier in the iteration."
            )
        return self._scale, self._growth_tracker

    def scale(self, outputs):
        """Multiply a tensor (or a nested list/tuple/iterable of tensors) by the current scale."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, Tensor):
            if self._scale is None:
                self._lazy_init(outputs.device)
            return outputs * self._scale.to(device=outputs.device, non_blocking=True)

        copies: dict[str, Tensor] = {}

        def apply(val):
            if isinstance(val, Tensor):
                if self._scale is None:
                    self._lazy_init(val.device)
                key = str(val.device)
                if key not in copies:
                    copies[key] = self._scale.to(device=val.device, non_blocking=True)
                return val * copies[key]
            if isinstance(val, abc.Iterable) and not isinstance(val, (str, bytes)):
                mapped = map(apply, val)
                return type(val)(mapped) if isinstance(val, (list, tuple)) else mapped
            raise ValueError(f"outputs: expected a Tensor or an iterable of Tensors, got {type(val).__name__}")

        return apply(outputs)

    # ------------------------------------------------------------------ unscale
    def _check_grads(self, optimizer, inv_scale: Tensor, allow_fp16: bool) -> Tensor:
        """found_inf (float32, 0-d, on the scale's device): non-zero if any gradient is inf/NaN.

        Gradients are multiplied by inv_scale in the same pass (a 1.0 leaves them as they are).
        """
        scale_device = inv_scale.device
        by_device_dtype: dict[torch.device, dict[torch.dtype, list[Tensor]]] = defaultdict(lambda: defaultdict(list))
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    if not allow_fp16 and param.grad.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    if param.grad.is_sparse:
                        if param.grad.dtype is torch.float16:
                            # Duplicate fp16 indices could sum past the fp16 range after coalescing.
                            param.grad = param.grad.coalesce()
                        grad = param.grad._values()
                    else:
                        grad = param.grad
                    by_device_dtype[grad.device][grad.dtype].append(grad)
            if not by_device_dtype:
                raise RuntimeError("No inf checks were recorded for this optimizer: none of its parameters has a gradient.")

            per_device = []
            for device, per_dtype in by_device_dtype.items():
                found = torch.zeros((), dtype=torch.float32, device=device)
                inv = inv_scale.to(device=device, non_blocking=True)
                for grads in per_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
                per_device.append(found)
            found_inf = per_device[0].to(device=scale_device, non_blocking=True)
            for other in per_device[1:]:
                found_inf = found_inf + other.to(device=scale_device, non_blocking=True)

            if _distributed_world_size() > 1:
                # Every replica must skip (or not) together, or their weights drift apart.
                torch.distributed.all_reduce(found_inf)
        return found_inf

    def _inverse_scale(self) -> Tensor:
        scale = self._scale
        if scale.device.type in ("cpu", "cuda"):
            # torch computes 1/scale in float64; equal results for the power-of-two scales.
            return scale.double().reciprocal().float()
        return scale.reciprocal()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale and record (on the device) whether any is inf/NaN."""
        if not self._enabled:
            return
        self._require_scale("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        state["found_inf"] = self._check_grads(optimizer, self._inverse_scale(), allow_fp16=False)
        state["stage"] = OptState.UNSCALED

    # ------------------------------------------------------------------ step
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any):
        """Unscale (unless unscale_ was called) and step where no gradient is inf/NaN, without a host sync.

        Returns what optimizer.step returns. Unlike torch's, the return value of a step that
        the device then discards is still returned: the host does not know it was skipped.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        scale, _ = self._require_scale("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")

        if getattr(optimizer, "_step_supports_amp_scaling", False) and not getattr(
            optimizer, "_step_supports_found_inf", False
        ):
            retval = self._step_amp_scaling_optimizer(optimizer, state, scale, args, kwargs)
        else:
            if state["stage"] is OptState.READY:
                self.unscale_(optimizer)
            if getattr(optimizer, "_step_supports_found_inf", False):
                retval = optimizer.step(*args, found_inf=state["found_inf"], **kwargs)
            else:
                retval = guarded_step(optimizer, state["found_inf"], *args, **kwargs)
        state["stage"] = OptState.STEPPED
        return retval

    def _step_amp_scaling_optimizer(self, optimizer, state, scale, args, kwargs):
        # torch's fused optimizers unscale and skip inside their kernel when given
        # grad_scale/found_inf attributes: the same protocol torch.amp.GradScaler uses.
        if state["stage"] is OptState.READY:
            state["found_inf"] = self._check_grads(optimizer, torch.ones_like(scale), allow_fp16=True)
            optimizer.grad_scale = scale
        else:
            optimizer.grad_scale = None
        optimizer.found_inf = state["found_inf"]
        try:
            return optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale
            del optimizer.found_inf

    # ------------------------------------------------------------------ update
    def update(self, new_scale: Optional[Union[float, Tensor]] = None) -> None:
        """Back off after an overflow, grow after growth_interval clean steps (all on the device),
        or set the scale to ``new_scale``."""
        if not self._enabled:
            return
        scale, tracker = self._require_scale("update")
        if new_scale is not None:
            if isinstance(new_scale, Tensor):
                # Its value is not checked: reading it would wait for the device.
                checks.check_one_element_tensor("new_scale", new_scale)
                if new_scale.requires_grad:
                    raise ValueError("new_scale: expected a tensor with requires_grad=False")
                scale.copy_(new_scale.reshape(()).to(device=scale.device, dtype=scale.dtype))
            else:
                scale.fill_(_check_scale("new_scale", new_scale))
        else:
            found = [s["found_inf"] for s in self._per_optimizer_states.values() if s["found_inf"] is not None]
            if not found:
                raise RuntimeError("No inf checks were recorded prior to update().")
            combined = found[0].to(device=scale.device, non_blocking=True)
            for other in found[1:]:
                combined = combined + other.to(device=scale.device, non_blocking=True)
            update_scale_(
                scale, tracker, combined, self._growth_factor, self._backoff_factor, self._growth_interval
            )
        self._per_optimizer_states = defaultdict(_fresh_optimizer_state)

    # ------------------------------------------------------------------ accessors
    def _get_scale_async(self) -> Optional[Tensor]:
        return self._scale

    def get_scale(self) -> float:
        """The current scale as a Python float (reads the device), or 1.0 when disabled."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else float(self._scale.item())

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._growth_factor = _check_growth_factor("new_factor", new_factor)

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._backoff_factor = _check_backoff_factor("new_factor", new_factor)

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._growth_interval = checks.check_int("new_interval", new_interval, min=1)

    def _get_growth_tracker(self) -> int:
        if not self._enabled:
            return 0
        return self._init_growth_tracker if self._growth_tracker is None else int(self._growth_tracker.item())

    def is_enabled(self) -> bool:
        return self._enabled

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Same keys as torch.amp.GradScaler's (interchangeable with it); empty when disabled."""
        if not self._enabled:
            return {}
        return {
            "scale": self.get_scale(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._get_growth_tracker(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self._enabled:
            return
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict: expected a dict from GradScaler.state_dict(), got {type(state_dict).__name__}")
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved from a disabled instance of GradScaler."
            )
        missing = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"} - set(state_dict)
        if missing:
            raise ValueError(f"state_dict: missing keys {sorted(missing)}")
        # All checked before any is applied, so a corrupt state dict leaves the scaler as it was.
        init_scale = _check_scale("state_dict['scale']", state_dict["scale"])
        growth_factor = _check_growth_factor("state_dict['growth_factor']", state_dict["growth_factor"])
        backoff_factor = _check_backoff_factor("state_dict['backoff_factor']", state_dict["backoff_factor"])
        growth_interval = checks.check_int("state_dict['growth_interval']", state_dict["growth_interval"], min=1)
        tracker = checks.check_int("state_dict['_growth_tracker']", state_dict["_growth_tracker"], min=0)
        self._init_scale = init_scale
        if self._scale is not None:
            self._scale.fill_(self._init_scale)
        self._growth_factor = growth_factor
        self._backoff_factor = backoff_factor
        self._growth_interval = growth_interval
        self._init_growth_tracker = tracker
        if self._growth_tracker is not None:
            self._growth_tracker.fill_(self._init_growth_tracker)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._enabled:
            if any(s["found_inf"] is not None for s in self._per_optimizer_states.values()):
                raise RuntimeError(
                    "A GradScaler instance may only be pickled at the beginning of an iteration, "
                    "or at the end after scaler.update()."
                )
            state["_init_scale"] = self.get_scale()
            state["_init_growth_tracker"] = self._get_growth_tracker()
            state["_scale"] = None
            state["_growth_tracker"] = None
        state["_per_optimizer_states"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._per_optimizer_states = defaultdict(_fresh_optimizer_state)
