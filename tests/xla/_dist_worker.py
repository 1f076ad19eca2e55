"""One worker of the 2-process test: collectives through the "xla" process group on CPU PJRT.

Usage: python -m accel.launch --nproc_per_node=2 ... _dist_worker.py OUT_DIR INIT_METHOD [full|quick]
Writes OUT_DIR/rank<r>.json; the test compares the ranks' results with each other and with
values it computes itself.
"""
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

import accel.torch_xla.core.xla_model as xm
import accel.torch_xla.distributed.xla_backend  # noqa: F401  (registers "xla")

out_dir, init_method, mode = sys.argv[1], sys.argv[2], sys.argv[3]
xm.set_rng_state(101)  # before init_process_group, as in the TorchAcc guide
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    dist.init_process_group("xla", init_method=init_method)
rank = dist.get_rank()
dev = xm.xla_device()
res = {
    "rank": rank,
    "backend_name": dist.get_backend(),
    "staging_warned": any("correctness, not speed" in str(w.message) for w in caught),
    "world_size": xm.world_size(),
    "xrt_world_size": xm.xrt_world_size(),
    "ordinal": xm.ordinal(),
    "local_ordinal": xm.local_ordinal(),
    "is_master": xm.is_master_ordinal(),
}

t = torch.tensor([rank + 1.0, 10.0 * (rank + 1)], device=dev)
dist.all_reduce(t)
res["all_reduce_sum"] = t.cpu().tolist()

