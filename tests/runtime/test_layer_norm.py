import pytest
import torch
import torch.nn.functional as F
from torch import nn

from accel.runtime.nn.layer_norm import FusedLayerNorm, fused_layer_norm, layer_norm_reference
from accel.utils.xla import xla_available

from ._autograd_probe import ACCEL_RUNTIME, LIBRARY, autograd_kernel, python_calls, ran
from ._params import DEVICES, DTYPES, NO_CUDA, tol

# (input shape, normalized_shape): odd sizes, one-element rows, multi-dim normalized shapes, empty.
# On CUDA the forward takes one warp per row of 768, two warps per row of 2000 with a half-empty last
# block of rows (3 rows, 2 per block), a block-wide team for 5000; the backward's teams: FUSED_LIMITS.
SHAPES = [((7,), (7,)), ((3, 1023), (1023,)), ((2, 5, 129), (5, 129)), ((4, 1), (1,)),
          ((6, 768), (768,)), ((3, 2000), (2000,)), ((5, 5000), (5000,)), ((0, 16), (16,))]


def _grads_tol(dtype):
    # dweight/dbias are sums over rows: allow a little more than one output ulp in fp32.
    return {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else tol(dtype)


def _run(fn, x, w, b, g):
    """Output and (dx, dweight, dbias) of fn for upstream gradient g."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, w, b)]
    y = fn(*leaves)
    y.backward(g)
    return y, [t.grad if t is not None else None for t in leaves]


def test_reference_matches_hand_computed_values():
    x = torch.tensor([[1.0, 2.0, 3.0, 6.0]], dtype=torch.float64)  # mean 3, var (4+1+0+9)/4 = 3.5
    w = torch.tensor([1.0, 2.0, -1.0, 0.5], dtype=torch.float64)
    b = torch.tensor([0.0, 1.0, 0.0, -1.0], dtype=torch.float64)
    s = (3.5 + 1e-5) ** -0.5
    expected = torch.tensor([[-2 * s, -2 * s + 1, 0.0, 1.5 * s - 1]], dtype=torch.float64)
    torch.testing.assert_close(layer_norm_reference(x, 4, w, b), expected)
    torch.testing.assert_close(fused_layer_norm(x, 4, w, b), expected)


# (x dtype, weight/bias dtype): params of x's dtype, and fp32 master params beside fp16/bf16 x.
DTYPE_PAIRS = [(d, d) for d in DTYPES] + [(torch.float16, torch.float32), (torch.bfloat16, torch.float32)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,pdtype", DTYPE_PAIRS, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("shape,normalized", SHAPES, ids=[str(s[0]) for s in SHAPES])
def test_forward_backward_match_torch(device, dtype, pdtype, shape, normalized):
    torch.manual_seed(0)
    x = (torch.randn(shape, device=device) * 2 + 0.5).to(dtype)
    w = (torch.randn(normalized, device=device) + 1).to(pdtype)
    b = torch.randn(normalized, device=device).to(pdtype)
    g = torch.randn(shape, device=device).to(dtype)
    y, (dx, dw, db) = _run(lambda x, w, b: fused_layer_norm(x, normalized, w, b), x, w, b, g)
    # independent reference: torch's own layer norm in float64 on the same (rounded) values
    yr, (dxr, dwr, dbr) = _run(lambda x, w, b: F.layer_norm(x, normalized, w, b),
                               x.double(), w.double(), b.double(), g.double())
    assert y.dtype == dtype and y.shape == x.shape
    assert dx.dtype == dtype and dw.dtype == pdtype and db.dtype == pdtype
    torch.testing.assert_close(y, yr.to(dtype), **tol(dtype))
    torch.testing.assert_close(dx, dxr.to(dtype), **_grads_tol(dtype))
    torch.testing.assert_close(dw, dwr.to(pdtype), **_grads_tol(pdtype if pdtype == dtype else dtype))
    torch.testing.assert_close(db, dbr.to(pdtype), **_grads_tol(pdtype if pdtype == dtype else dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("affine", ["none", "weight only", "bias only"])
def test_without_weight_or_bias(device, affine):
    torch.manual_seed(1)
    x = torch.randn(5, 33, device=device)
    w = torch.randn(33, device=device) if affine == "weight only" else None
    b = torch.randn(33, device=device) if affine == "bias only" else None
    g = torch.randn(5, 33, device=device)
    y, grads = _run(lambda x, w, b: fused_layer_norm(x, (33,), w, b), x, w, b, g)
    yr, grads_r = _run(lambda x, w, b: F.layer_norm(x, (33,), w, b), x.double(),
                       None if w is None else w.double(), None if b is None else b.double(), g.double())
    torch.testing.assert_close(y, yr.float(), **tol(torch.float32))
    for got, want in zip(grads, grads_r):
        assert (got is None) == (want is None)
        if got is not None:
            torch.testing.assert_close(got, want.float(), **_grads_tol(torch.float32))


@pytest.mark.parametrize("device", DEVICES)
def test_frozen_weight_gets_no_gradient(device):
    """Only the gradients autograd asks for are computed (here: x and bias, not weight)."""
    torch.manual_seed(10)
    x = torch.randn(6, 40, device=device, requires_grad=True)
    w = torch.randn(40, device=device)
    b = torch.randn(40, device=device, requires_grad=True)
    g = torch.randn(6, 40, device=device)
    fused_layer_norm(x, 40, w, b).backward(g)
    xr, br = x.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    F.layer_norm(xr, (40,), w.double(), br).backward(g.double())
    assert w.grad is None
    torch.testing.assert_close(x.grad, xr.grad.float(), **_grads_tol(torch.float32))
    torch.testing.assert_close(b.grad, br.grad.float(), **_grads_tol(torch.float32))


@pytest.mark.parametrize("device", DEVICES)
def test_large_rows_and_large_offset(device):
    """65536-wide rows (block-wide reduction on CUDA) whose mean is far from zero: a one-pass
    E[x^2]-E[x]^2 variance would lose every digit here."""
    torch.manual_seed(2)
    x = torch.randn(3, 65536, device=device) + 1000.0
    w = torch.randn(65536, device=device)
    b = torch.randn(65536, device=device)
    g = torch.randn(3, 65536, device=device)
    y, (dx, dw, db) = _run(lambda x, w, b: fused_layer_norm(x, 65536, w, b), x, w, b, g)
    yr, (dxr, dwr, dbr) = _run(lambda x, w, b: F.layer_norm(x, (65536,), w, b),
                               x.double(), w.double(), b.double(), g.double())
    # x itself carries fp32 rounding of ~6e-5 at 1000 on a spread of ~1: that bounds any method.
    torch.testing.assert_close(y, yr.float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dx, dxr.float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dw, dwr.float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(db, dbr.float(), rtol=1e-5, atol=1e-5)


def _row_std(x):
    return x.double().std(-1, unbiased=False, keepdim=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("scale", [1e20, 1e30, 2.0**124], ids=["1e20", "1e30", "2^124"])
@pytest.mark.parametrize("n", [768, 2000, 5000])
def test_huge_magnitude_rows(device, dtype, scale, n):
    """Rows whose squared deviations overflow float (from |x| ~ 1e19 / sqrt(N) on; bf16 shares float's
    range) up to the supported |x| <= 2^126: the statistics are redone on exactly scaled values instead of
    giving rstd = 0 and y = 0. Beside them a row of ordinary size (on CUDA at n = 2000, a two-warp team
    sharing its block with a huge row) and a row mixing huge and tiny values."""
    torch.manual_seed(14)
    x = torch.randn(3, n, device=device).clamp(-4, 4) * scale  # |x| <= 4 * 2^124 = 2^126
    x[1] = torch.randn(n, device=device) * 2 + 0.5
    x[2, ::3] *= 1e-30
    x = x.to(dtype)
    w = (torch.randn(n, device=device) + 1).to(dtype)
    b = torch.randn(n, device=device).to(dtype)
    g = torch.randn(3, n, device=device).to(dtype)
    y, (dx, dw, db) = _run(lambda x, w, b: fused_layer_norm(x, n, w, b), x, w, b, g)
    yr, (dxr, dwr, dbr) = _run(lambda x, w, b: F.layer_norm(x, (n,), w, b),
                               x.double(), w.double(), b.double(), g.double())
    # fp32: a few ulps of the largest |y| (~20), as y = xhat * w + b cancels where it is near 0
    y_tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else tol(dtype)
    torch.testing.assert_close(y, yr.to(dtype), **y_tol)
    # dx ~ rstd ~ 1 / scale: compared in units of each row's 1 / std
    sd = _row_std(x)
    torch.testing.assert_close((dx.double() * sd).to(dtype), (dxr * sd).to(dtype), **_grads_tol(dtype))
    torch.testing.assert_close(dw, dwr.to(dtype), **_grads_tol(dtype))
    torch.testing.assert_close(db, dbr.to(dtype), **_grads_tol(dtype))
    # the saved statistics themselves (float32): mean and rstd = 1 / sqrt(var + eps)
    from accel.runtime.nn.layer_norm import _ops

    _, mean, rstd = _ops().layer_norm_fwd(x, w, b, 1, 1e-5)
    xd = x.double()
    mean_err = (mean.double() - xd.mean(-1)) / sd.squeeze(-1)  # in units of the row's std
    torch.testing.assert_close(mean_err, torch.zeros_like(mean_err), rtol=0, atol=1e-5)
    torch.testing.assert_close(rstd.double(), (xd.var(-1, unbiased=False) + 1e-5).rsqrt(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_huge_rows_beside_rows_holding_inf_or_nan(device):
    """The rescaled statistics do not turn an inf or NaN into finite values: such a row stays non-finite
    (F.layer_norm gives NaN), while huge rows beside it are normalized."""
    x = torch.randn(4, 40, device=device) * 1e20
    x[0, 7] = float("inf")
    x[2, 3] = float("nan")
    y = fused_layer_norm(x, 40)
    assert not torch.isfinite(y[0]).any() and not torch.isfinite(y[2]).any()
    torch.testing.assert_close(y[1::2], F.layer_norm(x[1::2].double(), (40,)).float(), **tol(torch.float32))


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_input_and_weight(device):
    torch.manual_seed(3)
    x = torch.randn(40, 64, device=device).t()[:, ::2]  # (64, 20), strided both ways
    w = torch.randn(40, device=device)[::2]
    assert not x.is_contiguous() and not w.is_contiguous()
    torch.testing.assert_close(fused_layer_norm(x, 20, w), F.layer_norm(x, (20,), w))
    g = torch.randn(20, 64, device=device).t()
    _, (dx, dw, _) = _run(lambda x, w, b: fused_layer_norm(x, 20, w), x, w, None, g)
    _, (dxr, dwr, _) = _run(lambda x, w, b: F.layer_norm(x, (20,), w), x, w, None, g)
    torch.testing.assert_close(dx, dxr, **_grads_tol(torch.float32))
    torch.testing.assert_close(dw, dwr, **_grads_tol(torch.float32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_misaligned_storage(device, dtype):
    """A contiguous view one element into its storage: the CUDA kernels must fall back from
    16-byte vectors to scalar access."""
    torch.manual_seed(9)
    flat = torch.randn(4 * 256 + 1, device=device).to(dtype)
    x = flat[1:].view(4, 256)
    assert x.is_contiguous() and x.data_ptr() % 16 != 0
    w = torch.randn(257, device=device).to(dtype)[1:]
    g = torch.randn(4, 256, device=device).to(dtype)
    y, (dx, dw, _) = _run(lambda x, w, b: fused_layer_norm(x, 256, w), x, w, None, g)
    yr, (dxr, dwr, _) = _run(lambda x, w, b: F.layer_norm(x, (256,), w), x.double(), w.double(), None, g.double())
    torch.testing.assert_close(y, yr.to(dtype), **tol(dtype))
    torch.testing.assert_close(dx, dxr.to(dtype), **_grads_tol(dtype))
    torch.testing.assert_close(dw, dwr.to(dtype), **_grads_tol(dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_many_rows_cover_the_grid_stride_loops(device):
    """40000 rows of 8: on CUDA more row groups than the forward/dx grid has blocks (132 SMs x 64
    blocks x 4 rows), and 625 row chunks in the dweight/dbias reduction."""
    torch.manual_seed(11)
    x = torch.randn(40000, 8, device=device) * 3 + 1
    w = torch.randn(8, device=device)
    b = torch.randn(8, device=device)
    g = torch.randn(40000, 8, device=device)
    y, (dx, dw, db) = _run(lambda x, w, b: fused_layer_norm(x, 8, w, b), x, w, b, g)
    yr, (dxr, dwr, dbr) = _run(lambda x, w, b: F.layer_norm(x, (8,), w, b), x.double(), w.double(), b.double(),
                               g.double())
    torch.testing.assert_close(y, yr.float(), **tol(torch.float32))
    torch.testing.assert_close(dx, dxr.float(), **_grads_tol(torch.float32))
    torch.testing.assert_close(dw, dwr.float(), rtol=1e-4, atol=1e-3)  # sums of 40000 rows
    torch.testing.assert_close(db, dbr.float(), rtol=1e-4, atol=1e-3)


# On CUDA the backward takes one pass over x and dy for rows of up to 512 threads x 16 elements (8 in
# double); wider rows take the dx kernel and a second sweep for dweight/dbias. Each pair straddles that
# limit; 37 rows are an odd count (one row per block at these widths: blocks with part-empty teams come from
# SHAPES' narrow rows), 3000 rows give each team several rows to sum.
FUSED_LIMITS = [(torch.float32, torch.float32, 8192, 37), (torch.float32, torch.float32, 8196, 37),
                (torch.bfloat16, torch.float32, 8192, 37), (torch.bfloat16, torch.bfloat16, 8200, 37),
                (torch.float64, torch.float64, 4096, 37), (torch.float64, torch.float64, 4098, 37),
                (torch.bfloat16, torch.float32, 768, 3000), (torch.float32, torch.float32, 2000, 3000)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,pdtype,n,rows", FUSED_LIMITS,
                         ids=[f"{str(d).replace('torch.', '')}-{n}x{m}" for d, _, n, m in FUSED_LIMITS])
def test_backward_around_the_one_pass_limit(device, dtype, pdtype, n, rows):
    torch.manual_seed(13)
    x = (torch.randn(rows, n, device=device) * 2 - 1).to(dtype)
    w = (torch.randn(n, device=device) + 1).to(pdtype)
    b = torch.randn(n, device=device).to(pdtype)
    g = torch.randn(rows, n, device=device).to(dtype)
    y, (dx, dw, db) = _run(lambda x, w, b: fused_layer_norm(x, n, w, b), x, w, b, g)
    yr, (dxr, dwr, dbr) = _run(lambda x, w, b: F.layer_norm(x, (n,), w, b), x.double(), w.double(), b.double(),
                               g.double())
    # |y| reaches ~10 here: a few of 6M fp32 outputs are 2 ulps (~2e-6) off
    torch.testing.assert_close(y, yr.to(dtype), **(tol(dtype) if dtype != torch.float32 else {"rtol": 1e-5, "atol": 1e-5}))
    torch.testing.assert_close(dx, dxr.to(dtype), **_grads_tol(dtype))
    # sums over up to 3000 rows of O(1) terms, rounded to the params' dtype (one bf16 ulp of ~4 is 0.03)
    sums_tol = {"rtol": 1e-4, "atol": 2e-3} if pdtype == torch.float32 else _grads_tol(pdtype)
    torch.testing.assert_close(dw, dwr.to(pdtype), **sums_tol)
    torch.testing.assert_close(db, dbr.to(pdtype), **sums_tol)


# On CUDA the forward holds a thread's part of a row in registers (four 16-byte vectors for fp32, eight for
# 16-bit dtypes, teams of up to 512 threads) and loops over memory for wider rows: each pair straddles that
# limit (fp32 8192, bf16 32768); fp16 4100 is past it for rows read one element at a time (N % 8 != 0).
FORWARD_LIMITS = [(torch.float32, 8192), (torch.float32, 8196), (torch.bfloat16, 32768), (torch.bfloat16, 32776),
                  (torch.float16, 4100)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,n", FORWARD_LIMITS, ids=[f"{str(d).replace('torch.', '')}-{n}" for d, n in FORWARD_LIMITS])
def test_forward_around_the_register_limit(device, dtype, n):
    torch.manual_seed(14)
    x = (torch.randn(5, n, device=device) * 3 + 2).to(dtype)
    w = torch.randn(n, device=device).to(dtype)
    b = torch.randn(n, device=device).to(dtype)
    y = fused_layer_norm(x, n, w, b)
    yr = F.layer_norm(x.double(), (n,), w.double(), b.double())
    # |y| reaches ~15 here: a few fp32 outputs are 2 ulps off
    torch.testing.assert_close(y, yr.to(dtype), **(tol(dtype) if dtype != torch.float32 else {"rtol": 1e-5, "atol": 1e-5}))


@pytest.mark.parametrize("device", DEVICES)
def test_wide_bf16_rows_with_fp32_params(device):
    """65544-wide bf16 rows (a multiple of the 8-wide vector but not of the 1024-thread team, so the
    last vectors leave part of the team idle) with fp32 master params."""
    torch.manual_seed(12)
    n = 65536 + 8
    x = torch.randn(2, n, device=device).bfloat16()
    w = torch.randn(n, device=device) + 1
    b = torch.randn(n, device=device)
    g = torch.randn(2, n, device=device).bfloat16()
    y, (dx, dw, db) = _run(lambda x, w, b: fused_layer_norm(x, n, w, b), x, w, b, g)
    yr, (dxr, dwr, dbr) = _run(lambda x, w, b: F.layer_norm(x, (n,), w, b), x.double(), w.double(), b.double(),
                               g.double())
    assert y.dtype == dx.dtype == torch.bfloat16 and dw.dtype == db.dtype == torch.float32
    torch.testing.assert_close(y, yr.bfloat16(), **tol(torch.bfloat16))
    torch.testing.assert_close(dx, dxr.bfloat16(), **tol(torch.bfloat16))
    torch.testing.assert_close(dw, dwr.float(), **_grads_tol(torch.float32))
    torch.testing.assert_close(db, dbr.float(), **_grads_tol(torch.float32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_cuda_backward_refuses_inputs_on_another_device():
    """The op itself (not only the Python wrapper) must refuse host statistics for CUDA x: its
    kernel would dereference host pointers on the GPU."""
    x = torch.randn(4, 16, device="cuda")
    _, mean, rstd = torch.ops.accel.layer_norm_fwd(x, None, None, 1, 1e-5)
    with pytest.raises(RuntimeError, match="device"):
        torch.ops.accel.layer_norm_bwd(torch.ones_like(x), x, mean.cpu(), rstd.cpu(), None, None, 1, False, False)
    with pytest.raises(RuntimeError, match="device"):
        torch.ops.accel.layer_norm_bwd(torch.ones(4, 16), x, mean, rstd, None, None, 1, False, False)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cuda_tensors_on_a_second_device():
    """x on cuda:1 while cuda:0 is current: the kernels must run on cuda:1 and its stream."""
    torch.manual_seed(13)
    x = torch.randn(6, 300)
    w, b, g = torch.randn(300), torch.randn(300), torch.randn(6, 300)
    with torch.cuda.device(0):
        y, grads = _run(lambda x, w, b: fused_layer_norm(x, 300, w, b), *(t.to("cuda:1") for t in (x, w, b, g)))
    yr, grads_r = _run(lambda x, w, b: F.layer_norm(x, (300,), w, b), x.double(), w.double(), b.double(), g.double())
    assert y.device == torch.device("cuda:1")
    torch.testing.assert_close(y.cpu(), yr.float(), **tol(torch.float32))
    for got, want in zip(grads, grads_r):
        torch.testing.assert_close(got.cpu(), want.float(), **_grads_tol(torch.float32))


def test_params_of_another_dtype_are_cast():
    """fp32 x with bf16 weight (a mix the kernels do not take): cast, gradient back in bf16."""
    torch.manual_seed(4)
    x = torch.randn(4, 24)
    w = torch.randn(24).bfloat16().requires_grad_()
    y = fused_layer_norm(x, 24, w)
    torch.testing.assert_close(y, F.layer_norm(x, (24,), w.float()))
    y.sum().backward()
    assert w.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck_float64(device):
    torch.manual_seed(5)
    x = torch.randn(4, 3, 5, dtype=torch.float64, device=device, requires_grad=True)
    w = torch.randn(3, 5, dtype=torch.float64, device=device, requires_grad=True)
    b = torch.randn(3, 5, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: fused_layer_norm(x, (3, 5), w, b), (x, w, b))
    assert torch.autograd.gradcheck(lambda x: fused_layer_norm(x, 5), (x,))


def test_module_is_a_drop_in_for_nn_layer_norm():
    torch.manual_seed(6)
    ref = nn.LayerNorm((6, 10), eps=1e-6)
    with torch.no_grad():
        ref.weight.normal_()
        ref.bias.normal_()
    ours = FusedLayerNorm((6, 10), eps=1e-6)
    assert isinstance(ours, nn.LayerNorm)
    assert ours.state_dict().keys() == ref.state_dict().keys()
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(3, 6, 10)
    torch.testing.assert_close(ours(x), ref(x))
    ours(x).square().sum().backward()
    ref(x).square().sum().backward()
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, **_grads_tol(torch.float32))
    torch.testing.assert_close(ours.bias.grad, ref.bias.grad, **_grads_tol(torch.float32))

    plain = FusedLayerNorm(8, elementwise_affine=False)
    assert plain.weight is None and plain.bias is None and plain.state_dict() == {}
    no_bias = FusedLayerNorm(8, bias=False, dtype=torch.bfloat16)
    assert no_bias.bias is None and no_bias.weight.dtype == torch.bfloat16
    x8 = torch.randn(2, 8)
    torch.testing.assert_close(plain(x8), F.layer_norm(x8, (8,)))
    torch.testing.assert_close(no_bias(x8.bfloat16()), F.layer_norm(x8.bfloat16(), (8,), no_bias.weight))


def _graph_recorder(graphs):
    """A torch.compile backend that keeps each Dynamo graph's code and runs it as is."""
    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward
    return backend


@pytest.mark.parametrize("entry", ["module", "function"])
def test_torch_compile_fullgraph_forward_and_backward(entry):
    """Under torch.compile the module steps aside for plain ops Inductor can fuse with its neighbours;
    the function is the kernel everywhere. Both give F.layer_norm's values and gradients."""
    torch.manual_seed(7)
    m = FusedLayerNorm(48)
    with torch.no_grad():
        m.weight.normal_()
    x = torch.randn(5, 48, requires_grad=True)
    fn = m if entry == "module" else (lambda x: fused_layer_norm(x, 48, m.weight, m.bias))
    graphs = []
    y = torch.compile(fn, fullgraph=True, backend=_graph_recorder(graphs))(x)
    assert len(graphs) == 1 and ("accel.layer_norm_fwd" in graphs[0]) == (entry == "function"), graphs
    torch.testing.assert_close(y, F.layer_norm(x, (48,), m.weight, m.bias))
    y.sum().backward()
    xr = x.detach().clone().requires_grad_()
    F.layer_norm(xr, (48,), m.weight, m.bias).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, **_grads_tol(torch.float32))
    compiled = torch.compile(fn, fullgraph=True)  # and through Inductor
    torch.testing.assert_close(compiled(x), F.layer_norm(x, (48,), m.weight, m.bias))


