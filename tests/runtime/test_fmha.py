import math
import os

import pytest
import torch

from accel.runtime.nn.fmha import FusedSwinFmha, fmha_backward_reference, fmha_reference
from accel.utils.xla import xla_available

from ._autograd_probe import ACCEL_RUNTIME, LIBRARY, autograd_kernel, python_calls, ran
from ._params import DEVICES, DTYPES, tol

XLA_ON = bool(xla_available() and os.environ.get("PJRT_DEVICE"))
if XLA_ON:
    # torch's autograd engine sizes its per-device queues at its first backward; start the XLA
    # runtime at collection time, before any CPU backward, or an XLA backward hits an internal assert.
    import torch_xla

    torch_xla.device()


def _swin_reference(attn, bias, mask, B, nW):
    """Swin's WindowAttention written plainly, in float64: view as [B, nW, nH, N, N], add, softmax."""
    BnW, nH, N, _ = attn.shape
    s = attn.double() + bias.double().unsqueeze(0)
    if mask is not None:
        s = (s.view(B, nW, nH, N, N) + mask.double().unsqueeze(1).unsqueeze(0)).view(BnW, nH, N, N)
    return torch.softmax(s, dim=-1)


def _swin_mask(nW, N, device):
    """A shifted-window style mask: 0 inside a region, -100 across regions."""
    region = torch.randint(0, 3, (nW, N), device=device)
    return (region[:, :, None] != region[:, None, :]).float() * -100.0


def test_reference_matches_hand_computed_values():
    attn = torch.tensor([[[[0.0, 1.0], [2.0, -1.0]]]], dtype=torch.float64)  # B*nW=1, nH=1, N=2
    bias = torch.tensor([[[1.0, 0.0], [0.0, 0.5]]], dtype=torch.float64)
    mask = torch.tensor([[[0.0, -100.0], [0.0, 0.0]]], dtype=torch.float64)
    # row 0: scores (1, 1 - 100) -> (1/(1+e^-100), e^-100/(1+e^-100)); row 1: (2, -0.5)
    e = math.exp
    expected = torch.tensor([[[[1 / (1 + e(-100)), e(-100) / (1 + e(-100))],
                               [1 / (1 + e(-2.5)), e(-2.5) / (1 + e(-2.5))]]]], dtype=torch.float64)
    torch.testing.assert_close(fmha_reference(attn, bias, mask, 1), expected)
    torch.testing.assert_close(FusedSwinFmha.apply(attn, bias, mask, 1, 1, 1, 2), expected)


