"""Benchmark rows for the fused bias-dropout-add: ours vs torch eager (x + bias, F.dropout, + residual:
three kernels and a stored mask) and torch.compile of the same reference (one fused kernel)."""
import torch

from accel.runtime.nn.bias_dropout_add import bias_dropout_add, bias_dropout_add_reference

from . import Case

P = 0.1
HIDDEN = 1024


def cases(device: str, quick: bool) -> list[Case]:
    rows_list = [64, 1024] if quick else [1024, 16384, 65536]  # x rows of HIDDEN: 64K .. 64M elements
    compiled_ref = torch.compile(bias_dropout_add_reference)
    out = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for rows in rows_list:
            x = torch.randn(rows, HIDDEN, device=device, dtype=dtype)
            bias = torch.randn(HIDDEN, device=device, dtype=dtype)
            residual = torch.randn_like(x)
            nbytes = x.numel() * x.element_size()
            label = f"{x.numel() / 2**20:g}M {str(dtype).replace('torch.', '')}"
            # forward: reads x and residual, writes out (bias is negligible)
            out.append(Case("bias_dropout_add fwd", label, 3 * nbytes,
                            lambda x=x, b=bias, r=residual: bias_dropout_add(x, b, r, P, True), {
                "torch eager": lambda x=x, b=bias, r=residual: bias_dropout_add_reference(x, b, r, P, True),
                "torch.compile(ref)": lambda x=x, b=bias, r=residual: compiled_ref(x, b, r, P, True),
            }))
            # forward + backward wrt x, bias and residual; ideal traffic: fwd 3 + bwd (read grad,
            # write dx; d_residual is grad itself) 2
            xg, bg = x.clone().requires_grad_(), bias.clone().requires_grad_()
            rg, g = residual.clone().requires_grad_(), torch.randn_like(x)

            def step(fn, xg=xg, bg=bg, rg=rg, g=g):
                return torch.autograd.grad(fn(xg, bg, rg, P, True), (xg, bg, rg), g)

            out.append(Case("bias_dropout_add fwd+bwd", label, 5 * nbytes,
                            lambda step=step: step(bias_dropout_add), {
                "torch eager": lambda step=step: step(bias_dropout_add_reference),
                "torch.compile(ref)": lambda step=step: step(compiled_ref),
            }))
    return out


def host_cases(device: str) -> list[Case]:
    """bias_dropout_add as a model calls it in training, on 2 rows of 8: ours against torch's
    F.dropout(x + bias, p, training) + residual."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    x = torch.randn(2, 8, device=device, requires_grad=True)
    bias = torch.randn(8, device=device, requires_grad=True)
    residual = torch.randn(2, 8, device=device, requires_grad=True)

    def theirs():
        return F.dropout(x + bias, P, True) + residual

    peer = "torch F.dropout(x+bias)+residual"
    return [
        Case("bias_dropout_add fwd", "2x8", 0, lambda: bias_dropout_add(x, bias, residual, P, True),
             {peer: theirs}, False),
        Case("bias_dropout_add fwd+bwd", "2x8", 0,
             lambda: bias_dropout_add(x, bias, residual, P, True).sum().backward(),
             {peer: lambda: theirs().sum().backward()}, False),
    ]
