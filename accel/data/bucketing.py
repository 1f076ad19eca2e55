"""Bucketing: pad every batch to one of a few fixed lengths, so the compiler path sees few shapes.

Padding each batch to its longest sample gives a new shape almost every step (an XLA recompile each
time); padding everything to the maximum wastes most of the compute on long-tailed data. Buckets sit
between: a batch is padded to the smallest bucket that holds its longest sample. BucketBatchSampler
also groups samples of the same bucket into a batch, so the bucket padding stays small.

A sample longer than the largest bucket is never given a new shape: it is an error (overflow="error",
the default) or it is cut to the largest bucket (overflow="truncate").
"""
from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence

import torch
from torch.utils.data import DataLoader, Sampler

from accel.data.padding_stats import PaddingStats, check_lengths, slots_padded_to_longest
from accel.utils.loader import LoaderWrapper

LABEL_PAD = -100
_OVERFLOWS = ("error", "truncate")


def _check_buckets(buckets) -> tuple[int, ...]:
    try:
        values = tuple(buckets)
    except TypeError:
        raise ValueError(f"buckets must be a sequence of ints >= 1, got {buckets!r}") from None
    if not values or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in values):
        raise ValueError(f"buckets must be a non-empty sequence of ints >= 1, got {buckets!r}")
    return tuple(sorted(set(values)))


def bucket_for(length: int, buckets: Sequence[int], overflow: str = "error") -> int:
    """The smallest bucket >= length (buckets sorted ascending)."""
    i = bisect.bisect_left(buckets, length)
    if i < len(buckets):
        return buckets[i]
    if overflow == "truncate":
        return buckets[-1]
    raise ValueError(f"a sample of length {length} is longer than the largest bucket {buckets[-1]}; "
                     "add a bucket or pass overflow='truncate'")


def bucket_padding_stats(lengths: Sequence[int], batches: Sequence[Sequence[int]], buckets: Sequence[int],
                         overflow: str = "error") -> PaddingStats:
    """Padding of these batches padded to their longest sample (before) vs to their bucket (after)."""
    buckets = _check_buckets(buckets)
    cap = buckets[-1]
    clipped = [min(n, cap) if overflow == "truncate" else n for n in lengths]
    real = sum(clipped[i] for batch in batches for i in batch)
    before = slots_padded_to_longest(clipped, batches)
    after = sum(len(b) * bucket_for(max(clipped[i] for i in b), buckets, overflow) for b in batches if len(b))
    return PaddingStats(real_tokens=real, slots_before=before, slots_after=after)


_SUPPORTED = ("BucketingCollate batches numbers: a per-token sequence as long as input_ids, or a per-sample "
              "value (a number, or a tensor of one shape in every sample)")


def _field(pos: int, key: str, value) -> torch.Tensor:
    """samples[pos][key] as a tensor; what cannot be batched is refused with a message saying what can."""
    if isinstance(value, (str, bytes)):
        raise ValueError(f"samples[{pos}]['{key}'] is a {type(value).__name__}; {_SUPPORTED}. "
                         "Tokenize it or leave it out of the samples")
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"samples[{pos}]['{key}'] cannot be made a tensor ({exc}); {_SUPPORTED}") from None


def _is_integer(t: torch.Tensor) -> bool:
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


def _form(t: torch.Tensor) -> str:
    return "per-token (1-D)" if t.dim() == 1 else f"per-sample (shape {tuple(t.shape)})"


