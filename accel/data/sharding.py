"""Give each rank of a data-parallel run its own part of a DataLoader's data.

`shard_loader(loader, rank, world_size)` returns a DataLoader with the same settings (batch size, collate_fn,
workers, pinning, ...) over a DistributedSampler, or, for a loader with its own batch sampler (e.g.
BucketBatchSampler), over every world_size-th batch of it. The samplers take set_epoch, so shuffling
differs per epoch and agrees across ranks: accelerate() wraps the result in accel.data.ResumableLoader,
which calls it at every pass.
"""
from __future__ import annotations

import warnings

from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, RandomSampler, Sampler


class ShardedBatchSampler(Sampler):
    """Every world_size-th batch of `batch_sampler`, starting at `rank`; the tail that not every rank
    would get is dropped, so all ranks run the same number of steps (a rank waiting in a collective for
    a step the others never take would hang)."""

    def __init__(self, batch_sampler, rank: int, world_size: int):
        self.batch_sampler = batch_sampler
        self.rank = rank
        self.world_size = world_size

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.batch_sampler, "set_epoch"):
            self.batch_sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.batch_sampler) // self.world_size

    def __iter__(self):
        batches = list(self.batch_sampler)
        usable = len(batches) // self.world_size * self.world_size
        return iter(batches[self.rank:usable:self.world_size])


def _loader_settings(loader: DataLoader) -> dict:
    settings = dict(num_workers=loader.num_workers, collate_fn=loader.collate_fn, pin_memory=loader.pin_memory,
                    timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
                    multiprocessing_context=loader.multiprocessing_context, generator=loader.generator,
                    prefetch_factor=loader.prefetch_factor, persistent_workers=loader.persistent_workers)
    if getattr(loader, "pin_memory_device", ""):
        settings["pin_memory_device"] = loader.pin_memory_device
    if hasattr(loader, "in_order"):  # torch >= 2.6
        settings["in_order"] = loader.in_order
    return settings


def _already_sharded(loader: DataLoader) -> bool:
    samplers = (loader.sampler, getattr(loader.batch_sampler, "sampler", None), loader.batch_sampler)
    return any(isinstance(s, (DistributedSampler, ShardedBatchSampler)) for s in samplers)


def shard_loader(loader, rank: int, world_size: int):
    """The part of `loader` that rank `rank` of `world_size` reads (see the module docstring). Loaders that
    cannot be split (not a DataLoader, an IterableDataset) come back unchanged with a warning: the
    dataset then has to shard itself."""
    if world_size <= 1:
        return loader
    if isinstance(loader, DataLoader) and _already_sharded(loader):
        return loader
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        warnings.warn(f"accelerate(): the {type(loader).__name__} given cannot be split across the {world_size} "
                      "ranks (only a torch DataLoader over a map-style dataset can): every rank reads all of it "
                      "unless the dataset shards itself", stacklevel=3)
        return loader
    settings = _loader_settings(loader)
    if type(loader.batch_sampler) is BatchSampler:
        sampler = DistributedSampler(loader.dataset, num_replicas=world_size, rank=rank,
                                     shuffle=isinstance(loader.sampler, RandomSampler), drop_last=loader.drop_last)
        sharded = DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=sampler,
                             drop_last=loader.drop_last, **settings)
    elif loader.batch_sampler is not None:
        sharded = DataLoader(loader.dataset, batch_sampler=ShardedBatchSampler(loader.batch_sampler, rank, world_size),
                             **settings)
    else:  # batch_size=None: the loader yields samples one by one
        sampler = DistributedSampler(loader.dataset, num_replicas=world_size, rank=rank,
                                     shuffle=isinstance(loader.sampler, RandomSampler))
        sharded = DataLoader(loader.dataset, batch_size=None, sampler=sampler, **settings)
    return sharded