@pytest.mark.skipif(not xla_available(), reason="torch_xla is not installed")
def test_xla_tensors_take_the_reference():
    import torch_xla

    torch.manual_seed(8)
    x = torch.randn(3, 12)
    w = torch.randn(12)
    dev = torch_xla.device()
    y = fused_layer_norm(x.to(dev), 12, w.to(dev))
    torch.testing.assert_close(y.cpu(), F.layer_norm(x, (12,), w), **tol(torch.float32))


def test_bad_input_names_argument():
    x = torch.randn(2, 8)
    with pytest.raises(TypeError, match="x"):
        fused_layer_norm(torch.arange(8).reshape(2, 4), 4)
    with pytest.raises(TypeError, match="x"):
        fused_layer_norm([1.0, 2.0], 2)
    with pytest.raises(ValueError, match="normalized_shape"):
        fused_layer_norm(x, 7)
    with pytest.raises(ValueError, match="normalized_shape"):
        fused_layer_norm(x, (2, 8, 1))
    with pytest.raises(ValueError, match="normalized_shape"):
        fused_layer_norm(x, "8")
    with pytest.raises(ValueError, match="weight"):
        fused_layer_norm(x, 8, torch.ones(4))
    with pytest.raises(TypeError, match="bias"):
        fused_layer_norm(x, 8, torch.ones(8), torch.ones(8, dtype=torch.int64))
    with pytest.raises(ValueError, match="eps"):
        fused_layer_norm(x, 8, eps=-1.0)
    with pytest.raises(ValueError, match="eps"):
        fused_layer_norm(x, 8, eps="small")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("affine", ["both", "weight", "bias", "none"])
