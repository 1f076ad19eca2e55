"""Without torch_xla: every module imports; XLA calls say to install accel[xla]; the rest runs."""
import json

from ._helpers import run_python

SCRIPT = r"""
import json, sys, importlib, pkgutil
sys.modules["torch_xla"] = None  # any "import torch_xla" now raises ImportError
import torch
import torch.distributed as dist
import accel.xla, accel.torch_xla

imported = []
for pkg in (accel.xla, accel.torch_xla):
    imported.append(pkg.__name__)
    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        importlib.import_module(info.name)
        imported.append(info.name)

import accel.torch_xla.core.xla_model as xm
from accel.xla import spmd

errors = {}
for name, call in {
    "xla_device": xm.xla_device,
    "metrics": xm.metrics,
    "get_rng_state": xm.get_rng_state,
    "data_parallel_mesh": spmd.data_parallel_mesh,
    "init_process_group": lambda: dist.init_process_group(
        "xla", init_method="file://" + sys.argv[1], rank=0, world_size=1),
}.items():
    try:
        call()
        errors[name] = None
    except RuntimeError as exc:
        errors[name] = str(exc)

t = [torch.tensor([1.0, 2.0])]
xm.all_reduce("sum", t, scale=2.0)
seen = []
xm.add_step_closure(seen.append, args=("ran",))
xm.sync()
xm.set_rng_state(11)
a = torch.rand(3)
torch.manual_seed(11)
print(json.dumps({
    "imported": imported,
    "errors": errors,
    "world": [xm.world_size(), xm.xrt_world_size(), xm.ordinal(), xm.local_ordinal(), xm.is_master_ordinal()],
    "all_reduce": t[0].tolist(),
    "closure": seen,
    "seeded": torch.equal(a, torch.rand(3)),
}))
"""


def test_everything_imports_and_explains_itself_without_torch_xla(tmp_path):
    proc = run_python(["-c", SCRIPT, str(tmp_path / "store")], timeout=120)
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    for mod in (
        "accel.xla.backend",
        "accel.xla.spmd",
        "accel.xla.collectives",
        "accel.torch_xla.core.xla_model",
        "accel.torch_xla.distributed.xla_backend",
        "accel.torch_xla.distributed.parallel_loader",
        "accel.torch_xla.amp",
    ):
        assert mod in res["imported"]
    for name, message in res["errors"].items():
        assert message is not None, f"{name} did not raise"
        assert "accel[xla]" in message, f"{name}: {message}"
    assert res["world"] == [1, 1, 0, 0, True]
    assert res["all_reduce"] == [2.0, 4.0]  # one worker: only the scale applies
    assert res["closure"] == ["ran"]
    assert res["seeded"]  # set_rng_state still seeds torch
