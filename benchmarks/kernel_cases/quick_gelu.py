import torch

from accel.runtime.nn.quick_gelu import _ops, quick_gelu, quick_gelu_reference

from . import Case, grad_case


def cases(device: str, quick: bool) -> list[Case]:
    sizes = [1 << 16, 1 << 20] if quick else [1 << 20, 1 << 24, 1 << 26]
    compiled_ref = torch.compile(quick_gelu_reference)
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for n in sizes:
            x = torch.randn(n, device=device, dtype=dtype)
            g = torch.randn_like(x)
            xg = x.clone().requires_grad_()
            nbytes = x.numel() * x.element_size()
            label = f"{n / 2**20:g}M {str(dtype).replace('torch.', '')}"
            out.append(Case("quick_gelu fwd", label, 2 * nbytes, lambda x=x: quick_gelu(x), {
                "torch eager": lambda x=x: x * torch.sigmoid(1.702 * x),
                "torch.compile(ref)": lambda x=x: compiled_ref(x),
            }))
            # backward alone: grad wrt x given the saved input (reads x and g, writes dx)
            out.append(Case("quick_gelu bwd", label, 3 * nbytes,
                            lambda xg=xg, g=g: torch.ops.accel.quick_gelu_bwd(g, xg), {
                "torch autograd": lambda xg=xg, g=g: torch.autograd.grad(
                    xg * torch.sigmoid(1.702 * xg), xg, g)[0],
            }))
    return out + _compiled_cases(device, sizes)


def _in_graph(act):
    """What an MLP compiles around its activation: the bias add before it and a product after it."""
    return lambda x, b: act(x + b) * 2


def _compiled_cases(device: str, sizes) -> list[Case]:
    """quick_gelu inside a compiled graph, forward + backward: ours (which traces as plain ops there, see
    accel.runtime.nn._common.use_kernel_eagerly) against the plain ops and against the kernel op itself in
    the graph (what quick_gelu traced as before 2026-11-27: an extra pass, Inductor cannot fuse it)."""
    _ops()  # torch.ops.accel.quick_gelu_fwd exists from here on
    ours = torch.compile(_in_graph(quick_gelu), dynamic=False)
    peers = {"compiled plain ops": torch.compile(_in_graph(quick_gelu_reference), dynamic=False),
             "compiled accel::quick_gelu_fwd": torch.compile(_in_graph(torch.ops.accel.quick_gelu_fwd), dynamic=False)}
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for n in sizes:
            x = torch.randn(n // 3072 or 1, 3072, device=device, dtype=dtype, requires_grad=True)
            b = torch.randn(3072, device=device, dtype=dtype, requires_grad=True)
            g = torch.randn_like(x)
            nbytes = x.numel() * x.element_size()
            label = f"{x.numel() / 2**20:g}M {str(dtype).replace('torch.', '')}"
            # forward reads x, writes y; backward reads g and x, writes dx
            out.append(grad_case("quick_gelu compiled, between x + b and * 2, fwd+bwd", label, 5 * nbytes,
                                 (x, b), g, ours, peers))
    return out


def host_cases(device: str) -> list[Case]:
    """QuickGELU as a model calls it, on 16 values: the QuickGelu module against the same formula in
    torch's own ops."""
    from accel.runtime.nn.quick_gelu import QuickGelu

    torch.manual_seed(0)
    ours = QuickGelu()
    x = torch.randn(2, 8, device=device, requires_grad=True)

    def theirs(x):
        return x * torch.sigmoid(1.702 * x)

    return [
        Case("quick_gelu fwd", "2x8", 0, lambda: ours(x), {"torch x*sigmoid(1.702x)": lambda: theirs(x)}, False),
        Case("quick_gelu fwd+bwd", "2x8", 0, lambda: ours(x).sum().backward(),
             {"torch x*sigmoid(1.702x)": lambda: theirs(x).sum().backward()}, False),
    ]
