
import pytest
import torch
import torch.nn.functional as F
import torchvision

from accel.runtime.nn.dcn_v2 import DCN, DCNv2, dcn_v2_conv, deform_conv2d, deform_conv2d_reference
from accel.utils.xla import xla_available

from ._autograd_probe import ACCEL_RUNTIME, LIBRARY, autograd_kernel, python_calls, ran
from ._params import DEVICES, NO_CUDA

# (name, batch, in_channels, (H, W), out_channels, kernel, stride, padding, dilation, groups,
#  offset_groups, offset scale). Offsets of scale s are N(0, s) pixels: 1.5 sends some taps past the
# border, 6 sends most of them off the image (zero samples, zero offset gradients).
CASES = [
    ("basic", 2, 4, (7, 7), 6, 3, 1, 1, 1, 1, 1, 1.5),
    ("rect_stride_pad", 1, 3, (9, 11), 5, (3, 2), (2, 1), (0, 1), 1, 1, 1, 1.0),
    ("dilation", 2, 4, (10, 8), 3, 3, 1, 2, 2, 1, 1, 1.0),
    ("offset_groups", 2, 6, (6, 7), 4, 3, 1, 1, 1, 1, 3, 1.5),
    ("groups", 3, 4, (6, 6), 6, 3, 2, 1, 1, 2, 2, 1.0),
    ("far_offsets", 2, 3, (5, 5), 2, 3, 1, 1, 1, 1, 1, 6.0),
    ("pointwise_batch", 5, 3, (4, 5), 2, 1, 1, 0, 1, 1, 1, 0.7),
    # 4 samples x 2 offset groups: whole-group work items (no per-slice partials) on a 2-thread CPU
    ("many_items", 4, 4, (5, 6), 3, 3, 1, 1, 1, 1, 2, 1.0),
]
IDS = [c[0] for c in CASES]


def _pair(v):
    return (v, v) if isinstance(v, int) else v


