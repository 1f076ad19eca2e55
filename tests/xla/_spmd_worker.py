"""SPMD worker: train the shared case on a batch split over CPU_NUM_DEVICES devices.

Usage: CPU_NUM_DEVICES=4 PJRT_DEVICE=CPU python _spmd_worker.py OUT.pt
Saves the final parameters, the losses, the mesh size and how the batch was sharded, for
the test to compare with eager training; also records that the "xla" group refuses SPMD.
"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _spmd_case as case  # noqa: E402

import accel.torch_xla.distributed.xla_backend  # noqa: E402,F401
import accel.xla as xm  # noqa: E402
from accel.xla import spmd  # noqa: E402

out_path = sys.argv[1]
mesh = spmd.data_parallel_mesh()  # before any XLA computation
device = xm.xla_device()
model = case.make_model().to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=case.LR)
losses, shardings = [], []
for x, y in case.make_batches():
    batch = spmd.shard_batch({"x": x, "y": y}, mesh)
    import torch_xla

    shardings.append(torch_xla._XLAC._get_xla_sharding_spec(batch["x"]))
    loss = case.train_step(model, optimizer, batch["x"], batch["y"])
    xm.sync()
    losses.append(loss.item())

refused = ""
try:
    dist.init_process_group("xla", init_method=f"file://{out_path}.store", rank=0, world_size=1)
except RuntimeError as exc:
    refused = str(exc)

torch.save(
    {
        "params": {k: v.cpu() for k, v in model.state_dict().items()},
        "losses": losses,
        "mesh_devices": int(mesh.size()),
        "world_size": xm.world_size(),
        "batch_shardings": shardings,
        "xla_group_refused": refused,
    },
    out_path,
)