def test_gradgradcheck_float64(device, affine):
    # second derivatives against finite differences: they run through the backward's own gradient and,
    # for x, through the row mean and rstd the forward returns beside y
    torch.manual_seed(9)
    x = torch.randn(4, 3, 5, dtype=torch.float64, device=device, requires_grad=True)
    w = torch.randn(3, 5, dtype=torch.float64, device=device, requires_grad=True)
    b = torch.randn(3, 5, dtype=torch.float64, device=device, requires_grad=True)
    params = {"both": (w, b), "weight": (w,), "bias": (b,), "none": ()}[affine]

    def fn(x, *p):
        weight = p[0] if affine in ("both", "weight") else None
        bias = p[-1] if affine in ("both", "bias") else None
        return fused_layer_norm(x, (3, 5), weight, bias)

    assert torch.autograd.gradgradcheck(fn, (x, *params))


@pytest.mark.parametrize("device", DEVICES)
def test_third_derivative_gradcheck_float64(device):
    torch.manual_seed(10)
    x = torch.randn(3, 6, dtype=torch.float64, device=device, requires_grad=True)
    w = torch.randn(6, dtype=torch.float64, device=device, requires_grad=True)

    def first_derivative(x, w):
        y = fused_layer_norm(x, 6, w, None)
        return torch.autograd.grad(y.pow(3).sum(), (x, w), create_graph=True)

    # gradcheck checks the second derivatives first_derivative's backward computes, gradgradcheck the third
    assert torch.autograd.gradcheck(first_derivative, (x, w))
    assert torch.autograd.gradgradcheck(first_derivative, (x, w))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gradient_penalty_matches_f_layer_norm(device, dtype):
    # loss + |d loss / dx|^2 + |d loss / dw|^2 (WGAN-GP / R1 style), differentiated again in x, w, b
    torch.manual_seed(11)
    x0 = torch.randn(6, 33, dtype=dtype, device=device) * 2 + 1
    w0 = torch.randn(33, dtype=dtype, device=device)
    b0 = torch.randn(33, dtype=dtype, device=device)
    c = torch.randn(6, 33, dtype=dtype, device=device)

    def grads(fn):
        x, w, b = (t.clone().requires_grad_() for t in (x0, w0, b0))
        loss = (fn(x, (33,), w, b, 1e-5).tanh() * c).sum()
        gx, gw = torch.autograd.grad(loss, (x, w), create_graph=True)
        total = loss + gx.square().sum() + gw.square().sum()
        return torch.autograd.grad(total, (x, w, b))

    ours, ref = grads(fused_layer_norm), grads(F.layer_norm)
    for o, r in zip(ours, ref):
        torch.testing.assert_close(o, r, **(tol(dtype) if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-4}))


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_penalty_with_bf16_input_and_fp32_params(device):
    # mixed precision: the second-order terms are computed in fp32 from bf16 x, like the first-order ones
    torch.manual_seed(12)
    x0 = torch.randn(4, 64, device=device).bfloat16()
    w0 = torch.randn(64, device=device)
    c = torch.randn(4, 64, device=device)

    def grads(x0, fn):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        loss = (fn(x, (64,), w, None, 1e-5).float().tanh() * c).sum()
        (gx,) = torch.autograd.grad(loss, x, create_graph=True)
        return torch.autograd.grad(loss + gx.float().square().sum(), (x, w))

    ours = grads(x0, fused_layer_norm)
    ref = grads(x0.float(), F.layer_norm)
    assert ours[0].dtype == torch.bfloat16 and ours[1].dtype == torch.float32
    torch.testing.assert_close(ours[0].float(), ref[0], rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(ours[1], ref[1], rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_backward_op_gradient_takes_mean_and_rstd_as_inputs(device):
    # layer_norm_bwd's own gradient, with mean and rstd free inputs (the chain from them to x is the
    # forward op's): a wrong split between the two would still pass a check of the composition alone
    from accel.runtime.nn.layer_norm import _ops

    torch.manual_seed(13)
    d = {"dtype": torch.float64, "device": device, "requires_grad": True}
    dy, x, w, b = torch.randn(4, 6, **d), torch.randn(4, 6, **d), torch.randn(6, **d), torch.randn(6, **d)
    mean, rstd = torch.randn(4, **d), (torch.rand(4, dtype=torch.float64, device=device) + 0.5).requires_grad_()

    def bwd(dy, x, mean, rstd, w):
        return _ops().layer_norm_bwd(dy, x, mean, rstd, w, b.detach(), 1, True, True)

    assert torch.autograd.gradcheck(bwd, (dy, x, mean, rstd, w))
    assert torch.autograd.gradcheck(lambda dy, x, mean, rstd: _ops().layer_norm_bwd(
        dy, x, mean, rstd, None, None, 1, False, False)[0], (dy, x, mean, rstd))


@pytest.mark.parametrize("affine", ["weight and bias", "bias only", "none"])
def test_gradient_is_cpp_and_an_ordinary_backward_runs_no_python(affine):
    # layer_norm_fwd's gradient is C++ (csrc/autograd/layer_norm_autograd.cpp): neither the forward nor an
    # ordinary backward runs torch.library's Python wrappers, and the backward runs none of accel's own
    # (layer_norm_bwd is called below autograd); the gradients still equal F.layer_norm's.
    torch.manual_seed(3)
    x = torch.randn(4, 10, dtype=torch.float64, requires_grad=True)
    w = torch.randn(10, dtype=torch.float64, requires_grad=True) if affine == "weight and bias" else None
    b = torch.randn(10, dtype=torch.float64, requires_grad=True) if affine != "none" else None
    g = torch.randn(4, 10, dtype=torch.float64)
    fused_layer_norm(x, 10, w, b)  # loads the kernels outside the probed calls
    assert "layer_norm_autograd.cpp" in autograd_kernel("accel::layer_norm_fwd")
    leaves = [t for t in (x, w, b) if t is not None]
    y, fwd_files = python_calls(lambda: fused_layer_norm(x, 10, w, b))
    grads, bwd_files = python_calls(lambda: torch.autograd.grad(y, leaves, g))
    assert not ran(fwd_files, LIBRARY) and not ran(bwd_files, LIBRARY, ACCEL_RUNTIME)
    expected = torch.autograd.grad(F.layer_norm(x, (10,), w, b), leaves, g)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want)


def test_backward_node_keeps_autograds_contracts():
    # The C++ node (csrc/autograd/layer_norm_autograd.cpp) behaves as torch's own nodes do: saved-tensor
    # hooks see what it saves (non-reentrant activation checkpointing relies on them), an in-place change
    # of a saved input is caught, a second backward without retain_graph is refused, gradients go only to
    # the inputs asked for, and forward-mode AD is refused rather than silently dropped.
    torch.manual_seed(11)
    m = FusedLayerNorm(6)
    x = torch.randn(3, 6, requires_grad=True)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t.shape) or t.clone(), lambda t: t):
        y = m(x * 1.0)
    assert (3, 6) in packed and (6,) in packed and (3,) in packed  # x, weight/bias, mean/rstd
    g = torch.randn(3, 6)
    ref = F.layer_norm(x, (6,), m.weight, m.bias)
    torch.testing.assert_close(torch.autograd.grad(y, x, g, retain_graph=True)[0],
                               torch.autograd.grad(ref, x, g)[0], **_grads_tol(torch.float32))
    (dw,) = torch.autograd.grad(y, m.weight, g, retain_graph=True)  # weight alone
    assert dw.shape == (6,) and m.weight.grad is None
    y.backward(g)
    with pytest.raises(RuntimeError, match="second time|freed"):
        y.backward(g)

    h = x.detach().clone().requires_grad_()
    inner = h * 1.0
    y = fused_layer_norm(inner, 6, m.weight, m.bias)
    inner.add_(1.0)  # modifies a tensor the backward needs
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()

    import torch.autograd.forward_ad as fwAD
    with fwAD.dual_level(), pytest.raises(NotImplementedError, match="forward-mode AD"):
        fused_layer_norm(fwAD.make_dual(x.detach(), torch.ones(3, 6)), 6, m.weight, m.bias)


