"""gather_for_metrics: every rank's evaluation outputs of a batch, without the samples its sampler repeated.

HF Accelerate's `gather_for_metrics`, for the loader accelerate() returns:

    model, eval_loader = accel.accelerate(model, eval_loader, config)    # each rank reads its share
    for batch in eval_loader:
        with torch.no_grad():
            logits = model(**batch).logits
        preds, labels = accel.gather_for_metrics((logits.argmax(-1), batch["labels"]), eval_loader)
        metric.add_batch(predictions=preds, references=labels)           # every sample exactly once

With several ranks accelerate() reads a DataLoader through a DistributedSampler, which gives every rank as many
samples by repeating the first few after the last (N samples, W ranks: ceil(N / W) * W positions). Rank r reads
positions r, r + W, r + 2W, ...; so the batch the loop took k-th holds, on rank r, positions (kB + j)W + r for its
rows j (B: the batch size). The gather puts the ranks' rows in that order (the sampler's order: the dataset's
when it does not shuffle) and drops the positions >= N, the repeats. Tensors of other rows than the batch's
(a per-batch scalar) cannot be told apart by sample: give per-sample tensors ([batch, ...]).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from accel.data.sharding import ShardedBatchSampler
from accel.utils.batch import iter_tensors, map_tensors

__all__ = ["gather_for_metrics"]


def _sharding(loader):
    """(the ResumableLoader counting the loop's batches, the DistributedSampler of the rank's share) of a loader
    accelerate() returned, or (resumable, None) when it reads everything itself."""
    resumable = getattr(loader, "resumable", None)
    if resumable is None:
        raise ValueError(f"loader: expected the loader accel.accelerate() returned (it counts the batches the loop "
                         f"takes), got {type(loader).__name__}")
    inner = resumable.loader
    sampler = getattr(inner, "sampler", None)
    if isinstance(sampler, DistributedSampler):
        return resumable, sampler
    if isinstance(getattr(inner, "batch_sampler", None), ShardedBatchSampler):
        raise ValueError("loader: its batches come from a batch sampler of its own (buckets), which accelerate() "
                         "shards by whole batches and drops the tail not every rank would get; gather_for_metrics "
                         "needs a DataLoader with a batch_size (pad to buckets with dataloader.buckets instead)")
    return resumable, None


def gather_for_metrics(data, loader, pad_index=None):
    """Every rank's `data` for the batch the loop took last from `loader`, in the sampler's order, each sample
    once (see the module docstring).

    Args:
        data: a tensor, or tensors nested in lists, tuples and dicts, each with the batch's samples along dim 0
            ([B, ...]; the same shapes on every rank unless pad_index is given).
        loader: the evaluation loader accel.accelerate() returned.
        pad_index: where a tensor's other dimensions differ between ranks (per-token predictions of batches
            padded to their own longest sample), each rank's is padded at the end of those dimensions to the
            longest with this value (HF Accelerate's pad_across_processes; -100 for labels), then gathered.
            None: differing shapes are an error.

    Returns:
        `data`'s structure with each tensor [n, ...]: n = W * B, less the repeated samples on the pass's last
        batches. With one process, `data` itself.

    Raises:
        ValueError: loader is not one accelerate() returned, or shards by whole batches; a tensor whose dim 0 is
            not the batch's; shapes that differ between ranks without pad_index, or in their number of
            dimensions or rows (on every rank alike).
    """
    resumable, sampler = _sharding(loader)
    if sampler is None or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return data
    world, batch_size = dist.get_world_size(), resumable.loader.batch_size
    tensors = iter_tensors(data)
    rows = {t.shape[0] if t.dim() else None for t in tensors}
    if len(rows) != 1 or None in rows:
        raise ValueError(f"data: expected tensors with the batch's samples along dim 0, got shapes "
                         f"{[tuple(t.shape) for t in tensors]}")
    (rows,) = rows
    # One small gather of every shape first, so that ranks with different shapes all raise instead of hanging.
    device = tensors[0].device if dist.get_backend() != "gloo" else torch.device("cpu")
    shapes = torch.tensor([d for t in tensors for d in (t.dim(), *t.shape)], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(shapes) for _ in range(world)]
    dist.all_gather(everyone, shapes)
    if any(not torch.equal(other, shapes) for other in everyone):
        if pad_index is None or not _same_ranks_and_rows(everyone):
            raise ValueError("data: shapes differ between ranks (pass pad_index to pad the other dimensions to the "
                             "longest, or pad to one length, e.g. with dataloader.buckets); got "
                             + ", ".join(str(o.tolist()) for o in everyone))
        longest = _split_shapes(torch.stack(everyone).amax(0), tensors)
        data = map_tensors(data, lambda t: _pad_to(t, longest[id(t)], pad_index))
    first = (resumable.position - 1) * batch_size  # the rank's first sample of this batch in the pass
    keep = max(0, min(rows * world, len(sampler.dataset) - first * world)) if not sampler.drop_last else rows * world

    def gather(t: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous())
        # [W, B, ...] -> [B, W, ...]: row j of rank r is position (first + j) * W + r
        return torch.stack(parts, 1).flatten(0, 1)[:keep]

    return map_tensors(data, gather)


def _same_ranks_and_rows(everyone: list) -> bool:
    """Whether every rank's shape list has each tensor's rank and row count alike (only trailing sizes differ)."""
    first = everyone[0].tolist()
    for other in everyone[1:]:
        other, i = other.tolist(), 0
        while i < len(first):
            dims = first[i]
            if other[i] != dims or other[i + 1] != first[i + 1]:
                return False
            i += dims + 1
    return True


def _split_shapes(flat: torch.Tensor, tensors: list) -> dict:
    """{id(tensor): its longest shape over the ranks} from the flat (dim, *shape) list."""
    out, i, flat = {}, 0, flat.tolist()
    for t in tensors:
        out[id(t)] = flat[i + 1:i + 1 + t.dim()]
        i += t.dim() + 1
    return out


def _pad_to(t: torch.Tensor, shape: list, value) -> torch.Tensor:
    """t padded at the end of each dimension to `shape` with `value`."""
    pad = []
    for have, want in zip(reversed(t.shape), reversed(shape)):
        pad += [0, want - have]
    return torch.nn.functional.pad(t, pad, value=value) if any(pad) else t
