"""FusedAdam / FusedAdamW against torch.optim.Adam / AdamW (foreach=False) as the reference."""
import copy
import functools
import os
import pickle
import weakref

import pytest
import torch

from accel.runtime.optim import FusedAdam, FusedAdamW
from accel.runtime.optim.fused_adam import adam_reference, fused_adam_step
from accel.utils.xla import mark_step, require_xla, xla_available

from ._params import DEVICES, DTYPES, NO_CUDA, tol

PAIRS = [pytest.param(FusedAdam, torch.optim.Adam, id="adam"),
         pytest.param(FusedAdamW, torch.optim.AdamW, id="adamw")]
SHAPES = [(1,), (7,), (1001,), (3, 5, 7)]
FP32 = {"rtol": 1e-6, "atol": 1e-6}  # a few fp32 ulps after 20 steps: FMA contraction differs by compiler


def _params(device, dtype=torch.float32, shapes=SHAPES, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(device=device, dtype=dtype).requires_grad_() for s in shapes]


def _clone(params, dtype=None):
    return [p.detach().clone().to(dtype or p.dtype).requires_grad_() for p in params]


def _grads(params, step, scale=1.0):
    g = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(p.shape, generator=g) * scale).to(device=p.device, dtype=p.dtype) for p in params]


def _set_grads(params, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone()


def _step_both_and_compare(opt_a, params_a, opt_b, params_b, steps, **tol):
    """Feed both optimizers the same gradients for `steps`, then require the same weights
    (within `tol`, default FP32)."""
    for step in steps:
        grads = _grads(params_b, step)
        _set_grads(params_a, grads)
        _set_grads(params_b, grads)
        opt_a.step()
        opt_b.step()
    for p, q in zip(params_a, params_b):
        torch.testing.assert_close(p, q, **(tol or FP32))


def _assert_state_close(ours, ref, params_ours, params_ref, **kw):
    for p, q in zip(params_ours, params_ref):
        so, sr = ours.state[p], ref.state[q]
        assert set(so) == set(sr)
        for key in sr:
            torch.testing.assert_close(so[key].cpu().to(sr[key].dtype), sr[key].cpu(), **kw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ours_cls,ref_cls", PAIRS)
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_matches_torch_over_20_steps(device, ours_cls, ref_cls, amsgrad, maximize, weight_decay):
    # Two groups with their own lr and betas, several tensors each, odd sizes.
    a, b = _params(device), _params(device, shapes=[(5, 3), (2,)], seed=1)
    ra, rb = _clone(a), _clone(b)
    kw = dict(weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)
    ours = ours_cls([{"params": a}, {"params": b, "lr": 3e-3, "betas": (0.8, 0.99)}], lr=1e-2, **kw)
    ref = ref_cls([{"params": ra}, {"params": rb, "lr": 3e-3, "betas": (0.8, 0.99)}], lr=1e-2, foreach=False, **kw)
    _step_both_and_compare(ours, a + b, ref, ra + rb, range(20))
    _assert_state_close(ours, ref, a + b, ra + rb, **FP32)
    for p in a + b:
        st = ours.state[p]["step"]
        assert st.dtype == torch.float32 and st.device == p.device and st.item() == 20


@pytest.mark.parametrize("ours_cls,ref_cls", PAIRS)
def test_float64_matches_torch_to_rounding(ours_cls, ref_cls):
    a = _params("cpu", torch.float64)
    ra = _clone(a)
    ours, ref = ours_cls(a, lr=1e-2, amsgrad=True), ref_cls(ra, lr=1e-2, amsgrad=True, foreach=False)
    _step_both_and_compare(ours, a, ref, ra, range(20), rtol=1e-13, atol=1e-13)
    assert ours.state[a[0]]["exp_avg"].dtype == torch.float64


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("ours_cls,ref_cls", PAIRS)
def test_reduced_precision_params_round_once_from_fp32(device, dtype, ours_cls, ref_cls):
    # Semantics: widen the param, update in fp32 with fp32 state, round once. Reference: torch.optim on
    # an fp32 master copy that is rounded to the dtype after every step.
    a = _params(device, dtype)
    master = _clone(a, torch.float32)
    ours = ours_cls(a, lr=1e-2, weight_decay=0.01, amsgrad=True)
    ref = ref_cls(master, lr=1e-2, weight_decay=0.01, amsgrad=True, foreach=False)
    for step in range(20):
        grads = _grads(a, step)
        _set_grads(a, grads)
        _set_grads(master, [g.float() for g in grads])
        ours.step()
        ref.step()
        with torch.no_grad():
            for m in master:
                m.copy_(m.to(dtype).float())
    for p, q in zip(a, master):
        assert p.dtype == dtype
        torch.testing.assert_close(p, q.to(dtype), **tol(dtype))
    for p in a:
        assert all(ours.state[p][k].dtype == torch.float32 for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"))
    _assert_state_close(ours, ref, a, master, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("decoupled", [False, True], ids=["adam", "adamw"])
def test_compact_state_is_the_fp32_update_rounded_on_store(device, dtype, decoupled):
    # compact state (the param's dtype): each step must equal the fp32-state kernel's step from the same
    # values widened, with param and moments rounded once on store; every alignment and layout path
    kw = dict(_HYPER, decoupled_weight_decay=decoupled, maximize=True)
    ps, gs, ms, vs, xs = _awkward_views(device, dtype, compact=True)
    steps = [torch.zeros((), device=device) for _ in ps]
    for k in range(3):
        wide = [[t.float() for t in lst] for lst in (ms, vs, xs)]
        ref_p, ref_steps = [p.clone() for p in ps], [s.clone() for s in steps]
        grads = [g * (k + 1) for g in gs]
        fused_adam_step(ref_p, grads, *wide, ref_steps, **kw)
        fused_adam_step(ps, grads, ms, vs, xs, steps, **kw)
        for got, want in zip(ps + ms + vs + xs + steps, ref_p + sum(wide, []) + ref_steps):
            assert got.dtype == (torch.float32 if got.dim() == 0 else dtype)
            assert torch.equal(got, want.to(got.dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("ours_cls,ref_cls", PAIRS)
@pytest.mark.parametrize("amsgrad", [True, False])  # AdamW without amsgrad: the CUDA kernel's plain step
def test_compact_state_matches_torch_fused(device, dtype, ours_cls, ref_cls, amsgrad):
    # torch.optim's fused path keeps the state in the param dtype and computes in fp32, as compact_state
    # does: the same numbers but where the arithmetic rounds in another order. Then a value lands on the
    # other side of a rounding to fp16/bf16 now and then, and the weights move on from there: each
    # element within two ulps, or a tenth of a step (lr: an Adam step moves a weight by about lr at most,
    # so this bounds what that rounding can change), the state within two ulps at the tensor's scale, and
    # >= 99% of the weights bit for bit. torch's CPU kernel: AdamW's fused decay rounds once where it
    # rounds twice; its CUDA kernel computes parts in double (fused_adam_utils.cuh: the moments, the
    # denominator), which the H200 run of 2026-11-26 showed a few elements in 4099 move past 2 ulps.
    lr = 1e-2
    a = _params(device, dtype, shapes=SHAPES + [(4099,)])
    b = _clone(a)
    ours = ours_cls(a, lr=lr, weight_decay=0.1, amsgrad=amsgrad, compact_state=True)
    ref = ref_cls(b, lr=lr, weight_decay=0.1, amsgrad=amsgrad, fused=True)
    ulp = torch.finfo(dtype).eps
    _step_both_and_compare(ours, a, ref, b, range(10), rtol=2 * ulp, atol=0.1 * lr)
    same = sum(int(torch.eq(p, q).sum()) for p, q in zip(a, b))
    assert same >= 0.99 * sum(p.numel() for p in a)
    for p, q in zip(a, b):
        assert set(ours.state[p]) == set(ref.state[q])
        keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
        assert all(ours.state[p][k].dtype == dtype for k in keys)
        for key in keys:
            want = ref.state[q][key].float().cpu()
            torch.testing.assert_close(ours.state[p][key].float().cpu(), want, rtol=2 * ulp,
                                       atol=2 * ulp * float(want.abs().max()))
        torch.testing.assert_close(ours.state[p]["step"].cpu(), ref.state[q]["step"].cpu())


def test_compact_state_leaves_fp32_and_fp64_params_alone():
    for dtype in (torch.float32, torch.float64):
        a, b = _params("cpu", dtype), _params("cpu", dtype)
        compact, plain = FusedAdamW(a, lr=1e-2, compact_state=True), FusedAdamW(b, lr=1e-2)
        _step_both_and_compare(compact, a, plain, b, range(3), rtol=0, atol=0)
        assert compact.state[a[0]]["exp_avg"].dtype == dtype


def test_compact_state_loads_torch_state_as_it_is_and_the_default_widens_it():
    a = _params("cpu", torch.bfloat16)
    torch_opt = torch.optim.AdamW(a, lr=1e-2, amsgrad=True, fused=True)
    _set_grads(a, _grads(a, 0))
    torch_opt.step()
    sd = torch_opt.state_dict()
    for compact, want in ((True, torch.bfloat16), (False, torch.float32)):
        b = _clone(a)
        ours = FusedAdamW(b, lr=1.0, amsgrad=True, compact_state=compact)
        ours.load_state_dict(copy.deepcopy(sd))
        for p, q in zip(b, a):
            for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                assert ours.state[p][key].dtype == want
                assert torch.equal(ours.state[p][key].float(), torch_opt.state[q][key].float())
        if compact:  # continues as torch does
            _step_both_and_compare(ours, b, torch_opt, a, range(1, 4),
                                   rtol=2 * torch.finfo(torch.bfloat16).eps, atol=0)


def test_compact_state_of_the_reference_path_is_updated_in_fp32():
    # adam_reference (devices without kernels) widens compact state as the kernels do, found_inf included
    for found in (0.0, 1.0):
        k = _awkward_views("cpu", torch.bfloat16, compact=True)
        r = _awkward_views("cpu", torch.bfloat16, compact=True)
        before = [t.clone() for t in sum(r, [])]
        steps_k, steps_r = ([torch.zeros(()) for _ in k[0]] for _ in range(2))
        kw = dict(_HYPER, grad_scale=torch.tensor(4.0), found_inf=torch.tensor(found))
        fused_adam_step(*k, steps_k, **kw)
        adam_reference(*r, steps_r, **kw)
        for tk, tr, tb in zip(sum(k, []), sum(r, []), before):
            assert tr.dtype == torch.bfloat16
            torch.testing.assert_close(tr, tk, rtol=2 * torch.finfo(torch.bfloat16).eps, atol=1e-6)
            if found:
                assert torch.equal(tr, tb)


def test_the_kernel_refuses_state_of_two_dtypes_and_nothing_changes():
    ps, gs, ms, vs, xs = _awkward_views("cpu", torch.bfloat16, compact=True)
    vs = [v.float() for v in vs]  # exp_avg bf16, exp_avg_sq fp32
    before = [t.clone() for t in ps + ms + vs]
    with pytest.raises(RuntimeError, match=r"state of params\[0\] must be Float or BFloat16, exp_avg and "):
        fused_adam_step(ps, gs, ms, vs, xs, [torch.zeros(()) for _ in ps], **_HYPER)
    for t, b in zip(ps + ms + vs, before):
        assert torch.equal(t, b)


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_dtypes_and_many_tensors_in_one_group(device):
    # More tensors than a CUDA launch with 4 KB of arguments carries (32), and several dtypes in one group.
    shapes = [(n % 9 + 1, 3) for n in range(70)]
    a = _params(device, shapes=shapes)
    for k in range(0, 70, 3):
        a[k] = a[k].detach().double().requires_grad_()
    ra = _clone(a)
    ours, ref = FusedAdamW(a, lr=1e-2), torch.optim.AdamW(ra, lr=1e-2, foreach=False)
    _step_both_and_compare(ours, a, ref, ra, range(5))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk_size", [1, 3, 64])
@pytest.mark.parametrize("decoupled", [False, True], ids=["adam", "adamw"])
def test_small_chunks_exercise_offsets(device, dtype, chunk_size, decoupled):
    # Many chunks per tensor: the chunk -> (tensor, offset) arithmetic at small scale. Elements are
    # independent, so the result must not depend on the chunking at all (chunks under 16 elements
    # also take the CPU kernel's scalar loop, the default chunk its vector loop; on CUDA chunks of 1
    # and 3 elements start unaligned and take the scalar loop, 64 the vector loop: they must agree).
    a = _params(device, dtype, shapes=[(1001,), (7,), (130,), (0,), (1,)])
    b, ra = _clone(a), _clone(a)
    kw = dict(lr=1e-2, amsgrad=True, weight_decay=0.1, decoupled_weight_decay=decoupled)
    small = FusedAdam(a, chunk_size=chunk_size, **kw)
    big = FusedAdam(b, **kw)
    ref = torch.optim.Adam(ra, foreach=False, **kw)
    for step in range(4):
        grads = _grads(a, step)
        for opt, ps in ((small, a), (big, b), (ref, ra)):
            _set_grads(ps, grads)
            opt.step()
    for p, q, r in zip(a, b, ra):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
        if dtype == torch.float32:
            torch.testing.assert_close(p, r, **FP32)
    for p, q in zip(a, b):
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if dtype == torch.float32:
                assert torch.equal(small.state[p][key], big.state[q][key])
            else:
                # The scalar loop's fp32 math on half/bfloat16 inputs may be FMA-contracted differently
                # from the vector loop depending on the torch headers (seen with torch 2.13): allow a
                # couple of fp32 ulps in the state. A chunk/offset bug would be off by far more.
                torch.testing.assert_close(small.state[p][key], big.state[q][key], rtol=4e-6, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ours_cls,ref_cls", PAIRS)
def test_found_inf_skips_the_step_on_device(device, ours_cls, ref_cls):
    a = _params(device)
    ra = _clone(a)
    ours = ours_cls(a, lr=1e-2, amsgrad=True, weight_decay=0.1)
    ref = ref_cls(ra, lr=1e-2, amsgrad=True, weight_decay=0.1, foreach=False)
    zero = torch.zeros((), device=device)
    for step in range(6):
        grads = _grads(a, step)
        _set_grads(a, grads)
        if step == 3:
            # An overflowed step: grads carry inf; the reference simply does not step.
            a[0].grad[0] = float("inf")
            before = [p.detach().clone() for p in a]
            state_before = copy.deepcopy({i: ours.state[p] for i, p in enumerate(a)})
            ours.step(found_inf=torch.ones((), device=device))
            for i, p in enumerate(a):
                assert torch.equal(p, before[i])
                for key, value in state_before[i].items():
                    assert torch.equal(ours.state[p][key], value), key
            continue
        _set_grads(ra, grads)
        ours.step(found_inf=zero)
        ref.step()
    for p, q in zip(a, ra):
        torch.testing.assert_close(p, q, **FP32)
    assert ours.state[a[0]]["step"].item() == 5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale,exact", [(1024.0, True), (3.0, False)])
def test_grad_scale_unscales_inside_the_kernel(device, scale, exact):
    a = _params(device)
    b = _clone(a)
    scaled, plain = FusedAdam(a, lr=1e-2, weight_decay=0.1), FusedAdam(b, lr=1e-2, weight_decay=0.1)
    for step in range(5):
        grads = _grads(a, step)
        _set_grads(a, [g * scale for g in grads])
        _set_grads(b, grads)
        scaled.step(grad_scale=torch.tensor(scale, device=device))
        plain.step()
    for p, q in zip(a, b):
        # A power-of-two scale divides exactly; another one is within rounding of the grad.
        torch.testing.assert_close(p, q, **({"rtol": 0, "atol": 0} if exact else FP32))


def test_torch_amp_grad_scaler_drives_found_inf_and_scale():
    # torch.amp.GradScaler hands fused optimizers grad_scale/found_inf as attributes; an inf skips.
    model = torch.nn.Linear(5, 3)
    ref_model = copy.deepcopy(model)
    ours, ref = FusedAdam(model.parameters(), lr=1e-2), torch.optim.Adam(ref_model.parameters(), lr=1e-2,
                                                                          foreach=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1000)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1000)
    for step in range(4):
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(step))
        if step == 2:
            x[0, 0] = float("inf")
        for m, opt, sc in ((model, ours, scaler), (ref_model, ref, ref_scaler)):
            opt.zero_grad()
            sc.scale(m(x).pow(2).mean()).backward()
            sc.step(opt)
            sc.update()
    assert scaler.get_scale() == ref_scaler.get_scale() == 2.0 ** 7  # one overflow halved it
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, **FP32)
    assert ours.state[model.weight]["step"].item() == 3


def test_lr_as_tensor_matches_float():
    a = _params("cpu")
    b = _clone(a)
    lr = torch.tensor(1e-2)  # float32: the float twin must use the same (rounded) value
    ot, of = FusedAdamW(a, lr=lr), FusedAdamW(b, lr=lr.item())
    _step_both_and_compare(ot, a, of, b, range(5), rtol=0, atol=0)


def test_params_without_grads_are_skipped():
    a = _params("cpu")
    before = a[1].detach().clone()
    opt = FusedAdam(a, lr=1e-2)
    grads = _grads(a, 0)
    for k in (0, 2, 3):
        a[k].grad = grads[k]
    opt.step()
    assert torch.equal(a[1], before) and a[1] not in opt.state
    assert not torch.equal(a[0], _params("cpu")[0])


def test_reference_path_matches_kernel():
    # adam_reference serves devices without kernels (XLA); check it on CPU against the kernel,
    # including the device-side found_inf skip.
    def lists(seed):
        gen = torch.Generator().manual_seed(seed)
        ps = [t.detach() for t in _params("cpu", seed=seed)]
        gs = _grads(ps, seed)
        m, v, vmax = ([torch.rand(p.shape, generator=gen) + shift for p in ps] for shift in (0.0, 0.0, 0.5))
        return ps, gs, m, v, vmax, [torch.tensor(3.0) for _ in ps]

    for found in (0.0, 1.0):
        for decoupled in (False, True):
            k, r = lists(0), lists(0)
            kw = dict(lr=torch.tensor(1e-2), beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, amsgrad=True,
                      maximize=True, decoupled_weight_decay=decoupled, grad_scale=torch.tensor(4.0),
                      found_inf=torch.tensor(found))
            fused_adam_step(*k, **kw)
            adam_reference(*r, **kw)
            for tk, tr in zip(sum(k, []), sum(r, [])):
                torch.testing.assert_close(tk, tr, **FP32)
            if found:
                assert torch.equal(k[0][0], lists(0)[0][0]) and k[5][0].item() == 3.0


@pytest.mark.skipif(not xla_available(), reason="torch_xla is not installed")
def test_xla_params_take_the_reference_path():
    # No kernels on XLA: the plain-op path runs there, found_inf included, without a host sync.
    dev = require_xla("FusedAdam on XLA").device()
    a = _params("cpu", shapes=[(7,), (3, 5)])
    xs = [p.detach().to(dev).requires_grad_() for p in a]
    ours = FusedAdamW(xs, lr=1e-2, amsgrad=True)
    ref = torch.optim.AdamW(a, lr=1e-2, amsgrad=True, foreach=False)
    for step in range(3):
        grads = _grads(a, step)
        _set_grads(a, grads)
        _set_grads(xs, [g.to(dev) for g in grads])
        ours.step(found_inf=torch.tensor(float(step == 1), device=dev))
        if step != 1:
            ref.step()
        mark_step()
    for x, p in zip(xs, a):
        torch.testing.assert_close(x.detach().cpu(), p.detach(), **FP32)
    assert ours.state[xs[0]]["step"].cpu().item() == 2


def test_state_dict_round_trip_through_torch_adam():
    a = _params("cpu")
    ours = FusedAdam(a, lr=1e-2, amsgrad=True)
    for step in range(5):
        _set_grads(a, _grads(a, step))
        ours.step()
    sd = copy.deepcopy(ours.state_dict())
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
    # Into torch.optim.Adam: both continue identically.
    t = _clone(a)
    torch_opt = torch.optim.Adam(t, lr=1e-2, amsgrad=True, foreach=False)
    torch_opt.load_state_dict(sd)
    _step_both_and_compare(ours, a, torch_opt, t, range(5, 8))
    # And back: a fresh FusedAdam loaded from torch's state dict continues like torch.
    back_params = _clone(t)
    back = FusedAdam(back_params, lr=1.0)
    back.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    assert back.param_groups[0]["lr"] == 1e-2 and back.param_groups[0]["amsgrad"]
    step_t = back.state[back_params[0]]["step"]
    assert step_t.dtype == torch.float32 and step_t.item() == 8
    _step_both_and_compare(back, back_params, torch_opt, t, range(8, 10))


@pytest.mark.parametrize("copier", [copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))], ids=["deepcopy", "pickle"])
def test_a_copied_optimizer_keeps_its_own_options_and_steps_like_the_original(copier):
    # torch.optim.Optimizer pickles defaults, state and param_groups only: chunk_size and compact_state
    # must travel too (a copy without them failed at its first step)
    a = _params("cpu", torch.bfloat16)
    ours = FusedAdamW(a, lr=1e-2, chunk_size=5, compact_state=True)
    _set_grads(a, _grads(a, 0))
    ours.step()
    twin = copier(ours)
    assert (twin.chunk_size, twin.compact_state) == (5, True)
    b = twin.param_groups[0]["params"]
    _step_both_and_compare(ours, a, twin, b, range(1, 3), rtol=0, atol=0)
    assert twin.state[b[0]]["exp_avg"].dtype == torch.bfloat16


def test_state_changed_between_steps_is_seen_and_a_dropped_state_is_freed():
    # the per-step path trusts the state tensors it found in layout the step before, by identity: a state
    # replaced, cleared or of another layout since must be (re)built, and nothing it saw may be kept alive
    a = _params("cpu", torch.bfloat16)
    ours = FusedAdamW(a, lr=1e-2, amsgrad=True)
    _set_grads(a, _grads(a, 0))
    ours.step()
    old = weakref.ref(ours.state[a[0]]["exp_avg"])
    ours.state[a[0]].clear()  # a reset of one param's state
    ours.state[a[1]]["exp_avg"] = torch.zeros_like(a[1])  # bf16 where the layout is fp32
    assert old() is None
    fresh = FusedAdamW(_clone(a[:1]), lr=1e-2, amsgrad=True)
    _set_grads(a, _grads(a, 1))
    _set_grads(fresh.param_groups[0]["params"], _grads(a, 1)[:1])
    ours.step()
    fresh.step()
    assert torch.equal(a[0], fresh.param_groups[0]["params"][0])
    assert ours.state[a[0]]["step"].item() == 1 and ours.state[a[2]]["step"].item() == 2
    assert ours.state[a[1]]["exp_avg"].dtype == torch.float32
    assert torch.equal(ours.state[a[1]]["exp_avg"], 0.1 * _grads(a, 1)[1].float())
    ours.compact_state = True  # every param's layout changes
    _set_grads(a, _grads(a, 2))
    ours.step()
    for p in a:
        assert all(ours.state[p][k].dtype == torch.bfloat16 for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"))


def test_state_dict_keeps_fp32_state_of_bf16_params():
    a = _params("cpu", torch.bfloat16)
    ours = FusedAdam(a, lr=1e-2)
    _set_grads(a, _grads(a, 0))
    ours.step()
    sd = copy.deepcopy(ours.state_dict())
    b = _clone(a)
    other = FusedAdam(b, lr=1e-2)
    other.load_state_dict(sd)
    for p, q in zip(a, b):
        for key in ("exp_avg", "exp_avg_sq"):
            assert other.state[q][key].dtype == torch.float32
            assert torch.equal(other.state[q][key], ours.state[p][key])


def test_torch_kwargs_are_accepted():
    a = _params("cpu")
    b = _clone(a)
    opt = FusedAdam(a, lr=1e-2, foreach=True, fused=True, capturable=True)
    plain = FusedAdam(b, lr=1e-2)
    for opt_, ps in ((opt, a), (plain, b)):
        _set_grads(ps, _grads(ps, 0))
        opt_.step()
    for p, q in zip(a, b):
        assert torch.equal(p, q)
    assert FusedAdam._step_supports_found_inf and FusedAdamW._step_supports_found_inf
    assert FusedAdamW(_params("cpu")).param_groups[0]["weight_decay"] == 1e-2


@pytest.mark.parametrize("kwargs,name", [
    ({"lr": -1.0}, "lr"), ({"lr": torch.ones(2)}, "lr"), ({"betas": (1.0, 0.9)}, "betas"),
    ({"betas": (0.9,)}, "betas"), ({"eps": -1e-8}, "eps"), ({"weight_decay": -0.1}, "weight_decay"),
    ({"amsgrad": "yes"}, "amsgrad"), ({"maximize": 1}, "maximize"), ({"differentiable": True}, "differentiable"),
    ({"foreach": "no"}, "foreach"), ({"chunk_size": 0}, "chunk_size"), ({"compact_state": "yes"}, "compact_state"),
])
def test_bad_arguments_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        FusedAdam(_params("cpu"), **kwargs)


def test_bad_params_are_rejected():
    with pytest.raises(ValueError, match="params"):
        FusedAdam([torch.zeros(3, dtype=torch.int64)])
    with pytest.raises(ValueError, match="device"):
        FusedAdam([torch.zeros(3, requires_grad=True), torch.zeros(3, device="meta", requires_grad=True)])


def test_sparse_grad_is_rejected_and_nothing_changes():
    a, b = _params("cpu"), _params("cpu", seed=1)
    opt = FusedAdam([{"params": a}, {"params": b}], lr=1e-2)
    _set_grads(a + b, _grads(a + b, 0))
    before = [p.detach().clone() for p in a + b]
    b[0].grad = b[0].grad.to_sparse()
    with pytest.raises(ValueError, match="sparse"):
        opt.step()
    for p, q in zip(a + b, before):
        assert torch.equal(p, q)
    with pytest.raises(ValueError, match="found_inf"):
        opt.step(found_inf=1.0)


def _kernel_run(device, dtype, views, *, steps=3, chunk_size=5, skip=(), scaled=True, **kw):
    """fused_adam_step over `views(device)` (param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq lists
    built from the same seeded values on every device); the steps numbered in `skip` get found_inf=1;
    `scaled`: the grads come with a grad_scale of 4. Returns every tensor, on the CPU."""
    ps, gs, ms, vs, xs = views(device, dtype)
    st = [torch.zeros((), device=device) for _ in ps]
    scale = torch.tensor(4.0, device=device) if scaled else None
    for k in range(steps):
        fused_adam_step(ps, [g * (k + 1) for g in gs], ms, vs, xs, st, chunk_size=chunk_size, grad_scale=scale,
                        found_inf=torch.tensor(float(k in skip), device=device), **kw)
    return [t.cpu() for t in ps + ms + vs + xs + st]


_HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, amsgrad=True, maximize=False,
              decoupled_weight_decay=True)


@pytest.mark.parametrize("device", DEVICES)
def test_a_step_counter_shared_by_two_params_is_refused_and_nothing_changes(device):
    ps, gs, ms, vs, xs = _awkward_views(device, torch.float32)
    before = [t.clone() for t in ps + ms + vs]
    shared = torch.zeros((), device=device)
    steps = [torch.zeros((), device=device) for _ in ps]
    steps[3] = shared
    steps[1] = shared
    with pytest.raises(RuntimeError, match=r"steps\[1\] and steps\[3\] are the same counter"):
        fused_adam_step(ps, gs, ms, vs, xs, steps, **_HYPER)
    for t, b in zip(ps + ms + vs, before):
        assert torch.equal(t, b)
    assert shared.item() == 0


@pytest.mark.parametrize("device", DEVICES)
def test_a_chunk_larger_than_every_tensor_is_one_chunk(device):
    # chunk_size near 2^63: the chunk count must not overflow (one chunk per tensor, as chunk_size=2048 here)
    huge = _kernel_run(device, torch.float32, _awkward_views, chunk_size=2**63 - 1, **_HYPER)
    plain = _kernel_run(device, torch.float32, _awkward_views, chunk_size=2048, **_HYPER)
    for a, b in zip(huge, plain):
        assert torch.equal(a, b)


def _awkward_views(device, dtype, compact=False):
    """Odd sizes, views that start mid-vector (1 element in: no access width's alignment; 4 elements in: a 16-bit
    view aligned for packs of 4 but not to 16 bytes), a transposed
    (non-contiguous) one, an empty one and one long enough for every CUDA thread to go round its loop twice: every
    path of the kernels' alignment and layout logic.
    `compact`: the state in the param dtype."""
    gen = torch.Generator().manual_seed(3)
    sdt = dtype if compact else torch.float64 if dtype == torch.float64 else torch.float32

    def make(shape, dt):
        return torch.randn(shape, generator=gen).to(device=device, dtype=dt)

    def lists(dt, positive=False):
        base = make((1 + 1029,), dt)
        # 4109: over two packs per CUDA thread (256 threads) for every dtype, plus a tail: a second round of the
        # thread's loop
        out = [make((1029,), dt), base[1:], make((4 + 1029,), dt)[4:], make((33, 9), dt).t(), make((0,), dt),
               make((1,), dt), make((4109,), dt)]
        return [t.abs() for t in out] if positive else out

    return lists(dtype), lists(dtype), lists(sdt), lists(sdt, True), lists(sdt, True)


def _many_views(count):
    """`views` for _kernel_run: `count` small tensors of mixed fp32/bf16/fp16 dtypes (mostly fp32, the
    dtype argument is ignored) with odd sizes, empty ones, transposed ones, and views that start 1, 4
    or 8 elements into their allocation, chosen per list so that a chunk's pointers are aligned in
    some tensors and not in others."""
    def views(device, _dtype):
        gen = torch.Generator().manual_seed(5)
        out = ([], [], [], [], [])
        for k in range(count):
            dt = {1: torch.bfloat16, 4: torch.float16}.get(k % 7, torch.float32)
            numel = 0 if k % 13 == 0 else (k * 37) % 301
            for j, lst in enumerate(out):
                ldt = dt if j < 2 else torch.float32
                if k % 17 == 5:  # a transposed 2-D tensor: a strided one
                    t = torch.randn((numel % 7 + 1, 3), generator=gen).to(device=device, dtype=ldt).t()
                else:
                    offset = (0, 0, 1, 4, 8)[(k * 7 + j * 3) % 5]
                    t = torch.randn(offset + numel, generator=gen).to(device=device, dtype=ldt)[offset:]
                lst.append(t.abs() if j >= 3 else t)  # exp_avg_sq and max_exp_avg_sq are >= 0
        return out
    return views


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_cuda_many_tensors_mixed_dtypes_equal_cpu_kernel():
    # More tensors than one launch carries, for both argument sizes (480 or 32 tensors a dtype per
    # update launch, 3968 or 480 step counters per advance launch): 4000 tensors, ~2800 of them fp32.
    # Chunks of 8 elements: on CUDA two packs of 4 elements of a bf16/fp16 chunk (as of fp32) where the
    # tensor's pointers allow it, the scalar loop where not; on the CPU always the scalar loop, which
    # test_cuda_kernel_equals_cpu_kernel pins to the CUDA kernel's bits. Step 2 is skipped with
    # found_inf=1 on the device; params, state and step counters (list order of _kernel_run: params,
    # exp_avg, exp_avg_sq, max_exp_avg_sq, steps) must equal the CPU kernel's bit for bit.
    kw = dict(lr=torch.tensor(1e-2), beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, amsgrad=True,
              maximize=False, decoupled_weight_decay=True)
    views = _many_views(4000)
    cpu = _kernel_run("cpu", None, views, steps=4, chunk_size=8, skip=(2,), **kw)
    cuda = _kernel_run("cuda", None, views, steps=4, chunk_size=8, skip=(2,), **kw)
    assert len(cpu) == len(cuda) == 5 * 4000
    for k, (c, g) in enumerate(zip(cpu, cuda)):
        assert g.dtype == c.dtype and torch.equal(g, c), f"tensor {k % 4000} of list {k // 4000}"
    assert all(s.item() == 3.0 for s in cuda[-4000:])


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.parametrize("dtype,compact", [(torch.float32, False), (torch.bfloat16, False), (torch.float16, False),
                                           (torch.float64, False), (torch.bfloat16, True), (torch.float16, True)],
                         ids=["fp32", "bf16", "fp16", "fp64", "bf16-compact", "fp16-compact"])
@pytest.mark.parametrize("decoupled", [False, True], ids=["adam", "adamw"])
@pytest.mark.parametrize("general", [True, False], ids=["general", "plain"])
def test_cuda_kernel_equals_cpu_kernel(dtype, compact, decoupled, general):
    # Both devices run fused_adam_host::adam_element with a pinned rounding sequence: the same bits
    # for unaligned views, strided tensors, odd sizes and chunk starts mid-vector, with the state in
    # fp32 or compact. float64 may differ in the last bit of the bias corrections (the device's pow is
    # not correctly rounded). "plain": no amsgrad and no grad_scale, the CUDA kernels whose options are
    # compile-time constants (kPlain, kPlainCoupled).
    kw = dict(lr=torch.tensor(1e-2), beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, amsgrad=general,
              maximize=True, decoupled_weight_decay=decoupled, scaled=general)
    views = functools.partial(_awkward_views, compact=compact)
    cpu = _kernel_run("cpu", dtype, views, **kw)
    cuda = _kernel_run("cuda", dtype, views, **kw)
    for c, g in zip(cpu, cuda):
        if dtype == torch.float64:
            torch.testing.assert_close(g, c, rtol=1e-14, atol=1e-15)
        else:
            assert torch.equal(g, c)


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_cuda_step_never_waits_for_the_device():
    # GradScaler's found_inf / grad_scale and a tensor lr stay on the GPU: no host synchronisation.
    a = _params("cuda")
    opt = FusedAdamW(a, lr=torch.tensor(1e-2, device="cuda"), amsgrad=True)
    found, scale = torch.zeros((), device="cuda"), torch.tensor(2.0, device="cuda")
    _set_grads(a, _grads(a, 0))
    opt.step(found_inf=found, grad_scale=scale)  # builds/loads the kernels and creates the state
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step(found_inf=found, grad_scale=scale)
        opt.step(found_inf=found + 1, grad_scale=scale)  # a skipped step decides on the device, too
    finally:
        torch.cuda.set_sync_debug_mode(before)
    assert opt.state[a[0]]["step"].item() == 2


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cuda_params_on_a_second_device():
    # Params on cuda:1 while cuda:0 is current: the kernel must run on (and allocate on) cuda:1.
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, amsgrad=True, maximize=False,
              decoupled_weight_decay=True)
    cpu = _kernel_run("cpu", torch.float32, _awkward_views, **kw)
    with torch.cuda.device(0):
        other = _kernel_run("cuda:1", torch.float32, _awkward_views, **kw)
    for c, g in zip(cpu, other):
        assert torch.equal(g, c)


def _free_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _huge_tensor_check(device):
    # 2^31 + 5 bf16 elements: offsets past int32. Adam is elementwise, so the head and the tail are
    # checked against torch.optim on fp32 copies of those slices.
    n = 2 ** 31 + 5
    p = torch.zeros(n, dtype=torch.bfloat16, device=device)
    p[:1000] = torch.randn(1000, device=device).bfloat16()
    p[-1000:] = torch.randn(1000, device=device).bfloat16()
    p.requires_grad_()
    p.grad = torch.ones(n, dtype=torch.bfloat16, device=device)
    p.grad[-1000:] = torch.randn(1000, device=device).bfloat16()
    slices = [slice(0, 1000), slice(n - 1000, n)]
    masters = [p.detach()[s].float().clone().requires_grad_() for s in slices]
    for m, s in zip(masters, slices):
        m.grad = p.grad[s].float()
    FusedAdamW([p], lr=1e-2).step()
    torch.optim.AdamW(masters, lr=1e-2, foreach=False).step()
    for m, s in zip(masters, slices):
        torch.testing.assert_close(p.detach()[s], m.detach().bfloat16(), **tol(torch.bfloat16))


@pytest.mark.slow
@pytest.mark.skipif(_free_bytes() < 26 * 2 ** 30,
                    reason="a CPU tensor of 2^31+5 elements with its grad and fp32 state needs ~26 GB free")
def test_cpu_tensor_beyond_int32_elements():
    _huge_tensor_check("cpu")


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_cuda_tensor_beyond_int32_elements():
    if torch.cuda.get_device_properties(0).total_memory < 40 * 2 ** 30:
        pytest.skip("a CUDA tensor of 2^31+5 bf16 elements with grad and fp32 state needs a GPU of >= 40 GB")
    _huge_tensor_check("cuda")
