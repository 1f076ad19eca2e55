"""accel.compiler.optimizer's compiled steps under a schedule: a scheduler's new float lr each step no longer
compiles the step anew (the lr reaches the compiled step as a tensor; the groups keep their floats), another
hyperparameter that changes (OneCycleLR's momentum) makes the step run uncompiled from then on with a warning,
and the weights follow the same optimizer and schedule run eagerly, without accelerate()."""
import copy

import pytest
import torch
from torch import nn

import accel
from accel.amp import syncfree
from accel.compiler.optimizer import has_compiled_step
from accel.config import Config

OPTIMIZERS = {
    "SGD momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "SGD tensor lr": lambda params: torch.optim.SGD(params, lr=torch.tensor(0.05), momentum=0.9),
    "Adam loop": lambda params: torch.optim.Adam(params, lr=1e-2, fused=False),
    "RMSprop": lambda params: torch.optim.RMSprop(params, lr=1e-2),
    "sync-free AdamW": lambda params: syncfree.AdamW(params, lr=1e-2),
    "Adagrad": lambda params: torch.optim.Adagrad(params, lr=1e-1),
}


def warm_up(opt):  # transformers' linear warm-up then decay, as a LambdaLR: a new lr every step
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min((step + 1) / 3, max(0.0, (10 - step) / 7)))


# On CUDA the compiled step takes the lr tensor on the device (and Dynamo makes the step capturable)
DEVICES = pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device: the compiled step over CUDA parameters"))])


def _pair(make_optimizer, device="cpu"):
    torch._dynamo.reset()
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).to(device)
    model = copy.deepcopy(ref)
    config = Config(backend=device)
    config.compute.bf16 = False  # the reference runs in fp32
    accel.accelerate(model, config=config)
    return (model, make_optimizer(model.parameters())), (ref, make_optimizer(ref.parameters()))


def _train(pairs, make_scheduler, steps, after_step=None):
    import warnings

    schedulers = [make_scheduler(opt) for _, opt in pairs]
    # torch's schedulers warn when the step they wrap is replaced or not wrapped: accel's compiled step is not
    warnings.filterwarnings("error", message="Seems like `optimizer.step\\(\\)` has been overridden")
    warnings.filterwarnings("error", message="Detected call of `lr_scheduler.step\\(\\)` before")
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        x = torch.randn(4, 8, generator=g).to(next(pairs[0][0].parameters()).device)
        for (model, opt), scheduler in zip(pairs, schedulers):
            model(x).square().mean().backward()
            opt.step()
            scheduler.step()
            opt.zero_grad()
        if after_step:
            after_step(step)


@DEVICES
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_scheduled_lr_compiles_the_step_once_and_trains_like_eager(name, device):
    from torch._dynamo.utils import counters

    (model, opt), (ref, ref_opt) = _pair(OPTIMIZERS[name], device)
    graphs = {}

    def count(step):
        graphs[step] = counters["stats"]["unique_graphs"]
        assert not isinstance(opt.param_groups[0]["lr"], torch.Tensor) or name == "SGD tensor lr"
        torch.testing.assert_close(torch.as_tensor(opt.param_groups[0]["lr"]),
                                   torch.as_tensor(ref_opt.param_groups[0]["lr"]))

    _train([(model, opt), (ref, ref_opt)], warm_up, 8, count)
    assert has_compiled_step(opt)
    assert graphs[7] == graphs[2], f"the step compiled again after its first compiled call: {graphs}"
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def _one_cycle(opt):
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=8)


@pytest.mark.parametrize("make_optimizer, make_scheduler, changed", [
    (lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9), _one_cycle, "SGD's momentum"),
    # torch's Adam takes no tensor lr with foreach=True and capturable=False: the lr stays a float
    (lambda params: torch.optim.AdamW(params, lr=1e-2, foreach=True), warm_up, "AdamW's lr"),
], ids=["cycled momentum", "adam foreach lr"])
def test_a_changing_hyperparameter_runs_the_step_uncompiled_from_then_on_and_says_so(make_optimizer,
                                                                                      make_scheduler, changed):
    (model, opt), (ref, ref_opt) = _pair(make_optimizer)
    with pytest.warns(UserWarning, match=rf"{changed} changed between steps: .* runs uncompiled"):
        _train([(model, opt), (ref, ref_opt)], make_scheduler, 6)
    assert opt.step.uncompiled_since_change
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_a_scheduler_built_after_the_step_was_compiled():
    """torch's schedulers wrap optimizer.step's function when built: a step accel had replaced already broke
    that (no __func__); it now counts as wrapped, and the schedule reaches the compiled step."""
    (model, opt), (ref, ref_opt) = _pair(lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9))
    _train([(model, opt), (ref, ref_opt)], lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1.0), 2)
    assert has_compiled_step(opt)
    _train([(model, opt), (ref, ref_opt)], warm_up, 4)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
