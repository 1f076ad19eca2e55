"""ResumableLoader: a DataLoader that knows its epoch and position, so a run stopped mid-epoch resumes
with the very batches it would have seen.

    loader = accel.data.ResumableLoader(DataLoader(dataset, batch_size=32, shuffle=True))
    extra = accel.load_state("ckpt.pt", model, optimizer, dataloader=loader)   # on restart
    for epoch in range(extra.get("epoch", 0), epochs):
        loader.set_epoch(epoch)
        for batch in loader:                      # after a load: the rest of the interrupted pass
            ...
        accel.save_state("ckpt.pt", model, optimizer, dataloader=loader, epoch=epoch + 1)

How a pass is resumed:
- The position is the number of batches handed out in the current pass (a batch counts as consumed once
  the loop has it: save after the step that used it).
- The interrupted pass is re-created with the same order: a sampler that shuffles draws its seed from the
  global RNGs (torch's RandomSampler: torch's generator, as does the DataLoader's worker base seed) or from
  a generator it holds, when the pass starts. The host RNG states (torch, python, numpy) and the loader's
  own generators are recorded at every pass start; the resumed pass is started with them replayed, and the
  RNG states of the moment are put back right after, so the training loop's random stream is untouched.
  Samplers that derive the order from seed + epoch (DistributedSampler, BucketBatchSampler) need no replay
  but get it all the same.
- The consumed batches are skipped at the index level: the resumed pass runs on a shallow copy of the
  DataLoader whose batch sampler yields the original's batches less the first `position`, so their data
  is never read.

Bit-identical on CPU for num_workers=0, and for num_workers>0 (persistent_workers too) when the dataset
and collate_fn draw no random numbers: the batch order and the training loop's RNG streams are reproduced,
but not the RNG streams inside worker processes. Batch i of the resumed pass goes to worker
i % num_workers, each worker's RNG has advanced over fewer batches than in the uninterrupted pass, and
persistent workers started after a resume are seeded afresh, so random augmentation inside workers differs
after a resume.

Epochs: set_epoch(e) announces the epoch of the next pass; a pass not announced is the one after the
previous (the first: 0), and the loader's samplers that take set_epoch (DistributedSampler) get it.

len() is the full pass's length, also for a resumed pass (iterate it to see how many remain).
"""
from __future__ import annotations

import copy
import operator
import warnings
from typing import Optional

import torch
from torch.utils.data import DataLoader, IterableDataset

from accel.utils.loader import LoaderWrapper
from accel.utils.rng import host_rng_state, set_host_rng_state

__all__ = ["ResumableLoader"]

_STATE_VERSION = 1


# ---------------------------------------------------------------- the resumed pass
class _SkipIterator:
    """The first `count` items of `iterator` are dropped, on the first next() or on prime()."""

    def __init__(self, iterator, count: int):
        self._iterator = iterator
        self._left = count

    def prime(self) -> None:
        while self._left > 0:
            self._left -= 1
            try:
                next(self._iterator)
            except StopIteration:
                self._left = 0
                return

    def __iter__(self):
        return self

    def __next__(self):
        self.prime()
        return next(self._iterator)


class _SkipFirst:
    """Stands in for a DataLoader's batch sampler (or sampler) for one resumed pass."""

    def __init__(self, sampler, count: int):
        self.sampler = sampler
        self.count = count
        self.latest: Optional[_SkipIterator] = None

    def __iter__(self):
        # iter() of the original now, as the DataLoader iterator does at this point of the uninterrupted
        # pass: a sampler drawing its seed eagerly in __iter__ draws it at the same point of the RNG stream.
        self.latest = _SkipIterator(iter(self.sampler), self.count)
        return self.latest

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self.count)


def _loader_generators(loader: DataLoader) -> list:
    """The torch.Generators the loader and its samplers own (in a fixed order), deduplicated."""
    batch_sampler = loader.batch_sampler
    holders = (loader, loader.sampler, batch_sampler, getattr(batch_sampler, "sampler", None))
    found: list = []
    for holder in holders:
        generator = getattr(holder, "generator", None) if holder is not None else None
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
            found.append(generator)
    return found


def _clone_skipping(loader: DataLoader, count: int) -> tuple[DataLoader, _SkipFirst]:
    """A shallow copy of `loader` whose passes skip the first `count` batches without reading them."""
    clone = copy.copy(loader)  # keeps the subclass, dataset, collate_fn, workers, generator: all shared
    attrs = clone.__dict__  # DataLoader refuses to set its samplers once built; the copy is ours alone
    attrs["_iterator"] = None
    attrs["persistent_workers"] = False  # one pass only: do not keep its workers alive
    name = "batch_sampler" if loader.batch_sampler is not None else "sampler"
    skipping = _SkipFirst(getattr(loader, name), count)
    attrs[name] = skipping
    return clone, skipping


