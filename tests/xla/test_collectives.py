"""all_reduce and the gradient helpers in one process (the 2-process run is test_distributed)."""
import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torch_xla", reason="torch_xla is not installed")

import accel.xla as xm  # noqa: E402
from accel.xla import collectives  # noqa: E402


@pytest.mark.parametrize("reduce_type", ["sum", "mul", "min", "max"])
def test_single_worker_returns_a_scaled_copy_of_a_tensor(reduce_type):
    dev = xm.xla_device()
    src = torch.tensor([1.0, -2.0, 3.5])
    t = src.to(dev)
    out = xm.all_reduce(reduce_type, t, scale=0.5)
    torch.testing.assert_close(out.cpu(), src * 0.5)
    torch.testing.assert_close(t.cpu(), src)  # a single tensor is not modified in place


@pytest.mark.parametrize("reduce_type", ["and", "or"])
def test_logical_reductions_of_one_worker_are_identity(reduce_type):
    flags = [torch.tensor([True, False, True])]
    assert xm.all_reduce(reduce_type, flags)[0].tolist() == [True, False, True]


def test_list_is_reduced_in_place_and_returned():
    dev = xm.xla_device()
    a, b = torch.ones(2, 3, device=dev), torch.arange(4.0)
    lst = [a, b]
    out = xm.all_reduce("sum", lst, scale=3.0)
    assert out is lst
    torch.testing.assert_close(a.cpu(), torch.full((2, 3), 3.0))
    torch.testing.assert_close(b, torch.arange(4.0) * 3)


def test_invalid_arguments_raise_value_error():
    t = torch.ones(2)
    with pytest.raises(ValueError, match="reduce_type"):
        xm.all_reduce("avg", t)
    with pytest.raises(ValueError, match="scale"):
        xm.all_reduce("sum", t, scale="2")
    with pytest.raises(ValueError, match="inputs"):
        xm.all_reduce("sum", [t, 3])
    with pytest.raises(ValueError, match="groups"):
        xm.all_reduce("sum", t, groups=[[0], [5]])
    with pytest.raises(ValueError, match="optimizer_args"):
        xm.optimizer_step(torch.optim.SGD([torch.nn.Parameter(t)], lr=1), optimizer_args=[1])
    with pytest.raises(ValueError, match="optimizer"):
        xm.fetch_gradients(object())


def test_warns_when_several_workers_run_without_a_process_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(collectives, "_warned_local_only", False)
    with pytest.warns(RuntimeWarning, match="init_process_group"):
        xm.all_reduce("sum", [torch.ones(1)])


def _model_and_grads(device):
    torch.manual_seed(3)
    model = torch.nn.Linear(4, 2)
    x, y = torch.randn(5, 4), torch.randn(5, 2)
    model = model.to(device)
    torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
    return model


def test_fetch_gradients_returns_the_parameters_grads():
    dev = xm.xla_device()
    model = _model_and_grads(dev)
    frozen = torch.nn.Parameter(torch.ones(1, device=dev))  # no grad: skipped
    opt = torch.optim.SGD([{"params": list(model.parameters())}, {"params": [frozen]}], lr=0.1)
    grads = xm._fetch_gradients(opt)
    assert [g is p.grad for g, p in zip(grads, model.parameters())] == [True, True]
    assert len(grads) == 2


def test_optimizer_step_matches_torch_optim_on_one_worker():
    dev = xm.xla_device()
    ref = _model_and_grads("cpu")
    torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9).step()
    model = _model_and_grads(dev)
    xm.optimizer_step(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), barrier=True)
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().cpu(), r.detach(), rtol=1e-5, atol=1e-6)


def test_optimizer_step_passes_optimizer_args():
    calls = []

    class Recording(torch.optim.SGD):
        def step(self, closure=None, **kwargs):
            calls.append(kwargs)
            return super().step(closure)

    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    xm.optimizer_step(Recording([p], lr=1.0), optimizer_args={"tag": 7})
    assert calls == [{"tag": 7}]
    assert p.tolist() == [0.0, 0.0]


@pytest.mark.filterwarnings("ignore:accel's 'xla' process group")
def test_xla_process_group_of_one_worker(tmp_path):
    # The host-staged group in this process: XLA tensors in place, CPU tensors directly.
    import accel.torch_xla.distributed.xla_backend as xb

    dev = xm.xla_device()
    dist.init_process_group("xla", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        assert isinstance(dist.group.WORLD, xb.HostStagedProcessGroup)
        assert dist.get_backend() == "xla"
        assert (xm.world_size(), xm.ordinal()) == (1, 0)
        t = torch.tensor([2.0, 5.0], device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        assert t.cpu().tolist() == [2.0, 5.0]
        out = torch.zeros(2, device=dev)
        dist.all_gather_into_tensor(out, torch.tensor([1.0, 2.0], device=dev))
        assert out.cpu().tolist() == [1.0, 2.0]
        c = torch.tensor([4.0])
        dist.broadcast(c, src=0)
        dist.barrier()
        assert c.tolist() == [4.0]
    finally:
        dist.destroy_process_group()