def _make(case, device, dtype, masked=True, bias=True, seed=0):
    _, batch, cin, (h, w), cout, k, stride, padding, dilation, groups, og, scale = case
    kh, kw = _pair(k)
    (sh, sw), (ph, pw), (dh, dw) = _pair(stride), _pair(padding), _pair(dilation)
    ho = (h + 2 * ph - (dh * (kh - 1) + 1)) // sh + 1
    wo = (w + 2 * pw - (dw * (kw - 1) + 1)) // sw + 1
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, s=1.0):
        return (torch.randn(shape, generator=g, dtype=torch.float64) * s).to(device=device, dtype=dtype)

    x = randn(batch, cin, h, w)
    offset = randn(batch, 2 * og * kh * kw, ho, wo, s=scale)
    weight = randn(cout, cin // groups, kh, kw)
    b = randn(cout) if bias else None
    mask = torch.rand(batch, og * kh * kw, ho, wo, generator=g, dtype=torch.float64).to(device=device, dtype=dtype) \
        if masked else None
    conv = {"stride": _pair(stride), "padding": _pair(padding), "dilation": _pair(dilation)}
    return (x, offset, weight, b, mask), conv


def _run(fn, tensors, conv, grad_seed=1):
    """fn's output and the gradient of every tensor argument (None stays None) for a random upstream grad."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in tensors]
    x, offset, weight, b, mask = leaves
    y = fn(x, offset, weight, b, mask=mask, **conv)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(grad_seed), dtype=torch.float64)
    y.backward(g.to(device=y.device, dtype=y.dtype))
    return y, [t.grad if t is not None else None for t in leaves]


def _torchvision(tensors, conv):
    """torchvision's CPU kernels in float64: the reference, whatever the device and dtype under test."""
    cpu = [t.detach().cpu().double() if t is not None else None for t in tensors]
    return _run(torchvision.ops.deform_conv2d, cpu, conv)


NAMES = ("output", "grad_input", "grad_offset", "grad_weight", "grad_bias", "grad_mask")
# (rtol, atol relative to the largest reference magnitude)
TOL = {torch.float64: (1e-10, 1e-12), torch.float32: (1e-4, 2e-5), torch.float16: (1e-2, 5e-3),
       torch.bfloat16: (5e-2, 3e-2)}


def _compare(got, want, dtype):
    rtol, atol = TOL[dtype]
    y, grads = got
    yr, grads_r = want
    for name, a, b in zip(NAMES, [y, *grads], [yr, *grads_r]):
        assert (a is None) == (b is None), name
        if a is None:
            continue
        assert a.dtype == dtype and a.shape == b.shape, name
        scale = max(1.0, b.abs().max().item())
        torch.testing.assert_close(a.cpu().double(), b, rtol=rtol, atol=atol * scale, msg=lambda m: f"{name}: {m}")


# ------------------------------------------------------------------ against torchvision


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("masked", [True, False], ids=["mask", "no_mask"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_forward_and_gradients_match_torchvision(device, dtype, masked, case):
    tensors, conv = _make(case, device, dtype, masked=masked)
    _compare(_run(deform_conv2d, tensors, conv), _torchvision(tensors, conv), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", CASES[:2], ids=IDS[:2])
def test_reduced_precision_matches_torchvision(device, dtype, case):
    # within the dtype's rounding of a float64 reference: sampling in float32, the GEMMs accumulating in it
    tensors, conv = _make(case, device, dtype)
    _compare(_run(deform_conv2d, tensors, conv), _torchvision(tensors, conv), dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_without_bias(device):
    tensors, conv = _make(CASES[0], device, torch.float64, bias=False)
    _compare(_run(deform_conv2d, tensors, conv), _torchvision(tensors, conv), torch.float64)


@pytest.mark.parametrize("device", DEVICES)
def test_integer_offsets_match_torchvision(device):
    # Zero and whole-pixel offsets put every tap on a pixel: the offset gradient there is
    # torchvision's one-sided derivative (towards the next pixel), not an average of both sides.
    tensors, conv = _make(CASES[0], device, torch.float64)
    x, offset, weight, b, mask = tensors
    offset = torch.randint(-2, 3, offset.shape, generator=torch.Generator().manual_seed(3)).to(offset)
    tensors = (x, offset, weight, b, mask)
    _compare(_run(deform_conv2d, tensors, conv), _torchvision(tensors, conv), torch.float64)


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_inputs(device):
    tensors, conv = _make(CASES[0], device, torch.float32)
    x, offset, weight, b, mask = tensors
    x = x.to(memory_format=torch.channels_last)
    offset = offset.transpose(2, 3).contiguous().transpose(2, 3)
    mask = mask[:, :, :, :].contiguous(memory_format=torch.channels_last)
    weight = weight.transpose(0, 1).contiguous().transpose(0, 1)
    assert not (x.is_contiguous() or offset.is_contiguous() or mask.is_contiguous() or weight.is_contiguous())
    tensors = (x, offset, weight, b, mask)
    _compare(_run(deform_conv2d, tensors, conv), _torchvision(tensors, conv), torch.float32)


def test_several_batch_chunks():
    # The CPU driver processes the batch in chunks of at most 2**24 column elements: 16 channels x 9
    # taps x 256*256 pixels is 9.4M per sample, so 3 samples take 3 chunks. Samples are independent,
    # so the result must be that of each sample on its own (one chunk each), grad_weight and grad_bias
    # summed over them.
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 16, 256, 256, generator=g)
    offset = torch.randn(3, 18, 256, 256, generator=g)
    mask = torch.rand(3, 9, 256, 256, generator=g)
    weight = torch.randn(2, 16, 3, 3, generator=g) * 0.1
    b = torch.randn(2, generator=g)
    conv = {"stride": (1, 1), "padding": (1, 1), "dilation": (1, 1)}
    y, grads = _run(deform_conv2d, (x, offset, weight, b, mask), conv)
    g_out = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).float()
    per_sample = []
    for i in range(3):
        leaves = [t.detach().clone().requires_grad_() for t in (x[i:i + 1], offset[i:i + 1], weight, b, mask[i:i + 1])]
        yi = deform_conv2d(*leaves[:4], mask=leaves[4], **conv)
        yi.backward(g_out[i:i + 1])
        per_sample.append((yi, [t.grad for t in leaves]))
    torch.testing.assert_close(y, torch.cat([p[0] for p in per_sample]))
    for j, name in enumerate(NAMES[1:]):
        parts = [p[1][j] for p in per_sample]
        want = sum(parts) if name in ("grad_weight", "grad_bias") else torch.cat(parts)
        torch.testing.assert_close(grads[j], want, rtol=1e-5, atol=1e-5 * max(1.0, want.abs().max().item()), msg=name)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch(device):
    (x, offset, weight, b, mask), conv = _make(CASES[0], device, torch.float32)
    tensors = (x[:0], offset[:0], weight, b, mask[:0])
    y, (gx, goff, gw, gb, gm) = _run(deform_conv2d, tensors, conv)
    assert y.shape == (0, 6, 7, 7)
    assert gx.shape == tensors[0].shape and goff.shape == tensors[1].shape and gm.shape == tensors[4].shape
    assert torch.count_nonzero(gw) == 0 and torch.count_nonzero(gb) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_nan_offset_samples_zero(device):
    x = torch.ones(1, 1, 3, 3, device=device)
    offset = torch.zeros(1, 2, 3, 3, device=device)
    offset[0, :, 1, 1] = float("nan")
    y = deform_conv2d(x, offset, torch.ones(1, 1, 1, 1, device=device))
    expected = torch.ones(1, 1, 3, 3, device=device)
    expected[0, 0, 1, 1] = 0
    torch.testing.assert_close(y, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck_float64(device):
    tensors, conv = _make(("tiny", 2, 2, (3, 4), 3, 2, 1, 0, 1, 1, 2, 0.8), device, torch.float64)
    leaves = [t.detach().requires_grad_() for t in tensors]

    def fn(x, offset, weight, b, mask):
        return deform_conv2d(x, offset, weight, b, mask=mask, **conv)

    # the CUDA backward adds grad_input with atomics in a varying order (as torchvision's): two backward
    # passes may differ in the last bits (an H100 run did); the Jacobians must still match the numerical ones
    assert torch.autograd.gradcheck(fn, leaves, nondet_tol=1e-12 if device == "cuda" else 0.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_cuda_backward_is_refused_under_deterministic_algorithms():
    tensors, conv = _make(("tiny", 2, 2, (3, 4), 3, 2, 1, 0, 1, 1, 2, 0.8), "cuda", torch.float32)
    x, offset, weight, b, mask = (t.detach().requires_grad_() for t in tensors)
    y = deform_conv2d(x, offset, weight, b, mask=mask, **conv)
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(RuntimeError, match="dcn_v2_bwd_cuda does not have a deterministic implementation"):
            y.sum().backward()
    finally:
        torch.use_deterministic_algorithms(False)


# ------------------------------------------------------------------ autograd in C++


# which of (input, offset, weight, bias, mask) require grad: with bias or mask absent, the
# gradient's tensor-input edges shift (needs_input_grad counts only the tensors present)
NEEDS = {"all": (1, 1, 1, 1, 1), "mask": (0, 0, 0, 0, 1), "bias": (0, 0, 0, 1, 0), "offset_weight": (0, 1, 1, 0, 0)}


@pytest.mark.parametrize("need", sorted(NEEDS))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("masked", [True, False], ids=["mask", "no_mask"])
def test_gradient_is_cpp_and_an_ordinary_backward_runs_no_python(need, bias, masked):
    # dcn_v2_fwd's gradient is C++ (csrc/autograd/dcn_v2_autograd.cpp): neither the forward op nor an
    # ordinary backward runs a torch.library.register_autograd gradient's Python (torch/_library/) or
    # our own (accel/runtime/nn/); the backward op is called below autograd. (The CPU autograd engine
    # runs a CPU graph on the calling thread, where the profile hook sees it.) Gradients go to exactly
    # the tensors that require them, equal to torchvision's.
    tensors, conv = _make(CASES[3], "cpu", torch.float64, masked=masked, bias=bias)
    leaves = [t.detach().clone().requires_grad_(bool(r)) if t is not None else None
              for t, r in zip(tensors, NEEDS[need])]
    wanted = [t for t in leaves if t is not None and t.requires_grad]
    if not wanted:
        pytest.skip("no tensor present requires grad")
    deform_conv2d(*leaves[:4], mask=leaves[4], **conv)  # loads the kernels outside the profiled calls
    assert "dcn_v2_autograd.cpp" in autograd_kernel("accel::dcn_v2_fwd")
    args = [list(conv["stride"]), list(conv["padding"]), list(conv["dilation"])]
    y, fwd_files = python_calls(lambda: torch.ops.accel.dcn_v2_fwd(*leaves, *args))
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads, bwd_files = python_calls(lambda: torch.autograd.grad(y, wanted, g))
    assert not ran(fwd_files, LIBRARY)
    assert not ran(bwd_files, LIBRARY, ACCEL_RUNTIME)
    _, want = _torchvision(tensors, conv)
    expected = [w for t, w in zip(leaves, want) if t is not None and t.requires_grad]
    for got, ref in zip(grads, expected):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


def test_double_backward_still_goes_through_torchs_fallback():
    # dcn_v2_bwd has no gradient (as in torchvision): create_graph=True calls it through autograd, as
    # the Python gradient did, so the first-order gradients are right and differentiating them warns
    # that the op has no autograd kernel, rather than failing or silently differing from before.
    tensors, conv = _make(CASES[0], "cpu", torch.float64)
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    y = deform_conv2d(*leaves[:4], mask=leaves[4], **conv)
    first = torch.autograd.grad(y.pow(2).sum(), leaves, create_graph=True)
    plain = torch.autograd.grad(deform_conv2d(*leaves[:4], mask=leaves[4], **conv).pow(2).sum(), leaves)
    for a, b in zip(first, plain):
        assert a.requires_grad
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.warns(UserWarning, match="accel::dcn_v2_bwd: an autograd kernel was not registered"):
        torch.autograd.grad(sum(t.pow(2).sum() for t in first), leaves, allow_unused=True)


# ------------------------------------------------------------------ the reference


def test_reference_matches_hand_computed_values():
    # 1x1 kernel, offsets (0.5, 0.5): each output is the mean of a 2x2 block, the image being zero
    # past its border; a mask scales it.
    x = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]], dtype=torch.float64)
    offset = torch.full((1, 2, 2, 2), 0.5, dtype=torch.float64)
    weight = torch.ones(1, 1, 1, 1, dtype=torch.float64)
    expected = torch.tensor([[[[2.5, 1.5], [1.75, 1.0]]]], dtype=torch.float64)
    torch.testing.assert_close(deform_conv2d_reference(x, offset, weight), expected)
    torch.testing.assert_close(deform_conv2d(x, offset, weight), expected)
    mask = torch.tensor([[[[2.0, 0.0], [1.0, -1.0]]]], dtype=torch.float64)
    torch.testing.assert_close(deform_conv2d_reference(x, offset, weight, mask=mask), expected * mask)
    torch.testing.assert_close(deform_conv2d(x, offset, weight, mask=mask), expected * mask)


@pytest.mark.parametrize("masked", [True, False], ids=["mask", "no_mask"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_reference_matches_torchvision(masked, case):
    tensors, conv = _make(case, "cpu", torch.float64, masked=masked)
    _compare(_run(deform_conv2d_reference, tensors, conv), _torchvision(tensors, conv), torch.float64)


@pytest.mark.skipif(not xla_available(), reason="torch_xla is not installed")
def test_xla_tensors_take_the_reference():
    import torch_xla

    dev = torch_xla.device()
    tensors, conv = _make(CASES[0], "cpu", torch.float32)
    y = deform_conv2d(*[t.to(dev) for t in tensors[:4]], mask=tensors[4].to(dev), **conv)
    torch.testing.assert_close(y.cpu(), torchvision.ops.deform_conv2d(*tensors[:4], mask=tensors[4], **conv),
                               rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ modules


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("groups", [1, 2])
def test_dcnv2_with_zero_offsets_and_unit_mask_is_conv2d(device, groups):
    torch.manual_seed(0)
    m = DCNv2(4, 6, 3, stride=2, padding=2, dilation=2, deformable_groups=2, groups=groups).to(device).double()
    conv = torch.nn.Conv2d(4, 6, 3, stride=2, padding=2, dilation=2, groups=groups).to(device).double()
    with torch.no_grad():
        m.bias.normal_()
        conv.weight.copy_(m.weight)
        conv.bias.copy_(m.bias)
    x = torch.randn(2, 4, 9, 8, device=device, dtype=torch.float64)
    y = conv(x)
    offset = torch.zeros(2, 2 * 2 * 9, *y.shape[2:], device=device, dtype=torch.float64)
    mask = torch.ones(2, 2 * 9, *y.shape[2:], device=device, dtype=torch.float64)
    torch.testing.assert_close(m(x, offset, mask), y)
    torch.testing.assert_close(m(x, offset), y)  # no mask: DCN v1


@pytest.mark.parametrize("device", DEVICES)
def test_fresh_dcn_is_half_a_conv2d_plus_bias(device):
    # dcn_v2's DCN: zero offsets, mask sigmoid(0) = 0.5
    torch.manual_seed(0)
    m = DCN(4, 6, (3, 3), 1, 1, dilation=2, deformable_groups=2).to(device).double()
    with torch.no_grad():
        m.bias.normal_()
    x = torch.randn(2, 4, 8, 9, device=device, dtype=torch.float64)
    torch.testing.assert_close(m(x), F.conv2d(x, m.weight * 0.5, m.bias, padding=1, dilation=2))


@pytest.mark.parametrize("device", DEVICES)
def test_dcn_matches_torchvision_composition(device):
    torch.manual_seed(0)
    m = DCN(4, 5, 3, 1, 1, deformable_groups=2).to(device).double()
    with torch.no_grad():
        m.conv_offset_mask.weight.normal_(0, 0.3)
        m.conv_offset_mask.bias.normal_(0, 0.3)
    x = torch.randn(2, 4, 6, 7, device=device, dtype=torch.float64, requires_grad=True)
    y = m(x)
    y.square().sum().backward()
    got = [x.grad] + [p.grad for p in m.parameters()]

    xr = x.detach().clone().requires_grad_()
    params = [p.detach().clone().requires_grad_() for p in m.parameters()]
    weight, bias, ow, ob = params
    out = F.conv2d(xr, ow, ob, padding=1)
    yr = torchvision.ops.deform_conv2d(xr, out[:, :36], weight, bias, padding=1, mask=torch.sigmoid(out[:, 36:]))
    yr.square().sum().backward()
    torch.testing.assert_close(y, yr)
    for a, b in zip(got, [xr.grad] + [p.grad for p in params]):
        torch.testing.assert_close(a, b)


def test_module_api_matches_dcn_v2():
    m = DCN(8, 16, 3, 2, 1, 1, 2)
    assert [n for n, _ in m.named_parameters()] == ["weight", "bias", "conv_offset_mask.weight",
                                                    "conv_offset_mask.bias"]
    assert m.weight.shape == (16, 8, 3, 3) and m.conv_offset_mask.weight.shape == (2 * 3 * 9, 8, 3, 3)
    assert torch.count_nonzero(m.bias) == 0 and m.weight.abs().max() <= 1 / (8 * 9) ** 0.5
    assert m(torch.randn(1, 8, 10, 10)).shape == (1, 16, 5, 5)
    assert DCNv2(8, 16, (1, 3), padding=(0, 1), bias=False).bias is None
    assert "deformable_groups=2" in repr(m)


def test_module_casts_parameters_to_input_dtype():
    m = DCNv2(4, 4, 3, 1, 1)  # float32 parameters
    x = torch.randn(1, 4, 5, 5, dtype=torch.float64)
    y = m(x, torch.randn(1, 18, 5, 5), torch.rand(1, 9, 5, 5))
    assert y.dtype == torch.float64
    y.sum().backward()
    assert m.weight.grad.dtype == torch.float32


def test_dcn_v2_conv_argument_order():
    tensors, conv = _make(CASES[3], "cpu", torch.float64)
    x, offset, weight, b, mask = tensors
    y = dcn_v2_conv(x, offset, mask, weight, b, conv["stride"], conv["padding"], conv["dilation"], 3)
    torch.testing.assert_close(y, torchvision.ops.deform_conv2d(x, offset, weight, b, mask=mask, **conv))
    with pytest.raises(ValueError, match="offset"):
        dcn_v2_conv(x, offset, mask, weight, b, conv["stride"], conv["padding"], conv["dilation"], 1)


# ------------------------------------------------------------------ errors


def _args():
    (x, offset, weight, b, mask), conv = _make(CASES[0], "cpu", torch.float32)
    return {"input": x, "offset": offset, "weight": weight, "bias": b, "mask": mask, **conv}


@pytest.mark.parametrize("change, error, name", [
    ({"input": [[1.0]]}, TypeError, "input"),
    ({"input": torch.zeros(2, 4, 7, 7, dtype=torch.int64)}, TypeError, "input"),
    ({"input": torch.zeros(4, 7, 7)}, ValueError, "input"),
    ({"offset": None}, TypeError, "offset"),
    ({"offset": torch.zeros(2, 17, 7, 7)}, ValueError, "offset"),
    ({"offset": torch.zeros(2, 18, 6, 7)}, ValueError, "offset"),
    ({"offset": torch.zeros(2, 18 * 3, 7, 7)}, ValueError, "offset"),  # 3 groups do not divide 4 channels
    ({"offset": torch.zeros(2, 18, 7, 7, dtype=torch.float64)}, TypeError, "offset"),
    ({"weight": torch.zeros(6, 3, 3, 3)}, ValueError, "weight"),
    ({"weight": torch.zeros(5, 2, 3, 3)}, ValueError, "weight"),
    ({"weight": torch.zeros(6, 4, 3)}, ValueError, "weight"),
    ({"bias": torch.zeros(5)}, ValueError, "bias"),
    ({"bias": 1.0}, TypeError, "bias"),
    ({"mask": torch.zeros(2, 18, 7, 7)}, ValueError, "mask"),
    ({"mask": torch.zeros(2, 9, 7, 7, dtype=torch.float16)}, TypeError, "mask"),
    ({"stride": 0}, ValueError, "stride"),
    ({"stride": 1.5}, TypeError, "stride"),
    ({"stride": (1, 1, 1)}, ValueError, "stride"),
    ({"padding": -1}, ValueError, "padding"),
    ({"padding": "1"}, TypeError, "padding"),
    ({"dilation": (1, True)}, TypeError, "dilation"),
    ({"padding": 0, "weight": torch.zeros(6, 4, 9, 9), "offset": torch.zeros(2, 162, 1, 1),
      "mask": None}, ValueError, "input"),
])
def test_bad_arguments_name_the_argument(change, error, name):
    args = {**_args(), **change}
    with pytest.raises(error, match=f"^{name}"):
        deform_conv2d(**args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_tensors_on_different_devices():
    args = _args()
    args["offset"] = args["offset"].cuda()
    with pytest.raises(ValueError, match="^offset"):
        deform_conv2d(**args)


def test_module_arguments():
    with pytest.raises(ValueError, match="deformable_groups"):
        DCN(6, 4, 3, deformable_groups=4)
    with pytest.raises(ValueError, match="groups"):
        DCNv2(6, 4, 3, groups=4)
    with pytest.raises(TypeError, match="kernel_size"):
        DCNv2(6, 4, 2.5)
    with pytest.raises(ValueError, match="in_channels"):
        DCNv2(0, 4, 3)
    m = DCNv2(4, 4, 3, 1, 1, deformable_groups=2)
    with pytest.raises(ValueError, match="offset"):
        m(torch.zeros(1, 4, 5, 5), torch.zeros(1, 18, 5, 5), torch.zeros(1, 18, 5, 5))


def test_kernels_check_their_arguments():
    # called directly, the ops refuse what the Python API refuses rather than read out of bounds
    a = _args()
    deform_conv2d(**a)  # loads the kernels
    with pytest.raises(RuntimeError, match="offset"):
        torch.ops.accel.dcn_v2_fwd(a["input"], a["offset"][:, :, :6], a["weight"], None, None, [1, 1], [1, 1], [1, 1])
    with pytest.raises(RuntimeError, match="mask"):
        torch.ops.accel.dcn_v2_fwd(a["input"], a["offset"], a["weight"], None, a["mask"][:1], [1, 1], [1, 1], [1, 1])
    with pytest.raises(RuntimeError, match="grad_output"):
        torch.ops.accel.dcn_v2_bwd(torch.zeros(2, 6, 7, 6), a["input"], a["offset"], a["weight"], None,
                                   [1, 1], [1, 1], [1, 1])


# ------------------------------------------------------------------ torch.library / torch.compile


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("masked", [True, False], ids=["mask", "no_mask"])
def test_opcheck(device, masked):
    tensors, conv = _make(CASES[4], device, torch.float32, masked=masked)
    x, offset, weight, b, mask = [t.requires_grad_() if t is not None else None for t in tensors]
    args = [list(conv["stride"]), list(conv["padding"]), list(conv["dilation"])]
    deform_conv2d(x, offset, weight, b, mask=mask, **conv)  # loads the kernels
    torch.library.opcheck(torch.ops.accel.dcn_v2_fwd.default, (x, offset, weight, b, mask, *args))
    y = torch.ops.accel.dcn_v2_fwd(x, offset, weight, b, mask, *args)
    detached = [t.detach() if t is not None else None for t in (x, offset, weight, mask)]
    torch.library.opcheck(torch.ops.accel.dcn_v2_bwd.default, (torch.randn_like(y), *detached, *args))


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph(device):
    tensors, conv = _make(CASES[1], device, torch.float32)
    compiled = torch.compile(deform_conv2d, fullgraph=True)
    got = _run(compiled, tensors, conv)
    want = _run(deform_conv2d, tensors, conv)
    for name, a, b in zip(NAMES, [got[0], *got[1]], [want[0], *want[1]]):
        torch.testing.assert_close(a, b, msg=name)
