import os

import pytest
import torch

from accel.runtime.nn.window_process import (
    WindowProcess,
    WindowProcessReverse,
    window_partition,
    window_process_reference,
    window_process_reverse_reference,
    window_reverse,
)
from accel.utils.xla import xla_available

from ._autograd_probe import ACCEL_RUNTIME, LIBRARY, autograd_kernel, python_calls, ran
from ._params import DEVICES, DTYPES
from ._tracing import accel_ops, traced_ops

XLA_ON = bool(xla_available() and os.environ.get("PJRT_DEVICE"))
if XLA_ON:
    # torch's autograd engine sizes its per-device queues at its first backward; start the XLA
    # runtime at collection time, before any CPU backward, or an XLA backward hits an internal assert.
    import torch_xla

    torch_xla.device()


def _partition_by_loops(x, shift, ws):
    """The definition written out element by element: window (b, wh, ww), pixel (i, j) of the rolled x."""
    B, H, W, C = x.shape
    nWh, nWw = H // ws, W // ws
    out = torch.empty(B * nWh * nWw, ws, ws, C, dtype=x.dtype)
    for b in range(B):
        for wh in range(nWh):
            for ww in range(nWw):
                for i in range(ws):
                    for j in range(ws):
                        # torch.roll(x, s)[h] == x[(h - s) mod H]
                        out[(b * nWh + wh) * nWw + ww, i, j] = x[b, (wh * ws + i - shift) % H,
                                                                 (ww * ws + j - shift) % W]
    return out


# (B, H, W, C, window_size, shift): H != W, odd C (no vector width divides the row), shifts of both
# signs, zero, and larger than H or W (torch.roll wraps them).
GEOMETRIES = [
    (2, 14, 21, 5, 7, -3),
    (1, 8, 12, 16, 4, 2),
    (3, 6, 9, 3, 3, 0),
    (1, 4, 6, 8, 2, 7),
    (2, 10, 5, 1, 5, -13),
    (1, 12, 8, 96, 4, -2),
]


def test_references_match_the_definition_written_out():
    torch.manual_seed(0)
    for B, H, W, C, ws, shift in [(2, 6, 9, 2, 3, -1), (1, 4, 8, 3, 2, 5)]:
        x = torch.randn(B, H, W, C, dtype=torch.float64)
        windows = window_process_reference(x, shift, ws)
        assert torch.equal(windows, _partition_by_loops(x, shift, ws))
        assert torch.equal(window_reverse(window_partition(x, ws), ws, H, W), x)
        assert torch.equal(window_process_reverse_reference(windows, H, W, -shift, ws), x)


def _partition_case(B, H, W, C, ws, shift):
    """(input shape, the op, its plain-PyTorch definition) for WindowProcess."""
    return ((B, H, W, C), lambda t: WindowProcess.apply(t, B, H, W, C, shift, ws),
            lambda t: window_partition(torch.roll(t, (shift, shift), (1, 2)), ws))