class BucketingCollate:
    """collate_fn that pads a batch of samples to the smallest bucket holding its longest sample.

    Samples are mappings with "input_ids" and any other per-token fields (same length as input_ids:
    labels, token_type_ids, ...) or per-sample values (e.g. a class label). Per-token fields are padded
    (input_ids with pad_token_id, labels with -100, others with 0); per-sample values are stacked. An
    attention_mask (1 = real token) is added. pad_batch_to=N also pads a short last batch with empty
    rows up to N samples, so the batch dimension is static too.

    `stats` accumulates PaddingStats over every batch collated in this process (with DataLoader workers
    each worker has its own copy; use bucket_padding_stats on the sampler's batches instead).
    """

    def __init__(self, buckets: Sequence[int] = (64, 128, 256, 512), pad_token_id: int = 0,
                 overflow: str = "error", pad_batch_to: int | None = None):
        if overflow not in _OVERFLOWS:
            raise ValueError(f"overflow must be one of {_OVERFLOWS}, got {overflow!r}")
        if pad_batch_to is not None and (isinstance(pad_batch_to, bool) or not isinstance(pad_batch_to, int)
                                         or pad_batch_to < 1):
            raise ValueError(f"pad_batch_to must be None or an int >= 1, got {pad_batch_to!r}")
        self.buckets = _check_buckets(buckets)
        self.pad_token_id = pad_token_id
        self.overflow = overflow
        self.pad_batch_to = pad_batch_to
        self.reset_stats()

    def reset_stats(self) -> None:
        self.stats = PaddingStats(0, 0, 0)

    def _pad_value(self, key: str) -> int:
        if key == "input_ids":
            return self.pad_token_id
        return LABEL_PAD if key == "labels" else 0

    @staticmethod
    def _check_same_keys(pos: int, sample: Mapping, first: Mapping) -> None:
        keys, expected = set(sample) - {"attention_mask"}, set(first) - {"attention_mask"}
        if keys != expected:
            extra, missing = sorted(keys - expected), sorted(expected - keys)
            what = (f"has {extra[0]!r}, which samples[0] lacks" if extra
                    else f"lacks {missing[0]!r}, which samples[0] has")
            raise ValueError(f"samples[{pos}] {what}; every sample of a batch needs the same fields "
                             f"(samples[0]: {sorted(expected)}, samples[{pos}]: {sorted(keys)})")

    def __call__(self, samples: Sequence[Mapping]) -> dict:
        if len(samples) == 0:
            raise ValueError("samples must not be empty")
        if self.pad_batch_to is not None and len(samples) > self.pad_batch_to:
            raise ValueError(f"a batch of {len(samples)} samples is larger than pad_batch_to={self.pad_batch_to}")
        cap = self.buckets[-1]
        rows = []
        for pos, sample in enumerate(samples):
            if not isinstance(sample, Mapping) or "input_ids" not in sample:
                raise ValueError(f"samples[{pos}] must be a mapping with 'input_ids'")
            if pos > 0:
                self._check_same_keys(pos, sample, samples[0])
            ids = _field(pos, "input_ids", sample["input_ids"])
            if ids.dim() == 1 and ids.numel() == 0:
                raise ValueError(f"samples[{pos}]['input_ids'] is empty; every sample needs at least one token")
            if ids.dim() != 1 or not _is_integer(ids):
                raise ValueError(f"samples[{pos}]['input_ids'] must be a 1-D sequence of ints, "
                                 f"got shape {tuple(ids.shape)} dtype {str(ids.dtype).replace('torch.', '')}")
            n = ids.numel()
            if n > cap and self.overflow == "error":
                raise ValueError(f"samples[{pos}] has {n} tokens, more than the largest bucket {cap}; "
                                 "add a bucket or pass overflow='truncate'")
            row = {}
            for key, value in sample.items():
                if key == "attention_mask":
                    continue  # rebuilt below from the true lengths
                field = ids if key == "input_ids" else _field(pos, key, value)
                if field.dim() == 1 and field.numel() != n:
                    raise ValueError(f"samples[{pos}]['{key}'] has {field.numel()} entries, "
                                     f"input_ids has {n}; per-token fields must match")
                if pos > 0:
                    first = rows[0][key]
                    if (field.dim() == 1) != (first.dim() == 1) or (field.dim() != 1 and field.shape != first.shape):
                        raise ValueError(f"samples[{pos}]['{key}'] is {_form(field)} but samples[0]['{key}'] is "
                                         f"{_form(first)}; a field must have one form in every sample of a batch")
                row[key] = field[:cap] if field.dim() == 1 else field
            rows.append(row)

        lengths = [row["input_ids"].numel() for row in rows]
        width = bucket_for(max(lengths), self.buckets, self.overflow)
        height = self.pad_batch_to or len(rows)
        batch = {}
        for key, first in rows[0].items():
            if first.dim() == 1:
                out = torch.full((height, width), self._pad_value(key), dtype=first.dtype)
                for i, row in enumerate(rows):
                    out[i, :lengths[i]] = row[key]
            else:
                stacked = torch.stack([row[key] for row in rows])
                fill = LABEL_PAD if key == "labels" else 0
                out = torch.full((height, *stacked.shape[1:]), fill, dtype=stacked.dtype)
                out[:len(rows)] = stacked
            batch[key] = out
        mask = torch.zeros((height, width), dtype=torch.long)
        for i, n in enumerate(lengths):
            mask[i, :n] = 1
        batch["attention_mask"] = mask
        self.stats = self.stats + PaddingStats(real_tokens=sum(lengths), slots_before=len(rows) * max(lengths),
                                               slots_after=height * width)
        return batch


