"""One rank of the distributed accelerate() tests, started by xlarun (gloo, CPU).

    python -m accel.launch --nproc_per_node=WORLD tests/distributed/_worker.py OUT_DIR MODE[,MODE...]

For each mode (one launch runs several: starting processes costs more than training), trains
tests/distributed/_model.TinyNet through accel.accelerate() and writes OUT_DIR/<MODE>.pt from rank 0:
the full (gathered) state dict, the communication counts and the sample ids every rank saw; and, through
accel.save_model, OUT_DIR/<MODE>_model/model.safetensors.

A mode is a name made of parts: ddp / fsdp (dist.fsdp.size=2) / hsdp (dist.dp.size=2 x dist.fsdp.size=2,
four ranks), then any of: compiled, named (wrap_layer_cls), accumulate (MICRO micro-batches per step),
offload (dist.fsdp.cpu_offload), scaler (accel.amp.GradScaler + accel.amp.syncfree.AdamW, with an inf put into
one gradient element of the last rank only, after the gradients are reduced, at step INF_STEP).
"""
import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import accel  # noqa: E402
from accel import distributed  # noqa: E402
from tests.distributed._model import Points, inject_inf, new_model, optimizer_for  # noqa: E402

MICRO = 4  # micro-batches per step in the accumulate modes
BATCH = 4  # per rank per micro-batch
STEPS = 3
INF_STEP = 1  # the optimizer step whose gradients overflow on the last rank in the scaler modes


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
    # FSDP2 calls dist.reduce_scatter_single from torch 2.13 on (reduce_scatter_tensor, before; it is now a
    # deprecated alias of reduce_scatter_single)
    return _count_calls(dist, "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single")
                        else "reduce_scatter_tensor", counts)


def fsdp_layout(model):
    """What FSDP2 recorded on each unit (offload policy) and on each parameter (DTensor placements, mesh)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    units = {}
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            group = fully_shard.state(module)._fsdp_param_group
            units[name] = {"offload_policy": type(group.offload_policy).__name__,
                           "pin_memory": getattr(group.offload_policy, "pin_memory", None),
                           "offload_to_cpu": [p.offload_to_cpu for p in group.fsdp_params],
                           "shard_devices": [p._sharded_param_data.device.type for p in group.fsdp_params]}
    params = {name: {"placements": str(tuple(p.placements)), "mesh": p.device_mesh.mesh.tolist(),
                     "mesh_dim_names": p.device_mesh.mesh_dim_names}
              for name, p in model.named_parameters()}
    return {"units": units, "params": params}


def run(out_dir, mode):
    backend = "xla" if mode.startswith("xla") else "cpu"
    world = int(os.environ["WORLD_SIZE"])
    config = accel.Config(backend=backend)
    config.compute.compile = mode.endswith("compiled")
    if mode.startswith("fsdp"):
        config.dist.fsdp.size = 2
        if "named" in mode:
            config.dist.fsdp.wrap_layer_cls = {"Block"}
    if mode.startswith("hsdp"):
        config.dist.dp.size, config.dist.fsdp.size = 2, 2
    config.dist.fsdp.cpu_offload = "offload" in mode
    accumulating = "accumulate" in mode
    scaling = "scaler" in mode
    loader = DataLoader(Points(world * BATCH * STEPS * MICRO), batch_size=BATCH, shuffle=False)
    model, loader = accel.accelerate(new_model(), loader, config)
    optimizer = optimizer_for(model, syncfree=scaling)
    scaler = accel.amp.GradScaler("cpu") if scaling else None
    counts = {"reductions": 0}
    stop_counting = count_communication(model, counts)
    per_micro_batch, ids, scales = [], [], []
    micro = MICRO if accumulating else 1
    for i, batch in enumerate(loader):
        if i == STEPS * micro:
            break
        ids.extend(batch.pop("id").cpu().tolist())
        before = counts["reductions"]
        with accel.accumulate(model, steps=micro):
            loss = model(**batch)["loss"] / micro
            (scaler.scale(loss) if scaling else loss).backward()
        per_micro_batch.append(counts["reductions"] - before)
        if (i + 1) % micro == 0:
            if scaling:
                if i // micro == INF_STEP and dist.get_rank() == world - 1:
                    inject_inf(model)
                scaler.step(optimizer)
                scaler.update()
                scales.append(scaler.get_scale())
            elif mode == "xla_optimizer_step":  # TorchAcc's call: must not reduce a second time
                from accel.xla import optimizer_step

                optimizer_step(optimizer)
            else:
                optimizer.step()
            optimizer.zero_grad()
    stop_counting()
    total = counts["reductions"]
    inner = getattr(model, "_orig_mod", model)
    layout = fsdp_layout(inner) if mode.startswith(("fsdp", "hsdp")) else None
    # Each rank's own weights: DDP's full copies (they must stay equal), FSDP's local shards (HSDP: equal
    # within a replicate group).
    local = [(p.to_local() if layout else p).detach().cpu().clone() for p in model.parameters()]
    epochs = []  # the shuffled loader: what each rank reads in two epochs
    shuffled = accel.accelerate(torch.nn.Linear(1, 1), DataLoader(Points(), batch_size=BATCH, shuffle=True),
                                accel.Config(backend=backend))[1]
    for _ in range(2):
        epochs.append([i for batch in shuffled for i in batch["id"].cpu().tolist()])
    agree = [distributed.all_ranks_agree(True), distributed.all_ranks_agree(dist.get_rank() == 0)]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"agree": agree, "ids": ids, "per_micro_batch": per_micro_batch, "epochs": epochs, "reductions": total,
                                      "wrapper": type(inner).__name__, "layout": layout,
                                      "scales": scales, "local": local})
    state = full_state(model)
    accel.save_model(model, os.path.join(out_dir, f"{mode}_model"))  # every rank calls it; rank 0 writes
    if dist.get_rank() == 0:
        torch.save({"state": state, "ranks": gathered}, os.path.join(out_dir, f"{mode}.pt"))
    dist.barrier()


if __name__ == "__main__":
    for mode in sys.argv[2].split(","):
        run(sys.argv[1], mode)
    dist.destroy_process_group()
