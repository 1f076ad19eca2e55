"""compute.cpu_attention: an encoder's bidirectional bf16 training attention (forward + backward) in the plain ops
ACCEL_SDPA computes it in where the probe says so (accel.compiler.unpadded_attention: matmul, softmax in fp32,
matmul, compiled by Inductor), against torch's SDPA (its CPU flash kernel), eager and compiled, unmasked and with a
padding mask: BERT-base / ViT-base heads (12 of 64) at the lengths encoders train at. CPU only: on CUDA SDPA keeps
the attention."""
import torch
import torch.nn.functional as F

from accel.compiler.unpadded_attention import _NO_DROPOUT, _plain_attention

from . import Case


def _case(batch: int, length: int, padded: bool) -> Case:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, 12, length, 64, generator=g).bfloat16().requires_grad_() for _ in range(3))
    grad = torch.randn(batch, length, 12, 64, generator=g).bfloat16()  # [B, L, H, D]: what the attention returns
    mask = None
    if padded:  # each row real up to a length between half the batch's and all of it
        lengths = torch.randint(length // 2, length + 1, (batch,), generator=g)
        mask = (torch.arange(length)[None, :] < lengths[:, None])[:, None, None, :].expand(batch, 1, length, length)

    def plain(q, k, v):
        return _plain_attention(q, k, v, mask, None, _NO_DROPOUT)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)

    def step(fn):
        return torch.autograd.grad(fn(q, k, v), (q, k, v), grad)

    ours, compiled_sdpa = torch.compile(plain, dynamic=False), torch.compile(sdpa, dynamic=False)
    nbytes = 2 * batch * 12 * length * 64 * 8  # q, k, v, out read/written, their gradients
    return Case(f"cpu_attention bf16 {'padded' if padded else 'unmasked'} fwd+bwd", f"{batch}x12x{length}x64",
                nbytes, lambda: step(ours), {"SDPA": lambda: step(sdpa), "compiled SDPA": lambda: step(compiled_sdpa)},
                memory_bound=False)


def cases(device: str, quick: bool):
    if device != "cpu":
        return
    sizes = ((2, 32),) if quick else ((8, 128), (8, 197), (4, 384), (2, 512))
    for batch, length in sizes:
        for padded in (False, True):
            yield _case(batch, length, padded)
