"""Fused Adam and AdamW: every parameter of a group updated by one multi-tensor kernel call.

`FusedAdam` / `FusedAdamW` take torch.optim.Adam / AdamW's constructor and follow their formulas
(torch's single-tensor path): Adam's weight_decay adds wd * p to the grad, AdamW multiplies p by
1 - lr * wd, bias corrections from a per-parameter step count, amsgrad's running max, maximize.
Each element's update is one fixed sequence of roundings (csrc/fused_adam_host.h), the same on the
CPU (scalar and AVX-512) and CUDA paths, so chunking never changes a result; it may differ from
torch's by one rounding per step where the kernel fuses a multiply into an add.

Precision: fp32, fp16 and bf16 parameters keep their state (exp_avg, exp_avg_sq, max_exp_avg_sq) in
fp32 (fp64 parameters in fp64). A reduced-precision parameter is widened to fp32, updated in fp32
and rounded once on store: the result equals torch.optim on an fp32 copy of the parameter that is
rounded to the parameter's dtype after every step. `compact_state=True` keeps the state of fp16/bf16
parameters in their own dtype instead, as torch.optim.Adam does (its fused path too): 14 bytes moved
per bf16 parameter and step instead of 22, and half the state's memory; the math stays fp32, the
moments are rounded on store like the parameter.

Sync-free with a GradScaler: `step(found_inf=..., grad_scale=...)` (or the `found_inf` /
`grad_scale` attributes torch.amp.GradScaler sets) divides the grads by grad_scale inside the kernel
and, when found_inf is non-zero, skips the step on the device: weights, state and step counters
stay as they were, and the host never waits for the flag. state['step'] is a float32 tensor on the
parameter's device, incremented by the kernel.

CPU and CUDA tensors run the kernels in csrc/{cpu,cuda}/fused_adam.*; tensors on other devices
(XLA) run `adam_reference`, plain tensor ops that the XLA compiler fuses.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable, Optional

import torch

from accel.amp.syncfree import _functional as _syncfree_functional
from accel.runtime import _build

CHUNK_SIZE = 1 << 16  # elements per work item (CPU thread task / CUDA block)
PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def _absent():  # stands for a weakref.ref in FusedAdam._seen where the key was absent: nothing there
    return None


def _register():
    # The op mutates its inputs and returns nothing; this lets torch.compile trace through it.
    torch.library.register_fake("accel::fused_adam_step")(lambda *args, **kwargs: None)


def _ops():
    return _build.ops("fused_adam", _register)


def state_dtype(param_dtype: torch.dtype, compact: bool = False) -> torch.dtype:
    """The dtype of the optimizer state of a parameter: its compute type, or with `compact` its own."""
    if compact:
        return param_dtype
    return torch.float64 if param_dtype == torch.float64 else torch.float32


def fused_adam_step(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, *, lr, beta1, beta2,
                    eps, weight_decay, amsgrad, maximize, decoupled_weight_decay, grad_scale=None,
                    found_inf=None, chunk_size: int = CHUNK_SIZE) -> None:
    """One Adam step over lists of same-device tensors, in place. The functional core of the
    optimizers; `chunk_size` (elements per work item) is exposed so tests can exercise many
    chunks per tensor at small sizes."""
    if not params:
        return
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
        raise ValueError(f"chunk_size: expected a positive int, got {chunk_size!r}")
    device = params[0].device
    if device.type not in ("cpu", "cuda"):
        adam_reference(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr=lr, beta1=beta1,
                       beta2=beta2, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                       decoupled_weight_decay=decoupled_weight_decay, grad_scale=grad_scale,
                       found_inf=found_inf)
        return
    lr_tensor = None
    if isinstance(lr, torch.Tensor):
        # A CPU lr is read by the host for free; a device lr stays on the device (no sync).
        lr_tensor = lr.detach().to(torch.float64) if lr.device.type == "cpu" else \
            lr.detach().to(device=device, dtype=torch.float64)
        lr = 0.0
    _ops().fused_adam_step(
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if amsgrad else [], steps,
        float(lr), lr_tensor, float(beta1), float(beta2), float(eps), float(weight_decay), bool(amsgrad),
        bool(maximize), bool(decoupled_weight_decay), grad_scale, found_inf, chunk_size)


def adam_reference(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, *, lr, beta1, beta2, eps,
                   weight_decay, amsgrad, maximize, decoupled_weight_decay, grad_scale=None,
                   found_inf=None) -> None:
    """Plain tensor ops for devices without kernels: accel.amp.syncfree's Adam, which updates in the
    state's dtype (fp32 for fp16/bf16 params, rounded once on store, as the kernels do) and skips on
    the device where found_inf != 0, never branching on the host. A tensor lr is taken in float64 on
    the params' device, as the kernels take it."""
    if params and isinstance(lr, torch.Tensor):
        lr = lr.detach().to(device=params[0].device, dtype=torch.float64)
    # compact state (an fp16/bf16 param's own dtype) is updated in fp32, as the kernels do, rounded on store
    states = (exp_avgs, exp_avg_sqs, max_exp_avg_sqs)[:3 if amsgrad else 2]
    work = [list(lst) for lst in states]
    compact = [i for i, (p, m) in enumerate(zip(params, exp_avgs)) if m.dtype != state_dtype(p.dtype)]
    for i in compact:
        for lst in work:
            lst[i] = lst[i].float()
    _syncfree_functional.adam(params, grads, work[0], work[1], work[2] if amsgrad else max_exp_avg_sqs, steps,
                              found_inf, amsgrad=amsgrad, beta1=beta1, beta2=beta2, lr=lr,
                              weight_decay=weight_decay, eps=eps, maximize=maximize,
                              decoupled_weight_decay=decoupled_weight_decay, grad_scale=grad_scale)
    for i in compact:
        for lst, wide in zip(states, work):
            lst[i].copy_(wide[i])


