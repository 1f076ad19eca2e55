"""accel.amp.syncfree optimizers against torch.optim, with device-side skipped steps."""
from __future__ import annotations

import copy

import pytest
import torch

from accel.amp import syncfree

from ._sync_guard import ForbidHostReads
from ._xla import requires_xla, sync, xla_device

STEPS = 20
SKIPPED = {0, 4, 5, 11}  # 0: a skipped first step, before any state exists

CASES = [
    (syncfree.Adam, torch.optim.Adam, dict(lr=1e-2)),
    (syncfree.Adam, torch.optim.Adam, dict(lr=1e-2, betas=(0.8, 0.95), amsgrad=True, weight_decay=0.1)),
    (syncfree.Adam, torch.optim.Adam, dict(lr=3e-3, eps=1e-6, maximize=True)),
    (syncfree.AdamW, torch.optim.AdamW, dict(lr=1e-2)),
    (syncfree.AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.3, amsgrad=True, maximize=True)),
    (syncfree.SGD, torch.optim.SGD, dict(lr=0.1)),
    (syncfree.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    (syncfree.SGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (syncfree.SGD, torch.optim.SGD, dict(lr=0.05, momentum=0.8, dampening=0.3, maximize=True)),
]
CASE_IDS = [f"{c[0].__name__}-{'-'.join(f'{k}={v}' for k, v in c[2].items())}" for c in CASES]


def _initial_params():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(5, 3, generator=g), torch.randn(7, generator=g)]


def _gradients(steps=STEPS):
    g = torch.Generator().manual_seed(1)
    return [[torch.randn(5, 3, generator=g), torch.randn(7, generator=g)] for _ in range(steps)]


def _run(ours_cls, ref_cls, kwargs, device, ref_kwargs=None, per_step_sync=lambda: None):
    init = _initial_params()
    ref_params = [p.clone().requires_grad_() for p in init]
    our_params = [p.clone().to(device).requires_grad_() for p in init]
    ref = ref_cls(ref_params, **kwargs, **(ref_kwargs or {}))
    ours = ours_cls(our_params, **kwargs)
    for step, grads in enumerate(_gradients()):
        skip = step in SKIPPED
        for p, g in zip(our_params, grads):
            p.grad = (torch.full_like(g, float("nan")) if skip else g).to(device)
        ours.step(found_inf=torch.tensor(1.0 if skip else 0.0, device=device))
        per_step_sync()
        if not skip:  # the reference simply does not step
            for p, g in zip(ref_params, grads):
                p.grad = g.clone()
            ref.step()
    return ref, ours, ref_params, our_params


@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
@pytest.mark.parametrize("ours_cls,ref_cls,kwargs", CASES, ids=CASE_IDS)
def test_matches_torch_optim_on_cpu_with_skipped_steps(ours_cls, ref_cls, kwargs, foreach):
    ref, ours, ref_params, our_params = _run(ours_cls, ref_cls, kwargs, "cpu", dict(foreach=foreach))
    for r, o in zip(ref_params, our_params):
        torch.testing.assert_close(o, r, atol=1e-6, rtol=1e-5)
    for r, o in zip(ref_params, our_params):
        ref_state, our_state = ref.state[r], ours.state[o]
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer"):
            if ref_state.get(key) is not None:
                torch.testing.assert_close(our_state[key], ref_state[key], atol=1e-6, rtol=1e-5)
        if "step" in ref_state:
            assert float(our_state["step"]) == float(ref_state["step"]) == STEPS - len(SKIPPED)


