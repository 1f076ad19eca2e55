"""Fused bias-dropout-add against the formula residual + mask * (x + bias) / (1 - p), with the mask
recovered from the op itself (x = ones, residual = zeros, same seed), computed in float64."""
import math

import pytest
import torch

from accel.runtime.nn import bias_dropout_add, dropout_add_fused, dropout_add_fused_train
from accel.runtime.nn.bias_dropout_add import bias_dropout_add_reference

from ._autograd_probe import ACCEL_RUNTIME, LIBRARY, autograd_kernel, python_calls, ran
from ._params import DEVICES, DTYPES, tol
from ._tracing import accel_ops, traced_ops

# On CUDA, rows whose length is a multiple of 4 take the backward that sums the bias gradient in the dx
# pass: (2, 3, 128); the others take dx, then a row sum.
SHAPES = [(7,), (3, 1001), (2, 5, 129), (2, 3, 128), (0, 4)]


def recover_mask(shape, p, seed, device):
    """The keep-mask the op draws after torch.manual_seed(seed): with x = 1 and residual = 0 the
    output is scale where kept and 0 where dropped."""
    torch.manual_seed(seed)
    out = bias_dropout_add(torch.ones(shape, device=device), None, torch.zeros(shape, device=device), p, True)
    kept = out != 0
    if p < 1:
        torch.testing.assert_close(out[kept], torch.full_like(out[kept], 1 / (1 - p)))
    return kept


