"""The small training case shared by the SPMD worker and its eager reference in the test."""
import torch

STEPS = 3
BATCH = 8  # divisible by the 4 CPU devices of the mesh
LR = 0.05


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def make_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 6, generator=gen), torch.randn(BATCH, 3, generator=gen)) for _ in range(STEPS)]


def train_step(model, optimizer, x, y):
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return loss