class BucketBatchSampler(Sampler):
    """Batches of sample indices where every sample of a batch falls in the same bucket.

    Batches are formed within each bucket (shuffled per epoch when shuffle=True, seeded by
    seed + epoch; call set_epoch like a DistributedSampler), then the batches of all buckets are
    interleaved in random order. drop_last=True drops each bucket's short last batch, so every batch
    has exactly batch_size samples.
    """

    def __init__(self, lengths: Sequence[int], batch_size: int, buckets: Sequence[int] = (64, 128, 256, 512),
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, overflow: str = "error"):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if overflow not in _OVERFLOWS:
            raise ValueError(f"overflow must be one of {_OVERFLOWS}, got {overflow!r}")
        self.buckets = _check_buckets(buckets)
        self.lengths = check_lengths(lengths)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.overflow = overflow
        self.epoch = 0
        self.members: dict[int, list[int]] = {b: [] for b in self.buckets}
        for i, n in enumerate(self.lengths):
            try:
                self.members[bucket_for(n, self.buckets, overflow)].append(i)
            except ValueError as exc:
                raise ValueError(f"lengths[{i}]: {exc}") from None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def batches(self) -> list[list[int]]:
        """This epoch's batches (the same list __iter__ yields)."""
        gen = torch.Generator().manual_seed(self.seed + self.epoch)
        out: list[list[int]] = []
        for bucket in self.buckets:
            ids = self.members[bucket]
            if self.shuffle:
                ids = [ids[j] for j in torch.randperm(len(ids), generator=gen).tolist()]
            for start in range(0, len(ids), self.batch_size):
                chunk = ids[start:start + self.batch_size]
                if len(chunk) == self.batch_size or not self.drop_last:
                    out.append(chunk)
        if self.shuffle:
            out = [out[j] for j in torch.randperm(len(out), generator=gen).tolist()]
        return out

    def __iter__(self):
        return iter(self.batches())

    def __len__(self) -> int:
        full = sum(len(ids) // self.batch_size for ids in self.members.values())
        if self.drop_last:
            return full
        return full + sum(1 for ids in self.members.values() if len(ids) % self.batch_size)

    def padding_stats(self) -> PaddingStats:
        """This epoch's batches padded to their longest sample (before) vs to their bucket (after)."""
        return bucket_padding_stats(self.lengths, self.batches(), self.buckets, self.overflow)


def _sample_length(sample) -> int:
    if isinstance(sample, Mapping) and "input_ids" in sample:
        return len(sample["input_ids"])
    raise ValueError("lengths was not given and a dataset item is not a mapping with 'input_ids'")


class BucketingLoader(DataLoader):
    """A DataLoader whose batches come from a BucketBatchSampler and a BucketingCollate.

    lengths: the token count of every dataset item (read from item["input_ids"] when omitted).
    Other keyword arguments (num_workers, pin_memory, ...) go to DataLoader.
    """

    def __init__(self, dataset, batch_size: int, buckets: Sequence[int] = (64, 128, 256, 512), *,
                 lengths: Sequence[int] | None = None, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, pad_token_id: int = 0, overflow: str = "error", **kwargs):
        for forbidden in ("batch_sampler", "sampler", "collate_fn"):
            if forbidden in kwargs:
                raise ValueError(f"BucketingLoader builds its own {forbidden}; do not pass one")
        if lengths is None:
            lengths = [_sample_length(dataset[i]) for i in range(len(dataset))]
        if len(lengths) != len(dataset):
            raise ValueError(f"lengths has {len(lengths)} entries, the dataset {len(dataset)}")
        sampler = BucketBatchSampler(lengths, batch_size, buckets, shuffle=shuffle, seed=seed,
                                     drop_last=drop_last, overflow=overflow)
        collate = BucketingCollate(buckets, pad_token_id=pad_token_id, overflow=overflow)
        super().__init__(dataset, batch_sampler=sampler, collate_fn=collate, **kwargs)

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)

    def padding_stats(self) -> PaddingStats:
        return self.batch_sampler.padding_stats()


