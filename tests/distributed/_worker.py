"""One rank of the distributed accelerate() tests, started by xlarun with two processes (gloo, CPU).

    python -m accel.launch --nproc_per_node=2 tests/distributed/_worker.py OUT_DIR MODE[,MODE...]

For each mode (one launch runs several: starting processes costs more than training), trains
tests/distributed/_model.TinyNet through accel.accelerate() and writes OUT_DIR/<MODE>.pt from rank 0:
the full (gathered) state dict, the communication counts and the sample ids every rank saw.
"""
import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import accel  # noqa: E402
from tests.distributed._model import Points, new_model, optimizer_for  # noqa: E402

MICRO = 4  # micro-batches per step in the accumulate modes
BATCH = 4  # per rank per micro-batch
STEPS = 3


def full_state(model):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.cpu() for k, v in state.items()}


def _count_calls(owner, name, counts):
    """Replace owner.<name> by a wrapper counting its calls; returns what puts the original back."""
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        counts["reductions"] += 1
        return original(*args, **kwargs)

    setattr(owner, name, counted)
    return lambda: setattr(owner, name, original)


def count_communication(model, counts):
    """Count gradient reductions: DDP through a comm hook, FSDP2 by wrapping the reduce-scatter it calls,
    xla by wrapping accel's all-reduce (done at the optimizer step, not in backward)."""
    inner = getattr(model, "_orig_mod", model)
    if next(model.parameters()).device.type == "xla":
        from accel.xla import collectives

        return _count_calls(collectives, "all_reduce", counts)
    if isinstance(inner, torch.nn.parallel.DistributedDataParallel):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def hook(state, bucket):
            counts["reductions"] += 1
            return allreduce_hook(state, bucket)

        inner.register_comm_hook(None, hook)
        return lambda: None
    return _count_calls(dist, "reduce_scatter_tensor", counts)


def run(out_dir, mode):
    backend = "xla" if mode.startswith("xla") else "cpu"
    config = accel.Config(backend=backend)
    config.compute.compile = mode.endswith("compiled")
    if mode.startswith("fsdp"):
        config.dist.fsdp.size = 2
        if "named" in mode:
            config.dist.fsdp.wrap_layer_cls = {"Block"}
    accumulating = "accumulate" in mode
    loader = DataLoader(Points(2 * BATCH * STEPS * MICRO), batch_size=BATCH, shuffle=False)
    model, loader = accel.accelerate(new_model(), loader, config)
    optimizer = optimizer_for(model)
    counts = {"reductions": 0}
    stop_counting = count_communication(model, counts)
    per_micro_batch, ids = [], []
    micro = MICRO if accumulating else 1
    for i, batch in enumerate(loader):
        if i == STEPS * micro:
            break
        ids.extend(batch.pop("id").cpu().tolist())
        before = counts["reductions"]
        with accel.accumulate(model, steps=micro):
            (model(**batch)["loss"] / micro).backward()
        per_micro_batch.append(counts["reductions"] - before)
        if (i + 1) % micro == 0:
            if mode == "xla_optimizer_step":  # TorchAcc's call: must not reduce a second time
                from accel.xla import optimizer_step

                optimizer_step(optimizer)
            else:
                optimizer.step()
            optimizer.zero_grad()
    stop_counting()
    total = counts["reductions"]
    epochs = []  # the shuffled loader: what each rank reads in two epochs
    shuffled = accel.accelerate(torch.nn.Linear(1, 1), DataLoader(Points(), batch_size=BATCH, shuffle=True),
                                accel.Config(backend=backend))[1]
    for _ in range(2):
        epochs.append([i for batch in shuffled for i in batch["id"].cpu().tolist()])
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"ids": ids, "per_micro_batch": per_micro_batch, "epochs": epochs, "reductions": total,
                                      "wrapper": type(getattr(model, "_orig_mod", model)).__name__})
    state = full_state(model)
    if dist.get_rank() == 0:
        torch.save({"state": state, "ranks": gathered}, os.path.join(out_dir, f"{mode}.pt"))
    dist.barrier()


if __name__ == "__main__":
    for mode in sys.argv[2].split(","):
        run(sys.argv[1], mode)
    dist.destroy_process_group()
