"""accel.amp.GradScaler against torch.amp.GradScaler("cpu") on the same runs."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch

from accel.amp import GradScaler, syncfree
from accel.amp._scale_update import update_scale_where

from ._sync_guard import ForbidHostReads
from ._xla import requires_xla, sync, xla_device

STEPS = 14
INF_STEPS = {0, 1, 6, 7, 12}  # includes the very first step, before any optimizer state exists
SCALER_KW = dict(init_scale=2.0**4, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)

OPTIMIZERS = {
    "syncfree.Adam": (syncfree.Adam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.01)),
    "syncfree.AdamW": (syncfree.AdamW, torch.optim.AdamW, dict(lr=1e-2)),
    "syncfree.SGD": (syncfree.SGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.1)),
    "torch.optim.Adam": (torch.optim.Adam, torch.optim.Adam, dict(lr=1e-2, amsgrad=True)),
    "torch.optim.SGD": (torch.optim.SGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.1)),
    "torch.optim.Adam-fused": (torch.optim.Adam, torch.optim.Adam, dict(lr=1e-2, fused=True)),
}


def _model(device="cpu"):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).to(device)


def _batches(steps=STEPS):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)) for _ in range(steps)]


def _train(scaler, model, opt, device="cpu", clip=None, per_step_sync=lambda: None):
    """The guide's loop; INF_STEPS blow up the loss so every gradient overflows."""
    scales = []
    for step, (x, y) in enumerate(_batches()):
        opt.zero_grad()
        loss = ((model(x.to(device)) - y.to(device)) ** 2).mean()
        if step in INF_STEPS:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        if clip is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()
        per_step_sync()
        scales.append(scaler.get_scale())
    return scales


def _reference(ref_cls, kwargs, clip=None):
    model = _model()
    opt = ref_cls(model.parameters(), **kwargs)
    scales = _train(torch.amp.GradScaler("cpu", **SCALER_KW), model, opt, clip=clip)
    return scales, model, opt


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_scale_trajectory_and_weights_match_torch_on_cpu(name):
    ours_cls, ref_cls, kwargs = OPTIMIZERS[name]
    ref_scales, ref_model, _ = _reference(ref_cls, kwargs)
    model = _model()
    scales = _train(GradScaler(**SCALER_KW), model, ours_cls(model.parameters(), **kwargs))
    assert scales == ref_scales
    # The run both backs off and grows the scale.
    changes = list(zip(ref_scales, ref_scales[1:]))
    assert any(b < a for a, b in changes) and any(b > a for a, b in changes)
    for ours, ref in zip(model.parameters(), ref_model.parameters()):
        if ours_cls is ref_cls:
            assert torch.equal(ours, ref)  # the same optimizer, only the skip mechanism differs
        else:
            torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["syncfree.Adam", "torch.optim.SGD"])
def test_unscale_then_clip_matches_torch(name):
    ours_cls, ref_cls, kwargs = OPTIMIZERS[name]
    ref_scales, ref_model, _ = _reference(ref_cls, kwargs, clip=0.5)
    model = _model()
    scales = _train(GradScaler(**SCALER_KW), model, ours_cls(model.parameters(), **kwargs), clip=0.5)
    assert scales == ref_scales
    for ours, ref in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-5)


def test_skipped_step_of_plain_optimizer_keeps_its_state_and_step_count():
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, capturable=False)
    scaler = GradScaler(init_scale=8.0)
    x, y = _batches(1)[0]
    for _ in range(2):
        opt.zero_grad()
        scaler.scale(((model(x) - y) ** 2).mean()).backward()
        scaler.step(opt)
        scaler.update()
    params_before = [p.detach().clone() for p in model.parameters()]
    state_before = copy.deepcopy(opt.state_dict())
    opt.zero_grad()
    scaler.scale(((model(x) - y) ** 2).mean() * float("nan")).backward()
    scaler.step(opt)
    scaler.update()
    for p, b in zip(model.parameters(), params_before):
        assert torch.equal(p, b)
    state_after = opt.state_dict()["state"]
    for idx, st in state_before["state"].items():
        assert float(state_after[idx]["step"]) == float(st["step"]) == 2.0
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state_after[idx][key], st[key])
    assert scaler.get_scale() == 4.0


