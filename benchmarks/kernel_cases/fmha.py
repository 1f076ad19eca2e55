import torch

from accel.runtime.nn.fmha import FusedSwinFmha, _ops, fmha_backward_reference, fmha_reference

from . import Case

# Swin-T at 224x224, window 7 (N=49): stage 1 (64 windows, 3 heads) and stage 3 (4 windows, 12 heads).
STAGES = [("stage1", 64, 3), ("stage3", 4, 12)]
N = 49


def _eager(attn, bias, mask, B, nW):
    """What Swin's WindowAttention runs: two broadcast adds and a softmax, in attn's dtype."""
    BnW, nH, N = attn.shape[:3]
    s = attn.view(B, nW, nH, N, N) + bias.unsqueeze(0).unsqueeze(0) + mask.unsqueeze(1).unsqueeze(0)
    return torch.softmax(s.view(BnW, nH, N, N), dim=-1)


def cases(device: str, quick: bool) -> list[Case]:
    batch = 2 if quick else 32
    compiled_fwd = torch.compile(fmha_reference)
    compiled_bwd = torch.compile(fmha_backward_reference)
    out = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for stage, nW, nH in STAGES:
            attn = torch.randn(batch * nW, nH, N, N, device=device, dtype=dtype)
            bias = torch.randn(nH, N, N, device=device, dtype=dtype)
            mask = (torch.rand(nW, N, N, device=device) < 0.3).to(dtype) * -100
            y = FusedSwinFmha.apply(attn, bias, mask, batch, nW, nH, N)
            g = torch.randn_like(y)
            es = attn.element_size()
            big = attn.numel() * es
            small = (bias.numel() + mask.numel()) * es
            label = f"B{batch} {stage} nW{nW} nH{nH} N{N} {str(dtype).replace('torch.', '')}"
            out.append(Case("swin fmha fwd", label, 2 * big + small,
                            lambda a=attn, b=bias, m=mask, nW=nW, nH=nH: FusedSwinFmha.apply(
                                a, b, m, batch, nW, nH, N), {
                "torch eager (add + add + softmax)": lambda a=attn, b=bias, m=mask, nW=nW: _eager(a, b, m, batch, nW),
                "torch.compile(ref)": lambda a=attn, b=bias, m=mask, nW=nW: compiled_fwd(a, b, m, nW),
            }))
            # backward alone, from the saved softmax output: reads g and y, writes dx and the bias grad
            out.append(Case("swin fmha bwd", label, 3 * big + bias.numel() * es,
                            lambda g=g, y=y: _ops().fmha_swin_bwd(g, y), {
                "torch eager (softmax bwd + sum)": lambda g=g, y=y: _eager_backward(g, y),
                "torch.compile(ref)": lambda g=g, y=y: compiled_bwd(g, y),
            }))
    return out


def _eager_backward(g, y):
    """The kernels autograd runs for the eager composition: softmax backward, then the bias add's
    broadcast reduction."""
    dx = torch.ops.aten._softmax_backward_data(g, y, -1, y.dtype)
    return dx, dx.sum(0)


def host_cases(device: str) -> list[Case]:
    """Swin's window attention scores as WindowAttention computes them, on 2 windows of 4 tokens, 2 heads
    (the bias a Parameter, the shift mask a buffer): FusedSwinFmha against the eager two adds + softmax."""
    torch.manual_seed(0)
    B, nW, nH, n = 1, 2, 2, 4
    attn = torch.randn(B * nW, nH, n, n, device=device, requires_grad=True)
    bias = torch.nn.Parameter(torch.randn(nH, n, n, device=device))
    mask = (torch.rand(nW, n, n, device=device) < 0.3).float() * -100
    ours = lambda: FusedSwinFmha.apply(attn, bias, mask, B, nW, nH, n)  # noqa: E731
    theirs = lambda: _eager(attn, bias, mask, B, nW)  # noqa: E731
    peer = "torch eager (add + add + softmax)"
    return [
        Case("fmha fwd", f"{B * nW}x{nH}x{n}x{n}", 0, ours, {peer: theirs}, False),
        Case("fmha fwd+bwd", f"{B * nW}x{nH}x{n}x{n}", 0, lambda: ours().sum().backward(),
             {peer: lambda: theirs().sum().backward()}, False),
    ]