def _reverse_case(B, H, W, C, ws, shift):
    """The same for WindowProcessReverse."""
    nW = (H // ws) * (W // ws)
    return ((B * nW, ws, ws, C), lambda t: WindowProcessReverse.apply(t, B, H, W, C, shift, ws),
            lambda t: torch.roll(window_reverse(t, ws, H, W), (shift, shift), (1, 2)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "x".join(map(str, g)))
@pytest.mark.parametrize("case", [_partition_case, _reverse_case], ids=["partition", "reverse"])
def test_forward_backward_match_reference(device, dtype, geometry, case):
    shape, op, reference = case(*geometry)
    torch.manual_seed(0)
    x = torch.randn(shape, device=device).to(dtype).requires_grad_()
    xr = x.detach().clone().requires_grad_()
    y, yr = op(x), reference(xr)
    assert y.shape == yr.shape and y.dtype == dtype
    assert torch.equal(y, yr)  # a permutation: bit-exact
    g = torch.randn(yr.shape, device=device).to(dtype)
    y.backward(g)
    yr.backward(g)
    assert torch.equal(x.grad, xr.grad)


@pytest.mark.parametrize("device", DEVICES)
def test_round_trip_is_identity(device):
    x = torch.randn(2, 14, 28, 6, device=device)
    for shift in (-3, 0, 3):
        windows = WindowProcess.apply(x, 2, 14, 28, 6, -shift, 7)
        assert torch.equal(WindowProcessReverse.apply(windows, 2, 14, 28, 6, shift, 7), x)


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_input(device):
    base = torch.randn(2, 12, 16, 10, device=device)
    x = base[..., ::2]  # [2, 12, 16, 5], strided last dim
    assert not x.is_contiguous()
    torch.testing.assert_close(WindowProcess.apply(x, 2, 12, 16, 5, -2, 4),
                               window_process_reference(x, -2, 4), rtol=0, atol=0)
    w = torch.randn(24, 4, 4, 10, device=device).transpose(1, 2)
    assert not w.is_contiguous()
    torch.testing.assert_close(WindowProcessReverse.apply(w, 2, 12, 16, 10, 2, 4),
                               window_process_reverse_reference(w, 12, 16, 2, 4), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch_and_channels(device):
    x = torch.randn(0, 8, 8, 4, device=device)
    assert WindowProcess.apply(x, 0, 8, 8, 4, 1, 4).shape == (0, 4, 4, 4)
    x = torch.randn(2, 8, 8, 0, device=device)
    assert WindowProcess.apply(x, 2, 8, 8, 0, 1, 4).shape == (8, 4, 4, 0)
    w = torch.randn(0, 4, 4, 3, device=device)
    assert WindowProcessReverse.apply(w, 0, 8, 8, 3, -1, 4).shape == (0, 8, 8, 3)


@pytest.mark.parametrize("device", DEVICES)
def test_more_than_65535_windows(device):
    # window_size 1 makes every pixel a window: 257 * 256 = 65792 windows, beyond a gridDim.y/z limit.
    x = torch.randn(1, 257, 256, 3, device=device)
    y = WindowProcess.apply(x, 1, 257, 256, 3, 5, 1)
    assert y.shape[0] == 65792
    assert torch.equal(y, window_process_reference(x, 5, 1))
    assert torch.equal(WindowProcessReverse.apply(y, 1, 257, 256, 3, -5, 1), x)


def test_gradcheck_float64_cpu():
    x = torch.randn(2, 6, 9, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: WindowProcess.apply(t, 2, 6, 9, 3, -1, 3), (x,))
    w = torch.randn(12, 3, 3, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: WindowProcessReverse.apply(t, 2, 6, 9, 3, 2, 3), (w,))


def test_raw_ops_have_gradients():
    from accel.runtime.nn.window_process import _ops
    x = torch.randn(1, 4, 6, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: _ops().window_process_partition(t, 2, 1), (x,))
    w = torch.randn(6, 2, 2, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: _ops().window_process_reverse(t, 4, 6, 2, -1), (w,))


def test_torch_compile_fullgraph_forward_and_backward():
    def block(x):
        windows = WindowProcess.apply(x, 2, 8, 12, 5, -2, 4)
        return WindowProcessReverse.apply(windows * 2.0, 2, 8, 12, 5, 2, 4)

    def block_ref(x):
        windows = window_partition(torch.roll(x, (-2, -2), (1, 2)), 4)
        return torch.roll(window_reverse(windows * 2.0, 4, 8, 12), (2, 2), (1, 2))

    x = torch.randn(2, 8, 12, 5)
    compiled = torch.compile(block, fullgraph=True)
    xc = x.clone().requires_grad_()
    xr = x.clone().requires_grad_()
    y, yr = compiled(xc), block_ref(xr)
    torch.testing.assert_close(y, yr, rtol=0, atol=0)
    g = torch.randn_like(yr)
    y.backward(g)
    yr.backward(g)
    torch.testing.assert_close(xc.grad, xr.grad, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_compiled_code_takes_the_plain_ops_where_inductor_wins(device, dtype):
    """Under torch.compile the ops are the roll and the permute in plain ops, which Inductor fuses into the
    kernels next to them, except for 16-bit tensors on the CPU, where the kernels win (_kernel_for)."""
    WindowProcess.apply(torch.zeros(1, 4, 4, 1), 1, 4, 4, 1, 1, 2)  # loads the kernels

    def block(x):
        windows = WindowProcess.apply(x.to(dtype) * 2, 2, 8, 12, 5, -2, 4)
        return WindowProcessReverse.apply(windows, 2, 8, 12, 5, 2, 4)

    ops = traced_ops(block, device, shape=(2, 8, 12, 5))
    if device == "cpu" and dtype == torch.bfloat16:
        assert accel_ops(ops) == {"accel.window_process_partition.default", "accel.window_process_reverse.default"}
    else:
        assert not accel_ops(ops) and "aten.roll.default" in ops, ops


@pytest.mark.skipif(not XLA_ON, reason="needs torch_xla with PJRT_DEVICE set (PJRT_DEVICE=CPU works)")
def test_xla_tensors_take_the_reference():
    import torch_xla

    dev = torch_xla.device()
    x = torch.randn(1, 4, 6, 3)
    xx = x.to(dev).requires_grad_()
    windows = WindowProcess.apply(xx, 1, 4, 6, 3, -1, 2)
    y = WindowProcessReverse.apply(windows * 2.0, 1, 4, 6, 3, 1, 2)
    y.sum().backward()
    torch.testing.assert_close(windows.cpu(), _partition_by_loops(x, -1, 2), rtol=0, atol=0)
    torch.testing.assert_close(y.cpu(), 2.0 * x, rtol=0, atol=0)
    torch.testing.assert_close(xx.grad.cpu(), torch.full_like(x, 2.0), rtol=0, atol=0)


def test_bad_input_names_argument():
    x = torch.randn(2, 14, 21, 5)
    with pytest.raises(ValueError, match="window_size"):
        WindowProcess.apply(x, 2, 14, 21, 5, 0, 4)  # 4 divides neither 14 nor 21
    with pytest.raises(ValueError, match="window_size"):
        WindowProcess.apply(x, 2, 14, 21, 5, 0, 0)
    with pytest.raises(ValueError, match="x"):
        WindowProcess.apply(x.view(2, 294, 5), 2, 14, 21, 5, 0, 7)
    with pytest.raises(ValueError, match=r"x: expected shape \(B, H, W, C\)"):
        WindowProcess.apply(x, 2, 21, 14, 5, 0, 7)  # B*H*W*C agrees, the shape does not
    with pytest.raises(TypeError, match="x"):
        WindowProcess.apply(torch.arange(8).view(1, 2, 2, 2), 1, 2, 2, 2, 0, 1)
    with pytest.raises(TypeError, match="shift_size: expected an int, got float"):
        WindowProcess.apply(x, 2, 14, 21, 5, 1.5, 7)
    w = torch.randn(12, 7, 7, 5)
    with pytest.raises(ValueError, match="windows"):
        WindowProcessReverse.apply(w.view(12, 49, 5), 2, 14, 21, 5, 0, 7)
    with pytest.raises(ValueError, match="windows"):
        WindowProcessReverse.apply(w, 3, 14, 21, 5, 0, 7)  # 12 windows cannot hold B=3
    with pytest.raises(ValueError, match="window_size"):
        WindowProcessReverse.apply(w, 2, 14, 21, 5, 0, 5)


INT64_MAX = 2 ** 63 - 1
SHIFT_RANGE = r"shift_size: expected an int in \[-9223372036854775807, 9223372036854775807\], got "


@pytest.mark.parametrize("device", DEVICES)
def test_shift_beyond_int64_names_the_argument_and_its_range(device):
    # Issue 11.10: shift=2**63 passed the per-call fast path, and the op's schema said "Expected a value of
    # type 'int' for argument 'shift' but instead found type 'int'". -2**63 fits an int64, but the
    # backward's shift, its negation, does not: it wrapped to -2**63 and gave a wrong gradient.
    x = torch.randn(2, 6, 3, 4, device=device)
    w = WindowProcess.apply(x, 2, 6, 3, 4, 1, 3)
    for shift in (2 ** 63, -2 ** 63, 2 ** 64, -2 ** 100):
        with pytest.raises(ValueError, match=SHIFT_RANGE + str(shift)):
            WindowProcess.apply(x, 2, 6, 3, 4, shift, 3)
        with pytest.raises(ValueError, match=SHIFT_RANGE + str(shift)):
            WindowProcessReverse.apply(w, 2, 6, 3, 4, shift, 3)
    # the extreme shifts that remain roll as torch.roll would, forward and backward (torch.roll itself
    # refuses shifts this large: c10::SymInt takes them for symbolic; the reference rolls by the shift
    # reduced modulo H and W)
    for shift in (INT64_MAX, -INT64_MAX):
        rolls = (shift % 6, shift % 3)

        def partition_ref(t):
            return window_partition(torch.roll(t, rolls, (1, 2)), 3)

        def reverse_ref(t):
            return torch.roll(window_reverse(t, 3, 6, 3), rolls, (1, 2))

        for op, inp, ref in ((WindowProcess, x, partition_ref), (WindowProcessReverse, w, reverse_ref)):
            t = inp.clone().requires_grad_()
            tr = inp.clone().requires_grad_()
            out, out_ref = op.apply(t, 2, 6, 3, 4, shift, 3), ref(tr)
            torch.testing.assert_close(out, out_ref, rtol=0, atol=0)
            g = torch.randn_like(out)
            out.backward(g)
            out_ref.backward(g)
            torch.testing.assert_close(t.grad, tr.grad, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_sizes_beyond_int64_name_the_argument_and_its_range(device):
    # An empty batch (B = 0, or C = 0) leaves H and W unbounded by any tensor's shape: values beyond the
    # ops' int64 reached the schema's "found type 'int'" error, and an H * W past 2**63 a window count that
    # wrapped to 0, which the CPU kernel divided by (SIGFPE: the process died).
    w = torch.empty(0, 2, 2, 3, device=device)
    x = torch.empty(0, 4, 4, 3, device=device)
    big = 2 ** 64
    cases = [
        (WindowProcessReverse, w, (0, big, 2, 3, 0, 2), r"H: expected an int in \[1, 9223372036854775807\], got " + str(big)),
        (WindowProcessReverse, w, (0, 2, big, 3, 0, 2), r"W: expected an int in \[1, 9223372036854775807\], got " + str(big)),
        (WindowProcessReverse, w, (0, 2, 2, 3, 0, 2 ** 63), r"window_size: expected an int in \[1, 9223372036854775807\]"),
        (WindowProcessReverse, w, (big, 2, 2, 3, 0, 2), r"B: expected an int in \[0, 9223372036854775807\]"),
        (WindowProcessReverse, w, (0, 2, 2, big, 0, 2), r"C: expected an int in \[0, 9223372036854775807\]"),
        (WindowProcessReverse, w, (0, -2, 2, 3, 0, 2), r"H: expected an int in \[1, 9223372036854775807\], got -2"),
        (WindowProcessReverse, w, (0, 2 ** 62, 2 ** 62, 3, 0, 2),
         r"H, W, C: expected H \* W \* max\(C, 1\) <= 2\*\*63 - 1, got H=4611686018427387904, W=4611686018427387904"),
        (WindowProcessReverse, w[..., :0], (0, 2 ** 62, 4, 0, 0, 2), r"H, W, C: expected"),
        (WindowProcess, x, (0, 4, 4, 3, 0, -1), r"window_size: expected an int in \[1, 9223372036854775807\], got -1"),
        (WindowProcess, x, (0, 4, 4, -3, 0, 2), r"C: expected an int in \[0, 9223372036854775807\], got -3"),
    ]
    for op, t, args, message in cases:
        with pytest.raises(ValueError, match=message):
            op.apply(t, *args)
    # the largest empty geometry torch can lay out still runs: [0, H, W, C] with H * W * C = 2**62
    out = WindowProcessReverse.apply(torch.empty(0, 2, 2, 2, device=device), 0, 2 ** 60, 2, 2, 0, 2)
    assert out.shape == (0, 2 ** 60, 2, 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_misaligned_storage_offset(device, dtype):
    # One element into its storage, a contiguous x is not 16-byte aligned although its 16-channel
    # rows are a multiple of 16 bytes: the CUDA kernel must copy in narrower words there.
    B, H, W, C, ws, shift = 2, 8, 12, 16, 4, -2
    n = B * H * W * C
    x = torch.randn(n + 1, device=device).to(dtype)[1:].view(B, H, W, C)
    assert x.is_contiguous() and x.data_ptr() % 16 != 0
    windows = WindowProcess.apply(x, B, H, W, C, shift, ws)
    assert torch.equal(windows, window_process_reference(x, shift, ws))
    w = torch.randn(windows.numel() + 1, device=device).to(dtype)[1:].view(windows.shape)
    assert torch.equal(WindowProcessReverse.apply(w, B, H, W, C, -shift, ws),
                       window_process_reverse_reference(w, H, W, -shift, ws))


def _cuda_memory_gib():
    return torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else 0


@pytest.mark.slow
@pytest.mark.skipif(_cuda_memory_gib() < 40, reason="needs a CUDA device with 40 GiB: four 4.3 GB tensors")
def test_cuda_64bit_index_path():
    # 46200 * 46200 one-channel fp16 pixels: 2.13e9 two-byte words, past the kernel's 32-bit path
    # (2^31 - 2^24 words), so its 64-bit indexing runs.
    H = W = 46200
    x = torch.randn(1, H, W, 1, dtype=torch.float16, device="cuda")
    windows = WindowProcess.apply(x, 1, H, W, 1, -3, 7)
    assert torch.equal(windows, window_process_reference(x, -3, 7))
    assert torch.equal(WindowProcessReverse.apply(windows, 1, H, W, 1, 3, 7), x)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cuda_second_device():
    x = torch.randn(2, 14, 21, 5, device="cuda:1")
    windows = WindowProcess.apply(x, 2, 14, 21, 5, -3, 7)
    assert windows.device == x.device
    assert torch.equal(windows, window_process_reference(x, -3, 7))
    assert torch.equal(WindowProcessReverse.apply(windows, 2, 14, 21, 5, 3, 7), x)


@pytest.mark.parametrize("device", DEVICES)
def test_gradgradcheck_float64(device):
    # each op's gradient is the other op, whose own gradient is registered: second (and higher)
    # derivatives of anything built on them are exact
    x = torch.randn(2, 6, 9, 3, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda t: WindowProcess.apply(t, 2, 6, 9, 3, -1, 3), (x,))
    w = torch.randn(12, 3, 3, 3, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda t: WindowProcessReverse.apply(t, 2, 6, 9, 3, 2, 3), (w,))


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_penalty_matches_reference(device):
    torch.manual_seed(3)
    x0 = torch.randn(2, 8, 12, 5, device=device)
    c = torch.randn(12, 4, 4, 5, device=device)

    def grads(partition):
        x = x0.clone().requires_grad_()
        loss = (partition(x).tanh() * c).sum()
        (gx,) = torch.autograd.grad(loss, x, create_graph=True)
        return torch.autograd.grad(loss + gx.square().sum(), x)[0]

    ours = grads(lambda x: WindowProcess.apply(x, 2, 8, 12, 5, -2, 4))
    ref = grads(lambda x: window_process_reference(x, -2, 4))
    torch.testing.assert_close(ours, ref)


@pytest.mark.parametrize("op", ["partition", "reverse"])
def test_gradients_are_cpp_and_an_ordinary_backward_runs_no_python(op):
    # Both ops' gradients are C++ (csrc/autograd/window_process_autograd.cpp): neither the forward nor
    # an ordinary backward runs a torch.library.register_autograd gradient's Python (torch/_library/) or
    # our own (accel/runtime/nn/); the other op is called below autograd. (The CPU autograd engine runs
    # a CPU graph on the calling thread, where the profile hook sees it.) The gradients still match.
    B, H, W, C, ws, shift = 2, 8, 12, 5, 4, -3
    if op == "partition":
        t = torch.randn(B, H, W, C, requires_grad=True)
        fn, ref = (lambda t: WindowProcess.apply(t, B, H, W, C, shift, ws),
                   lambda t: window_process_reference(t, shift, ws))
    else:
        t = torch.randn(B * (H // ws) * (W // ws), ws, ws, C, requires_grad=True)
        fn, ref = (lambda t: WindowProcessReverse.apply(t, B, H, W, C, shift, ws),
                   lambda t: window_process_reverse_reference(t, H, W, shift, ws))
    g = torch.randn_like(ref(t.detach()))
    fn(t)  # loads the kernels outside the profiled calls
    assert "window_process_autograd.cpp" in autograd_kernel(f"accel::window_process_{op}")
    y, fwd_files = python_calls(lambda: fn(t))
    (dt,), bwd_files = python_calls(lambda: torch.autograd.grad(y, t, g))
    assert not ran(fwd_files, LIBRARY)
    assert not ran(bwd_files, LIBRARY, ACCEL_RUNTIME)
    tr = t.detach().requires_grad_()
    torch.testing.assert_close(dt, torch.autograd.grad(ref(tr), tr, g)[0], rtol=0, atol=0)