@pytest.mark.parametrize("name", ["syncfree.Adam", "torch.optim.SGD", "torch.optim.Adam-fused"])
def test_steady_state_steps_never_read_the_device(name):
    ours_cls, _, kwargs = OPTIMIZERS[name]
    model = _model()
    opt = ours_cls(model.parameters(), **kwargs)
    scaler = GradScaler(**SCALER_KW)
    batches = _batches(6)
    x, y = batches[0]
    opt.zero_grad()
    scaler.scale(((model(x) - y) ** 2).mean()).backward()
    scaler.step(opt)  # a plain optimizer's first step may read found_inf: it has no state to restore yet
    scaler.update()
    with ForbidHostReads():
        for step, (x, y) in enumerate(batches[1:]):
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean() * (float("inf") if step == 2 else 1.0)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()


def test_syncfree_first_steps_never_read_the_device():
    model = _model()
    opt = syncfree.Adam(model.parameters())
    scaler = GradScaler(init_scale=2.0**40)  # overflows at first, like fp16 runs
    x, y = _batches(1)[0]
    with ForbidHostReads():
        for _ in range(3):
            opt.zero_grad()
            scaler.scale(((model(x) - y) ** 2).mean() * 1e30).backward()
            scaler.step(opt)
            scaler.update()


def test_overflow_is_checked_on_gradients_as_modified_before_unscale():
    """Gradients all-reduced (here: overwritten) after backward and before unscale_ are the ones checked."""
    model = _model()
    opt = syncfree.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler(init_scale=4.0)
    x, y = _batches(1)[0]
    scaler.scale(((model(x) - y) ** 2).mean()).backward()
    before = [p.detach().clone() for p in model.parameters()]
    next(model.parameters()).grad[0, 0] = float("inf")  # what a reduction with an overflowing replica yields
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert scaler.get_scale() == 2.0


def test_two_optimizers_one_overflowing_backs_off_once_and_skips_only_that_one():
    def run(scaler_cls, opt_cls):
        torch.manual_seed(0)
        a, b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
        opt_a, opt_b = opt_cls(a.parameters(), lr=0.1), opt_cls(b.parameters(), lr=0.1)
        scaler = scaler_cls(init_scale=8.0, growth_interval=2)
        scales = []
        for step in range(5):
            x = torch.ones(2, 3)
            loss = a(x).sum() + b(x).sum() * (float("inf") if step == 1 else 1.0)
            opt_a.zero_grad()
            opt_b.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt_a)
            scaler.step(opt_b)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales, [p.detach() for p in (*a.parameters(), *b.parameters())]

    ref_scales, ref_params = run(lambda **k: torch.amp.GradScaler("cpu", **k), torch.optim.SGD)
    for opt_cls in (torch.optim.SGD, syncfree.SGD):
        scales, params = run(GradScaler, opt_cls)
        assert scales == ref_scales == [8.0, 4.0, 4.0, 8.0, 8.0]
        for p, r in zip(params, ref_params):
            torch.testing.assert_close(p, r, atol=1e-6, rtol=0)


def test_scale_update_where_equals_torch_amp_update_scale():
    g = torch.Generator().manual_seed(5)
    flags = (torch.rand(60, generator=g) < 0.25).float()
    flags[10] = float("nan")  # NaN counts as "found" in torch's kernel
    ref_scale, ref_tracker = torch.tensor(2.0**10), torch.tensor(0, dtype=torch.int32)
    scale, tracker = ref_scale.clone(), ref_tracker.clone()
    for f in flags:
        torch._amp_update_scale_(ref_scale, ref_tracker, f.clone(), 2.0, 0.5, 3)
        update_scale_where(scale, tracker, f.clone(), 2.0, 0.5, 3)
        assert torch.equal(scale, ref_scale) and torch.equal(tracker, ref_tracker)
    # growth stops at the largest finite float32 instead of overflowing
    big, t = torch.tensor(3.0e38), torch.tensor(0, dtype=torch.int32)
    update_scale_where(big, t, torch.tensor(0.0), 2.0, 0.5, 1)
    assert float(big) == pytest.approx(3.0e38) and int(t) == 0


