import torch
import torch.nn.functional as F

from accel.runtime.nn.layer_norm import FusedLayerNorm, _ops, fused_layer_norm, layer_norm_reference

from . import Case

EPS = 1e-5


def _shapes(device: str, quick: bool) -> list[tuple[int, int]]:
    """(rows, normalized size): BERT/GPT hidden sizes at training batch*seq, and wide rows that
    take the block-wide reduction on CUDA."""
    if quick:
        return [(512, 768), (64, 4096)]
    if device == "cuda":
        return [(16384, 768), (16384, 1024), (8192, 4096), (4096, 8192), (256, 65536)]
    return [(4096, 768), (1024, 4096), (32, 65536)]


def cases(device: str, quick: bool) -> list[Case]:

    ops = _ops()  # build/load outside any timed call
    compiled_ref = torch.compile(layer_norm_reference)
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for rows, n in _shapes(device, quick):
            x = torch.randn(rows, n, device=device, dtype=dtype)
            w = torch.randn(n, device=device, dtype=dtype)
            b = torch.randn(n, device=device, dtype=dtype)
            g = torch.randn_like(x)
            label = f"{rows}x{n} {str(dtype).replace('torch.', '')}"
            act = x.numel() * x.element_size()
            params = 2 * n * w.element_size()
            stats = 2 * rows * 4
            # forward: read x and the params, write y and the saved statistics
            out.append(Case("layer_norm fwd", label, 2 * act + params + stats,
                            lambda x=x, w=w, b=b, n=n: fused_layer_norm(x, n, w, b, EPS), {
                "torch F.layer_norm": lambda x=x, w=w, b=b, n=n: F.layer_norm(x, (n,), w, b, EPS),
                "torch.compile(ref)": lambda x=x, w=w, b=b, n=n: compiled_ref(x, n, w, b, EPS),
            }))
            # backward alone, from the saved statistics: read x, dy, stats, params; write dx,
            # dweight, dbias. The peer is ATen's own backward kernel on the same inputs.
            _, mean, rstd = ops.layer_norm_fwd(x, w, b, 1, EPS)
            _, amean, arstd = torch.ops.aten.native_layer_norm(x, [n], w, b, EPS)
            out.append(Case("layer_norm bwd", label, 3 * act + 2 * params + stats,
                            lambda x=x, w=w, b=b, g=g, mean=mean, rstd=rstd: ops.layer_norm_bwd(
                                g, x, mean, rstd, w, b, 1, True, True), {
                "torch native_layer_norm_backward":
                    lambda x=x, w=w, b=b, g=g, n=n, mean=amean, rstd=arstd:
                    torch.ops.aten.native_layer_norm_backward(g, x, [n], mean, rstd, w, b, [True, True, True]),
            }))
    return out


def host_cases(device: str) -> list[Case]:
    """nn.LayerNorm as a model calls it, on 2 rows of 8: FusedLayerNorm against torch's own module."""
    torch.manual_seed(0)
    ours, theirs = FusedLayerNorm(8).to(device), torch.nn.LayerNorm(8).to(device)
    x = torch.randn(2, 8, device=device, requires_grad=True)
    return [
        Case("layer_norm fwd", "2x8", 0, lambda: ours(x), {"torch nn.LayerNorm": lambda: theirs(x)}, False),
        Case("layer_norm fwd+bwd", "2x8", 0, lambda: ours(x).sum().backward(),
             {"torch nn.LayerNorm": lambda: theirs(x).sum().backward()}, False),
    ]
