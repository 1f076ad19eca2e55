"""Base of the loaders that wrap another loader (bucket padding, device loading, recompile guard)."""
from __future__ import annotations


class LoaderWrapper:
    """Holds `loader`; len() and every public attribute not defined here (dataset, sampler, batch_size,
    set_epoch, ...) read through to it, so a wrapped DataLoader still looks like one."""

    def __init__(self, loader):
        if not hasattr(loader, "__iter__"):
            raise ValueError(f"loader must be an iterable of batches (e.g. a DataLoader), got {type(loader).__name__}")
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name):
        if name.startswith("_") or name == "loader":  # never recurse while unpickling (no loader yet)
            raise AttributeError(name)
        return getattr(self.loader, name)
