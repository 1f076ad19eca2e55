"""SPMD data parallelism over 4 CPU devices equals eager training on the whole batch.

SPMD and CPU_NUM_DEVICES must be set before torch_xla starts, so the XLA side runs in a
subprocess (_spmd_worker.py); the eager reference runs here with plain torch.
"""
import os

import pytest
import torch

pytest.importorskip("torch_xla", reason="torch_xla is not installed")

from . import _spmd_case as case  # noqa: E402
from ._helpers import HERE, run_python  # noqa: E402


@pytest.fixture(scope="module")
def spmd_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("spmd") / "result.pt"
    run_python([os.path.join(HERE, "_spmd_worker.py"), str(out)], env_extra={"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"})
    return torch.load(out)


def _eager():
    model = case.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=case.LR)
    losses = [case.train_step(model, opt, x, y).item() for x, y in case.make_batches()]
    return model.state_dict(), losses


@pytest.mark.slow
def test_spmd_training_equals_eager(spmd_result):
    params, losses = _eager()
    assert spmd_result["mesh_devices"] == 4
    assert spmd_result["world_size"] == 1  # one process drives all devices
    assert all(s.startswith("{devices=[4,1]") for s in spmd_result["batch_shardings"])  # batch split on dim 0
    torch.testing.assert_close(torch.tensor(spmd_result["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    initial = case.make_model().state_dict()
    for name, want in params.items():
        assert not torch.equal(want, initial[name])  # training moved the weights
        torch.testing.assert_close(spmd_result["params"][name], want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_xla_process_group_refuses_spmd(spmd_result):
    assert "SPMD" in spmd_result["xla_group_refused"]
