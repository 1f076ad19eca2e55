"""Benchmark rows for the fused bias-dropout-add: ours vs torch eager (x + bias, F.dropout, + residual:
three kernels and a stored mask) and torch.compile of the same reference (one fused kernel). And for
philox_dropout, whose mask comes from accel::dropout_mask: alone against F.dropout eager and compiled, and
compiled behind a softmax (attention probabilities) against the same code with F.dropout, where the
multiply fuses into the softmax kernel and only the mask's source differs. On CUDA compiled code takes
torch's dropout itself (Inductor's fused Philox won, 0.80-0.92x against ours on an H200): that row then
checks that stepping aside costs nothing (~1.0x)."""
import torch
import torch.nn.functional as F

from accel.runtime.nn.bias_dropout_add import (
    PhiloxDropout,
    bias_dropout_add,
    bias_dropout_add_reference,
    philox_dropout,
)

from . import Case, grad_case

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
    return out + _philox_dropout_cases(device, rows_list) + _compiled_cases(device, rows_list)


def _softmax_dropout(dropout):
    return lambda x: dropout(x.softmax(-1), P)


def _philox_dropout_cases(device: str, rows_list) -> list[Case]:
    compiled_torch = torch.compile(F.dropout)
    compiled_ours = torch.compile(_softmax_dropout(philox_dropout))
    compiled_theirs = torch.compile(_softmax_dropout(F.dropout))
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for rows in rows_list:
            x = torch.randn(rows, HIDDEN, device=device, dtype=dtype)
            nbytes = x.numel() * x.element_size()
            label = f"{x.numel() / 2**20:g}M {str(dtype).replace('torch.', '')}"
            # reads x, writes the output and the one-byte mask
            out.append(Case("philox_dropout fwd", label, 2 * nbytes + x.numel(), lambda x=x: philox_dropout(x, P), {
                "torch eager": lambda x=x: F.dropout(x, P),
                "torch.compile(F.dropout)": lambda x=x: compiled_torch(x, P),
            }))
            out.append(Case("compiled softmax+philox_dropout fwd", label, 2 * nbytes + x.numel(),
                            lambda x=x: compiled_ours(x), {"compiled softmax+F.dropout": lambda x=x: compiled_theirs(x)}))
    return out


def _before_a_layer_norm(op: str, ours, theirs, peer: str, device: str, rows_list, bytes_per_x: int) -> list[Case]:
    """Cases of compiled graphs fn(x, r, u, v) ending in a transformer's LayerNorm, forward + backward, ours
    against `peer`: x and r [rows, HIDDEN], u and v [HIDDEN] (biases, LayerNorm weights), fp32 and bf16;
    bytes_per_x: the ideal traffic in units of x's bytes."""
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for rows in rows_list:
            x, r = (torch.randn(rows, HIDDEN, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
            u, v = (torch.randn(HIDDEN, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
            g = torch.randn(rows, HIDDEN, device=device, dtype=dtype)
            nbytes = x.numel() * x.element_size()
            label = f"{x.numel() / 2**20:g}M {str(dtype).replace('torch.', '')}"
            out.append(grad_case(op, label, bytes_per_x * nbytes, (x, r, u, v), g, ours, {peer: theirs}))
    return out


def _compiled_cases(device: str, rows_list) -> list[Case]:
    """bias_dropout_add inside a compiled graph, before the LayerNorm it feeds in a transformer, forward +
    backward: ours (the kernel op in the graph on the CPU; on CUDA torch's dropout, which Inductor fuses)
    against the plain reference compiled. Traffic: the forward reads x and r and writes the output, the
    backward reads g (and what it saved) and writes dx and dr."""
    import torch.nn.functional as F

    def graph(op):
        return torch.compile(lambda x, r, b, w: F.layer_norm(op(x * 1.5, b, r, P, True), (HIDDEN,), w), dynamic=False)

    return _before_a_layer_norm("bias_dropout_add compiled, before a LayerNorm, fwd+bwd", graph(bias_dropout_add),
                                graph(bias_dropout_add_reference), "compiled reference", device, rows_list, 6)


def host_cases(device: str) -> list[Case]:
    """PhiloxDropout and bias_dropout_add as a model calls them in training, on 2 rows of 8: ours against
    torch's nn.Dropout and F.dropout(x + bias, p, training) + residual."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    x = torch.randn(2, 8, device=device, requires_grad=True)
    bias = torch.randn(8, device=device, requires_grad=True)
    residual = torch.randn(2, 8, device=device, requires_grad=True)

    def theirs():
        return F.dropout(x + bias, P, True) + residual

    ours_dropout, torch_dropout = PhiloxDropout(P), torch.nn.Dropout(P)
    peer = "torch F.dropout(x+bias)+residual"
    return [
        Case("PhiloxDropout fwd", "2x8", 0, lambda: ours_dropout(x), {"torch nn.Dropout": lambda: torch_dropout(x)},
             False),
        Case("PhiloxDropout fwd+bwd", "2x8", 0, lambda: ours_dropout(x).sum().backward(),
             {"torch nn.Dropout": lambda: torch_dropout(x).sum().backward()}, False),
        Case("bias_dropout_add fwd", "2x8", 0, lambda: bias_dropout_add(x, bias, residual, P, True),
             {peer: theirs}, False),
        Case("bias_dropout_add fwd+bwd", "2x8", 0,
             lambda: bias_dropout_add(x, bias, residual, P, True).sum().backward(),
             {peer: lambda: theirs().sum().backward()}, False),
    ]