def pad_to_bucket(batch: Mapping, buckets: Sequence[int], pad_values: Mapping[str, float]) -> dict:
    """Pad an already collated batch (e.g. DataCollatorWithPadding's, padded to its longest sample) along
    the sequence dimension to the smallest bucket that holds it, as TorchAcc's bucketing does.

    Args:
        batch: a mapping with "input_ids" [B, L]; every tensor whose dim 1 is L is a per-token field
            and is padded (dim >= 2); other values pass through.
        buckets: ascending sequence lengths.
        pad_values: field name -> pad value (fields not named are padded with 0). position_ids, unless named,
            count on from 0 over the padding: rows a collator packed by position ids (DataCollatorWithFlattening)
            then see their padding as one more sample, not one sample a pad token (transformers' packed masks and
            accel's per-sample attention: one piece of work instead of one a token).

    Returns:
        a dict with every per-token field of length bucket_for(L).
    """
    if not isinstance(batch, Mapping) or not isinstance(batch.get("input_ids"), torch.Tensor):
        raise ValueError("batch: bucketing needs collated batches as mappings with an 'input_ids' tensor, got "
                         f"{type(batch).__name__}")
    if batch["input_ids"].dim() != 2:
        raise ValueError(f"batch['input_ids']: expected [batch, seq], got shape {tuple(batch['input_ids'].shape)}")
    length = batch["input_ids"].shape[1]
    width = bucket_for(length, buckets)
    out = dict(batch)
    if width == length:
        return out
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == length:
            padded = value.new_full((value.shape[0], width, *value.shape[2:]), pad_values.get(key, 0))
            if key == "position_ids" and key not in pad_values and value.dim() == 2:
                padded[:, length:] = torch.arange(width - length, dtype=value.dtype)
            padded[:, :length] = value
            out[key] = padded
    return out


class BucketPaddedLoader(LoaderWrapper):
    """Iterate `loader` with every batch padded to a bucket length (see pad_to_bucket).

    Re-iterable like the loader it wraps; len(), dataset, sampler, batch_size, set_epoch ... read through.
    """

    def __init__(self, loader, buckets: Sequence[int], pad_values: Mapping[str, float]):
        super().__init__(loader)
        self.buckets = _check_buckets(buckets)
        self.pad_values = dict(pad_values)

    def __iter__(self):
        for batch in self.loader:
            yield pad_to_bucket(batch, self.buckets, self.pad_values)