@pytest.mark.parametrize("device", DEVICES)
def test_common_call_takes_the_cpp_entry(device):
    # The call a model makes every step (module or function) is checked and run by the extension's C++
    # entry (csrc/autograd/python_entry.h): torch.ops' Python (torch/_ops.py) and the Python checks do
    # not run, and the result and gradients equal F.layer_norm's.
    torch.manual_seed(4)
    m = FusedLayerNorm(12).to(device)
    x = torch.randn(3, 12, device=device, requires_grad=True)
    m(x)  # loads the kernels outside the probed call
    y, files = python_calls(lambda: m(x))
    assert not ran(files, "torch/_ops.py", LIBRARY, "nn/_common.py")
    ref = F.layer_norm(x, (12,), m.weight, m.bias)
    torch.testing.assert_close(y, ref, **tol(torch.float32))
    g = torch.randn_like(y)
    for got, want in zip(torch.autograd.grad(y, (x, m.weight, m.bias), g),
                         torch.autograd.grad(ref, (x, m.weight, m.bias), g)):
        torch.testing.assert_close(got, want, **_grads_tol(torch.float32))


class _Tagged(torch.Tensor):
    """A subclass with its own __torch_function__: it records every function it is handed."""
    seen: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(func)
        return super().__torch_function__(func, types, args, kwargs or {})


