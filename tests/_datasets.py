"""Small datasets shared by the loader tests (MpDeviceLoader, Prefetcher)."""
import collections

import torch
from torch.utils.data import Dataset

Pair = collections.namedtuple("Pair", "x y")


class BrokenSample(Exception):
    """Raised by Numbers at `fail_at`; a type of its own, so a test can tell it was passed on unchanged."""


class Numbers(Dataset):
    """Sample i is {"x": [i, 1.0], "id": i, "y": Pair(i, [-i])}: a nested sample whose values say its index.

    fail_at: the index whose read raises BrokenSample. on_get: called with each index as it is read, to
    see when (and in which order) the loader reads.
    """

    def __init__(self, n, fail_at=None, on_get=None):
        self.n, self.fail_at, self.on_get = n, fail_at, on_get

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.on_get is not None:
            self.on_get(i)
        if i == self.fail_at:
            raise BrokenSample(f"broken sample {i}")
        return {"x": torch.tensor([float(i), 1.0]), "id": torch.tensor(i),
                "y": Pair(torch.tensor(i), [torch.tensor(-i)])}