class _Pass:
    """The iterator of one pass; counts the batches it hands out unless an outer wrapper counts them."""

    def __init__(self, owner: "ResumableLoader", iterator, pass_id: int):
        self._owner = owner
        self._iterator = iterator
        self._pass_id = pass_id

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return operator.length_hint(self._iterator)

    def __next__(self):
        owner = self._owner
        counting = not owner._counted_outside and owner._pass_id == self._pass_id
        try:
            batch = next(self._iterator)
        except StopIteration:
            if counting:
                owner._in_pass = False
            raise
        if counting:
            owner._position += 1
        return batch


def _keeps_own_state(loader) -> bool:
    # On the type: accel's wrappers read unknown attributes through to the loader they wrap.
    return callable(getattr(type(loader), "state_dict", None)) and callable(getattr(type(loader), "load_state_dict",
                                                                                   None))


def _persistent(loader: DataLoader) -> bool:
    return loader.num_workers > 0 and bool(loader.persistent_workers)


def _workers_alive(loader: DataLoader) -> bool:
    """Whether a persistent-workers DataLoader has its iterator (and workers) already: its next pass reuses
    them and draws no new worker base seed."""
    return _persistent(loader) and loader.__dict__.get("_iterator") is not None


def _iter_without_base_seed(loader: DataLoader):
    """iter(loader), with the worker base seed drawn from a scratch generator instead of the loader's (or the
    global) one: for passes the uninterrupted run made with workers it had started earlier."""
    own = loader.generator
    loader.generator = torch.Generator()  # samplers keep their own reference to the loader's generator
    try:
        return iter(loader)
    finally:
        loader.generator = own


def _check_epoch(epoch) -> int:
    if isinstance(epoch, bool) or not isinstance(epoch, int):
        raise TypeError(f"epoch: expected an int, got {type(epoch).__name__}")
    if epoch < 0:
        raise ValueError(f"epoch: expected an int >= 0, got {epoch}")
    return epoch