def test_state_dict_round_trip_and_interchange_with_torch():
    ours = GradScaler(**SCALER_KW)
    model = _model()
    _train(ours, model, syncfree.SGD(model.parameters(), lr=0.01))
    sd = ours.state_dict()
    ref_scales, _, _ = _reference(torch.optim.SGD, dict(lr=0.01))
    ref = torch.amp.GradScaler("cpu", **SCALER_KW)
    ref_model = _model()
    _train(ref, ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.01))
    assert sd == ref.state_dict()
    assert sd["scale"] == ref_scales[-1]

    restored = GradScaler()
    restored.load_state_dict(sd)
    assert restored.state_dict() == sd
    assert restored.get_growth_interval() == 3
    # a restored scaler continues exactly like the original
    x = torch.ones(1, requires_grad=True)
    for s in (ours, restored):
        opt = torch.optim.SGD([x], lr=0.0)
        s.scale(x.sum()).backward()
        s.step(opt)
        s.update()
    assert ours.state_dict() == restored.state_dict()

    from_torch = GradScaler()
    from_torch.load_state_dict(ref.state_dict())
    assert from_torch.get_scale() == ref.get_scale()

    clone = pickle.loads(pickle.dumps(ours))
    assert clone.state_dict() == ours.state_dict()


def test_update_with_new_scale_and_disabled_scaler():
    scaler = GradScaler(init_scale=4.0)
    x = torch.ones(2, requires_grad=True)
    assert torch.equal(scaler.scale(x), torch.full((2,), 4.0))
    scaler.update(new_scale=64.0)
    assert scaler.get_scale() == 64.0
    scaler.update(new_scale=torch.tensor(8.0))
    assert scaler.get_scale() == 8.0
    with pytest.raises(TypeError, match="new_scale"):
        scaler.update(new_scale="big")
    with pytest.raises(ValueError, match="new_scale"):
        scaler.update(new_scale=float("nan"))
    assert scaler.get_scale() == 8.0

    off = GradScaler(enabled=False)
    assert off.scale(x) is x and off.get_scale() == 1.0 and not off.is_enabled() and off.state_dict() == {}
    opt = torch.optim.SGD([x], lr=1.0)
    x.grad = torch.ones(2)
    off.step(opt)
    assert torch.equal(x.detach(), torch.zeros(2))


def test_scale_nested_outputs():
    scaler = GradScaler(init_scale=2.0)
    a, b, c = torch.ones(1), torch.ones(2), torch.ones(3)
    out = scaler.scale([a, (b, c)])
    assert isinstance(out, list) and isinstance(out[1], tuple)
    assert torch.equal(out[1][1], torch.full((3,), 2.0))
    with pytest.raises(ValueError, match="outputs"):
        scaler.scale([a, "x"])


def test_misuse_errors():
    scaler = GradScaler()
    p = torch.nn.Parameter(torch.ones(2))
    opt = syncfree.SGD([p], lr=0.1)
    with pytest.raises(RuntimeError, match="scale"):
        scaler.unscale_(opt)
    scaler.scale(p.sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="after step"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.step(opt)
    scaler.update()
    half = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    half.grad = torch.ones(2, dtype=torch.float16)
    with pytest.raises(ValueError, match="FP16"):
        scaler.unscale_(syncfree.SGD([half], lr=0.1))


@pytest.mark.parametrize(
    "kwargs,argname,error",
    [
        (dict(init_scale=0.0), "init_scale", ValueError),
        (dict(growth_factor=1.0), "growth_factor", ValueError),
        (dict(backoff_factor=1.5), "backoff_factor", ValueError),
        (dict(growth_interval=0), "growth_interval", ValueError),
        (dict(growth_interval=2.5), "growth_interval", TypeError),
        (dict(device="no-such-device"), "device", ValueError),
        (dict(enabled="yes"), "enabled", TypeError),
    ],
)
def test_bad_constructor_arguments(kwargs, argname, error):
    with pytest.raises(error, match=argname):
        GradScaler(**kwargs)


@requires_xla
@pytest.mark.parametrize("name", ["syncfree.Adam", "torch.optim.SGD"])
def test_xla_run_matches_the_cpu_reference(name):
    ours_cls, ref_cls, kwargs = OPTIMIZERS[name]
    ref_scales, ref_model, _ = _reference(ref_cls, kwargs)
    device = xla_device()
    model = _model(device)
    opt = ours_cls(model.parameters(), **kwargs)
    scales = _train(GradScaler(**SCALER_KW), model, opt, device, per_step_sync=sync)
    assert scales == ref_scales
    for ours, ref in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(ours.cpu(), ref, atol=1e-5, rtol=1e-5)