def test_calls_the_entry_leaves_to_the_general_path_keep_torchs_semantics():
    # What the C++ entry does not take goes through torch.ops.accel, where torch's protocols apply:
    # a subclass's __torch_function__ and a TorchFunctionMode see the op, an int eps is accepted,
    # fp64 params beside fp32 x are cast; a TorchDispatchMode sees the op on the entry's path too.
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.manual_seed(5)
    x, w, b = torch.randn(2, 6), torch.randn(6), torch.randn(6)
    ref = F.layer_norm(x, (6,), w, b)
    fused_layer_norm(x, 6, w, b)

    _Tagged.seen = []
    y = fused_layer_norm(x.as_subclass(_Tagged), 6, w, b)
    assert torch.ops.accel.layer_norm_fwd in _Tagged.seen
    torch.testing.assert_close(y.as_subclass(torch.Tensor), ref)

    class Log(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    seen = []
    with Log():
        y = fused_layer_norm(x, 6, w, b)
    assert torch.ops.accel.layer_norm_fwd in seen
    torch.testing.assert_close(y, ref)

    class DispatchLog(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    seen = []
    with DispatchLog():
        y = fused_layer_norm(x, 6, w, b)
    assert torch.ops.accel.layer_norm_fwd.default in seen
    torch.testing.assert_close(y, ref)

    torch.testing.assert_close(fused_layer_norm(x, 6, w, b, eps=1), F.layer_norm(x, (6,), w, b, eps=1.0))
    torch.testing.assert_close(fused_layer_norm(x, 6, w.double(), b.double()), ref)
    with torch.inference_mode():
        y = fused_layer_norm(x, (6,), w.requires_grad_(), b)
    assert y.grad_fn is None and y.is_inference()
    torch.testing.assert_close(y, ref)
