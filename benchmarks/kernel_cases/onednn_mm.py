"""accel::onednn_mm against torch's own fp32 products (MKL on x86) on BERT-base's Linear layers: the forward
product and both backward ones (the input's gradient, the weight's), then a compiled Linear + GELU + Linear
forward + backward with and without accel.compiler.cpu_gemm's pass. CPU only: there is no CUDA op."""
import torch
import torch.nn.functional as F

from accel.compiler.cpu_gemm import SwapCpuGemms
from accel.runtime.nn.onednn_mm import onednn_available, onednn_mm

from . import Case, grad_case

# (in, out) of BERT-base's Linear layers: attention projections, intermediate, output
_LINEARS = ((768, 768), (768, 3072), (3072, 768))


def cases(device: str, quick: bool) -> list[Case]:
    if device != "cpu" or not onednn_available():
        return []
    out = []
    for tokens in ((128,) if quick else (1024, 4096)):
        for k, n in _LINEARS:
            x = torch.randn(tokens, k)
            w = torch.randn(n, k)
            dy = torch.randn(tokens, n)
            size = f"{tokens}x{k}->{n}"
            nbytes = 4 * (tokens * k + k * n + tokens * n)  # each product reads two operands, writes one
            out.append(Case("fp32 linear fwd", size, nbytes, lambda x=x, w=w: onednn_mm(x, w.t()),
                            {"torch F.linear": lambda x=x, w=w: F.linear(x, w)}, memory_bound=False))
            out.append(Case("fp32 linear grad input", size, nbytes, lambda dy=dy, w=w: onednn_mm(dy, w),
                            {"torch mm": lambda dy=dy, w=w: torch.mm(dy, w)}, memory_bound=False))
            # the weight's gradient in the weight's layout, as OneDNNLinear's backward computes it
            out.append(Case("fp32 linear grad weight", size, nbytes, lambda dy=dy, x=x: onednn_mm(dy.t(), x),
                            {"torch mm": lambda dy=dy, x=x: torch.mm(dy.t(), x)}, memory_bound=False))
    return out + _linear_cases(quick) + _compiled_cases(quick)


def _linear_twins(k: int, n: int):
    """An nn.Linear(k, n) and a OneDNNLinear with the same weights."""
    import copy

    from torch import nn

    from accel.runtime.nn.onednn_mm import OneDNNLinear

    torch.manual_seed(0)
    plain = nn.Linear(k, n)
    ours = copy.deepcopy(plain)
    ours.__class__ = OneDNNLinear
    return plain, ours


def _linear_cases(quick: bool) -> list[Case]:
    """OneDNNLinear against nn.Linear, forward + backward, where oneDNN wins (many rows) and where it loses (few
    rows against a large weight: the per-class timing keeps torch's product there, so the row shows ~1.0)."""
    out = []
    for rows, k, n in ((16, 256, 256),) if quick else ((16, 1024, 1024), (32, 1024, 512), (1024, 768, 3072)):
        plain, ours = _linear_twins(k, n)
        x = torch.randn(rows, k, requires_grad=True)
        g = torch.randn(rows, n)
        nbytes = 4 * (rows * k + k * n + rows * n)

        def step(layer, x=x, g=g):  # what training computes: the input's, the weight's and the bias's gradients
            return torch.autograd.grad(layer(x), (x, layer.weight, layer.bias), g)

        out.append(Case("fp32 OneDNNLinear fwd+bwd", f"{rows}x{k}->{n}", 3 * nbytes,
                        lambda ours=ours, step=step: step(ours), {"nn.Linear": lambda plain=plain, step=step: step(plain)},
                        memory_bound=False))
    return out


def _mlp(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


def _compiled_cases(quick: bool) -> list[Case]:
    """BERT's feed-forward block compiled, forward + backward: with the pass accelerate() installs where oneDNN
    wins, against the same graph with torch's products."""
    ours = torch.compile(_mlp, dynamic=False, options={"post_grad_custom_post_pass": SwapCpuGemms()})
    peer = torch.compile(_mlp, dynamic=False)
    out = []
    for tokens in ((128,) if quick else (1024,)):
        params = [torch.randn(3072, 768) * 0.02, torch.zeros(3072), torch.randn(768, 3072) * 0.02, torch.zeros(768)]
        inputs = tuple(t.requires_grad_() for t in (torch.randn(tokens, 768), *params))
        g = torch.randn(tokens, 768)
        out.append(grad_case("fp32 Linear+GELU+Linear compiled, fwd+bwd", f"{tokens}x768", 0, inputs, g, ours,
                             {"compiled, torch's products": peer}))
    return out


def host_cases(device: str) -> list[Case]:
    """OneDNNLinear as a model calls it: on 2x8 inputs it is nn.Linear after its checks (the product is small),
    which is the cost every call of a swapped layer pays on top of F.linear; and accel::onednn_mm itself, the
    call a large product makes (timed on 2x8 so that the product takes no time)."""
    if device != "cpu" or not onednn_available():
        return []
    plain, ours = _linear_twins(8, 4)
    x = torch.randn(2, 8, requires_grad=True)
    a, b = torch.randn(2, 8), torch.randn(8, 4)
    return [
        Case("OneDNNLinear fwd", "2x8", 0, lambda: ours(x), {"nn.Linear": lambda: plain(x)}, False),
        Case("OneDNNLinear fwd+bwd", "2x8", 0, lambda: ours(x).sum().backward(),
             {"nn.Linear": lambda: plain(x).sum().backward()}, False),
        Case("onednn_mm fwd", "2x8x4", 0, lambda: onednn_mm(a, b), {"torch mm": lambda: torch.mm(a, b)}, False),
    ]