def _check_flag(name: str, value, allowed=(True, False)) -> None:
    if value not in allowed or not (value is None or isinstance(value, bool)):
        raise ValueError(f"{name}: expected one of {allowed}, got {value!r}")


def _scalar(name: str, value) -> float:
    """A float hyper-parameter, or a one-element CPU tensor (read on the host without a sync)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.device.type != "cpu":
            raise ValueError(f"{name}: expected a float or a one-element CPU tensor, got {tuple(value.shape)} "
                             f"on {value.device}")
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}: expected a float, got {type(value).__name__}")
    return float(value)


def _check_flag_tensor(name: str, value) -> None:
    if value is not None and (not isinstance(value, torch.Tensor) or value.numel() != 1
                              or not value.dtype.is_floating_point):
        raise ValueError(f"{name}: expected a one-element floating-point tensor, got {value!r}")


def _on_device(value: Optional[torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
    """A GradScaler flag on the device of a group. GradScaler keeps it there already; a copy
    between accelerators stays asynchronous, a copy to the host has to wait for the value."""
    if value is None:
        return None
    if value.device != device:
        value = value.to(device, non_blocking=device.type != "cpu")
    return value.reshape(())


class FusedAdam(torch.optim.Optimizer):
    """torch.optim.Adam with a multi-tensor kernel; see the module docstring for the semantics.

    Accepted for compatibility and validated: foreach and fused (ignored: this class always runs the
    multi-tensor kernel), capturable (the step is sync-free either way). differentiable=True is
    refused: the kernel is not differentiable. `chunk_size` sets the elements per work item;
    `compact_state` keeps the state of fp16/bf16 params in their dtype (module docstring).
    """

    _step_supports_found_inf = True   # accel's GradScaler passes found_inf / grad_scale to step()
    _step_supports_amp_scaling = True  # torch.amp.GradScaler sets optimizer.found_inf / grad_scale

    def __init__(self, params: Iterable, lr: float | torch.Tensor = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, *, foreach: Optional[bool] = None,
                 maximize: bool = False, capturable: bool = False, differentiable: bool = False,
                 fused: Optional[bool] = None, decoupled_weight_decay: bool = False,
                 chunk_size: int = CHUNK_SIZE, compact_state: bool = False):
        if isinstance(lr, torch.Tensor):
            if lr.numel() != 1:
                raise ValueError(f"lr: expected a float or a one-element tensor, got shape {tuple(lr.shape)}")
            if lr.requires_grad:
                raise ValueError("lr: a tensor lr must not require grad (differentiable is unsupported)")
            lr_value = None
        else:
            lr_value = _scalar("lr", lr)
        if lr_value is not None and not lr_value >= 0.0:
            raise ValueError(f"lr: expected >= 0, got {lr}")
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas: expected a pair (beta1, beta2), got {betas!r}")
        for k, b in enumerate(betas):
            if not 0.0 <= _scalar(f"betas[{k}]", b) < 1.0:
                raise ValueError(f"betas[{k}]: expected a value in [0, 1), got {b}")
        if not 0.0 <= _scalar("eps", eps):
            raise ValueError(f"eps: expected >= 0, got {eps}")
        if not 0.0 <= _scalar("weight_decay", weight_decay):
            raise ValueError(f"weight_decay: expected >= 0, got {weight_decay}")
        _check_flag("amsgrad", amsgrad)
        _check_flag("maximize", maximize)
        _check_flag("capturable", capturable)
        _check_flag("decoupled_weight_decay", decoupled_weight_decay)
        _check_flag("foreach", foreach, (None, True, False))
        _check_flag("fused", fused, (None, True, False))
        _check_flag("differentiable", differentiable, (False,))
        _check_flag("compact_state", compact_state)
        self.compact_state = compact_state
        self._seen: dict = {}  # per param: what _state_for last found in layout (see there)
        if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
            raise ValueError(f"chunk_size: expected a positive int, got {chunk_size!r}")
        self.chunk_size = chunk_size
        # The same group keys as torch.optim.Adam, so state dicts load either way. foreach/fused are
        # stored as None: loaded into torch.optim.Adam, they let torch pick its default path.
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=None, capturable=capturable, differentiable=False,
                        fused=None, decoupled_weight_decay=decoupled_weight_decay)
        super().__init__(params, defaults)  # checks each group's params through add_param_group

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self._check_group_params(self.param_groups[-1])

    @staticmethod
    def _check_group_params(group) -> None:
        params = group["params"]
        for k, p in enumerate(params):
            if p.dtype not in PARAM_DTYPES:
                allowed = ", ".join(str(d).replace("torch.", "") for d in PARAM_DTYPES)
                raise ValueError(f"params: expected dtype in ({allowed}), got {p.dtype} for param {k}")
            if p.device != params[0].device:
                raise ValueError(f"params: all params of a group must be on one device; param {k} is on "
                                 f"{p.device}, param 0 on {params[0].device}")

    def __getstate__(self):
        # torch.optim.Optimizer pickles defaults, state and param_groups only; these two are ours
        return {**super().__getstate__(), "chunk_size": self.chunk_size, "compact_state": self.compact_state}

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("chunk_size", CHUNK_SIZE)  # pickled before they were kept
        self.__dict__.setdefault("compact_state", False)
        self._seen = {}
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("foreach", None)
            group.setdefault("capturable", False)
            group.setdefault("differentiable", False)
            group.setdefault("fused", None)
            group.setdefault("decoupled_weight_decay", False)

    def _gather(self, group):
        """The tensor lists of a group's params that have grads, with state created on first use.
        Raises before anything is modified, so a refused step leaves the weights as they were.
        Runs every step over every param: its checks use what a tensor answers without building objects
        (get_device(), is_cuda, dtype identity); the messages, built only on failure, name the devices."""
        lists = ([], [], [], [], [], [])
        device = None  # (is_cuda, index) of the group's first param with a grad
        for k, p in enumerate(group["params"]):
            g = p.grad
            if g is None:
                continue
            if g.layout is not torch.strided:
                raise ValueError(f"params: param {k} has a sparse gradient; FusedAdam supports dense "
                                 f"gradients only (use torch.optim.SparseAdam)")
            if g.dtype is not p.dtype or g.shape != p.shape:
                raise ValueError(f"params: param {k} is {p.dtype} {tuple(p.shape)} but its grad is "
                                 f"{g.dtype} {tuple(g.shape)}")
            here = (p.is_cuda, p.get_device())
            if device is None:
                device, first = here, p
            elif here != device:
                raise ValueError(f"params: all params of a group must be on one device; param {k} is on "
                                 f"{p.device}, the group on {first.device}")
            if (g.is_cuda, g.get_device()) != device:
                raise ValueError(f"params: all params of a group must be on one device; param {k} is on "
                                 f"{p.device}, its grad on {g.device}")
            lists[0].append(p)
            lists[1].append(g)
        return (None if device is None else first.device), lists

    def _state_for(self, p, amsgrad: bool):
        state = self.state[p]
        sdt = state_dtype(p.dtype, self.compact_state)
        get = state.get
        seen = self._seen.get(p)
        if (seen is not None and seen[0] is sdt and seen[1] == p.get_device() and seen[2]() is get("step") is not None
                and seen[3]() is get("exp_avg") is not None and seen[4]() is get("exp_avg_sq") is not None
                and (not amsgrad or seen[5]() is get("max_exp_avg_sq") is not None)):
            return state  # every step after the first: the tensors found in layout last time, still there
        self._to_layout(state, p, amsgrad, sdt)
        # weak references: a state the user drops (or load_state_dict replaces) is freed, not kept by this
        self._seen[p] = (sdt, p.get_device(), *(weakref.ref(state[k]) if k in state else _absent
                                                for k in ("step",) + STATE_KEYS))
        return state

    @staticmethod
    def _to_layout(state: dict, p: torch.Tensor, amsgrad: bool, sdt: torch.dtype) -> None:
        """Create the state of a param's first step, or bring state loaded from elsewhere (or changed since the
        last step) to our layout: a float32 0-dim step and the moments in `sdt`, all on p's device."""
        if len(state) == 0:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros(p.shape, dtype=sdt, device=p.device)
            state["exp_avg_sq"] = torch.zeros(p.shape, dtype=sdt, device=p.device)
        if amsgrad and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros(p.shape, dtype=sdt, device=p.device)
        # State loaded from torch.optim (param dtype, CPU step) is brought to our layout once.
        step = state["step"]
        if not isinstance(step, torch.Tensor):
            state["step"] = torch.tensor(float(step), dtype=torch.float32, device=p.device)
        elif step.dtype != torch.float32 or step.device != p.device or step.dim() != 0:
            state["step"] = step.detach().to(device=p.device, dtype=torch.float32).reshape(())
        for key in STATE_KEYS:
            t = state.get(key)
            if t is not None and (t.dtype != sdt or t.device != p.device):
                state[key] = t.detach().to(device=p.device, dtype=sdt)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None, found_inf: Optional[torch.Tensor] = None,
             grad_scale: Optional[torch.Tensor] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if found_inf is None:
            found_inf = getattr(self, "found_inf", None)
        if grad_scale is None:
            grad_scale = getattr(self, "grad_scale", None)
        _check_flag_tensor("found_inf", found_inf)
        _check_flag_tensor("grad_scale", grad_scale)
        for group in self.param_groups:
            if group["differentiable"]:
                raise ValueError("differentiable: FusedAdam does not support differentiable=True")
        gathered = [self._gather(group) for group in self.param_groups]  # validate every group first
        for group, (device, (params, grads, m, v, vmax, steps)) in zip(self.param_groups, gathered):
            if device is None:
                continue
            amsgrad = group["amsgrad"]
            for p in params:
                state = self._state_for(p, amsgrad)
                m.append(state["exp_avg"])
                v.append(state["exp_avg_sq"])
                if amsgrad:
                    vmax.append(state["max_exp_avg_sq"])
                steps.append(state["step"])
            beta1, beta2 = group["betas"]
            fused_adam_step(params, grads, m, v, vmax, steps, lr=group["lr"], beta1=_scalar("betas[0]", beta1),
                            beta2=_scalar("betas[1]", beta2), eps=group["eps"], weight_decay=group["weight_decay"],
                            amsgrad=amsgrad, maximize=group["maximize"],
                            decoupled_weight_decay=group["decoupled_weight_decay"],
                            grad_scale=_on_device(grad_scale, device), found_inf=_on_device(found_inf, device),
                            chunk_size=self.chunk_size)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this class or of torch.optim.Adam/AdamW. The base class casts state
        to each parameter's dtype, which would round fp32 moments of fp16/bf16 params; the original
        tensors are put back in our layout (the state dtype, float32 step on the param's device)."""
        original = {pid: dict(s) for pid, s in state_dict["state"].items()}
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(saved_ids, params):
            if pid not in original or p not in self.state:
                continue
            for key, value in original[pid].items():
                if key == "step":
                    value = value if isinstance(value, torch.Tensor) else torch.tensor(float(value))
                    self.state[p][key] = value.detach().to(device=p.device, dtype=torch.float32).reshape(())
                elif key in STATE_KEYS and isinstance(value, torch.Tensor):
                    self.state[p][key] = value.detach().to(device=p.device,
                                                           dtype=state_dtype(p.dtype, self.compact_state))


class FusedAdamW(FusedAdam):
    """torch.optim.AdamW with a multi-tensor kernel: decoupled weight decay, default 1e-2."""

    def __init__(self, params: Iterable, lr: float | torch.Tensor = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: Optional[bool] = None, capturable: bool = False, differentiable: bool = False,
                 fused: Optional[bool] = None, chunk_size: int = CHUNK_SIZE, compact_state: bool = False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True, chunk_size=chunk_size, compact_state=compact_state)
