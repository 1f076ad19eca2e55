"""Deformable convolution (DCN v2, with mask): ours vs torchvision.ops.deform_conv2d.

torchvision is the peer on both devices: its CPU kernels sample one element at a time on one
thread and its backward walks the batch in blocks, sampling the inputs three times; its CUDA kernels
are the original dcn_v2 ones. Sizes are ResNet-stage layers of a detector with DCN (64 -> 64 channels,
3x3, at 56x56 and, on CUDA, 128 -> 128 at 100x100), offsets of a trained model (a pixel or two) and
a sigmoid mask. The op is compute-bound (two GEMMs plus the bilinear sampling), so the rows are
judged by time, not by bandwidth.
"""
import torch

from accel.runtime.nn.dcn_v2 import DCNv2, deform_conv2d

from . import Case


def _inputs(batch, channels, size, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, channels, size, size, generator=g)
    offset = torch.randn(batch, 18, size, size, generator=g) * 1.5
    mask = torch.rand(batch, 9, size, size, generator=g)
    weight = torch.randn(channels, channels, 3, 3, generator=g) * (1.0 / (9 * channels) ** 0.5)
    bias = torch.randn(channels, generator=g)
    return [t.to(device=device, dtype=dtype) for t in (x, offset, mask, weight, bias)]


def _fwd_bwd(fn, x, offset, mask, weight, bias, grad):
    y = fn(x, offset, weight, bias, padding=1, mask=mask)
    return torch.autograd.grad(y, (x, offset, mask, weight, bias), grad)


def cases(device: str, quick: bool) -> list[Case]:
    import torchvision

    tv = torchvision.ops.deform_conv2d
    if device.startswith("cuda"):
        sizes = [(8, 64, 56), (8, 128, 100)] if not quick else [(8, 64, 56)]
        dtypes = (torch.float32, torch.float16)
    else:
        sizes = [(8, 64, 56), (4, 128, 64)] if not quick else [(8, 64, 56), (2, 128, 64)]
        dtypes = (torch.float32,)
    out = []
    for dtype in dtypes:
        for batch, channels, size in sizes:
            x, offset, mask, weight, bias = _inputs(batch, channels, size, device, dtype)
            label = f"{batch}x{channels}x{size}x{size} {str(dtype).replace('torch.', '')}"
            # inputs read once, output written once (the floor for an ideal fused kernel)
            nbytes = (x.numel() * 2 + offset.numel() + mask.numel()) * x.element_size()
            out.append(Case("dcn_v2 fwd", label, nbytes,
                            lambda a=(x, offset, weight, bias), m=mask: deform_conv2d(*a, padding=1, mask=m),
                            {"torchvision.ops.deform_conv2d": lambda a=(x, offset, weight, bias), m=mask: tv(
                                *a, padding=1, mask=m)},
                            memory_bound=False))
            leaves = [t.clone().requires_grad_() for t in (x, offset, mask, weight, bias)]
            grad = torch.randn(batch, channels, size, size, device=device, dtype=dtype)
            out.append(Case("dcn_v2 fwd+bwd", label, 3 * nbytes,
                            lambda a=leaves, g=grad: _fwd_bwd(deform_conv2d, *a, g),
                            {"torchvision.ops.deform_conv2d": lambda a=leaves, g=grad: _fwd_bwd(tv, *a, g)},
                            memory_bound=False))
    return out


def host_cases(device: str) -> list[Case]:
    """DCNv2 as a model calls it (offsets and mask from the caller), 4 -> 4 channels 3x3 on one 5x5
    image: our module against torchvision.ops.deform_conv2d with the same parameters."""
    import torchvision

    tv = torchvision.ops.deform_conv2d
    torch.manual_seed(0)
    m = DCNv2(4, 4, 3, padding=1).to(device)
    x = torch.randn(1, 4, 5, 5, device=device, requires_grad=True)
    offset = (torch.randn(1, 18, 5, 5, device=device) * 0.5).requires_grad_()
    mask = torch.rand(1, 9, 5, 5, device=device, requires_grad=True)

    def theirs():
        return tv(x, offset, m.weight, m.bias, padding=1, mask=mask)

    peer = "torchvision.ops.deform_conv2d"
    return [
        Case("dcn_v2 DCNv2 fwd", "1x4x5x5", 0, lambda: m(x, offset, mask), {peer: theirs}, False),
        Case("dcn_v2 DCNv2 fwd+bwd", "1x4x5x5", 0, lambda: m(x, offset, mask).sum().backward(),
             {peer: lambda: theirs().sum().backward()}, False),
    ]
