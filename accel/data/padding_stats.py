"""How much of a padded batch is padding, before and after packing or bucketing."""
from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PaddingStats:
    """Token-slot counts for one set of samples.

    real_tokens: tokens that belong to samples.
    slots_before: token slots if every batch were padded to its longest sample (the usual dynamic
        padding, which changes shape from batch to batch).
    slots_after: token slots actually produced (packed rows, or bucket-length batches).
    """

    real_tokens: int
    slots_before: int
    slots_after: int

    @staticmethod
    def _pad_fraction(real: int, slots: int) -> float:
        return 0.0 if slots == 0 else 1.0 - real / slots

    @property
    def pad_fraction_before(self) -> float:
        return self._pad_fraction(self.real_tokens, self.slots_before)

    @property
    def pad_fraction_after(self) -> float:
        return self._pad_fraction(self.real_tokens, self.slots_after)

    @property
    def padding_reduction(self) -> float:
        """Pad tokens before / pad tokens after (inf when nothing is padded after)."""
        before = self.slots_before - self.real_tokens
        after = self.slots_after - self.real_tokens
        if after == 0:
            return float("inf") if before > 0 else 1.0
        return before / after

    def __add__(self, other: PaddingStats) -> PaddingStats:
        return PaddingStats(self.real_tokens + other.real_tokens, self.slots_before + other.slots_before,
                            self.slots_after + other.slots_after)

    def as_dict(self) -> dict:
        return {
            "real_tokens": self.real_tokens,
            "slots_before": self.slots_before,
            "slots_after": self.slots_after,
            "pad_fraction_before": self.pad_fraction_before,
            "pad_fraction_after": self.pad_fraction_after,
            "padding_reduction": self.padding_reduction,
        }


def slots_padded_to_longest(lengths: Sequence[int], batches: Iterable[Sequence[int]]) -> int:
    """Token slots when each batch (a list of sample indices) is padded to its longest sample."""
    return sum(len(batch) * max(lengths[i] for i in batch) for batch in batches if len(batch) > 0)


def consecutive_batches(n: int, batch_size: int) -> list[range]:
    """Sample indices 0..n-1 cut into batches of batch_size in order (the last one may be short)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    return [range(start, min(start + batch_size, n)) for start in range(0, n, batch_size)]


def check_lengths(lengths: Iterable, name: str = "lengths") -> list[int]:
    """Sample lengths as a list of ints >= 1. A float is refused rather than truncated (3.7 tokens is a
    bug upstream, not 3 tokens): TypeError naming the entry; a length < 1 is a ValueError."""
    out = []
    for i, n in enumerate(lengths):
        try:
            if isinstance(n, bool):
                raise TypeError
            value = operator.index(n)  # ints, numpy ints, 0-d integer tensors
        except TypeError:
            raise TypeError(f"{name}[{i}] must be an int, got {n!r} ({type(n).__name__})") from None
        if value < 1:
            raise ValueError(f"{name}[{i}] = {value}; every sample needs at least one token")
        out.append(value)
    return out