def inputs(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(device, dtype)
    bias = torch.randn(shape[-1], generator=g).to(device, dtype)
    residual = torch.randn(shape, generator=g).to(device, dtype)
    return x, bias, residual


def by_hand(x, bias, residual, mask, p):
    scale = 1 / (1 - p) if p < 1 else 0.0
    y = x.double() + (0 if bias is None else bias.double())
    return residual.double() + mask.double() * y * scale


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("p", [0.0, 0.3, 1.0])
def test_forward_backward_match_formula(device, dtype, shape, p):
    _check_formula(device, dtype, shape, p)


def _grid_stride_rows(device, cols):
    """Rows of `cols` elements that take the CUDA kernels' grid-stride loops (grid_for: 32 blocks of 256
    threads an SM, a 4-element group a thread and round) twice round the grid, and a few threads a third
    time, the last group part-filled where 4 does not divide the size."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device == "cuda" else 132
    groups = 2 * sms * 32 * 256 + 3
    return (4 * groups + cols - 1) // cols


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["1000 rows", "grid-stride", "grid-stride, no bias"])
def test_large_inputs_past_the_cuda_grid(device, dtype, case):
    """1000 rows of 128: the one-pass bias gradient over chunks of rows and a part-filled last chunk; rows
    of 1028 (bias columns not aligned with the threads' groups) past the forward's grid, and past the
    backward's without a bias (its grid-stride kernel)."""
    shape = (1000, 128) if case == "1000 rows" else (_grid_stride_rows(device, 1028), 1028)
    _check_formula(device, dtype, shape, 0.3, with_bias=not case.endswith("no bias"))


def _check_formula(device, dtype, shape, p, with_bias=True):
    mask = recover_mask(shape, p, seed=11, device=device)
    x, bias, residual = inputs(shape, dtype, device)
    bias = bias if with_bias else None
    for t in (x, bias, residual):
        if t is not None:
            t.requires_grad_()
    torch.manual_seed(11)
    out = bias_dropout_add(x, bias, residual, p, True)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, by_hand(x, bias, residual, mask, p).to(dtype), **tol(dtype))

    g = torch.randn(shape).to(device, dtype)
    out.backward(g)
    scale = 1 / (1 - p) if p < 1 else 0.0
    gx = mask.double() * scale * g.double()
    torch.testing.assert_close(x.grad, gx.to(dtype), **tol(dtype))
    torch.testing.assert_close(residual.grad, g)
    if bias is None:
        return
    gb = gx.reshape(-1, shape[-1]).sum(0)
    rtol, atol = tol(dtype).values()
    torch.testing.assert_close(bias.grad, gb.to(dtype), rtol=rtol, atol=atol * max(1, math.prod(shape[:-1])) ** 0.5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_kept_fraction_is_binomial(device, p):
    n = 200_003
    torch.manual_seed(1)
    kept = (bias_dropout_add(torch.ones(n, device=device), None, torch.zeros(n, device=device), p, True) != 0)
    frac = kept.double().mean().item()
    assert abs(frac - (1 - p)) <= 5 * math.sqrt(p * (1 - p) / n)  # 5 sigma
    # no structure across the 4 words of one Philox draw: each lane keeps ~(1 - p) too
    lanes = kept[: n - n % 4].reshape(-1, 4).double().mean(0)
    assert torch.all((lanes - (1 - p)).abs() <= 5 * math.sqrt(p * (1 - p) / (n // 4)))


@pytest.mark.parametrize("device", DEVICES)
def test_p0_is_identity_and_p1_gives_residual(device):
    x, bias, residual = inputs((5, 33), torch.float32, device)
    torch.testing.assert_close(bias_dropout_add(x, bias, residual, 0.0, True), residual + (x + bias))
    torch.testing.assert_close(bias_dropout_add(x, bias, residual, 1.0, True), residual, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_reproducible_under_manual_seed_and_different_across_seeds(device):
    x, bias, residual = inputs((64, 65), torch.float32, device)
    torch.manual_seed(3)
    a = bias_dropout_add(x, bias, residual, 0.5, True)
    b = bias_dropout_add(x, bias, residual, 0.5, True)  # the generator moved on
    torch.manual_seed(3)
    a2 = bias_dropout_add(x, bias, residual, 0.5, True)
    torch.manual_seed(4)
    c = bias_dropout_add(x, bias, residual, 0.5, True)
    assert torch.equal(a, a2)
    assert not torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("device", DEVICES)
def test_backward_regenerates_the_forward_mask_without_storing_it(device):
    shape = (9, 130)
    mask = recover_mask(shape, 0.4, seed=5, device=device)
    x = torch.randn(shape, device=device, requires_grad=True)
    residual = torch.randn(shape, device=device)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        torch.manual_seed(5)
        out = dropout_add_fused_train(x, residual, 0.4)
    # only the Philox (seed, offset): 2 int64, not a mask the size of x
    assert [(t.dtype, t.numel()) for t in saved] == [(torch.int64, 2)]
    torch.rand(1000, device=device)  # move the generator on between forward and backward
    g = torch.randn(shape, device=device)
    out.backward(g)
    torch.testing.assert_close(x.grad, mask * g / 0.6)


def test_gradcheck_float64_cpu():
    x = torch.randn(6, 7, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(7, dtype=torch.float64, requires_grad=True)
    residual = torch.randn(6, 7, dtype=torch.float64, requires_grad=True)

    def fn(x, bias, residual):
        torch.manual_seed(0)  # the same mask at every evaluation
        return bias_dropout_add(x, bias, residual, 0.3, True)

    assert torch.autograd.gradcheck(fn, (x, bias, residual))


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_inputs(device):
    x = torch.randn(64, 48, device=device).t()[::2]
    residual = torch.randn(48, 64, device=device)[::2]
    bias = torch.randn(128, device=device)[::2]
    assert not x.is_contiguous() and not bias.is_contiguous()
    mask = recover_mask(x.shape, 0.25, seed=2, device=device)
    torch.manual_seed(2)
    out = bias_dropout_add(x, bias, residual, 0.25, True)
    torch.testing.assert_close(out, by_hand(x, bias, residual, mask, 0.25).float())


@pytest.mark.parametrize("device", DEVICES)
def test_inference_forms(device):
    x, bias, residual = inputs((4, 17), torch.float32, device)
    torch.testing.assert_close(dropout_add_fused(x, residual, 0.5), x + residual, rtol=0, atol=0)
    torch.testing.assert_close(bias_dropout_add(x, bias, residual, 0.5, False), residual + (x + bias))
    torch.testing.assert_close(bias_dropout_add_reference(x, bias, residual, 0.5, False), residual + (x + bias))
    torch.manual_seed(8)
    a = dropout_add_fused_train(x, residual, 0.5)
    torch.manual_seed(8)
    torch.testing.assert_close(a, bias_dropout_add(x, None, residual, 0.5, True), rtol=0, atol=0)


def test_torch_compile_fullgraph_matches_eager():
    x, bias, residual = inputs((8, 40), torch.float32, "cpu")
    x.requires_grad_()

    def fn(x, bias, residual):
        return bias_dropout_add(x * 2, bias, residual, 0.3, True).sum(-1)

    compiled = torch.compile(fn, fullgraph=True)
    torch.manual_seed(6)
    eager = fn(x, bias, residual)
    (gx_eager,) = torch.autograd.grad(eager.sum(), x)
    torch.manual_seed(6)
    out = compiled(x, bias, residual)
    (gx,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(gx, gx_eager)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_compiled_code_leaves_cuda_to_inductor(device):
    """Under torch.compile the op runs on the CPU, and on CUDA torch's dropout and adds, which Inductor fuses
    with their neighbours (see philox_dropout's test of the same rule)."""
    bias_dropout_add(torch.zeros(1), None, torch.zeros(1), 0.3, True)  # loads the kernels
    ops = traced_ops(lambda x: bias_dropout_add(x, None, x, 0.3, True), device)
    assert accel_ops(ops) == ({"accel.bias_dropout_add_fwd.default"} if device == "cpu" else set()), ops


def test_bad_input_names_argument():
    x = torch.randn(3, 4)
    for bad in (-0.1, 1.5, "0.1", None, True):
        with pytest.raises(ValueError, match="drop_rate"):
            dropout_add_fused_train(x, x, bad)
        with pytest.raises(ValueError, match="drop_rate"):
            dropout_add_fused(x, x, bad)
        with pytest.raises(ValueError, match="prob"):
            bias_dropout_add(x, None, x, bad, True)
    with pytest.raises(ValueError, match="to_add"):
        dropout_add_fused_train(x, torch.randn(4, 3), 0.1)
    with pytest.raises(ValueError, match="residual"):
        bias_dropout_add(x, None, torch.randn(3, 4, dtype=torch.float64), 0.1, True)
    with pytest.raises(ValueError, match="bias"):
        bias_dropout_add(x, torch.randn(3), x, 0.1, True)
    with pytest.raises(ValueError, match="to_add"):
        dropout_add_fused_train(x, torch.randn(3, 4, device="meta"), 0.1)
    with pytest.raises(TypeError, match="x"):
        dropout_add_fused_train(torch.arange(12).reshape(3, 4), x, 0.1)


@pytest.mark.parametrize("device", DEVICES)
def test_nan_and_inf_propagate_like_torch_dropout(device):
    # torch's dropout multiplies by the mask, so a dropped NaN stays NaN and a dropped inf becomes NaN;
    # the kernels (both devices) must do the same rather than write 0 where an element is dropped.
    n = 64
    mask = recover_mask((n,), 0.5, seed=9, device=device)
    assert mask.any() and not mask.all()
    x = torch.randn(n, device=device)
    x[::3] = float("nan")
    x[1::3] = float("inf")
    residual = torch.randn(n, device=device)
    torch.manual_seed(9)
    x_leaf = x.clone().requires_grad_()
    out = bias_dropout_add(x_leaf, None, residual, 0.5, True)
    # mask * x * scale: NaN wherever x is NaN, and wherever x is inf and dropped
    torch.testing.assert_close(out, by_hand(x, None, residual, mask, 0.5).float(), equal_nan=True)
    assert torch.equal(out.isnan(), x.isnan() | (x.isinf() & ~mask))
    g = torch.full((n,), float("nan"), device=device)
    g[1::2] = 1.0
    out.backward(g)
    torch.testing.assert_close(x_leaf.grad, (mask.double() * g.double() * 2.0).float(), equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_misaligned_views_match_aligned_copies(device, dtype):
    # A view one element into its storage is not 16-byte aligned: the CUDA kernels must take their
    # element-wise path there (n % 4 == 0 would otherwise pick the vector path). The mask depends on
    # the element index only, so both paths give the same bits.
    shape = (6, 20)
    n = math.prod(shape)
    g = torch.Generator().manual_seed(0)
    buf_x = torch.randn(n + 1, generator=g).to(device, dtype)
    buf_r = torch.randn(n + 1, generator=g).to(device, dtype)
    bias = torch.randn(shape[-1], generator=g).to(device, dtype)
    x, residual = buf_x[1:].view(shape), buf_r[1:].view(shape)
    assert x.is_contiguous() and x.data_ptr() % 16 != 0
    grad = torch.randn(n + 1, generator=g).to(device, dtype)[1:].view(shape)
    results = []
    for xs, rs, gs in ((x, residual, grad), (x.clone(), residual.clone(), grad.clone())):
        xs, bs = xs.detach().requires_grad_(), bias.detach().clone().requires_grad_()
        torch.manual_seed(4)
        out = bias_dropout_add(xs, bs, rs, 0.4, True)
        out.backward(gs)
        results.append((out.detach(), xs.grad, bs.grad))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])
    # the aligned copy sums the bias gradient in the dx pass (CUDA), the view after it: other orders
    torch.testing.assert_close(results[0][2], results[1][2], **tol(dtype))


CUDA = [pytest.param("cuda", marks=DEVICES[1].marks)]


def _fwd_raw(x, bias, residual, p):
    from accel.runtime.nn.bias_dropout_add import _ops
    return _ops().bias_dropout_add_fwd(x, bias, residual, p, True)


@pytest.mark.parametrize("device", CUDA)
def test_cuda_takes_seed_and_offset_from_the_generator(device):
    # torch.cuda.get_rng_state() is (seed, offset) as two little-endian 64-bit words; the offset counts
    # 32-bit draws. A call must reserve 4 draws per Philox subsequence and use counter offset / 4.
    torch.manual_seed(21)
    torch.rand(1000, device=device)  # move the offset away from 0
    before = torch.cuda.get_rng_state().view(torch.int64).tolist()
    _, rng_state = _fwd_raw(torch.ones(10, device=device), None, torch.zeros(10, device=device), 0.5)
    after = torch.cuda.get_rng_state().view(torch.int64).tolist()
    assert before[1] % 4 == 0 and before[1] > 0
    assert rng_state.tolist() == [before[0], before[1] // 4]
    assert after == [before[0], before[1] + 4]


@pytest.mark.parametrize("device", CUDA)
def test_cuda_mask_is_the_cpu_mask_of_the_same_rng_state(device):
    # One (seed, counter) pair means one mask on both devices: the CPU backward, fed the CUDA
    # forward's rng_state, reproduces the CUDA mask bit for bit.
    from accel.runtime.nn.bias_dropout_add import _ops
    n, p = 4099, 0.3
    torch.manual_seed(2)
    out, rng_state = _fwd_raw(torch.ones(n, device=device), None, torch.zeros(n, device=device), p)
    cpu = _ops().bias_dropout_add_bwd(torch.ones(n), rng_state.cpu(), p, False)[0]
    assert torch.equal(out.cpu() != 0, cpu != 0)
    torch.testing.assert_close(out.cpu(), cpu)


@pytest.mark.parametrize("device", CUDA)
def test_cuda_grid_stride_loop_keeps_the_bias_column(device):
    # More 4-element groups than the grid has threads (132 SMs * 32 blocks * 256 threads), so every
    # thread loops and advances its bias column without a division; 1001 columns never align with
    # the stride. Odd n also exercises the masked tail.
    shape = (8657, 1001)
    x, bias, residual = inputs(shape, torch.float32, device)
    mask = recover_mask(shape, 0.2, seed=12, device=device)
    torch.manual_seed(12)
    out = bias_dropout_add(x, bias, residual, 0.2, True)
    torch.testing.assert_close(out, (residual + mask * (x + bias) / 0.8), **tol(torch.float32))


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).replace("torch.", ""))
def test_cuda_bias_gradient_summed_in_the_dx_pass(device, dtype):
    # 5000 rows of 264 (66 groups of 4: the last 32-group block of columns is part empty) over several row
    # chunks: dbias is the sum of the dx the op returns, within fp32 summation error
    shape, p = (5000, 264), 0.2
    x, bias, residual = (t.requires_grad_() for t in inputs(shape, dtype, device, seed=6))
    torch.manual_seed(15)
    out = bias_dropout_add(x, bias, residual, p, True)
    mask = recover_mask(shape, p, seed=15, device=device)
    g = torch.randn(shape, device=device).to(dtype)
    gx, gb = torch.autograd.grad(out, (x, bias), g)
    assert torch.equal(gx, (g.float() * (mask.float() * (1 / (1 - p)))).to(dtype))
    torch.testing.assert_close(gb, gx.double().sum(0).to(dtype), rtol=tol(dtype)["rtol"], atol=1e-3)


@pytest.mark.parametrize("device", CUDA)
def test_cuda_graph_replays_draw_new_masks(device):
    # Under capture the seed and offset are read on the device at each replay: every replay draws a
    # new mask, and its rng_state regenerates exactly that mask.
    from accel.runtime.nn.bias_dropout_add import _ops
    n, p = 1000, 0.5
    x, r = torch.ones(n, device=device), torch.zeros(n, device=device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _fwd_raw(x, None, r, p)  # warm-up (and kernel load) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, rng_state = _fwd_raw(x, None, r, p)
    masks = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        masks.append(out != 0)
        cpu = _ops().bias_dropout_add_bwd(torch.ones(n), rng_state.cpu(), p, False)[0]
        assert torch.equal(masks[-1].cpu(), cpu != 0)
    assert not torch.equal(masks[0], masks[1])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cuda_second_device():
    device = "cuda:1"
    x, bias, residual = inputs((33, 65), torch.float16, device)
    mask = recover_mask(x.shape, 0.3, seed=3, device=device)
    torch.manual_seed(3)
    out = bias_dropout_add(x.requires_grad_(), bias, residual, 0.3, True)
    assert out.device == torch.device(device)
    torch.testing.assert_close(out, by_hand(x, bias, residual, mask, 0.3).half(), **tol(torch.float16))
    g = torch.randn_like(out)
    out.backward(g)
    torch.testing.assert_close(x.grad, (mask.double() * g.double() / 0.7).half(), **tol(torch.float16))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_gradgradcheck_float64(device, p):
    # the backward regenerates the mask and is linear in the incoming gradient; its own gradient is
    # the same op. The seed is fixed inside so every evaluation draws the same mask.
    g = torch.Generator().manual_seed(1)
    x, bias, residual = (torch.randn(shape, generator=g, dtype=torch.float64).to(device).requires_grad_()
                         for shape in ((4, 6), (6,), (4, 6)))

    def fn(x, bias, residual):
        torch.manual_seed(21)
        return bias_dropout_add(x, bias, residual, p, True)

    assert torch.autograd.gradgradcheck(fn, (x, bias, residual))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gradient_penalty_matches_formula(device, dtype):
    # loss + |d loss / dx|^2 differentiated again, against the formula with the op's own mask
    shape, p = (5, 129), 0.3
    mask = recover_mask(shape, p, seed=22, device=device)
    x0, bias0, residual0 = inputs(shape, dtype, device, seed=3)

    def grads(fn):
        x, bias, residual = (t.clone().requires_grad_() for t in (x0, bias0, residual0))
        out = fn(x, bias, residual)
        loss = (out.tanh() * out).sum()
        gx, gb = torch.autograd.grad(loss, (x, bias), create_graph=True)
        return torch.autograd.grad(loss + gx.square().sum() + gb.square().sum(), (x, bias, residual))

    def ours(x, bias, residual):
        torch.manual_seed(22)
        return bias_dropout_add(x, bias, residual, p, True)

    def formula(x, bias, residual):
        return residual + mask.to(dtype) * (x + bias) / (1 - p)

    # the bias gradients are sums over the rows: a little more than an output ulp in fp32
    tolerance = tol(dtype) if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-5}
    for o, r in zip(grads(ours), grads(formula)):
        torch.testing.assert_close(o, r, **tolerance)


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("needs", ["x", "bias", "residual", "x+residual", "bias+residual"])
def test_gradients_of_any_subset_of_inputs(with_bias, needs):
    # the C++ gradient reads needs_input_grad by the position of each present tensor input: an absent
    # bias moves residual to position 1
    shape, p = (6, 33), 0.3
    if "bias" in needs and not with_bias:
        pytest.skip("no bias to differentiate")
    mask = recover_mask(shape, p, seed=13, device="cpu")
    x, bias, residual = inputs(shape, torch.float32, "cpu", seed=4)
    bias = bias if with_bias else None
    wanted = {"x": x, "bias": bias, "residual": residual}
    wrt = [wanted[n].requires_grad_() for n in needs.split("+")]
    torch.manual_seed(13)
    out = bias_dropout_add(x, bias, residual, p, True)
    g = torch.randn(shape)
    grads = dict(zip(needs.split("+"), torch.autograd.grad(out, wrt, g)))
    gx = mask * g / (1 - p)
    expected = {"x": gx, "bias": gx.sum(0), "residual": g}
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_gradient_is_cpp_and_an_ordinary_backward_runs_no_python(p):
    # The forward op's gradient is C++ (csrc/autograd/bias_dropout_add_autograd.cpp): neither the
    # forward nor an ordinary backward runs a torch.library.register_autograd gradient's Python
    # (torch/_library/) or our own (accel/runtime/nn/); the backward op is called below autograd. (The
    # CPU autograd engine runs a CPU graph on the calling thread, where the profile hook sees it.)
    shape = (4, 9)
    mask = recover_mask(shape, p, seed=14, device="cpu")  # also loads the kernels outside the profiled calls
    assert "bias_dropout_add_autograd.cpp" in autograd_kernel("accel::bias_dropout_add_fwd")
    x, bias, residual = (t.requires_grad_() for t in inputs(shape, torch.float32, "cpu", seed=5))
    g = torch.randn(shape)
    torch.manual_seed(14)
    out, fwd_files = python_calls(lambda: bias_dropout_add(x, bias, residual, p, True))
    (gx, gb, gr), bwd_files = python_calls(lambda: torch.autograd.grad(out, (x, bias, residual), g))
    assert not ran(fwd_files, LIBRARY)
    assert not ran(bwd_files, LIBRARY, ACCEL_RUNTIME)
    torch.testing.assert_close(gx, mask * g / (1 - p))
    torch.testing.assert_close(gb, gx.sum(0))
    torch.testing.assert_close(gr, g)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["bias_dropout_add", "dropout_add_fused_train", "dropout_add_fused"])
def test_common_call_takes_the_cpp_entry(device, form):
    # The call a model makes every step is checked and run by the extension's C++ entry
    # (csrc/autograd/python_entry.h): torch.ops' Python (torch/_ops.py) and the Python checks do not
    # run; the result is the formula's with the op's own mask.
    x, bias, residual = inputs((3, 10), torch.float32, device, seed=6)
    call = {"bias_dropout_add": lambda: bias_dropout_add(x, bias, residual, 0.25, True),
            "dropout_add_fused_train": lambda: dropout_add_fused_train(x, residual, 0.25),
            "dropout_add_fused": lambda: dropout_add_fused(x, residual, 0.25)}[form]
    mask = recover_mask((3, 10), 0.25, seed=15, device=device) if form != "dropout_add_fused" \
        else torch.ones(3, 10, dtype=torch.bool, device=device)
    torch.manual_seed(15)
    out, files = python_calls(call)
    assert not ran(files, "torch/_ops.py", "nn/_common.py")
    p = 0.25 if form != "dropout_add_fused" else 0.0
    want = by_hand(x, bias if form == "bias_dropout_add" else None, residual, mask, p)
    torch.testing.assert_close(out.double(), want)


def test_calls_the_entry_leaves_to_the_general_path_keep_torchs_semantics():
    # What the C++ entry does not take goes through torch.ops.accel, where torch's protocols apply: a
    # TorchFunctionMode sees the op; an int prob and an int training flag are accepted as numbers.
    from torch.overrides import TorchFunctionMode

    x, bias, residual = inputs((2, 6), torch.float32, "cpu", seed=7)
    bias_dropout_add(x, bias, residual, 0.5, True)

    class Log(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    seen = []
    torch.manual_seed(3)
    with Log():
        a = bias_dropout_add(x, bias, residual, 0.5, True)
    assert torch.ops.accel.bias_dropout_add_fwd in seen
    torch.manual_seed(3)
    torch.testing.assert_close(a, bias_dropout_add(x, bias, residual, 0.5, True), rtol=0, atol=0)
    torch.testing.assert_close(bias_dropout_add(x, bias, residual, 0, 1), residual + (x + bias))
    torch.testing.assert_close(bias_dropout_add(x, bias, residual, 1, 0), residual + (x + bias))
