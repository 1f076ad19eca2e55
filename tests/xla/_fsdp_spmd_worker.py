"""FSDP on the xla backend (torch_xla SPMD, FSDPv2): train tests/distributed/_model.TinyNet through
accel.accelerate(backend='xla', dist.fsdp.size > 1) in ONE process over the CPU_NUM_DEVICES devices of the
PJRT CPU client, and record what the test compares with eager training on the CPU.

Usage: PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 python tests/xla/_fsdp_spmd_worker.py OUT.pt

SPMD must be on before any XLA computation, which is why this runs in a process of its own. Modes (one
process runs them all: starting torch_xla costs more than training):
- fsdp: dist.fsdp.size=4, units per repeated block (found by accel), STEPS steps of BATCH samples;
- named: the same with dist.fsdp.wrap_layer_cls={"Block"} and dist.fsdp.flatten_parameters=False;
- accumulate: dist.fsdp.size=4, MICRO micro-batches of BATCH per optimizer step under accel.accumulate;
- hsdp / hsdp_strided: dist.dp.size=2 x dist.fsdp.size=2, topology ['dp', 'fsdp'] / ['fsdp', 'dp'];
- own_forward: a model with an instance `forward` (what accelerate()'s autocast sets) still wraps and runs;
- gc: with memory.gc (accel's activation checkpointing of the blocks FSDPv2 then wraps).
Then: state_dict / load_state_dict / accel.save_state round trips, accel.save_model, and the config errors.
"""
import os
import sys
import tempfile

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import accel  # noqa: E402
from tests.distributed._model import Points, new_model, optimizer_for  # noqa: E402

STEPS = 3
BATCH = 8  # the global batch: one process reads it whole and splits it over the devices
MICRO = 4
ACC_STEPS = 2


def spec(t) -> str:
    import torch_xla

    return torch_xla._XLAC._get_xla_sharding_spec(t)


def config_for(mode: str) -> accel.Config:
    config = accel.Config(backend="xla")
    config.dist.fsdp.size = 4
    if mode == "named":
        config.dist.fsdp.wrap_layer_cls = {"Block"}
        config.dist.fsdp.flatten_parameters = False
    if mode.startswith("hsdp"):
        config.dist.dp.size, config.dist.fsdp.size = 2, 2
    if mode == "hsdp_strided":
        config.dist.topology = ["fsdp", "dp"]
    config.memory.gc = mode == "gc"
    return config


class OwnForward:
    """An instance forward (as accelerate()'s autocast sets one): counts its calls."""

    def __init__(self, module):
        self.module = module
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return type(self.module).forward(self.module, *args, **kwargs)


def train(mode: str) -> dict:
    from accel.xla import fsdp as xla_fsdp

    model = new_model()
    own = None
    if mode == "own_forward":
        own = OwnForward(model)
        object.__setattr__(model, "forward", own)
    micro = MICRO if mode == "accumulate" else 1
    steps = ACC_STEPS if mode == "accumulate" else STEPS
    loader = DataLoader(Points(64), batch_size=BATCH, shuffle=False)
    model, loader = accel.accelerate(model, loader, config_for(mode))
    optimizer = optimizer_for(model)
    wrapped = [name for name, m in model.named_modules() if xla_fsdp.is_fully_sharded(m)]
    losses, batch_specs = [], None
    for i, batch in enumerate(loader):
        if i == steps * micro:
            break
        if batch_specs is None:
            batch_specs = {k: spec(v) for k, v in batch.items()}
        batch.pop("id")
        with accel.accumulate(model, steps=micro):
            loss = model(**batch)["loss"] / micro
            loss.backward()
        if (i + 1) % micro == 0:
            optimizer.step()
            optimizer.zero_grad()
        accel.xla.sync()
        losses.append(loss.item() * micro)
    return {"state": {k: v.cpu() for k, v in model.state_dict().items()}, "losses": losses,
            "param_specs": xla_fsdp.parameter_shardings(model), "batch_specs": batch_specs,
            "wrapped": wrapped, "wrapper": type(model).__name__, "own_forward_calls": own.calls if own else None,
            "checkpointed": sorted(n for n, m in model.named_modules() if hasattr(type(m), "_accel_ckpt_base")),
            "model": model}


def round_trips(model) -> dict:
    """state_dict keys, load_state_dict into the sharded model, accel.save_state / load_state."""
    from accel.xla import fsdp as xla_fsdp

    out = {"keys": list(model.state_dict().keys())}
    trained = {k: v.cpu() for k, v in model.state_dict().items()}
    fresh = new_model().state_dict()
    result = model.load_state_dict(fresh)
    out["load_missing"], out["load_unexpected"] = list(result.missing_keys), list(result.unexpected_keys)
    out["loaded_equal"] = all(torch.equal(model.state_dict()[k].cpu(), v) for k, v in fresh.items())
    out["specs_after_load"] = xla_fsdp.parameter_shardings(model)
    with torch.no_grad():  # back to the trained weights, then through a checkpoint file
        model.load_state_dict(trained)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt.pt")
        accel.save_state(path, model)
        out["checkpoint_keys"] = sorted(torch.load(path, weights_only=True)["model"].keys())
        other = accel.accelerate(new_model(), config=config_for("fsdp"))
        accel.load_state(path, other)
        out["checkpoint_equal"] = all(torch.equal(other.state_dict()[k].cpu(), v) for k, v in trained.items())
        out["specs_after_checkpoint"] = xla_fsdp.parameter_shardings(other)
        accel.save_model(model, os.path.join(tmp, "out"))  # the sharded weights gathered into one file
        from safetensors.torch import load_file

        saved = load_file(os.path.join(tmp, "out", "model.safetensors"))
        out["saved_model_equal"] = set(saved) == set(trained) and all(torch.equal(saved[k], v)
                                                                        for k, v in trained.items())
    return out


def errors() -> dict:
    cases = {}

    def record(name, config, model=None):
        try:
            accel.accelerate(model if model is not None else new_model(), config=config)
        except ValueError as exc:
            cases[name] = str(exc)
        else:
            cases[name] = "no error"

    config = accel.Config(backend="xla")
    config.dist.fsdp.size = 3
    record("fsdp_size", config)
    config = accel.Config(backend="xla")
    config.dist.dp.size, config.dist.fsdp.size = 3, 2
    record("dp_size", config)
    config = accel.Config(backend="xla")
    config.dist.fsdp.size = 4
    config.dist.fsdp.wrap_layer_cls = {"NoSuchBlock"}
    record("wrap_layer_cls", config)
    config = accel.Config(backend="xla")
    config.dist.fsdp.size = 4
    config.dist.fsdp.cpu_offload = True
    record("cpu_offload", config)
    return cases


def main(out_path: str) -> None:
    import accel.xla as xm
    from accel.xla import spmd

    results = {}
    for mode in ("fsdp", "named", "accumulate", "hsdp", "hsdp_strided", "own_forward", "gc"):
        results[mode] = train(mode)
    trips = round_trips(results["fsdp"]["model"])
    for result in results.values():
        del result["model"]
    torch.save({"modes": results, "round_trips": trips, "errors": errors(), "device_count": spmd.device_count(),
                "is_spmd": spmd.is_spmd(), "world_size": xm.world_size()}, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