if mode == "full":
    for name, op in [("max", dist.ReduceOp.MAX), ("min", dist.ReduceOp.MIN), ("product", dist.ReduceOp.PRODUCT)]:
        t = torch.tensor([rank + 2.0], device=dev)
        dist.all_reduce(t, op=op)
        res[f"all_reduce_{name}"] = t.cpu().tolist()
    t = torch.tensor([rank + 1.0], device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    res["all_reduce_avg"] = t.cpu().tolist()

    outs = [torch.zeros(2, device=dev) for _ in range(2)]
    dist.all_gather(outs, torch.tensor([rank, rank + 0.5], device=dev))
    res["all_gather"] = [o.cpu().tolist() for o in outs]
    out = torch.zeros(4, device=dev)
    dist.all_gather_into_tensor(out, torch.tensor([rank * 10.0, rank * 10.0 + 1], device=dev))
    res["all_gather_into_tensor"] = out.cpu().tolist()

    t = torch.tensor([rank * 7.0 + 1], device=dev)
    dist.broadcast(t, src=1)
    res["broadcast_from_1"] = t.cpu().tolist()

    out = torch.zeros(2, device=dev)
    dist.reduce_scatter_tensor(out, torch.arange(4.0, device=dev) * (rank + 1))
    res["reduce_scatter_tensor"] = out.cpu().tolist()

    out = torch.zeros(1, device=dev)
    dist.reduce_scatter(out, [torch.tensor([1.0 + rank], device=dev), torch.tensor([10.0 * (rank + 1)], device=dev)])
    res["reduce_scatter_list"] = out.cpu().tolist()
    objs = [None, None]
    dist.all_gather_object(objs, {"rank": rank})
    res["all_gather_object"] = objs

    # scatter / gather / all-to-all / point to point: XLA tensors through dist.<fn>.
    for src in (0, 1):
        out = torch.zeros(2, device=dev)
        chunks = [torch.tensor([src * 10.0 + i, -1.0], device=dev) for i in range(2)] if rank == src else None
        dist.scatter(out, chunks, src=src)
        res[f"scatter_from_{src}"] = out.cpu().tolist()
    gathered = [torch.zeros(2, device=dev) for _ in range(2)] if rank == 0 else None
    dist.gather(torch.tensor([rank * 10.0 + 1, rank * 10.0 + 2], device=dev), gathered, dst=0)
    res["gather_to_0"] = [g.cpu().tolist() for g in gathered] if gathered else None
    out = torch.zeros(4, device=dev)
    dist.all_to_all_single(out, torch.arange(4.0, device=dev) + 10 * rank)
    res["all_to_all_single_even"] = out.cpu().tolist()
    # Rows of 2: rank 0 keeps 1 row and sends 2 to rank 1; rank 1 sends all 3 to rank 0.
    in_splits, out_splits = [([1, 2], [1, 3]), ([3, 0], [2, 0])][rank]
    out = torch.zeros(sum(out_splits), 2, device=dev)
    dist.all_to_all_single(out, (torch.arange(6.0) + 10 * rank).reshape(3, 2).to(dev), out_splits, in_splits)
    res["all_to_all_single_uneven"] = out.cpu().tolist()
    outs = [torch.zeros(rank + 1, device=dev) for _ in range(2)]  # rank r gets r + 1 elements from each
    dist.all_to_all(outs, [torch.full((i + 1,), 10.0 * rank + i, device=dev) for i in range(2)])
    res["all_to_all"] = [o.cpu().tolist() for o in outs]

    if rank == 0:
        dist.send(torch.tensor([5.0, 6.0], device=dev), dst=1)
        dist.send(torch.tensor([7.0], device=dev), dst=1, tag=4)
    else:
        got = torch.zeros(2, device=dev)
        dist.recv(got, src=0)
        res["recv"] = got.cpu().tolist()
        got = torch.zeros(1, device=dev)
        res["recv_any_sender"] = dist.recv(got, tag=4)  # no src: any source, which recv returns
        res["recv_any"] = got.cpu().tolist()
    peer = 1 - rank
    got = torch.zeros(2, device=dev)
    # Both ranks post the receive first: only works if receives stay in flight.
    mine = torch.tensor([rank * 10.0, 1.0], device=dev)
    ops = [dist.P2POp(dist.irecv, got, peer), dist.P2POp(dist.isend, mine, peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    res["batch_isend_irecv"] = got.cpu().tolist()
    got = torch.zeros(1, device=dev)
    recv_work = dist.irecv(got, src=peer)
    dist.isend(torch.tensor([rank + 100.0], device=dev), dst=peer).wait()
    recv_work.wait()
    res["isend_irecv"] = got.cpu().tolist()

    # Object collectives: byte tensors on CPU by default, on XLA when asked (device=...).
    objs = [{"from": 0, "x": [1, 2]}, "second"] if rank == 0 else [None, None]
    dist.broadcast_object_list(objs, src=0)
    res["broadcast_object_list"] = objs
    objs = [rank * 3 + 1]
    dist.broadcast_object_list(objs, src=1, device=dev)
    res["broadcast_object_list_xla"] = objs
    gathered = [None, None] if rank == 0 else None
    dist.gather_object({"rank": rank, "sq": rank * rank}, gathered, dst=0)
    res["gather_object"] = gathered
    received = [None]
    dist.scatter_object_list(received, [{"to": i} for i in range(2)] if rank == 1 else None, src=1)
    res["scatter_object_list"] = received[0]

    c = torch.tensor([rank + 1.0])  # a CPU tensor through the same group
    dist.all_reduce(c)
    res["cpu_all_reduce"] = c.tolist()
    dist.barrier()

    # accel.xla.all_reduce: list in place with scale, single tensor returned, groups.
    a, b = torch.full((2,), rank + 1.0, device=dev), torch.tensor([3.0 * rank], device=dev)
    xm.all_reduce("sum", [a, b], scale=0.5)
    res["xm_all_reduce_list"] = [a.cpu().tolist(), b.cpu().tolist()]
    s = torch.tensor([rank + 1.0], device=dev)
    r = xm.all_reduce("max", s)
    res["xm_all_reduce_single"] = [r.cpu().tolist(), s.cpu().tolist()]
    for kind in ("mul", "min", "max"):
        res[f"xm_all_reduce_{kind}"] = xm.all_reduce(kind, torch.tensor([rank + 2.0, -rank], device=dev)).cpu().tolist()
    for kind in ("and", "or"):
        flags = [torch.tensor([True, rank == 0, False], device=dev)]
        res[f"xm_all_reduce_{kind}"] = xm.all_reduce(kind, flags)[0].cpu().tolist()
    g = xm.all_reduce("sum", torch.tensor([rank + 1.0], device=dev), groups=[[0], [1]])
    res["xm_all_reduce_own_group"] = g.cpu().tolist()

    # The guide's loop: same init everywhere, rank-specific data, gradients averaged.
    model = torch.nn.Linear(3, 2).to(dev)
    res["init_weight"] = model.weight.detach().cpu().tolist()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.arange(12.0).reshape(4, 3) * (rank + 1) / 10
    y = torch.ones(4, 2) * rank
    loss = torch.nn.functional.mse_loss(model(x.to(dev)), y.to(dev))
    loss.backward()
    res["local_grads"] = [p.grad.cpu().tolist() for p in model.parameters()]
    grads = xm._fetch_gradients(opt)
    xm.all_reduce("sum", grads, scale=1.0 / xm.xrt_world_size())
    res["reduced_grads"] = [gr.cpu().tolist() for gr in grads]
    res["loss"] = loss.item()

    # optimizer_step averages again (already equal, so unchanged) and steps.
    xm.optimizer_step(opt, barrier=True)
    res["after_step"] = [p.detach().cpu().tolist() for p in model.parameters()]

    res["rendezvous"] = [p.decode() for p in xm.rendezvous("check", f"hello{rank}".encode())]
    xm.save({"rank": rank, "w": model.weight}, os.path.join(out_dir, "ckpt.pt"))

    # An evaluation loader accelerate() shards over the xla group: 11 samples, 3 a batch, so one repeat; the
    # gathered indices are every sample once, in order.
    from torch.utils.data import DataLoader, TensorDataset

    import accel

    data = TensorDataset(torch.arange(11))
    _, loader = accel.accelerate(torch.nn.Linear(1, 1), DataLoader(data, batch_size=3), accel.Config(backend="xla"))
    gathered = []
    for (index,) in loader:
        gathered += accel.gather_for_metrics(index, loader).cpu().tolist()
    res["gather_for_metrics"] = gathered

dist.barrier()
tmp = os.path.join(out_dir, f".rank{rank}.json.tmp")
with open(tmp, "w") as f:
    json.dump(res, f)
os.replace(tmp, os.path.join(out_dir, f"rank{rank}.json"))
dist.destroy_process_group()