def test_adam_matches_fused_torch_adam():
    _, _, ref_params, our_params = _run(syncfree.Adam, torch.optim.Adam, dict(lr=1e-2, amsgrad=True), "cpu", dict(fused=True))
    for r, o in zip(ref_params, our_params):
        torch.testing.assert_close(o, r, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("ours_cls,ref_cls,kwargs", CASES[:1] + CASES[6:7], ids=["Adam", "SGD-momentum"])
def test_found_inf_none_and_zero_both_step(ours_cls, ref_cls, kwargs):
    init = _initial_params()
    a = [p.clone().requires_grad_() for p in init]
    b = [p.clone().requires_grad_() for p in init]
    opt_a, opt_b = ours_cls(a, **kwargs), ours_cls(b, **kwargs)
    for grads in _gradients(3):
        for pa, pb, g in zip(a, b, grads):
            pa.grad, pb.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step(found_inf=torch.zeros(()))
    for pa, pb, p0 in zip(a, b, init):
        assert torch.equal(pa, pb)
        assert not torch.equal(pa, p0)


@pytest.mark.parametrize("ours_cls,ref_cls,kwargs", [CASES[1], CASES[4], CASES[7]], ids=["Adam", "AdamW", "SGD"])
def test_skipped_step_leaves_everything_bit_identical(ours_cls, ref_cls, kwargs):
    params = [p.requires_grad_() for p in _initial_params()]
    opt = ours_cls(params, **kwargs)
    for grads in _gradients(3):
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
    before_params = [p.detach().clone() for p in params]
    before_state = copy.deepcopy(opt.state_dict())
    for p in params:
        p.grad = torch.full_like(p, float("inf"))
        p.grad.view(-1)[0] = float("nan")
    opt.step(found_inf=torch.tensor(2.0))  # any non-zero count (e.g. summed over replicas) skips
    for p, b in zip(params, before_params):
        assert torch.equal(p, b)
    after_state = opt.state_dict()
    for idx, st in before_state["state"].items():
        for key, value in st.items():
            assert torch.equal(after_state["state"][idx][key], value), key


@pytest.mark.parametrize("ours_cls,ref_cls,kwargs", [CASES[1], CASES[7]], ids=["Adam", "SGD"])
def test_step_never_reads_a_tensor_value_on_the_host(ours_cls, ref_cls, kwargs):
    params = [p.requires_grad_() for p in _initial_params()]
    opt = ours_cls(params, **kwargs)
    with ForbidHostReads():
        for step, grads in enumerate(_gradients(4)):
            for p, g in zip(params, grads):
                p.grad = g
            opt.step(found_inf=torch.tensor(float(step == 1)))


@pytest.mark.parametrize("ours_cls,ref_cls,kwargs", [CASES[2], CASES[8]], ids=["Adam", "SGD"])
def test_state_dict_round_trip_continues_identically(ours_cls, ref_cls, kwargs):
    grads_seq = _gradients(8)
    init = _initial_params()
    straight = [p.clone().requires_grad_() for p in init]
    opt = ours_cls(straight, **kwargs)
    for grads in grads_seq:
        for p, g in zip(straight, grads):
            p.grad = g.clone()
        opt.step()

    first = [p.clone().requires_grad_() for p in init]
    opt1 = ours_cls(first, **kwargs)
    for grads in grads_seq[:4]:
        for p, g in zip(first, grads):
            p.grad = g.clone()
        opt1.step()
    saved = copy.deepcopy(opt1.state_dict())
    resumed = [p.detach().clone().requires_grad_() for p in first]
    opt2 = ours_cls(resumed, **kwargs)
    opt2.load_state_dict(saved)
    for grads in grads_seq[4:]:
        for p, g in zip(resumed, grads):
            p.grad = g.clone()
        opt2.step()
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)


@pytest.mark.parametrize("ours_cls,ref_cls,kwargs", [CASES[1], CASES[6]], ids=["Adam", "SGD"])
def test_loads_a_torch_optim_state_dict(ours_cls, ref_cls, kwargs):
    grads_seq = _gradients(6)
    ref_params = [p.requires_grad_() for p in _initial_params()]
    ref = ref_cls(ref_params, **kwargs)
    for grads in grads_seq[:3]:
        for p, g in zip(ref_params, grads):
            p.grad = g.clone()
        ref.step()
    our_params = [p.detach().clone().requires_grad_() for p in ref_params]
    ours = ours_cls(our_params, **kwargs)
    ours.load_state_dict(copy.deepcopy(ref.state_dict()))
    for grads in grads_seq[3:]:
        for p, g in zip(ref_params, grads):
            p.grad = g.clone()
        ref.step()
        for p, g in zip(our_params, grads):
            p.grad = g.clone()
        ours.step(found_inf=torch.zeros(()))
    for r, o in zip(ref_params, our_params):
        torch.testing.assert_close(o, r, atol=1e-6, rtol=1e-5)


def test_closure_loss_is_returned():
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = syncfree.SGD([p], lr=0.5)

    def closure():
        opt.zero_grad()
        loss = (p**2).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert float(loss.detach()) == 5.0
    assert torch.equal(p.detach(), torch.tensor([0.0, 0.0]))  # p - 0.5 * 2p


