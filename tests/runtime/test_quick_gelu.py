
import pytest
import torch

from accel.runtime.nn.quick_gelu import QuickGelu, quick_gelu, quick_gelu_reference

from ._autograd_probe import ACCEL_RUNTIME, LIBRARY, autograd_kernel, python_calls, ran
from ._params import DEVICES, DTYPES, NO_CUDA, tol
from ._tracing import accel_ops, traced_ops


def _by_hand(x):
    return x * (1.0 / (1.0 + torch.exp(-1.702 * x)))


def test_reference_matches_hand_computed_values():
    x = torch.tensor([-2.0, -0.5, 0.0, 0.5, 3.0], dtype=torch.float64)
    expected = torch.tensor([-2 / (1 + 2.718281828459045 ** 3.404), -0.5 / (1 + 2.718281828459045 ** 0.851),
                             0.0, 0.5 / (1 + 2.718281828459045 ** -0.851), 3 / (1 + 2.718281828459045 ** -5.106)],
                            dtype=torch.float64)
    torch.testing.assert_close(quick_gelu_reference(x), expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7,), (3, 1001), (2, 5, 129), (0, 4)])
def test_forward_backward_match_reference(device, dtype, shape):
    torch.manual_seed(0)
    x = (torch.randn(shape, device=device) * 3).to(dtype).requires_grad_()
    xr = x.detach().double().requires_grad_()
    y = quick_gelu(x)
    yr = _by_hand(xr)
    assert y.dtype == dtype and y.shape == x.shape
    torch.testing.assert_close(y, yr.to(dtype), **tol(dtype))
    g = torch.randn(shape, device=device).to(dtype)
    y.backward(g)
    yr.backward(g.double())
    torch.testing.assert_close(x.grad, xr.grad.to(dtype), **tol(dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_input(device):
    x = torch.randn(64, 48, device=device).t()[::2]
    assert not x.is_contiguous()
    torch.testing.assert_close(quick_gelu(x), _by_hand(x))


def test_gradcheck_float64_cpu():
    x = torch.randn(17, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(quick_gelu, (x,))


def test_module_and_torch_compile():
    m = QuickGelu()
    x = torch.randn(33, 9)
    torch.testing.assert_close(m(x), _by_hand(x))
    compiled = torch.compile(quick_gelu, fullgraph=True)
    torch.testing.assert_close(compiled(x), _by_hand(x))


def test_bad_input_names_argument():
    with pytest.raises(TypeError, match="x"):
        quick_gelu(torch.arange(4))
    with pytest.raises(TypeError, match="x"):
        quick_gelu([1.0, 2.0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extreme_values_saturate_without_nan(dtype):
    # the CPU kernel's own exp must saturate as std::exp does: to inf above ~88.72, to 0 below ~-104
    x = torch.tensor([-1e4, -100.0, -60.0, -1e-30, 0.0, 1e-30, 60.0, 100.0, 1e4], dtype=dtype)
    torch.testing.assert_close(quick_gelu(x), quick_gelu_reference(x), rtol=1e-5, atol=1e-30)


@pytest.mark.parametrize("device", DEVICES)
def test_float64_uses_the_exact_alpha(device):
    # float64 must compute with 1.702 itself, not with float32's nearest value (1.70200002...),
    # which is off by 1.3e-8 relative: far outside float64 rounding.
    x = torch.linspace(-8, 8, 1001, dtype=torch.float64, device=device).requires_grad_()
    xr = x.detach().clone().requires_grad_()
    y, yr = quick_gelu(x), _by_hand(xr)
    torch.testing.assert_close(y, yr, rtol=1e-13, atol=1e-15)
    g = torch.randn(1001, dtype=torch.float64, device=device)
    y.backward(g)
    yr.backward(g)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_unaligned_views_and_odd_sizes(device, dtype):
    # Views that start one element into their storage (not 16-byte aligned: the CUDA kernel must
    # take its scalar path), sizes that are no multiple of the 8- or 4-wide vector.
    torch.manual_seed(4)
    for n in (1, 9, 1003):
        flat = (torch.randn(n + 1, device=device) * 3).to(dtype)
        x = flat[1:].requires_grad_()
        gflat = torch.randn(n + 1, device=device).to(dtype)
        g = gflat[1:]
        assert x.is_contiguous() and x.data_ptr() % 16 != 0 and g.data_ptr() % 16 != 0
        xr = x.detach().double().requires_grad_()
        y, yr = quick_gelu(x), _by_hand(xr)
        torch.testing.assert_close(y, yr.to(dtype), **tol(dtype))
        y.backward(g)
        yr.backward(g.double())
        torch.testing.assert_close(x.grad, xr.grad.to(dtype), **tol(dtype))


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_cuda_grid_stride_covers_every_element():
    # More vectors than the grid has threads (132 SMs x 32 blocks x 256 threads x 4 floats is 4.3M):
    # an element the grid-stride loop skipped would keep empty_like's garbage.
    x = torch.randn(2 ** 23 + 3, device="cuda") * 3
    torch.testing.assert_close(quick_gelu(x), quick_gelu_reference(x.double()).float(), **tol(torch.float32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_cuda_backward_refuses_a_grad_on_another_device():
    x = torch.randn(8, device="cuda")
    quick_gelu(x)  # loads the kernels
    with pytest.raises(RuntimeError, match="device"):
        torch.ops.accel.quick_gelu_bwd(torch.ones(8), x)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cuda_tensor_on_a_second_device():
    x = torch.randn(4099) * 3
    with torch.cuda.device(0):
        y = quick_gelu(x.to("cuda:1"))
    assert y.device == torch.device("cuda:1")
    torch.testing.assert_close(y.cpu(), _by_hand(x.double()).float(), **tol(torch.float32))


# Inputs where the exponential in sigmoid(1.702 x) overflows or underflows: past ln(max) the kernels'
# exp must give inf (so sigmoid is exactly 0 and x * 0 = -0), not a clamped finite value.
def _extreme_values(dtype):
    fi = torch.finfo(dtype)
    vals = [fi.max, -fi.max, 1e30, -1e30, 1e4, -1e4, 100.0, -100.0, 60.0, -60.0, 52.0, -52.0, 51.9, -51.9,
            fi.tiny, -fi.tiny, fi.tiny / 4, 1e-30, -1e-30, 0.0, -0.0, float("inf"), float("-inf"), float("nan")]
    vals += torch.linspace(88.0, 90.0, 17).tolist() + torch.linspace(-90.0, -88.0, 17).tolist()
    return torch.tensor(vals, dtype=torch.float64).to(dtype)  # out-of-range values become +-inf in fp16


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_extreme_values_match_plain_pytorch(device, dtype):
    x = _extreme_values(dtype).to(device).requires_grad_()
    xr = x.detach().clone().requires_grad_()
    y, yr = quick_gelu(x), quick_gelu_reference(xr)
    torch.testing.assert_close(y, yr, equal_nan=True, **tol(dtype))
    y.backward(torch.ones_like(y))
    yr.backward(torch.ones_like(yr))
    torch.testing.assert_close(x.grad, xr.grad, equal_nan=True, **tol(dtype))
    finite = torch.isfinite(x.detach())
    assert torch.isfinite(y[finite]).all() and torch.isfinite(x.grad[finite]).all()
    xd, yd = x.detach(), y.detach()
    # the limits: 0 far left (value and gradient), x far right; -inf gives NaN or -0, never -inf
    far_left = xd == -torch.finfo(dtype).max
    assert (yd[far_left] == 0).all() and (x.grad[far_left] == 0).all()
    assert (yd[xd == float("inf")] == float("inf")).all()
    at_neg_inf = yd[xd == float("-inf")]
    assert (torch.isnan(at_neg_inf) | (at_neg_inf == 0)).all()


@pytest.mark.parametrize("device", DEVICES)
def test_float32_sweep_across_the_exp_overflow(device):
    # 1.702 x over [-105, 105]: every exponent the kernels' exp reaches, its overflow at 88.72 and its
    # subnormal results below -87.3 included. atol 1e-40: past the overflow sigmoid is exactly 0 in
    # both (a clamped exp left x s ~ -2.7e-37 there); just before it, s is subnormal and may differ
    # by a few of its smallest steps, times |x| < 62.
    x = torch.linspace(-62.0, 62.0, 200_001, device=device).requires_grad_()
    xr = x.detach().clone().requires_grad_()
    y, yr = quick_gelu(x), quick_gelu_reference(xr)
    torch.testing.assert_close(y, yr, rtol=1e-5, atol=1e-40)
    y.backward(torch.ones_like(y))
    yr.backward(torch.ones_like(yr))
    # relative where the gradient is tiny (the far left), absolute around its zero (x ~ -0.75), where
    # s + a x s (1 - s) cancels in both computations
    tails = x.detach().abs() > 4
    torch.testing.assert_close(x.grad[tails], xr.grad[tails], rtol=1e-5, atol=1e-40)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_gradgradcheck_float64(device):
    # the second derivative (and, through the graph of the first, the third) against finite differences
    torch.manual_seed(5)
    x = (torch.randn(4, 9, dtype=torch.float64, device=device) * 3).requires_grad_()
    assert torch.autograd.gradgradcheck(quick_gelu, (x,))

    def first_derivative(t):
        return torch.autograd.grad(quick_gelu(t).pow(3).sum(), t, create_graph=True)[0]

    assert torch.autograd.gradcheck(first_derivative, (x,))
    assert torch.autograd.gradgradcheck(first_derivative, (x,))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_gradient_penalty_matches_plain_pytorch(device, dtype):
    # loss + |d loss / dx|^2, differentiated again: needs the backward's own gradient
    torch.manual_seed(6)
    x0 = (torch.randn(3, 257, device=device) * 3).to(dtype)
    c = torch.randn(3, 257, device=device).to(dtype)

    def grads(fn):
        x = x0.clone().requires_grad_()
        loss = (fn(x) * c).sum()
        (gx,) = torch.autograd.grad(loss, x, create_graph=True)
        total = loss + gx.float().square().sum()
        return torch.autograd.grad(total, x)[0]

    # the reference with fp32 math for fp16/bf16, as the kernels compute; loose where bf16 rounds the
    # first derivative (which the second-order term is built from) differently in the two paths
    tolerance = {"rtol": 5e-2, "atol": 5e-2} if dtype == torch.bfloat16 else tol(dtype)
    torch.testing.assert_close(grads(quick_gelu), grads(quick_gelu_reference), **tolerance)


# Layouts torch's elementwise ops keep (x * torch.sigmoid(1.702 * x) is the reference): the output of a
# non-overlapping and dense x has x's strides; that of a strided x with gaps has dense strides in x's
# order of dims (torch.empty_like's).
def _layouts(device, dtype):
    torch.manual_seed(7)

    def randn(*shape):
        return (torch.randn(*shape, device=device) * 3).to(dtype)

    return {
        "channels_last": randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "channels_last_3d": randn(2, 3, 4, 5, 6).to(memory_format=torch.channels_last_3d),
        "permuted": randn(4, 6, 5).permute(2, 0, 1),
        "channels_last_one_channel": randn(2, 1, 4, 4).to(memory_format=torch.channels_last),
        # one element into its storage: not 16-byte aligned (the CUDA kernel's scalar path)
        "channels_last_unaligned": randn(2 * 3 * 4 * 5 + 1)[1:].view(2, 4, 5, 3).permute(0, 3, 1, 2),
        "channels_last_with_gaps": randn(2, 4, 6, 8).permute(0, 3, 1, 2)[:, 1:, ::2],
        "transposed_slice": randn(64, 48).t()[::2],
        "expanded": randn(3, 1).expand(3, 4),
    }


def _assert_same_layout(actual, expected):
    # strides where they matter (dims of size 1 have none that is used), and the memory formats
    assert actual.shape == expected.shape
    assert [st for st, n in zip(actual.stride(), actual.shape) if n != 1] == \
        [st for st, n in zip(expected.stride(), expected.shape) if n != 1], (actual.stride(), expected.stride())
    formats = [torch.contiguous_format] + {4: [torch.channels_last], 5: [torch.channels_last_3d]}.get(actual.dim(), [])
    for fmt in formats:
        assert actual.is_contiguous(memory_format=fmt) == expected.is_contiguous(memory_format=fmt), fmt


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_output_and_gradient_keep_the_memory_format(device, dtype):
    # Issue 11.10: a channels-last x gave a contiguous result where torch's x * sigmoid(1.702 x) keeps
    # channels-last (the next conv then converts it back).
    for name, x0 in _layouts(device, dtype).items():
        x = x0.detach().requires_grad_()
        xt = x0.detach().requires_grad_()  # torch's ops on the same strides
        y, yt = quick_gelu(x), _by_hand(xt)
        _assert_same_layout(y, yt)
        torch.testing.assert_close(y, _by_hand(x0.double()).to(dtype), **tol(dtype), msg=name)
        # a gradient laid out like y, as the next op's backward gives it: dx laid out as torch's
        g = torch.empty_like(yt).copy_(torch.randn(y.shape, device=device))
        (dx,), (dxt,) = torch.autograd.grad(y, x, g), torch.autograd.grad(yt, xt, g)
        _assert_same_layout(dx, dxt)
        xr = x0.detach().double().requires_grad_()
        (dxr,) = torch.autograd.grad(_by_hand(xr), xr, g.double())
        torch.testing.assert_close(dx, dxr.to(dtype), **tol(dtype), msg=name)
        # a contiguous gradient (strides that differ from x's but for a contiguous x): dx keeps x's
        # layout, and x.grad has torch's (x's, by autograd's layout contract for .grad)
        gc = g.contiguous()
        (dx,) = torch.autograd.grad(quick_gelu(x), x, gc)
        _assert_same_layout(dx, y)
        torch.testing.assert_close(dx, dxr.to(dtype), **tol(dtype), msg=name)
        quick_gelu(x).backward(gc)
        _by_hand(xt).backward(gc)
        _assert_same_layout(x.grad, xt.grad)
        torch.testing.assert_close(x.grad, dxr.to(dtype), **tol(dtype), msg=name)


@pytest.mark.parametrize("device", DEVICES)
def test_memory_format_of_the_fake_kernels(device):
    # The fake kernels give the real kernels' strides, for torch.compile: inductor asserts them where the
    # op's result feeds code of its own (the contiguous fake of old failed there for channels-last), and
    # opcheck compares them (on CUDA only: its fake-tensor check skips CPU strides).
    from torch._subclasses.fake_tensor import FakeTensorMode

    quick_gelu(torch.zeros(1, device=device))  # loads the kernels
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    for name, x in _layouts(device, torch.float32).items():
        grads = {"like_x": torch.empty_like(x).normal_(), "contiguous": torch.randn(x.shape, device=device)}
        with FakeTensorMode() as mode:
            fx = mode.from_tensor(x)
            fake = [torch.ops.accel.quick_gelu_fwd(fx)]
            fake += [torch.ops.accel.quick_gelu_bwd(mode.from_tensor(g), fx) for g in grads.values()]
        real = [torch.ops.accel.quick_gelu_fwd(x)] + [torch.ops.accel.quick_gelu_bwd(g, x) for g in grads.values()]
        assert [t.stride() for t in fake] == [t.stride() for t in real], name
        torch.library.opcheck(torch.ops.accel.quick_gelu_fwd.default, (x.detach().requires_grad_(),),
                              test_utils=utils)
        for g in grads.values():
            torch.library.opcheck(torch.ops.accel.quick_gelu_bwd.default, (g, x), test_utils=utils)

    def step(t):
        # the op's result feeds a product, and so does the backward op's in the compiled backward (the op
        # itself: quick_gelu() takes the plain ops under compile)
        return torch.ops.accel.quick_gelu_fwd(t) * t

    for name, x0 in _layouts(device, torch.float32).items():
        if name not in ("channels_last", "channels_last_with_gaps"):
            continue
        torch._dynamo.reset()  # one graph per layout, none over the recompile limit
        x, xt = x0.detach().requires_grad_(), x0.detach().requires_grad_()
        y, yt = torch.compile(step, fullgraph=True, dynamic=False)(x), step(xt)
        torch.testing.assert_close(y, yt, msg=name)
        _assert_same_layout(y, _by_hand(x0) * x0)
        c = torch.randn(x.shape, device=device)
        (y * c).sum().backward()
        (yt * c).sum().backward()
        torch.testing.assert_close(x.grad, xt.grad, msg=name)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_compiled_code_takes_the_plain_ops(device):
    """Under torch.compile quick_gelu is x * sigmoid(1.702 x) in plain ops, which Inductor fuses with its
    neighbours (an opaque op cost an extra pass: _common.use_kernel_eagerly); eager calls take the kernel."""
    quick_gelu(torch.zeros(1))  # loads the kernels
    ops = traced_ops(lambda x: quick_gelu(x + 1) * 2, device)
    assert not accel_ops(ops) and "aten.sigmoid.default" in ops, ops
    x = torch.randn(64, 3)
    compiled = torch.compile(lambda t: quick_gelu(t + 1) * 2, fullgraph=True)
    torch.testing.assert_close(compiled(x), _by_hand(x + 1) * 2)


def test_gradient_is_cpp_and_an_ordinary_backward_runs_no_python():
    # The forward op's gradient is C++ (csrc/autograd/quick_gelu_autograd.cpp): neither the forward nor
    # an ordinary backward runs a torch.library.register_autograd gradient's Python (torch/_library/)
    # or our own (accel/runtime/nn/); the backward op is called below autograd. (The CPU autograd
    # engine runs a CPU graph on the calling thread, where the profile hook sees it.)
    x, g = torch.randn(3, 5, requires_grad=True), torch.randn(3, 5)
    quick_gelu(x)  # loads the kernels outside the profiled calls
    assert "quick_gelu_autograd.cpp" in autograd_kernel("accel::quick_gelu_fwd")
    y, fwd_files = python_calls(lambda: quick_gelu(x))
    (dx,), bwd_files = python_calls(lambda: torch.autograd.grad(y, x, g))
    assert not ran(fwd_files, LIBRARY)
    assert not ran(bwd_files, LIBRARY, ACCEL_RUNTIME)
    xr = x.detach().requires_grad_()
    torch.testing.assert_close(dx, torch.autograd.grad(_by_hand(xr), xr, g)[0])
