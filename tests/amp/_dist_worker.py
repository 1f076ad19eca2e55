"""Worker for test_distributed_found_inf: one gloo process per replica (no torch_xla import)."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist


def run(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    from accel.amp import GradScaler, syncfree

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        opt = syncfree.SGD(model.parameters(), lr=0.1)
        plain = torch.nn.Linear(3, 2)
        plain.load_state_dict(model.state_dict())
        plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
        scaler = GradScaler(init_scale=8.0)
        x = torch.full((2, 3), float(rank + 1))
        weights, scales = [], []
        for step in range(3):
            # Only rank 0 overflows, and only at step 1: every replica must skip that step.
            blow_up = float("inf") if (step == 1 and rank == 0) else 1.0
            for m, o in ((model, opt), (plain, plain_opt)):
                o.zero_grad()
                scaler.scale(m(x).sum() * blow_up).backward()
                scaler.step(o)
            scaler.update()
            scales.append(scaler.get_scale())
            weights.append(torch.cat([model.weight.detach().flatten(), plain.weight.detach().flatten()]))
        torch.save({"scales": scales, "weights": torch.stack(weights)}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
