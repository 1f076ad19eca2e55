"""accel.compiler.cpu_dropout: compiled CPU graphs draw their dropout masks with accel::dropout_mask. The reference
is the op itself: under the same seed, a compiled dropout must give x * mask / (1 - p) with the mask the op draws
when called directly (Inductor's own random numbers would give another mask)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import accel
from accel.compiler.cpu_dropout import DrawDropoutMasks
from accel.runtime.nn.bias_dropout_add import _ops

P = 0.3


def _accel_mask(shape, p=P, seed=0):
    torch.manual_seed(seed)
    return _ops().dropout_mask(shape, p, device=torch.device("cpu"))


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, options={"joint_custom_pre_pass": DrawDropoutMasks()})


class _FunctionalDropout(nn.Module):
    """A layer that calls F.dropout itself, as BART's and OPT's do (nothing for PhiloxDropout to swap)."""

    def __init__(self, width=64, p=P):
        super().__init__()
        self.proj, self.p = nn.Linear(width, width), p

    def forward(self, x):
        return F.dropout(self.proj(x), p=self.p, training=self.training)


def test_functional_dropout_takes_accels_mask_forward_and_backward():
    x = torch.randn(4, 96, 33, requires_grad=True)
    compiled = _compiled(lambda t: F.dropout(t, P, True))
    torch.manual_seed(0)
    out = compiled(x)
    mask = _accel_mask(x.shape)
    torch.testing.assert_close(out, x.detach() * mask * (1 / (1 - P)))
    grad = torch.randn_like(out)
    out.backward(grad)
    torch.testing.assert_close(x.grad, grad * mask * (1 / (1 - P)))


@pytest.mark.parametrize("autocast", [False, True])
def test_dropout_layers_and_calls_in_a_model_take_accels_masks(autocast):
    torch.manual_seed(1)
    model = nn.Sequential(_FunctionalDropout(), nn.GELU(), nn.Linear(64, 64), nn.Dropout(P)).train()
    compiled = _compiled(model)
    x = torch.randn(8, 64)
    torch.manual_seed(5)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        out = compiled(x)
    # the two masks the seed draws, in either order (Inductor may schedule the draws, which read no data, apart
    # from the graph's order)
    torch.manual_seed(5)
    masks = [_ops().dropout_mask((8, 64), P, device=torch.device("cpu")) for _ in range(2)]
    tolerance = dict(rtol=2e-2, atol=2e-2) if autocast else {}
    for first, second in (masks, masks[::-1]):
        if torch.equal(out == 0, ~second):
            with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                hidden = model[0].proj(x) * first * (1 / (1 - P))
                expected = model[2](model[1](hidden)) * second * (1 / (1 - P))
            torch.testing.assert_close(out.detach(), expected, **tolerance)
            return
    raise AssertionError("the compiled model's output has neither of accel's masks")


def test_a_second_call_draws_new_masks_and_a_seed_repeats_them():
    compiled = _compiled(lambda t: F.dropout(t, P, True))
    x = torch.ones(4096)
    torch.manual_seed(3)
    a, b = compiled(x), compiled(x)
    torch.manual_seed(3)
    assert torch.equal(compiled(x), a)
    assert not torch.equal(a, b)
    assert abs((a != 0).float().mean().item() - (1 - P)) < 0.03


def test_other_random_numbers_stay_inductors():
    """rand used beyond one comparison with p (here also returned) is not a dropout mask: it is left alone."""
    def noisy(t):
        r = torch.rand(t.shape)
        return t * (r > P), r

    compiled = _compiled(noisy)
    x = torch.randn(2048)
    torch.manual_seed(0)
    out, r = compiled(x)
    torch.testing.assert_close(out, x * (r > P))
    assert not torch.equal(r > P, _accel_mask(x.shape))


def test_the_pass_leaves_cuda_seeded_and_certain_draws_alone():
    aten = torch.ops.aten
    graph = torch.fx.Graph()
    cpu = torch.device("cpu")
    for kwargs, p in [({"device": torch.device("cuda")}, P), ({"device": cpu, "generator": torch.Generator()}, P),
                      ({"device": cpu}, 1.0), ({"device": cpu}, 0.0), ({}, P)]:
        graph.call_function(aten.gt.Scalar, (graph.call_function(aten.rand.default, ([16],), kwargs), p))
    before = [node.target for node in graph.nodes]
    DrawDropoutMasks()(graph)
    assert [node.target for node in graph.nodes] == before


def test_accelerate_gives_compiled_cpu_models_the_pass_with_kernels_on():
    torch.manual_seed(0)
    model = _FunctionalDropout().train()
    config = accel.Config(backend="cpu")
    ours = accel.accelerate(model, None, config)
    x = torch.randn(16, 64)
    torch.manual_seed(7)
    out = ours(x)
    mask = _accel_mask((16, 64), seed=7)
    with torch.no_grad():
        torch.testing.assert_close(out.detach(), model.proj(x) * mask * (1 / (1 - P)))


def test_accelerate_without_kernels_leaves_inductors_masks():
    torch.manual_seed(0)
    config = accel.Config(backend="cpu")
    config.compute.kernels = False
    ours = accel.accelerate(_FunctionalDropout().train(), None, config)
    x = torch.randn(16, 64)
    torch.manual_seed(7)
    out = ours(x)
    assert not torch.equal(out != 0, _accel_mask((16, 64), seed=7))


@pytest.mark.parametrize("layer", [False, True], ids=["F.dropout", "PhiloxDropout"])
def test_a_checkpointed_region_recomputes_the_forwards_masks(layer):
    """Activation checkpointing recomputes the region's forward in the backward: its masks must be the ones the
    forward drew (torch's rng-state replay of ops tagged nondeterministic_seeded), or the gradient would drop
    other elements than the output did."""
    from torch.utils.checkpoint import checkpoint

    from accel.runtime.nn.bias_dropout_add import PhiloxDropout

    drop = PhiloxDropout(0.5) if layer else (lambda t: F.dropout(t, 0.5, True))
    compiled = _compiled(lambda t: checkpoint(lambda u: drop(u * 3), t, use_reentrant=False))
    x = torch.ones(4096, requires_grad=True)
    out = compiled(x)
    out.sum().backward()
    kept = out != 0
    assert 0.45 < kept.float().mean().item() < 0.55
    torch.testing.assert_close(x.grad, kept.float() * 6.0)  # d(3 x / (1 - p))/dx where kept, 0 where dropped
