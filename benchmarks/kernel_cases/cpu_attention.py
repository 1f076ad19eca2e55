"""compute.cpu_attention: a bf16 training self-attention (forward + backward) in the plain ops ACCEL_SDPA computes it
in where the probe says so (accel.compiler.unpadded_attention: matmul, softmax in fp32, matmul, compiled by
Inductor), against torch's SDPA (its CPU flash kernel), eager and compiled: an encoder's bidirectional one, unmasked
and with a padding mask, BERT-base / ViT-base heads (12 of 64), and a decoder's causal one with grouped key/value
heads (8 query heads over 4, of 64; SDPA's enable_gqa), at the lengths they train at. CPU only: on CUDA SDPA keeps
the attention."""
import torch
import torch.nn.functional as F

from accel.compiler.unpadded_attention import _plain_module_attention

from . import Case


def _case(batch: int, length: int, padded: bool, causal: bool = False) -> Case:
    heads, kv_heads = (8, 4) if causal else (12, 12)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, length, 64, generator=g).bfloat16().requires_grad_()
    k, v = (torch.randn(batch, kv_heads, length, 64, generator=g).bfloat16().requires_grad_() for _ in range(2))
    grad = torch.randn(batch, length, heads, 64, generator=g).bfloat16()  # [B, L, H, D]: what the attention returns
    mask = None
    if padded:  # each row real up to a length between half the batch's and all of it
        lengths = torch.randint(length // 2, length + 1, (batch,), generator=g)
        mask = (torch.arange(length)[None, :] < lengths[:, None])[:, None, None, :].expand(batch, 1, length, length)
    module = torch.nn.Module()
    module.is_causal = causal  # the plain way makes a causal module's missing mask explicit, as ACCEL_SDPA does

    def plain(q, k, v):
        return _plain_module_attention(module, q, k, v, mask, None)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              enable_gqa=kv_heads != heads).transpose(1, 2)

    def step(fn):
        return torch.autograd.grad(fn(q, k, v), (q, k, v), grad)

    ours, compiled_sdpa = torch.compile(plain, dynamic=False), torch.compile(sdpa, dynamic=False)
    nbytes = 2 * batch * length * 64 * (4 * heads + 4 * kv_heads)  # q, out, k, v read/written, their gradients
    kind = "causal" if causal else "padded" if padded else "unmasked"
    return Case(f"cpu_attention bf16 {kind} fwd+bwd", f"{batch}x{heads}/{kv_heads}x{length}x64", nbytes,
                lambda: step(ours), {"SDPA": lambda: step(sdpa), "compiled SDPA": lambda: step(compiled_sdpa)},
                memory_bound=False)


def cases(device: str, quick: bool):
    if device != "cpu":
        return
    sizes = ((2, 32),) if quick else ((8, 128), (8, 197), (4, 384), (2, 512))
    for batch, length in sizes:
        for padded in (False, True):
            yield _case(batch, length, padded)
    for batch, length in ((2, 32),) if quick else ((8, 256), (4, 512), (2, 1024)):
        yield _case(batch, length, padded=False, causal=True)
