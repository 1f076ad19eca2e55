"""Argument checks of the sync-free optimizers and GradScaler (accel.utils.checks' rule).

TypeError for a wrong type, ValueError for a value out of range (NaN included), the argument
named in the message. Where torch.optim / torch.amp reject an argument, ours reject it too;
where they accept a value that breaks training (SGD's lr=nan, momentum=nan, any dampening,
Adam's amsgrad='yes', GradScaler's init_scale=True), ours are stricter.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from accel.amp import GradScaler, syncfree
from accel.utils import checks

NAN, INF = float("nan"), float("inf")


def _params():
    return [torch.nn.Parameter(torch.ones(3))]


def _named(argname: str) -> str:
    return "^" + re.escape(argname) + ":"


# (ours, torch's, kwargs, the argument named, the error both raise)
TORCH_REJECTS = [
    (syncfree.Adam, torch.optim.Adam, dict(lr=NAN), "lr", ValueError),
    (syncfree.Adam, torch.optim.Adam, dict(lr=-1e-3), "lr", ValueError),
    (syncfree.Adam, torch.optim.Adam, dict(eps=NAN), "eps", ValueError),
    (syncfree.Adam, torch.optim.Adam, dict(weight_decay=NAN), "weight_decay", ValueError),
    (syncfree.Adam, torch.optim.Adam, dict(betas=(NAN, 0.999)), "betas[0]", ValueError),
    (syncfree.Adam, torch.optim.Adam, dict(betas=(0.9, NAN)), "betas[1]", ValueError),
    (syncfree.Adam, torch.optim.Adam, dict(betas=(0.9, 1.0)), "betas[1]", ValueError),
    (syncfree.Adam, torch.optim.Adam, dict(lr=torch.ones(2)), "lr", ValueError),
    (syncfree.Adam, torch.optim.Adam, dict(lr="0.1"), "lr", TypeError),
    (syncfree.Adam, torch.optim.Adam, dict(betas=0.9), "betas", TypeError),
    (syncfree.AdamW, torch.optim.AdamW, dict(lr=NAN), "lr", ValueError),
    (syncfree.AdamW, torch.optim.AdamW, dict(eps=NAN), "eps", ValueError),
    (syncfree.AdamW, torch.optim.AdamW, dict(weight_decay=-0.1), "weight_decay", ValueError),
    (syncfree.SGD, torch.optim.SGD, dict(lr=-0.1), "lr", ValueError),
    (syncfree.SGD, torch.optim.SGD, dict(lr=0.1, momentum=-0.5), "momentum", ValueError),
    (syncfree.SGD, torch.optim.SGD, dict(lr=0.1, weight_decay=-1.0), "weight_decay", ValueError),
    (syncfree.SGD, torch.optim.SGD, dict(lr=0.1, nesterov=True), "nesterov", ValueError),
    (syncfree.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.1, nesterov=True), "nesterov", ValueError),
]


@pytest.mark.parametrize("ours,theirs,kwargs,argname,error", TORCH_REJECTS,
                         ids=[f"{c[0].__name__}-{c[3]}-{c[2]}" for c in TORCH_REJECTS])
def test_rejected_where_torch_optim_rejects(ours, theirs, kwargs, argname, error):
    with pytest.raises(error):
        theirs(_params(), **kwargs)
    with pytest.raises(error, match=_named(argname)):
        ours(_params(), **kwargs)


# Accepted by torch.optim (2.9), and each one ruins or silently changes training.
STRICTER = [
    (syncfree.Adam, dict(amsgrad="yes"), "amsgrad", TypeError),  # any non-empty string is "on"
    (syncfree.Adam, dict(maximize=1), "maximize", TypeError),
    (syncfree.Adam, dict(lr=True), "lr", TypeError),  # a bool in the lr position
    (syncfree.Adam, dict(lr=INF), "lr", ValueError),
    (syncfree.Adam, dict(eps=INF), "eps", ValueError),
    (syncfree.Adam, dict(lr=torch.tensor(NAN)), "lr", ValueError),
    (syncfree.Adam, dict(betas=(0.9,)), "betas", ValueError),  # torch: IndexError
    (syncfree.AdamW, dict(amsgrad="yes"), "amsgrad", TypeError),
    (syncfree.SGD, dict(lr=NAN), "lr", ValueError),  # every weight NaN after the first step
    (syncfree.SGD, dict(lr=0.1, momentum=NAN), "momentum", ValueError),
    (syncfree.SGD, dict(lr=0.1, momentum=0.9, dampening=-5), "dampening", ValueError),
    (syncfree.SGD, dict(lr=0.1, momentum=0.9, dampening=NAN), "dampening", ValueError),
    (syncfree.SGD, dict(lr=0.1, momentum=0.9, dampening=1.5), "dampening", ValueError),
    (syncfree.SGD, dict(lr=0.1, weight_decay=NAN), "weight_decay", ValueError),
    (syncfree.SGD, dict(lr=0.1, momentum=0.9, nesterov="yes"), "nesterov", TypeError),
    (syncfree.SGD, dict(lr=0.1, maximize="no"), "maximize", TypeError),  # "no" is truthy
]


@pytest.mark.parametrize("ours,kwargs,argname,error", STRICTER,
                         ids=[f"{c[0].__name__}-{c[2]}-{c[1]}" for c in STRICTER])
def test_stricter_than_torch_optim(ours, kwargs, argname, error):
    with pytest.raises(error, match=_named(argname)):
        ours(_params(), **kwargs)


def test_sgd_with_nan_lr_would_have_made_every_weight_nan():
    # Why the stricter checks matter: torch.optim takes these and the first step destroys the weights.
    for opt_cls, kwargs in ((torch.optim.SGD, dict(lr=NAN)), (torch.optim.SGD, dict(lr=0.1, momentum=NAN))):
        p = _params()
        try:
            opt = opt_cls(p, **kwargs)
        except ValueError:
            continue  # a later torch that rejects it as well
        p[0].grad = torch.ones(3)
        opt.step()
        if "momentum" in kwargs:  # the NaN momentum enters on the second step
            opt.step()
        assert torch.isnan(p[0]).all()


@pytest.mark.parametrize("ours", [syncfree.Adam, syncfree.AdamW, syncfree.SGD])
def test_edge_values_stay_accepted(ours):
    if ours is syncfree.SGD:
        kwargs = [dict(lr=0), dict(lr=np.float32(0.1), momentum=0.0, dampening=1.0),
                  dict(lr=torch.tensor(0.1), momentum=0.9, nesterov=True), dict(lr=1, weight_decay=0)]
    else:
        kwargs = [dict(lr=0, betas=(0.0, 0.0), eps=0.0, weight_decay=0), dict(lr=np.float64(1e-3), betas=[0.5, 0.9]),
                  dict(lr=torch.tensor(1e-3), amsgrad=True, maximize=True)]
    for kw in kwargs:
        opt = ours(_params(), **kw)
        if "betas" in kw:
            assert opt.param_groups[0]["betas"] == tuple(kw["betas"])


@pytest.mark.parametrize("ours,bad,argname", [
    (syncfree.Adam, dict(lr=NAN), "lr"),
    (syncfree.Adam, dict(betas=(0.9, 1.5)), "betas[1]"),
    (syncfree.AdamW, dict(amsgrad="yes"), "amsgrad"),
    (syncfree.SGD, dict(momentum=0.9, dampening=-5), "dampening"),
])
def test_param_groups_are_checked_too(ours, bad, argname):
    # torch.optim checks only the constructor's defaults: a group's own lr=nan gets through there.
    error = TypeError if argname == "amsgrad" else ValueError
    with pytest.raises(error, match=_named(argname)):
        ours([{"params": _params()}, {"params": _params(), **bad}], lr=0.1)
    opt = ours(_params(), lr=0.1)
    with pytest.raises(error, match=_named(argname)):
        opt.add_param_group({"params": _params(), **bad})
    assert len(opt.param_groups) == 1  # nothing half-added


def test_bad_hyperparameter_reported_before_empty_params():
    with pytest.raises(ValueError, match=_named("lr")):
        syncfree.Adam([], lr=NAN)


def test_found_inf_type_and_shape():
    p = _params()
    p[0].grad = torch.ones(3)
    opt = syncfree.SGD(p, lr=0.1)
    with pytest.raises(TypeError, match=_named("found_inf")):
        opt.step(found_inf=1.0)
    with pytest.raises(ValueError, match=_named("found_inf")):
        opt.step(found_inf=torch.zeros(2))
    assert torch.equal(p[0].detach(), torch.ones(3))


# ------------------------------------------------------------------ GradScaler

SCALER_TORCH_REJECTS = [  # torch.amp.GradScaler asserts these (AssertionError); ours raise ValueError
    (dict(growth_factor=1.0), "growth_factor"),
    (dict(backoff_factor=1.0), "backoff_factor"),
]


@pytest.mark.parametrize("kwargs,argname", SCALER_TORCH_REJECTS, ids=[str(c[0]) for c in SCALER_TORCH_REJECTS])
def test_scaler_rejects_where_torch_rejects(kwargs, argname):
    with pytest.raises(Exception):
        torch.amp.GradScaler("cpu", **kwargs)
    with pytest.raises(ValueError, match=_named(argname)):
        GradScaler("cpu", **kwargs)


SCALER_STRICTER = [  # accepted by torch.amp.GradScaler (2.9; the NaN factors from 2.11)
    # torch <= 2.10 asserts growth_factor > 1.0 and backoff_factor < 1.0, which NaN fails; 2.11 raises on
    # growth_factor <= 1.0 and backoff_factor >= 1.0 instead, which NaN passes
    (dict(growth_factor=NAN), "growth_factor", ValueError),
    (dict(backoff_factor=NAN), "backoff_factor", ValueError),
    (dict(init_scale=True), "init_scale", TypeError),
    (dict(init_scale="65536"), "init_scale", TypeError),
    (dict(init_scale=NAN), "init_scale", ValueError),
    (dict(init_scale=INF), "init_scale", ValueError),
    (dict(init_scale=1e39), "init_scale", ValueError),  # inf once stored in float32
    (dict(init_scale=-1.0), "init_scale", ValueError),
    (dict(init_scale=0), "init_scale", ValueError),
    (dict(growth_factor=INF), "growth_factor", ValueError),
    (dict(growth_factor=True), "growth_factor", TypeError),
    (dict(backoff_factor=0.0), "backoff_factor", ValueError),
    (dict(backoff_factor=-0.5), "backoff_factor", ValueError),
    (dict(growth_interval=0), "growth_interval", ValueError),
    (dict(growth_interval=2.0), "growth_interval", TypeError),
    (dict(growth_interval=True), "growth_interval", TypeError),
    (dict(enabled=1), "enabled", TypeError),
    (dict(device=0), "device", TypeError),
]


@pytest.mark.parametrize("kwargs,argname,error", SCALER_STRICTER, ids=[str(c[0]) for c in SCALER_STRICTER])
def test_scaler_stricter_than_torch(kwargs, argname, error):
    with pytest.raises(error, match=_named(argname)):
        GradScaler(**{"device": "cpu", **kwargs})


def test_scaler_accepts_ints_and_numpy_numbers():
    s = GradScaler("cpu", init_scale=1024, growth_factor=np.float32(2.0), backoff_factor=0.25,
                   growth_interval=np.int64(10))
    assert (s.get_scale(), s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == (
        1024.0, 2.0, 0.25, 10)
    assert type(s.get_growth_interval()) is int and type(s.get_growth_factor()) is float


def test_scaler_setters_follow_the_same_rule():
    s = GradScaler("cpu")
    with pytest.raises(ValueError, match=_named("new_factor")):
        s.set_growth_factor(NAN)
    with pytest.raises(TypeError, match=_named("new_factor")):
        s.set_growth_factor("2")
    with pytest.raises(ValueError, match=_named("new_factor")):
        s.set_backoff_factor(NAN)
    with pytest.raises(TypeError, match=_named("new_interval")):
        s.set_growth_interval(True)
    with pytest.raises(ValueError, match=_named("new_interval")):
        s.set_growth_interval(0)
    assert (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == (2.0, 0.5, 2000)


def test_scaler_update_new_scale():
    s = GradScaler("cpu", init_scale=4.0)
    s.scale(torch.ones(()))
    for bad, error in ((NAN, ValueError), (0.0, ValueError), (INF, ValueError), ("8", TypeError), (True, TypeError),
                       (torch.ones(2), ValueError)):
        with pytest.raises(error, match=_named("new_scale")):
            s.update(new_scale=bad)
    assert s.get_scale() == 4.0


def test_scaler_load_state_dict_checks_before_applying():
    s = GradScaler("cpu", init_scale=4.0)
    good = s.state_dict()
    for key, bad, error in (("scale", NAN, ValueError), ("growth_factor", 0.5, ValueError),
                            ("backoff_factor", NAN, ValueError), ("growth_interval", 1.5, TypeError),
                            ("_growth_tracker", -1, ValueError)):
        with pytest.raises(error, match=re.escape(key)):
            s.load_state_dict({**good, key: bad})
        assert s.state_dict() == good
    with pytest.raises(TypeError, match=_named("state_dict")):
        s.load_state_dict([("scale", 1.0)])


# ------------------------------------------------------------------ the helpers themselves

def test_check_float_rule():
    assert checks.check_float("x", 3) == 3.0 and type(checks.check_float("x", 3)) is float
    assert checks.check_float("x", np.float32(0.5), min=0, max=1) == 0.5
    assert checks.check_float("x", INF, allow_inf=True) == INF
    for bad in (True, "1", None, torch.tensor(1.0), 1j):
        with pytest.raises(TypeError, match=_named("x")):
            checks.check_float("x", bad)
    for bad, bounds in ((NAN, {}), (NAN, dict(allow_inf=True)), (INF, {}), (-INF, {}), (-0.1, dict(min=0)),
                        (0.0, dict(min=0, min_inclusive=False)), (1.0, dict(max=1, max_inclusive=False)),
                        (1.5, dict(max=1))):
        with pytest.raises(ValueError, match=_named("x")):
            checks.check_float("x", bad, **bounds)


def test_check_int_bool_sequence_tensor_rules():
    assert checks.check_int("n", np.int32(3), min=1) == 3
    for bad in (True, 3.0, "3", None):
        with pytest.raises(TypeError, match=_named("n")):
            checks.check_int("n", bad)
    with pytest.raises(ValueError, match=_named("n")):
        checks.check_int("n", 0, min=1)
    assert checks.check_bool("b", False) is False
    for bad in (0, "True", None):
        with pytest.raises(TypeError, match=_named("b")):
            checks.check_bool("b", bad)
    assert checks.check_sequence("s", [1, 2], 2) == (1, 2)
    with pytest.raises(TypeError, match=_named("s")):
        checks.check_sequence("s", 1, 2)
    with pytest.raises(ValueError, match=_named("s")):
        checks.check_sequence("s", (1, 2, 3), 2)
    t = torch.tensor([0.5])
    assert checks.check_float_or_tensor("lr", t, min=0) is t
    with pytest.raises(TypeError, match=_named("lr")):
        checks.check_float_or_tensor("lr", torch.tensor(1))
    with pytest.raises(ValueError, match=_named("lr")):
        checks.check_float_or_tensor("lr", torch.tensor(-1.0), min=0)
    with pytest.raises(ValueError, match=_named("lr")):
        checks.check_float_or_tensor("lr", torch.zeros(2))