# (B, nW, nH, N): Swin 7x7 (49) and 12x12 (144) windows, odd N, one lane per row (N=1), and N just
# above a power-of-two register count (33, 65).
SHAPES = [(2, 4, 3, 49), (1, 2, 2, 144), (3, 2, 1, 5), (2, 1, 2, 33), (1, 3, 2, 65), (2, 2, 1, 1)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_mask", [True, False], ids=["mask", "nomask"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_backward_match_reference(device, dtype, with_mask, shape):
    B, nW, nH, N = shape
    torch.manual_seed(0)
    attn = (torch.randn(B * nW, nH, N, N, device=device) * 2).to(dtype).requires_grad_()
    bias = torch.randn(nH, N, N, device=device).to(dtype).requires_grad_()
    mask = _swin_mask(nW, N, device).to(dtype) if with_mask else None
    attn_before = attn.detach().clone()
    y = FusedSwinFmha.apply(attn, bias, mask, B, nW, nH, N)
    ar = attn.detach().double().requires_grad_()
    br = bias.detach().double().requires_grad_()
    yr = _swin_reference(ar, br, mask, B, nW)
    assert y.dtype == dtype and y.shape == attn.shape
    assert torch.equal(attn.detach(), attn_before)  # out-of-place
    torch.testing.assert_close(y, yr.to(dtype), **tol(dtype))
    g = torch.randn(y.shape, device=device).to(dtype)
    y.backward(g)
    yr.backward(g.double())
    rtol, atol = tol(dtype).values()
    torch.testing.assert_close(attn.grad, ar.grad.to(dtype), rtol=rtol, atol=atol)
    # the bias grad sums B*nW rounded-size terms: allow the error of one term per window
    torch.testing.assert_close(bias.grad, br.grad.to(dtype), rtol=rtol, atol=atol * B * nW)


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_attn_with_fp32_bias_and_mask(device):
    # Under autocast attn comes out of q @ k^T in fp16 while the bias table stays fp32.
    B, nW, nH, N = 2, 2, 3, 49
    attn = torch.randn(B * nW, nH, N, N, device=device).half().requires_grad_()
    bias = torch.randn(nH, N, N, device=device, requires_grad=True)
    mask = _swin_mask(nW, N, device)
    y = FusedSwinFmha.apply(attn, bias, mask, B, nW, nH, N)
    ar = attn.detach().double().requires_grad_()
    br = bias.detach().double().requires_grad_()
    yr = _swin_reference(ar, br, mask, B, nW)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y, yr.half(), **tol(torch.float16))
    g = torch.randn_like(yr)
    y.backward(g.half())
    yr.backward(g.half().double())
    assert bias.grad.dtype == torch.float32
    torch.testing.assert_close(attn.grad, ar.grad.half(), **tol(torch.float16))
    torch.testing.assert_close(bias.grad, br.grad.float(), rtol=2e-3, atol=1e-3 * B * nW)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_attn_and_bias_with_fp32_mask(device, dtype):
    # bias in attn's dtype, mask not: the CUDA kernel reads both in one dtype, so here it widens them first
    B, nW, nH, N = 2, 2, 3, 49
    torch.manual_seed(0)
    attn = torch.randn(B * nW, nH, N, N, device=device).to(dtype)
    bias = torch.randn(nH, N, N, device=device).to(dtype)
    mask = _swin_mask(nW, N, device)
    y = FusedSwinFmha.apply(attn, bias, mask, B, nW, nH, N)
    torch.testing.assert_close(y, _swin_reference(attn, bias, mask, B, nW).to(dtype), **tol(dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_attn_and_mask_gets_no_grad(device):
    B, nW, nH, N = 2, 2, 2, 7
    attn = torch.randn(B * nW, N, nH, N, device=device).transpose(1, 2)  # [B*nW, nH, N, N], strided
    assert not attn.is_contiguous()
    bias = torch.randn(nH, N, N, device=device)
    mask = _swin_mask(nW, N, device).requires_grad_()
    y = FusedSwinFmha.apply(attn, bias, mask, B, nW, nH, N)
    torch.testing.assert_close(y, _swin_reference(attn, bias, mask.detach(), B, nW).float())
    (y * torch.randn_like(y)).sum().backward()
    assert mask.grad is None  # the mask is a constant of the model: it gets no gradient


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch(device):
    attn = torch.randn(0, 3, 49, 49, device=device, requires_grad=True)
    bias = torch.randn(3, 49, 49, device=device, requires_grad=True)
    y = FusedSwinFmha.apply(attn, bias, None, 0, 4, 3, 49)
    assert y.shape == attn.shape
    y.sum().backward()
    assert torch.equal(bias.grad, torch.zeros_like(bias))


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=DEVICES[1].marks)])
def test_cuda_long_rows_take_the_reference(device):
    # N > 1024 exceeds the one-warp-per-row kernel; it must still be right.
    attn = torch.randn(1, 1, 1030, 1030, device=device, requires_grad=True)
    bias = torch.randn(1, 1030, 1030, device=device, requires_grad=True)
    y = FusedSwinFmha.apply(attn, bias, None, 1, 1, 1, 1030)
    torch.testing.assert_close(y, _swin_reference(attn, bias, None, 1, 1).float())


