"""philox_dropout / PhiloxDropout / accel::dropout_mask against F.dropout's definition: y = mask * x / (1 - p),
each element kept with probability 1 - p, computed in float64 from the mask the op drew. The mask itself is
checked against the one bias_dropout_add draws after the same seed (its own tests check that one against the
formula), and for its statistics."""
import copy
import io
import math
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from accel.runtime.nn.bias_dropout_add import (
    PhiloxDropout,
    _ops,
    bias_dropout_add,
    philox_dropout,
    swap_in_philox_dropout,
)

from ._autograd_probe import ACCEL_RUNTIME, LIBRARY, python_calls, ran
from ._params import DEVICES, DTYPES, tol
from ._tracing import accel_ops, traced_ops

SHAPES = [(7,), (3, 1001), (2, 5, 64), (0, 4), (129,)]


def drawn_mask(shape, p, seed, device):
    """The mask accel::dropout_mask draws after torch.manual_seed(seed)."""
    torch.manual_seed(seed)
    return _ops().dropout_mask(list(shape), p, device=torch.device(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_mask_is_the_keep_rule_of_bias_dropout_add(device, shape, p):
    mask = drawn_mask(shape, p, seed=4, device=device)
    assert mask.dtype == torch.bool and mask.shape == shape and mask.device.type == device
    torch.manual_seed(4)
    out = bias_dropout_add(torch.ones(shape, device=device), None, torch.zeros(shape, device=device), p, True)
    assert torch.equal(mask, out != 0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_kept_fraction_is_binomial_in_every_lane(device, p):
    n = 200_003
    torch.manual_seed(1)
    kept = _ops().dropout_mask([n], p, device=torch.device(device))
    assert abs(kept.double().mean().item() - (1 - p)) <= 5 * math.sqrt(p * (1 - p) / n)  # 5 sigma
    # the 4 words of a Philox draw and the 16 blocks drawn together keep ~(1 - p) each
    for lanes in (4, 64):
        frac = kept[: n - n % lanes].reshape(-1, lanes).double().mean(0)
        assert torch.all((frac - (1 - p)).abs() <= 5 * math.sqrt(p * (1 - p) / (n // lanes)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_and_backward_match_the_formula(device, dtype, shape):
    p = 0.3
    mask = drawn_mask(shape, p, seed=7, device=device)
    x = torch.randn(shape, device=device).to(dtype).requires_grad_()
    torch.manual_seed(7)
    y = philox_dropout(x, p)
    expected = mask.double() * x.double() / (1 - p)
    torch.testing.assert_close(y.double(), expected, **tol(dtype))
    assert y.dtype == dtype
    g = torch.randn(shape, device=device).to(dtype)
    y.backward(g)
    torch.testing.assert_close(x.grad.double(), mask.double() * g.double() / (1 - p), **tol(dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_eager_call_is_bitwise_the_plain_ops_and_its_gradient_a_cpp_node(device, dtype):
    # The eager call runs the C++ entry (accel::dropout_fwd, whose gradient is masked_scale's C++ node):
    # the same bits as the plain-op formula torch.compile traces (mask * x * scale), forward and backward,
    # on a transposed (non-contiguous) input too, and no Python of torch.ops or accel on the way.
    p = 0.3
    x = torch.randn(37, 21, device=device).to(dtype).t().requires_grad_()
    philox_dropout(x, p)  # loads the kernels outside the probed call
    torch.manual_seed(8)
    y, files = python_calls(lambda: philox_dropout(x, p))
    assert not ran(files, "torch/_ops.py", LIBRARY, "nn/_common.py")
    assert y.grad_fn.name() == "accel::MaskedScaleBackward"
    mask = drawn_mask(x.shape, p, seed=8, device=device)
    assert torch.equal(y, mask * x.detach() * (1.0 / (1.0 - p)))
    g = torch.randn(x.shape, device=device).to(dtype)
    (gx,), bwd_files = python_calls(lambda: torch.autograd.grad(y, x, g))
    assert not ran(bwd_files, LIBRARY, ACCEL_RUNTIME)
    assert torch.equal(gx, mask * g * (1.0 / (1.0 - p)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES + [(5, 8)])
@pytest.mark.parametrize("p", [0.0, 0.3, 1.0])
def test_dropout_fwd_is_dropout_mask_and_masked_scale_in_one_op(device, dtype, shape, p):
    # (y, mask): bitwise dropout_mask's draw after the same seed and masked_scale's product (0 for p = 1);
    # on CUDA one kernel writes both, vector path (numel % 4 == 0) and element path alike
    ops = _ops()
    x = torch.randn(shape, device=device).to(dtype).requires_grad_()
    torch.manual_seed(11)
    y, mask = ops.dropout_fwd(x, p)
    expected_mask = drawn_mask(shape, p, seed=11, device=device)
    assert mask.dtype == torch.bool and torch.equal(mask, expected_mask)
    scale = 1.0 / (1.0 - p) if p < 1.0 else 0.0
    assert y.dtype == dtype and torch.equal(y, ops.masked_scale(x.detach(), mask, scale))
    assert not mask.requires_grad and y.grad_fn.name() == "accel::MaskedScaleBackward"
    g = torch.randn(shape, device=device).to(dtype)
    (gx,) = torch.autograd.grad(y, x, g)
    assert torch.equal(gx, ops.masked_scale(g, mask, scale))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_fwd_past_the_grid(device, dtype):
    # more 4-element groups than the CUDA grid has threads, twice over and three more: every thread goes
    # round its grid-stride loop twice, a few a third time (against the mask kernel's own draw)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device == "cuda" else 132
    n = 4 * (2 * sms * 32 * 256 + 3)
    x = torch.randn(n, device=device).to(dtype)
    torch.manual_seed(12)
    y, mask = _ops().dropout_fwd(x, 0.3)
    assert torch.equal(mask, drawn_mask((n,), 0.3, seed=12, device=device))
    assert torch.equal(y, _ops().masked_scale(x, mask, 1.0 / 0.7))


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_fwd_checks_its_arguments(device):
    ops = _ops()
    with pytest.raises(RuntimeError, match="dropout_fwd: x: expected a floating-point tensor"):
        ops.dropout_fwd(torch.ones(3, dtype=torch.long, device=device), 0.5)
    with pytest.raises(RuntimeError, match=r"dropout_fwd: p: expected a float in \[0, 1\], got 1.5"):
        ops.dropout_fwd(torch.ones(3, device=device), 1.5)


@pytest.mark.parametrize("device", DEVICES)
def test_masked_scale_checks_its_mask(device):
    x = torch.randn(3, 4, device=device)
    ops = _ops()  # loads the kernels: this test may be the first of its process
    with pytest.raises(RuntimeError, match="mask: expected a bool tensor"):
        ops.masked_scale(x, torch.ones(3, 4, device=device), 2.0)
    with pytest.raises(RuntimeError, match="mask: expected x's shape"):
        ops.masked_scale(x, torch.ones(4, 3, dtype=torch.bool, device=device), 2.0)


@pytest.mark.parametrize("device", DEVICES)
def test_identity_and_torch_cases(device):
    x = torch.randn(5, 9, device=device)
    assert philox_dropout(x, 0.3, training=False) is x
    assert philox_dropout(x, 0.0) is x
    torch.testing.assert_close(philox_dropout(x, 1.0), torch.zeros_like(x), rtol=0, atol=0)
    ints = torch.arange(6, device=device)
    with pytest.raises(RuntimeError):  # F.dropout's own error for integer tensors
        F.dropout(ints, 0.5)
    with pytest.raises(RuntimeError):
        philox_dropout(ints, 0.5)
    y = x.clone()
    out = philox_dropout(y, 0.5, inplace=True)  # F.dropout(inplace=True): writes into its input
    assert out.data_ptr() == y.data_ptr() and torch.equal(out, y)


@pytest.mark.parametrize("device", DEVICES)
def test_reproducible_under_manual_seed_and_different_across_calls(device):
    x = torch.randn(64, 65, device=device)
    torch.manual_seed(3)
    a, b = philox_dropout(x, 0.5), philox_dropout(x, 0.5)
    torch.manual_seed(3)
    assert torch.equal(philox_dropout(x, 0.5), a)
    assert not torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_nan_and_inf_propagate_like_torch_dropout(device):
    n = 64
    mask = drawn_mask((n,), 0.5, seed=9, device=device)
    assert mask.any() and not mask.all()
    x = torch.randn(n, device=device)
    x[::3] = float("nan")
    x[1::3] = float("inf")
    torch.manual_seed(9)
    out = philox_dropout(x, 0.5)
    assert torch.equal(out.isnan(), x.isnan() | (x.isinf() & ~mask))


@pytest.mark.parametrize("p", [-0.1, 1.5, float("nan"), True, "0.1", None])
def test_bad_p_names_the_argument(p):
    with pytest.raises(ValueError, match="p: expected a number in"):
        philox_dropout(torch.randn(3), p)


def test_gradgradcheck_float64():
    x = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)

    def fn(x):
        torch.manual_seed(2)  # the same mask at every evaluation
        return philox_dropout(x * x, 0.4)

    assert torch.autograd.gradcheck(fn, (x,))
    assert torch.autograd.gradgradcheck(fn, (x,))


def test_torch_compile_fullgraph_matches_eager():
    x = torch.randn(8, 4, 33, requires_grad=True)

    def fn(x):
        return philox_dropout(x.softmax(-1), 0.2) * 3

    compiled = torch.compile(fn, fullgraph=True)
    torch.manual_seed(6)
    eager = fn(x)
    (gx_eager,) = torch.autograd.grad(eager.square().sum(), x)
    torch.manual_seed(6)
    out = compiled(x)
    (gx,) = torch.autograd.grad(out.square().sum(), x)
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(gx, gx_eager)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_compiled_code_draws_with_inductor_on_cuda_only(device):
    """Under torch.compile the mask comes from accel::dropout_mask on the CPU (Inductor's CPU code draws one
    scalar Philox per element) and from torch's own dropout on CUDA (Inductor fuses it into its kernel)."""
    _ops()
    ops = traced_ops(lambda x: philox_dropout(x, 0.3), device)
    if device == "cpu":
        assert accel_ops(ops) == {"accel.dropout_mask.default"}, ops
    else:
        assert not accel_ops(ops) and any("dropout" in op or "bernoulli" in op or "rand" in op for op in ops), ops


@pytest.mark.parametrize("device", DEVICES)
def test_dropouts_of_one_shape_in_a_compiled_training_graph_draw_their_own_masks(device):
    """Two layers, and one layer called twice, with equal shapes and p: AOTAutograd's common-subexpression pass
    merges nodes of equal arguments (accel::dropout_mask's nondeterministic_seeded tag notwithstanding), and
    before the op's `call` argument the three dropouts of this graph shared one mask."""
    _ops()

    class Three(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = PhiloxDropout(0.5), PhiloxDropout(0.5)  # CUDA: Inductor's own dropout

        def forward(self, x):
            return self.a(x), self.b(x), self.a(x * 2)

    torch._dynamo.reset()
    compiled = torch.compile(Three().train())
    x = torch.ones(4096, device=device, requires_grad=True)
    outs = compiled(x)
    masks = [out != 0 for out in outs]
    for i in range(3):
        for j in range(i):
            assert not torch.equal(masks[i], masks[j]), (i, j)
    sum(out.sum() for out in outs).backward()  # each output's gradient through its own mask
    expected = sum(mask.float() * scale for mask, scale in zip(masks, (2, 2, 4)))
    torch.testing.assert_close(x.grad, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="replays CUDA graphs: needs a CUDA device")
def test_cuda_graph_replays_of_the_compiled_mask_op_draw_new_masks():
    # torch.compile(mode="reduce-overhead") replays the graph it recorded: the op must take a new Philox offset
    # from the generator at every replay (graph-safe state), not the recorded one
    # (the op itself: compiled CUDA code of accel's layers takes Inductor's dropout, _inductor_draws)
    ops = _ops()
    fn = torch.compile(lambda x: ops.dropout_mask(list(x.shape), 0.25, device=x.device, call=1) * x * (2 / 0.75),
                       mode="reduce-overhead", fullgraph=True)
    x = torch.ones(256, 1024, device="cuda")
    outs = [fn(x).clone() for _ in range(5)]  # warm-up, recording, then replays
    masks = [o != 0 for o in outs]
    for a, b in zip(masks, masks[1:]):
        assert not torch.equal(a, b)
    for o, mask in zip(outs, masks):
        torch.testing.assert_close(o[mask], torch.full_like(o[mask], 2 / 0.75))  # kept: x / (1 - p), doubled
        assert abs(mask.float().mean().item() - 0.75) < 0.01  # 262144 draws: sd 0.00085


def test_swap_in_philox_dropout_changes_this_model_only():
    model, other = (nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.2), nn.Sequential(nn.Dropout(0.4))) for _ in range(2))
    swap_in_philox_dropout(model)
    assert [type(m) for m in model.modules() if isinstance(m, nn.Dropout)] == [PhiloxDropout] * 2
    assert model[1].p == 0.2 and model[2][0].p == 0.4
    assert all(type(m) is not PhiloxDropout for m in other.modules())


class TestPhiloxDropoutModule:
    def test_is_an_nn_dropout_with_its_attributes(self):
        m = PhiloxDropout(0.25)
        assert isinstance(m, nn.Dropout) and m.p == 0.25 and not m.inplace
        assert repr(m) == repr(nn.Dropout(0.25)).replace("Dropout", "PhiloxDropout")
        assert m.state_dict() == {}
        with pytest.raises(ValueError):  # nn.Dropout's own check
            PhiloxDropout(2.0)

    def test_train_draws_eval_is_identity(self):
        m = PhiloxDropout(0.5)
        x = torch.randn(40, 30)
        torch.manual_seed(11)
        y = m(x)
        torch.manual_seed(11)
        assert torch.equal(y, philox_dropout(x, 0.5))
        assert m.eval()(x) is x

    def test_pickles_and_copies(self):
        m = nn.Sequential(nn.Linear(3, 3), PhiloxDropout(0.1))
        buf = io.BytesIO()
        torch.save(m, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        assert type(loaded[1]) is PhiloxDropout and loaded[1].p == 0.1
        assert type(copy.deepcopy(m)[1]) is PhiloxDropout
        assert type(pickle.loads(pickle.dumps(m))[1]) is PhiloxDropout
