import pytest
import torch

from accel.runtime.nn.quick_gelu import QuickGelu, quick_gelu, quick_gelu_reference

from ._params import DEVICES, DTYPES, NO_CUDA, tol


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
    with pytest.raises(ValueError, match="x"):
        quick_gelu(torch.arange(4))
    with pytest.raises(ValueError, match="x"):
        quick_gelu([1.0, 2.0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extreme_values_saturate_without_nan(dtype):
    # the CPU kernel's own exp clamps its argument; outside the clamp the result must still be exact
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
        torch.ops.accel.quick_gelu_backward(torch.ones(8), x)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cuda_tensor_on_a_second_device():
    x = torch.randn(4099) * 3
    with torch.cuda.device(0):
        y = quick_gelu(x.to("cuda:1"))
    assert y.device == torch.device("cuda:1")
    torch.testing.assert_close(y.cpu(), _by_hand(x.double()).float(), **tol(torch.float32))