def test_backward_reference_matches_autograd():
    torch.manual_seed(0)
    attn = torch.randn(6, 2, 5, 5, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(2, 5, 5, dtype=torch.float64, requires_grad=True)
    y = torch.softmax(attn + bias, -1)
    g = torch.randn_like(y)
    y.backward(g)
    dx, dbias = fmha_backward_reference(g, y.detach())
    torch.testing.assert_close(dx, attn.grad)
    torch.testing.assert_close(dbias, bias.grad)


def test_bias_grad_is_reproducible_across_thread_counts():
    torch.manual_seed(0)
    attn = torch.randn(96, 3, 49, 49, requires_grad=True)  # 3 chunks of windows
    bias = torch.randn(3, 49, 49, requires_grad=True)
    g = torch.randn(96, 3, 49, 49)
    grads = []
    threads = torch.get_num_threads()
    try:
        for n in (1, max(2, threads)):
            torch.set_num_threads(n)
            bias.grad = None
            FusedSwinFmha.apply(attn, bias, None, 96, 1, 3, 49).backward(g)
            grads.append(bias.grad.clone())
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("nH, N", [(24, 49), (7, 100)])
def test_cpu_backward_past_one_run_of_heads(nH, N):
    # The CPU backward walks a chunk window by window over a run of heads, as many as its bias-gradient
    # buffers fit (20 of Swin's 49-wide rows, 5 of 100): more heads take several runs per chunk, and two
    # threads split chunks mid-run. Against the float64 reference, and the same bits at 1 and 2 threads.
    torch.manual_seed(0)
    B, nW = 35, 2  # 70 windows: three chunks
    attn, bias = torch.randn(B * nW, nH, N, N), torch.randn(nH, N, N)
    _assert_fp32_matches_swin(attn, bias, _swin_mask(nW, N, "cpu"), B, nW, bias_tol=(1e-5, 1e-5))
    g = torch.randn_like(attn)
    grads = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            b = bias.clone().requires_grad_()
            FusedSwinFmha.apply(attn, b, None, B, nW, nH, N).backward(g)
            grads.append(b.grad)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(grads[0], grads[1])


def test_gradcheck_float64_cpu():
    B, nW, nH, N = 2, 2, 2, 5
    attn = torch.randn(B * nW, nH, N, N, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(nH, N, N, dtype=torch.float64, requires_grad=True)
    mask = _swin_mask(nW, N, "cpu").double() / 50  # moderate values keep the gradients informative
    assert torch.autograd.gradcheck(lambda a, b: FusedSwinFmha.apply(a, b, mask, B, nW, nH, N), (attn, bias))
    assert torch.autograd.gradcheck(lambda a, b: FusedSwinFmha.apply(a, b, None, B, nW, nH, N), (attn, bias))


def test_raw_op_has_gradient():
    from accel.runtime.nn.fmha import _ops
    attn = torch.randn(2, 1, 4, 4, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(1, 4, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.randn(2, 4, 4, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda a, b: _ops().fmha_swin_fwd(a, b, mask, 2), (attn, bias))


def test_torch_compile_fullgraph_forward_and_backward():
    B, nW, nH, N = 2, 2, 3, 49
    mask = _swin_mask(nW, N, "cpu")

    def scores(attn, bias):
        return FusedSwinFmha.apply(attn, bias, mask, B, nW, nH, N) * 3.0

    attn = torch.randn(B * nW, nH, N, N)
    bias = torch.randn(nH, N, N)
    compiled = torch.compile(scores, fullgraph=True)
    a, b = attn.clone().requires_grad_(), bias.clone().requires_grad_()
    ar, br = attn.double().requires_grad_(), bias.double().requires_grad_()
    y = compiled(a, b)
    yr = _swin_reference(ar, br, mask, B, nW) * 3.0
    torch.testing.assert_close(y, yr.float())
    g = torch.randn_like(y)
    y.backward(g)
    yr.backward(g.double())
    torch.testing.assert_close(a.grad, ar.grad.float())
    torch.testing.assert_close(b.grad, br.grad.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not XLA_ON, reason="needs torch_xla with PJRT_DEVICE set (PJRT_DEVICE=CPU works)")
def test_xla_tensors_take_the_reference():
    import torch_xla

    dev = torch_xla.device()
    B, nW, nH, N = 2, 2, 1, 4
    attn, bias = torch.randn(B * nW, nH, N, N), torch.randn(nH, N, N)
    mask = _swin_mask(nW, N, "cpu")
    g = torch.randn(B * nW, nH, N, N)
    a, b = attn.to(dev).requires_grad_(), bias.to(dev).requires_grad_()
    y = FusedSwinFmha.apply(a, b, mask.to(dev), B, nW, nH, N)
    y.backward(g.to(dev))
    ar, br = attn.double().requires_grad_(), bias.double().requires_grad_()
    yr = _swin_reference(ar, br, mask, B, nW)
    yr.backward(g.double())
    torch.testing.assert_close(y.cpu(), yr.float())
    torch.testing.assert_close(a.grad.cpu(), ar.grad.float())
    torch.testing.assert_close(b.grad.cpu(), br.grad.float())


def test_bad_input_names_argument():
    B, nW, nH, N = 2, 2, 3, 9
    attn = torch.randn(B * nW, nH, N, N)
    bias = torch.randn(nH, N, N)
    mask = torch.zeros(nW, N, N)
    with pytest.raises(ValueError, match="attn"):
        FusedSwinFmha.apply(attn[0], bias, mask, B, nW, nH, N)
    with pytest.raises(ValueError, match="attn"):
        FusedSwinFmha.apply(attn[..., :-1], bias, mask, B, nW, nH, N)
    with pytest.raises(TypeError, match="attn"):
        FusedSwinFmha.apply(attn.long(), bias, mask, B, nW, nH, N)
    with pytest.raises(ValueError, match="relative_pos_bias"):
        FusedSwinFmha.apply(attn, bias[:2], mask, B, nW, nH, N)
    with pytest.raises(ValueError, match="relative_pos_bias"):
        FusedSwinFmha.apply(attn, bias.unsqueeze(0), mask, B, nW, nH, N)
    with pytest.raises(ValueError, match="attn_mask"):
        FusedSwinFmha.apply(attn, bias, torch.zeros(nW + 1, N, N), B, nW, nH, N)
    with pytest.raises(ValueError, match="batch_size"):
        FusedSwinFmha.apply(attn, bias, mask, B + 1, nW, nH, N)
    with pytest.raises(ValueError, match="window_num"):
        FusedSwinFmha.apply(attn, bias, None, B, nW + 1, nH, N)
    with pytest.raises(ValueError, match="num_head"):
        FusedSwinFmha.apply(attn, bias, mask, B, nW, nH + 1, N)
    with pytest.raises(ValueError, match="window_len"):
        FusedSwinFmha.apply(attn, bias, mask, B, nW, nH, N + 1)
    with pytest.raises(ValueError, match="window_len"):
        FusedSwinFmha.apply(attn, bias, mask, B, nW, nH, 2.5)
    # the window side is accepted for window_len (N = 3 * 3)
    torch.testing.assert_close(FusedSwinFmha.apply(attn, bias, mask, B, nW, nH, 3),
                               _swin_reference(attn, bias, mask, B, nW).float())


def test_fp32_cpu_accuracy_over_the_whole_score_range():
    # Each row is [x, 0]: its softmax is e^x / (1 + e^x), exercising the kernel's exponential from
    # 0 down to float underflow; compare with float64 on the same (float-rounded) scores.
    x = torch.linspace(-110, 0, 20001).float()
    attn = torch.stack([x, torch.zeros_like(x)], -1).view(-1, 1, 1, 2).expand(-1, 1, 2, 2).contiguous()
    y = FusedSwinFmha.apply(attn, torch.zeros(1, 2, 2), None, attn.shape[0], 1, 1, 2)
    ref = torch.softmax(attn.double(), -1)
    normal = ref > 1e-37
    torch.testing.assert_close(y.double()[normal], ref[normal], rtol=2e-6, atol=0)
    assert torch.all(y.double()[~normal] <= 1e-37)


@pytest.mark.parametrize("device", DEVICES)
def test_fully_masked_and_nan_rows_match_torch_softmax(device):
    # torch.softmax gives NaN for a row of -inf and for a row holding a NaN; the kernels must match it
    # (and leave the other rows finite), not invent zeros or a uniform row.
    B, nW, nH, N = 1, 2, 2, 40
    attn = torch.randn(B * nW, nH, N, N, device=device)
    attn[1, 0, 5, 7] = float("nan")
    bias = torch.randn(nH, N, N, device=device)
    mask = torch.zeros(nW, N, N, device=device)
    mask[0, 3] = float("-inf")  # row 3 of window 0, every head
    mask[1, 9, ::2] = float("-inf")  # half masked: finite
    y = FusedSwinFmha.apply(attn, bias, mask, B, nW, nH, N)
    ref = _swin_reference(attn, bias, mask, B, nW).float()
    torch.testing.assert_close(y, ref, equal_nan=True)
    nan_rows = y.isnan().any(-1)
    assert torch.equal(nan_rows, y.isnan().all(-1))
    assert nan_rows.sum() == nH + 1


def _assert_fp32_matches_swin(attn, bias, mask, B, nW, bias_tol):
    """FusedSwinFmha on fp32 leaves attn and bias, forward and backward, against the float64
    reference; bias_tol is the (rtol, atol) of the bias gradient, a sum over B*nW windows."""
    nH, N = attn.shape[1], attn.shape[-1]
    a, b = attn.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
    ar, br = attn.detach().double().requires_grad_(), bias.detach().double().requires_grad_()
    y = FusedSwinFmha.apply(a, b, mask, B, nW, nH, N)
    yr = _swin_reference(ar, br, mask, B, nW)
    assert y.device == attn.device
    torch.testing.assert_close(y, yr.float())
    g = torch.randn_like(y)
    y.backward(g)
    yr.backward(g.double())
    torch.testing.assert_close(a.grad, ar.grad.float())
    torch.testing.assert_close(b.grad, br.grad.float(), rtol=bias_tol[0], atol=bias_tol[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("N", [513, 1024])
def test_longest_rows_the_cuda_kernel_takes(device, N):
    # N in (512, 1024]: 32 values per lane, the largest register tile.
    torch.manual_seed(0)
    attn, bias = torch.randn(2, 1, N, N, device=device), torch.randn(1, N, N, device=device)
    _assert_fp32_matches_swin(attn, bias, _swin_mask(2, N, device), 1, 2, bias_tol=(1e-5, 2e-6))


# (B, nW, nH, N, bias-gradient tolerance): many windows. 66000 window-heads (rows beyond any gridDim.y/z) of
# N = 4, enough windows that the CUDA bias gradient is summed over several chunks (33000 fp32 terms per bias
# element); 256 windows of Swin's 49 (stage-1 heads), where the CUDA fp32 backward's warps take eight windows at a
# time, in 8 chunks of 32 on an H100's 132 SMs; 36 windows, a second chunk of 4 (a part-filled pass); 16 heads
# of 49 (784 bias rows, 4 blocks an SM on GPUs of up to 196 SMs) over 32 windows: one chunk, no second kernel.
MANY_WINDOWS = [pytest.param(1100, 30, 2, 4, (1e-4, 1e-3), id="66000-window-heads"),
                pytest.param(64, 4, 3, 49, (1e-5, 1e-5), id="256-swin-windows"),
                pytest.param(9, 4, 3, 49, (1e-5, 1e-5), id="36-swin-windows"),
                pytest.param(8, 4, 16, 49, (1e-5, 1e-5), id="16-heads-one-chunk")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("B,nW,nH,N,bias_tol", MANY_WINDOWS)
def test_many_windows(device, B, nW, nH, N, bias_tol):
    torch.manual_seed(0)
    attn, bias = torch.randn(B * nW, nH, N, N, device=device), torch.randn(nH, N, N, device=device)
    _assert_fp32_matches_swin(attn, bias, _swin_mask(nW, N, device), B, nW, bias_tol=bias_tol)


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=DEVICES[1].marks)])
def test_cuda_bias_grad_is_bitwise_reproducible(device):
    # The bias gradient is reduced without atomics in a fixed order: two runs agree to the bit.
    torch.manual_seed(0)
    attn = torch.randn(512, 3, 49, 49, device=device, requires_grad=True)
    bias = torch.randn(3, 49, 49, device=device, requires_grad=True)
    g = torch.randn(512, 3, 49, 49, device=device)
    grads = []
    for _ in range(2):
        bias.grad = None
        FusedSwinFmha.apply(attn, bias, None, 512, 1, 3, 49).backward(g)
        grads.append(bias.grad.clone())
    assert torch.equal(grads[0], grads[1])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cuda_second_device():
    device = "cuda:1"
    B, nW, nH, N = 2, 2, 3, 49
    attn, bias = torch.randn(B * nW, nH, N, N, device=device), torch.randn(nH, N, N, device=device)
    _assert_fp32_matches_swin(attn, bias, _swin_mask(nW, N, device), B, nW, bias_tol=(1e-5, 1e-5))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_mask", [True, False])
def test_gradgradcheck_float64(device, with_mask):
    # second derivatives (through the backward op's own gradient) against finite differences
    torch.manual_seed(13)
    B, nW, nH, N = 2, 2, 2, 5
    attn = torch.randn(B * nW, nH, N, N, dtype=torch.float64, device=device, requires_grad=True)
    bias = torch.randn(nH, N, N, dtype=torch.float64, device=device, requires_grad=True)
    mask = _swin_mask(nW, N, device).double() / 50 if with_mask else None
    assert torch.autograd.gradgradcheck(lambda a, b: FusedSwinFmha.apply(a, b, mask, B, nW, nH, N), (attn, bias))

    def first_derivative(a, b):
        y = FusedSwinFmha.apply(a, b, mask, B, nW, nH, N)
        return torch.autograd.grad((y.square() * a).sum(), (a, b), create_graph=True)

    assert torch.autograd.gradcheck(first_derivative, (attn, bias))
    assert torch.autograd.gradgradcheck(first_derivative, (attn, bias))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gradient_penalty_matches_plain_softmax(device, dtype):
    # loss + |d loss / d attn|^2 + |d loss / d bias|^2, differentiated again, against Swin's attention
    # written in plain PyTorch
    torch.manual_seed(14)
    B, nW, nH, N = 2, 3, 2, 49
    attn0 = torch.randn(B * nW, nH, N, N, dtype=dtype, device=device)
    bias0 = torch.randn(nH, N, N, dtype=dtype, device=device)
    mask = _swin_mask(nW, N, device).to(dtype)
    c = torch.randn(B * nW, nH, N, N, dtype=dtype, device=device)

    def grads(fn):
        a, b = attn0.clone().requires_grad_(), bias0.clone().requires_grad_()
        loss = (fn(a, b).square() * c).sum()
        ga, gb = torch.autograd.grad(loss, (a, b), create_graph=True)
        return torch.autograd.grad(loss + ga.square().sum() + gb.square().sum(), (a, b))

    ours = grads(lambda a, b: FusedSwinFmha.apply(a, b, mask, B, nW, nH, N))
    ref = grads(lambda a, b: _swin_reference(a, b, mask, B, nW).to(dtype))
    for o, r in zip(ours, ref):
        torch.testing.assert_close(o, r, **(tol(dtype) if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-4}))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", ["kernel", "reference"])
def test_kernel_and_reference_paths_have_the_same_gradients(device, path, monkeypatch):
    # the reference path (XLA, long CUDA rows) is plain autograd; forced here on a kernel device.
    # On both the mask gets no gradient and the bias gradient has the bias's dtype.
    import accel.runtime.nn.fmha as fmha_module

    if path == "reference":
        monkeypatch.setattr(fmha_module, "_kernel_for", lambda attn: False)
    torch.manual_seed(15)
    B, nW, nH, N = 2, 2, 2, 7
    attn = torch.randn(B * nW, nH, N, N, device=device).half().requires_grad_()
    bias = torch.randn(nH, N, N, device=device, requires_grad=True)
    mask = _swin_mask(nW, N, device).requires_grad_()
    y = FusedSwinFmha.apply(attn, bias, mask, B, nW, nH, N)
    g = torch.randn_like(y)
    y.backward(g)
    assert mask.grad is None and attn.grad.dtype == torch.float16 and bias.grad.dtype == torch.float32
    ar, br = attn.detach().double().requires_grad_(), bias.detach().double().requires_grad_()
    _swin_reference(ar, br, mask.detach(), B, nW).backward(g.double())
    torch.testing.assert_close(attn.grad, ar.grad.half(), **tol(torch.float16))
    torch.testing.assert_close(bias.grad, br.grad.float(), rtol=2e-3, atol=2e-3)


def test_gradient_is_cpp_and_an_ordinary_backward_runs_no_python():
    # fmha_swin_fwd's gradient is C++ (csrc/autograd/fmha_autograd.cpp): neither the forward nor an
    # ordinary backward runs a torch.library.register_autograd gradient's Python (torch/_library/) or
    # our own (accel/runtime/nn/); fmha_swin_bwd is called below autograd. (The CPU autograd engine runs
    # a CPU graph on the calling thread, where the profile hook sees it.) The gradients still match.
    B, nW, nH, N = 2, 2, 3, 6
    attn = torch.randn(B * nW, nH, N, N).half().requires_grad_()
    bias = torch.randn(nH, N, N, requires_grad=True)
    mask = _swin_mask(nW, N, "cpu").requires_grad_()
    g = torch.randn(B * nW, nH, N, N).half()
    FusedSwinFmha.apply(attn, bias, mask, B, nW, nH, N)  # loads the kernels outside the profiled calls
    assert "fmha_autograd.cpp" in autograd_kernel("accel::fmha_swin_fwd")
    y, fwd_files = python_calls(lambda: FusedSwinFmha.apply(attn, bias, mask, B, nW, nH, N))
    (da, db), bwd_files = python_calls(lambda: torch.autograd.grad(y, (attn, bias), g))
    assert not ran(fwd_files, LIBRARY)
    assert not ran(bwd_files, LIBRARY, ACCEL_RUNTIME)
    # the mask gets no gradient, the bias's has the bias's dtype
    FusedSwinFmha.apply(attn, bias, mask, B, nW, nH, N).backward(g)
    assert mask.grad is None and da.dtype == torch.float16 and db.dtype == torch.float32
    ar, br = attn.detach().double().requires_grad_(), bias.detach().double().requires_grad_()
    dar, dbr = torch.autograd.grad(_swin_reference(ar, br, mask.detach(), B, nW), (ar, br), g.double())
    torch.testing.assert_close(da, dar.half(), **tol(torch.float16))
    torch.testing.assert_close(db, dbr.float(), rtol=2e-3, atol=2e-3)
