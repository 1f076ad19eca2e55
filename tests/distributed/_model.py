"""The model and data the distributed tests train, shared by the workers and the single-process reference."""
import torch
from torch import nn
from torch.utils.data import Dataset

DIM = 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, x):
        return x + torch.tanh(self.linear(x))


class TinyNet(nn.Module):
    """Repeated blocks (what FSDP wraps one unit each) and a head; returns {"loss"} like a transformers model."""

    def __init__(self, n_blocks: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(n_blocks)])
        self.head = nn.Linear(DIM, 1)

    def forward(self, x, y):
        for block in self.blocks:
            x = block(x)
        return {"loss": nn.functional.mse_loss(self.head(x), y)}


class Points(Dataset):
    """Sample i: {"x": a fixed random vector, "y": a target, "id": i}."""

    def __init__(self, n: int = 64):
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, DIM, generator=g)
        self.y = torch.randn(n, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i], "id": i}


def new_model() -> TinyNet:
    torch.manual_seed(0)
    return TinyNet()


def optimizer_for(model: nn.Module, syncfree: bool = False) -> torch.optim.Optimizer:
    """torch's AdamW, or accel's sync-free AdamW (same update rule, skipped on the device by a GradScaler)."""
    if syncfree:
        from accel.amp import syncfree as sf

        return sf.AdamW(model.parameters(), lr=1e-2)
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def inject_inf(model: nn.Module) -> None:
    """Make one gradient element of this process inf: an overflow only this rank sees (FSDP: in its shard)."""
    for p in model.parameters():
        grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        if grad.numel():
            grad.view(-1)[0] = float("inf")
            return
    raise AssertionError("no gradient element to make inf")
