"""FSDP on the xla backend: accel.accelerate(backend='xla', dist.fsdp.size > 1) is torch_xla's FSDPv2 in SPMD
mode, one process over the 4 devices of the PJRT CPU client, and trains to the weights of eager training
on the CPU on the same full batches.

SPMD and CPU_NUM_DEVICES must be set before torch_xla starts, so the XLA side runs in a subprocess
(_fsdp_spmd_worker.py); the eager references run here with plain torch. On the CPU client this checks
correctness (sharding, numerics, wiring); the memory saving only exists on TPU.
"""
import os
import re

import pytest
import torch

pytest.importorskip("torch_xla", reason="torch_xla is not installed")

import accel  # noqa: E402
from tests.distributed._model import Points, new_model, optimizer_for  # noqa: E402

from . import _fsdp_spmd_worker as worker  # noqa: E402
from ._helpers import HERE, run_python  # noqa: E402

DEVICES = 4


@pytest.fixture(scope="module")
def spmd_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_spmd") / "result.pt"
    run_python([os.path.join(HERE, "_fsdp_spmd_worker.py"), str(out)],
               env_extra={"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(DEVICES)}, timeout=420)
    return torch.load(out, weights_only=False)


def _eager(batch_size: int, steps: int):
    """One process on the CPU, eager, over the same full batches (the first batch_size * steps samples)."""
    model = new_model()
    optimizer = optimizer_for(model)
    data = Points(64)
    losses = []
    for step in range(steps):
        chunk = slice(step * batch_size, (step + 1) * batch_size)
        loss = model(data.x[chunk], data.y[chunk])["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model.state_dict(), losses


def _assert_state_close(got, want):
    assert list(got) == list(want)  # the plain model's keys, in its order: no "_orig_module."
    initial = new_model().state_dict()
    for name, value in want.items():
        assert not torch.equal(value, initial[name])  # training moved every weight
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-5)


def _expected_spec(shape, mode: str) -> str:
    """torch_xla's sharding string for a parameter: FSDPv2 splits its largest dim over 'fsdp' (replicated
    over 'dp' for HSDP); accel keeps parameters smaller than the fsdp axis whole."""
    fsdp = 2 if mode.startswith("hsdp") else DEVICES
    if max(shape) < fsdp:
        return "{replicated}"
    tiles = [1] * len(shape)
    tiles[list(shape).index(max(shape))] = fsdp
    if mode == "hsdp":  # mesh [[0, 1], [2, 3]] (dp x fsdp): shard k lives on device k of each replica
        return "{devices=[%s,2]0,2,1,3 last_tile_dim_replicate}" % ",".join(map(str, tiles))
    if mode == "hsdp_strided":  # mesh [[0, 2], [1, 3]]: a shard group strides over the replicas
        return "{devices=[%s,2]0,1,2,3 last_tile_dim_replicate}" % ",".join(map(str, tiles))
    return "{devices=[%s]0,1,2,3}" % ",".join(map(str, tiles))


@pytest.mark.slow
def test_one_spmd_process_over_the_cpu_devices(spmd_run):
    assert spmd_run["is_spmd"] and spmd_run["device_count"] == DEVICES
    assert spmd_run["world_size"] == 1  # one process drives all 4 devices: no process group


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fsdp", "named", "hsdp", "hsdp_strided", "own_forward", "gc"])
def test_fsdp_training_equals_eager_on_the_full_batches(spmd_run, mode):
    got = spmd_run["modes"][mode]
    state, losses = _eager(worker.BATCH, worker.STEPS)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    _assert_state_close(got["state"], state)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fsdp", "named", "accumulate", "hsdp", "hsdp_strided", "own_forward", "gc"])
def test_parameters_are_sharded_over_the_fsdp_axis(spmd_run, mode):
    got = spmd_run["modes"][mode]
    shapes = {name: tuple(p.shape) for name, p in new_model().named_parameters()}
    assert got["param_specs"] == {name: _expected_spec(shape, mode) for name, shape in shapes.items()}
    assert sum(s.startswith("{devices=") for s in got["param_specs"].values()) == len(shapes) - 1  # all but head.bias [1]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fsdp", "named", "own_forward", "gc"])
def test_one_fsdpv2_unit_per_block_then_the_root(spmd_run, mode):
    # auto: accel's repeated blocks; named: dist.fsdp.wrap_layer_cls={"Block"} (with flatten_parameters=False,
    # which has no effect: FSDPv2 shards every parameter on its own)
    got = spmd_run["modes"][mode]
    assert got["wrapper"] == "SpmdFullyShardedDataParallel"
    assert got["wrapped"] == ["", "_orig_module.blocks.0", "_orig_module.blocks.1", "_orig_module.blocks.2"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fsdp", "hsdp", "hsdp_strided"])
def test_loader_batches_are_split_along_the_batch_dim_over_the_mesh(spmd_run, mode):
    order = "0,2,1,3" if mode == "hsdp_strided" else "0,1,2,3"  # dim 0 over ('dp', 'fsdp'), in mesh order
    assert spmd_run["modes"][mode]["batch_specs"] == {"x": f"{{devices=[4,1]{order}}}",
                                                      "y": f"{{devices=[4,1]{order}}}",
                                                      "id": f"{{devices=[4]{order}}}"}


@pytest.mark.slow
def test_accumulating_four_micro_batches_equals_one_4x_batch(spmd_run):
    got = spmd_run["modes"]["accumulate"]
    state, _ = _eager(worker.BATCH * worker.MICRO, worker.ACC_STEPS)
    _assert_state_close(got["state"], state)
    assert len(got["losses"]) == worker.MICRO * worker.ACC_STEPS


@pytest.mark.slow
def test_activation_checkpointing_of_the_wrapped_blocks(spmd_run):
    # memory.gc checkpoints the very blocks FSDPv2 wraps (the test above: same weights as eager)
    assert spmd_run["modes"]["gc"]["checkpointed"] == ["_orig_module.blocks.0._orig_module",
                                                       "_orig_module.blocks.1._orig_module",
                                                       "_orig_module.blocks.2._orig_module"]
    assert spmd_run["modes"]["fsdp"]["checkpointed"] == []


@pytest.mark.slow
def test_an_instance_forward_such_as_autocast_survives_the_wrapping(spmd_run):
    assert spmd_run["modes"]["own_forward"]["own_forward_calls"] == worker.STEPS


@pytest.mark.slow
def test_state_dict_keys_and_checkpoints_are_the_plain_models(spmd_run):
    trips = spmd_run["round_trips"]
    plain = list(new_model().state_dict())
    assert trips["keys"] == plain
    assert trips["load_missing"] == [] and trips["load_unexpected"] == []
    assert trips["loaded_equal"]  # load_state_dict of a plain CPU state dict into the sharded model
    assert trips["checkpoint_keys"] == sorted(plain)  # accel.save_state writes the plain keys
    assert trips["checkpoint_equal"]  # and accel.load_state reads them back into a new sharded model
    shapes = {name: tuple(p.shape) for name, p in new_model().named_parameters()}
    want = {name: _expected_spec(shape, "fsdp") for name, shape in shapes.items()}
    assert trips["specs_after_load"] == want and trips["specs_after_checkpoint"] == want  # still sharded
    assert trips["saved_model_equal"]  # accel.save_model gathers the sharded weights into model.safetensors


@pytest.mark.slow
@pytest.mark.parametrize("case,message", [
    ("fsdp_size", "dist.fsdp.size=3 does not divide the SPMD device count 4"),
    ("dp_size", r"dist.dp.size \* dist.fsdp.size = 3 \* 2 = 6, but the SPMD device count is 4"),
    ("wrap_layer_cls", "dist.fsdp.wrap_layer_cls: no module of the model has a class named in"),
    ("cpu_offload", "dist.fsdp.cpu_offload with backend='xla'"),
])
def test_config_errors_in_the_spmd_process(spmd_run, case, message):
    assert re.search(message, spmd_run["errors"][case])


# Checked before SPMD is switched on, so these run in the test process without touching the XLA runtime.
def test_cpu_offload_is_refused_before_anything_runs():
    config = accel.Config(backend="xla")
    config.dist.fsdp.size = 4
    config.dist.fsdp.cpu_offload = True
    with pytest.raises(ValueError, match=r"dist.fsdp.cpu_offload with backend='xla'.*no offload"):
        accel.accelerate(torch.nn.Linear(2, 2), config=config)


def test_several_launched_processes_are_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = accel.Config(backend="xla")
    config.dist.fsdp.size = 2
    with pytest.raises(ValueError, match=r"dist.fsdp.size > 1 with backend='xla' runs ONE process.*WORLD_SIZE=2"):
        accel.accelerate(torch.nn.Linear(2, 2), config=config)


def test_device_loader_input_sharding_is_checked():
    from accel.data import MpDeviceLoader

    with pytest.raises(ValueError, match="input_sharding needs an XLA device"):
        MpDeviceLoader([torch.zeros(2)], "cpu", input_sharding=object())
    with pytest.raises(ValueError, match="input_sharding must be an accel.xla.spmd.BatchSharding"):
        MpDeviceLoader([torch.zeros(2)], torch.device("xla", 0), input_sharding=object())