class ResumableLoader(LoaderWrapper):
    """Wrap a DataLoader so its epoch and position in the current pass can be saved and restored.

    len(), dataset, sampler, batch_size ... read through to the DataLoader. Each `for` loop is a pass;
    the position belongs to the latest pass started. After load_state_dict() of a state saved mid-pass,
    the next pass is the rest of the interrupted one (see the module docstring), unless set_epoch() is
    first called with another epoch (the saved position is then dropped, with a warning).

    Args:
        loader: a torch.utils.data.DataLoader (or subclass) over a map-style dataset. Loaders with their
            own state_dict()/load_state_dict() (e.g. torchdata's StatefulDataLoader) need no wrapper:
            pass them to accel.save_state directly.

    Raises:
        TypeError: `loader` is not a DataLoader, is over an IterableDataset (its position cannot be skipped
            by index), or keeps its own state.
    """

    def __init__(self, loader):
        if isinstance(loader, ResumableLoader):
            raise TypeError("loader: already a ResumableLoader")
        if not isinstance(loader, DataLoader):
            raise TypeError(f"loader: expected a torch.utils.data.DataLoader, got {type(loader).__name__}")
        if isinstance(loader.dataset, IterableDataset):
            raise TypeError("loader: a DataLoader over an IterableDataset cannot skip batches by index; use a "
                            "loader that keeps its own state (e.g. torchdata's StatefulDataLoader)")
        if _keeps_own_state(loader):
            raise TypeError(f"loader: {type(loader).__name__} keeps its own state_dict(); pass it to "
                            "accel.save_state without a ResumableLoader")
        super().__init__(loader)
        self._epoch = 0
        self._epoch_set = False
        self._next_epoch = 0  # the epoch of the next pass, unless set_epoch() announces another
        self._position = 0
        self._in_pass = False
        self._pass_id = 0
        self._pass_start: Optional[dict] = None  # RNG states when the current pass started
        self._resume: Optional[dict] = None  # a loaded mid-pass state, applied by the next pass
        self._counted_outside = False
        # Restored from a run whose persistent workers were running: its later passes drew no base seed.
        self._workers_were_alive = False

    @classmethod
    def wrap(cls, loader) -> Optional["ResumableLoader"]:
        """`loader` if it is a ResumableLoader, a new one around it if it can be resumed by index (a DataLoader
        over a map-style dataset, without its own state_dict), else None (for accel.accelerate())."""
        if isinstance(loader, cls):
            return loader
        if (isinstance(loader, DataLoader) and not isinstance(loader.dataset, IterableDataset)
                and not _keeps_own_state(loader)):
            return cls(loader)
        return None

    # ------------------------------------------------------------------ position
    @property
    def epoch(self) -> int:
        """The epoch last given to set_epoch() (or restored), 0 before any."""
        return self._epoch

    @property
    def position(self) -> int:
        """Batches of the current (or restored) pass handed to the training loop so far."""
        return self._resume["position"] if self._resume is not None else self._position

    def set_epoch(self, epoch: int) -> None:
        """Record the epoch and pass it on to the loader, or to its samplers that take it (e.g.
        DistributedSampler), so their order for the epoch is the one they derive from it."""
        epoch = _check_epoch(epoch)
        if self._resume is not None and self._resume["epoch"] != epoch:
            warnings.warn(f"ResumableLoader.set_epoch({epoch}): the restored position ({self._resume['position']} "
                          f"batches into epoch {self._resume['epoch']}) is dropped; the next pass starts epoch "
                          f"{epoch} from its first batch", stacklevel=2)
            self._resume = None
        self._epoch = epoch
        self._epoch_set = True
        self._next_epoch = epoch
        self._forward_epoch(epoch)

    def _forward_epoch(self, epoch: int) -> None:
        loader = self.loader
        if callable(getattr(loader, "set_epoch", None)):
            loader.set_epoch(epoch)
            return
        batch_sampler = loader.batch_sampler
        done: list = []
        for sampler in (loader.sampler, batch_sampler, getattr(batch_sampler, "sampler", None)):
            if callable(getattr(sampler, "set_epoch", None)) and all(sampler is not s for s in done):
                sampler.set_epoch(epoch)
                done.append(sampler)

    # ------------------------------------------------------------------ passes
    def __iter__(self):
        resume, self._resume = self._resume, None
        generators = _loader_generators(self.loader)
        if resume is not None:
            return self._resumed_pass(resume, generators)
        # A pass that set_epoch() did not announce is the epoch after the previous pass (the first: 0), so a
        # DistributedSampler reshuffles every epoch without the loop calling set_epoch.
        self._epoch = self._next_epoch
        self._next_epoch = self._epoch + 1
        self._forward_epoch(self._epoch)
        # Before iter(): the DataLoader iterator draws its worker base seed as it is created.
        self._pass_start = {"host": host_rng_state(), "generators": [g.get_state() for g in generators],
                            "reuses_workers": _workers_alive(self.loader)}
        self._position = 0
        self._in_pass = True
        self._pass_id += 1
        if self._workers_were_alive and _persistent(self.loader) and not _workers_alive(self.loader):
            iterator = _iter_without_base_seed(self.loader)
        else:
            iterator = iter(self.loader)
        self._workers_were_alive = False
        return _Pass(self, iterator, self._pass_id)

    def _resumed_pass(self, state: dict, generators: list):
        self._next_epoch = state["epoch"] + 1
        count = state["position"]
        self._pass_id += 1
        self._pass_start = state["pass_start"]
        self._position = count
        self._in_pass = True
        batches = self._num_batches()
        if batches is not None and count >= batches:
            self._in_pass = False
            return _Pass(self, iter(()), self._pass_id)
        clone, skipping = _clone_skipping(self.loader, count)
        host_now = host_rng_state()
        generators_now = [g.get_state() for g in generators]
        set_host_rng_state(state["pass_start"]["host"])
        for generator, saved in zip(generators, state["pass_start"]["generators"]):
            generator.set_state(saved)
        try:
            iterator = _iter_without_base_seed(clone) if state["pass_start"].get("reuses_workers") else iter(clone)
            if skipping.latest is not None:
                # The sampler's lazy draws (RandomSampler's seed) and the skipped indices happen now, with
                # the pass-start RNG, as they did when the uninterrupted pass fetched its first batch.
                skipping.latest.prime()
        finally:
            set_host_rng_state(host_now)
            for generator, saved in zip(generators, generators_now):
                generator.set_state(saved)
        return _Pass(self, iterator, self._pass_id)

    def _num_batches(self) -> Optional[int]:
        try:
            return len(self.loader)
        except TypeError:
            return None

    # ------------------------------------------------------------------ outer counting
    def counting(self, loader) -> "CountedLoader":
        """Wrap `loader`, a chain of wrappers around this ResumableLoader that may read ahead (a prefetcher,
        a device loader), so the position counts the batches the training loop takes from the chain rather
        than those read ahead. Use the returned loader in the training loop."""
        if not hasattr(loader, "__iter__"):
            raise TypeError(f"loader: expected an iterable of batches, got {type(loader).__name__}")
        self._counted_outside = True
        return CountedLoader(loader, self)

    def _taken(self) -> None:
        self._position += 1

    def _pass_done(self) -> None:
        self._in_pass = False

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """The epoch, the position in the current pass and the RNG states at its start (tensors, ints and
        lists only: torch.load(weights_only=True) reads it)."""
        if self._resume is not None:  # restored but not iterated yet: still the same position
            state = dict(self._resume)
            state["generators"] = [g.get_state() for g in _loader_generators(self.loader)]
            return state
        return {
            "version": _STATE_VERSION,
            "epoch": self._epoch,
            "epoch_set": self._epoch_set,
            "position": self._position,
            "in_pass": self._in_pass,
            "num_batches": self._num_batches(),
            "pass_start": self._pass_start if self._in_pass else None,
            "generators": [g.get_state() for g in _loader_generators(self.loader)],
            "workers_alive": _workers_alive(self.loader) or self._workers_were_alive,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a state_dict(): the next pass continues the saved one if it was saved mid-pass.

        Raises:
            TypeError: state_dict is not a dict.
            ValueError: it is not a ResumableLoader state, or the loader differs from the saved one (another
                number of batches per pass, or of generators).
        """
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict: expected a dict from ResumableLoader.state_dict(), got "
                            f"{type(state_dict).__name__}")
        missing = {"version", "epoch", "epoch_set", "position", "in_pass", "num_batches", "pass_start",
                   "generators"} - set(state_dict)
        if missing:
            raise ValueError(f"state_dict: not a ResumableLoader state (missing {sorted(missing)})")
        if state_dict["version"] != _STATE_VERSION:
            raise ValueError(f"state_dict: version {state_dict['version']!r} is not supported (expected "
                             f"{_STATE_VERSION})")
        epoch = _check_epoch(state_dict["epoch"])
        position = state_dict["position"]
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            raise ValueError(f"state_dict['position']: expected an int >= 0, got {position!r}")
        batches = self._num_batches()
        if state_dict["num_batches"] is not None and batches is not None and state_dict["num_batches"] != batches:
            raise ValueError(f"state_dict: saved from a loader with {state_dict['num_batches']} batches per pass, "
                             f"this one has {batches}: the position would point at other data")
        generators = _loader_generators(self.loader)
        if len(state_dict["generators"]) != len(generators):
            raise ValueError(f"state_dict: saved from a loader with {len(state_dict['generators'])} "
                             f"torch.Generator(s), this one has {len(generators)}")
        if state_dict["in_pass"] and state_dict["pass_start"] is None:
            raise ValueError("state_dict['pass_start']: missing for a state saved mid-pass")
        for generator, saved in zip(generators, state_dict["generators"]):
            generator.set_state(saved)
        self._epoch = epoch
        self._epoch_set = bool(state_dict["epoch_set"])
        if self._epoch_set:
            self._forward_epoch(epoch)
        self._position = position
        self._in_pass = False
        self._resume = dict(state_dict) if state_dict["in_pass"] else None
        # After the restored pass (or the saved epoch's completed pass) comes the next epoch; a state saved
        # before its epoch's pass began leaves that epoch for the next pass.
        self._next_epoch = epoch + 1 if state_dict["in_pass"] or position > 0 else epoch
        self._workers_were_alive = bool(state_dict.get("workers_alive", False))


class CountedLoader(LoaderWrapper):
    """What ResumableLoader.counting() returns: iterates the chain and counts each batch the loop takes."""

    def __init__(self, loader, resumable: ResumableLoader):
        super().__init__(loader)
        self.resumable = resumable

    @property
    def epoch(self) -> int:
        return self.resumable.epoch

    @property
    def position(self) -> int:
        return self.resumable.position

    def set_epoch(self, epoch: int) -> None:
        self.resumable.set_epoch(epoch)

    def state_dict(self) -> dict:
        return self.resumable.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.resumable.load_state_dict(state_dict)

    def __iter__(self):
        return _CountedPass(iter(self.loader), self.resumable)


class _CountedPass:
    def __init__(self, iterator, resumable: ResumableLoader):
        self._iterator = iterator
        self._resumable = resumable

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return len(self._iterator)

    def __next__(self):
        try:
            batch = next(self._iterator)
        except StopIteration:
            self._resumable._pass_done()
            raise
        self._resumable._taken()
        return batch
