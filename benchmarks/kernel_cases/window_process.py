import torch

from accel.runtime.nn.window_process import (
    WindowProcess,
    WindowProcessReverse,
    _ops,
    window_process_reference,
    window_process_reverse_reference,
)

from . import Case, grad_case

# Swin-T at 224x224: (H=W, C) of stages 1 and 3, window 7, shift 3 (the shifted blocks).
STAGES = [("stage1", 56, 96), ("stage3", 14, 384)]


def cases(device: str, quick: bool) -> list[Case]:
    batch = 2 if quick else 32
    ws, shift = 7, 3
    partition_ref = torch.compile(window_process_reference)
    reverse_ref = torch.compile(window_process_reverse_reference)
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for stage, hw, c in STAGES:
            x = torch.randn(batch, hw, hw, c, device=device, dtype=dtype)
            windows = window_process_reference(x, -shift, ws).contiguous()
            nbytes = 2 * x.numel() * x.element_size()  # read once, write once
            label = f"B{batch} {stage} {hw}x{hw}x{c} {str(dtype).replace('torch.', '')}"
            # the partition's backward is the reverse op and vice versa: these two rows cover all four
            out.append(Case("window_process partition", label, nbytes,
                            lambda x=x, b=batch, h=hw, c=c: WindowProcess.apply(x, b, h, h, c, -shift, ws), {
                "torch eager (roll + partition)": lambda x=x: window_process_reference(x, -shift, ws),
                "torch.compile(ref)": lambda x=x: partition_ref(x, -shift, ws),
            }))
            out.append(Case("window_process reverse", label, nbytes,
                            lambda w=windows, b=batch, h=hw, c=c: WindowProcessReverse.apply(w, b, h, h, c, shift, ws), {
                "torch eager (reverse + roll)": lambda w=windows, h=hw: window_process_reverse_reference(
                    w, h, h, shift, ws),
                "torch.compile(ref)": lambda w=windows, h=hw: reverse_ref(w, h, h, shift, ws),
            }))
    return out + _compiled_cases(device, batch)


def _compiled_cases(device: str, batch: int) -> list[Case]:
    """A shifted Swin block's window ops inside a compiled graph, forward + backward, with the LayerNorm
    before them: ours (plain ops there, accel.runtime.nn._common.use_kernel_eagerly) against the plain ops
    and against the kernel ops themselves in the graph (what they traced as before 2026-11-27)."""
    import torch.nn.functional as F

    ws, shift = 7, 3
    _ops()  # torch.ops.accel.window_process_* exist from here on

    def block(partition, reverse):
        def f(x, w):
            h = x.shape[1]
            windows = partition(F.layer_norm(x, x.shape[-1:], w), h)
            return reverse(windows * 2, h) + x
        return torch.compile(f, dynamic=False)

    B = batch
    ours = block(lambda t, h: WindowProcess.apply(t, B, h, h, t.shape[-1], -shift, ws),
                 lambda t, h: WindowProcessReverse.apply(t, B, h, h, t.shape[-1], shift, ws))
    peers = {
        "compiled plain ops": block(lambda t, h: window_process_reference(t, -shift, ws),
                                    lambda t, h: window_process_reverse_reference(t, h, h, shift, ws)),
        "compiled accel ops": block(lambda t, h: torch.ops.accel.window_process_partition(t, ws, -shift),
                                    lambda t, h: torch.ops.accel.window_process_reverse(t, h, h, ws, shift)),
    }
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for stage, hw, c in STAGES:
            x = torch.randn(batch, hw, hw, c, device=device, dtype=dtype, requires_grad=True)
            w = torch.ones(c, device=device, dtype=dtype, requires_grad=True)
            g = torch.randn_like(x)
            nbytes = x.numel() * x.element_size()
            label = f"B{batch} {stage} {hw}x{hw}x{c} {str(dtype).replace('torch.', '')}"
            # forward reads x, writes the output; backward reads g and x, writes dx
            out.append(grad_case("window_process compiled, LayerNorm -> partition -> reverse, fwd+bwd", label,
                                 5 * nbytes, (x, w), g, ours, peers))
    return out


def host_cases(device: str) -> list[Case]:
    """A shifted Swin block's window ops on a 1x4x4x2 map, window 2, shift 1: WindowProcess and
    WindowProcessReverse against their plain-PyTorch references (roll + window partition / reverse)."""
    torch.manual_seed(0)
    B, H, W, C, ws, shift = 1, 4, 4, 2, 2, 1
    x = torch.randn(B, H, W, C, device=device, requires_grad=True)
    windows = torch.randn(B * (H // ws) * (W // ws), ws, ws, C, device=device, requires_grad=True)
    part = lambda: WindowProcess.apply(x, B, H, W, C, -shift, ws)  # noqa: E731
    part_ref = lambda: window_process_reference(x, -shift, ws)  # noqa: E731
    rev = lambda: WindowProcessReverse.apply(windows, B, H, W, C, shift, ws)  # noqa: E731
    rev_ref = lambda: window_process_reverse_reference(windows, H, W, shift, ws)  # noqa: E731
    size = f"{B}x{H}x{W}x{C} ws{ws}"
    return [
        Case("window_process partition fwd", size, 0, part, {"torch (roll + partition)": part_ref}, False),
        Case("window_process partition fwd+bwd", size, 0, lambda: part().sum().backward(),
             {"torch (roll + partition)": lambda: part_ref().sum().backward()}, False),
        Case("window_process reverse fwd", size, 0, rev, {"torch (reverse + roll)": rev_ref}, False),
        Case("window_process reverse fwd+bwd", size, 0, lambda: rev().sum().backward(),
             {"torch (reverse + roll)": lambda: rev_ref().sum().backward()}, False),
    ]