@pytest.mark.parametrize(
    "make,argname,error",
    [
        (lambda p: syncfree.Adam(p, lr=-1.0), "lr", ValueError),
        (lambda p: syncfree.Adam(p, betas=(0.9, 1.0)), "betas[1]", ValueError),
        (lambda p: syncfree.Adam(p, betas=0.9), "betas", TypeError),
        (lambda p: syncfree.AdamW(p, eps=-1e-8), "eps", ValueError),
        (lambda p: syncfree.AdamW(p, weight_decay=-0.1), "weight_decay", ValueError),
        (lambda p: syncfree.SGD(p, momentum=-0.5), "momentum", ValueError),
        (lambda p: syncfree.SGD(p, lr=0.1, nesterov=True), "nesterov", ValueError),
        (lambda p: syncfree.SGD(p, lr=torch.ones(2)), "lr", ValueError),
    ],
)
def test_bad_arguments_raise_naming_them(make, argname, error):
    with pytest.raises(error, match=argname.replace("[", r"\[").replace("]", r"\]")):
        make([torch.nn.Parameter(torch.ones(2))])


def test_found_inf_must_be_a_one_element_tensor():
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    opt = syncfree.Adam([p])
    with pytest.raises(ValueError, match="found_inf"):
        opt.step(found_inf=torch.zeros(2))
    with pytest.raises(TypeError, match="found_inf"):
        opt.step(found_inf=1.0)
    assert torch.equal(p.detach(), torch.ones(2))


def test_advertises_found_inf_support():
    for cls in (syncfree.Adam, syncfree.AdamW, syncfree.SGD):
        assert cls._step_supports_found_inf is True
        assert issubclass(cls, torch.optim.Optimizer)


XLA_CASES = [CASES[1], CASES[4], CASES[7]]


@requires_xla
@pytest.mark.parametrize("ours_cls,ref_cls,kwargs", XLA_CASES, ids=["Adam-amsgrad-wd", "AdamW-maximize", "SGD-nesterov"])
def test_matches_torch_optim_on_xla_with_skipped_steps(ours_cls, ref_cls, kwargs):
    device = xla_device()
    ref, ours, ref_params, our_params = _run(ours_cls, ref_cls, kwargs, device, per_step_sync=sync)
    for r, o in zip(ref_params, our_params):
        assert o.device.type == "xla"
        torch.testing.assert_close(o.cpu(), r, atol=1e-5, rtol=1e-5)
    if "step" in ref.state[ref_params[0]]:
        assert float(ours.state[our_params[0]]["step"].cpu()) == float(ref.state[ref_params[0]]["step"])


def _compare_with_reference(ours_cls, ref_cls, kwargs, init, steps=6, ref_kwargs=None, atol=1e-6, rtol=1e-5):
    g = torch.Generator().manual_seed(7)
    grads_seq = [[torch.randn(p.shape, generator=g).to(p.dtype) for p in init] for _ in range(steps)]
    ref_params = [p.clone().requires_grad_() for p in init]
    our_params = [p.clone().requires_grad_() for p in init]
    ref = ref_cls(ref_params, **kwargs, **(ref_kwargs or {}))
    ours = ours_cls(our_params, **{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()})
    for grads in grads_seq:
        for p, g_ in zip(ref_params, grads):
            p.grad = g_.clone()
        for p, g_ in zip(our_params, grads):
            p.grad = g_.clone()
        ref.step()
        ours.step(found_inf=torch.zeros(()))
    for r, o in zip(ref_params, our_params):
        torch.testing.assert_close(o, r, atol=atol, rtol=rtol)


@pytest.mark.parametrize("ours_cls,ref_cls", [(syncfree.Adam, torch.optim.Adam), (syncfree.SGD, torch.optim.SGD)])
def test_complex_parameters_match_torch_optim(ours_cls, ref_cls):
    g = torch.Generator().manual_seed(2)
    init = [torch.randn(4, 3, dtype=torch.complex64, generator=g)]
    kwargs = dict(lr=1e-2, amsgrad=True) if ours_cls is syncfree.Adam else dict(lr=1e-2, momentum=0.9)
    _compare_with_reference(ours_cls, ref_cls, kwargs, init, ref_kwargs=dict(foreach=False))


@pytest.mark.parametrize("ours_cls,ref_cls", [(syncfree.AdamW, torch.optim.AdamW), (syncfree.SGD, torch.optim.SGD)])
def test_tensor_learning_rate_matches_torch_optim(ours_cls, ref_cls):
    init = _initial_params()
    kwargs = dict(lr=torch.tensor(0.01), weight_decay=0.1)
    _compare_with_reference(ours_cls, ref_cls, kwargs, init, ref_kwargs=dict(foreach=False))


def test_bfloat16_parameters_follow_torch_optim_within_bf16_rounding():
    init = [p.bfloat16() for p in _initial_params()]
    _compare_with_reference(syncfree.Adam, torch.optim.Adam, dict(lr=1e-2), init, ref_kwargs=dict(foreach=False),
                            atol=1e-2, rtol=1e-2)
