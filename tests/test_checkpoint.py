"""accel.auto_checkpoint against the unwrapped model: same outputs, gradients, state_dict keys, and
buffers (side effects of a block's forward happen once); fewer saved activations (checked against
hand-counted bytes); budget plans; undo; pickling, copies and DataParallel replicas; XLA."""
import copy
import functools
import inspect
import io
import itertools
import os
import pickle
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import accel
import accel.checkpoint as checkpoint_module
from accel.checkpoint import activation_bytes, auto_checkpoint, checkpoint_plan, find_repeated_blocks, remove_checkpoint
from accel.utils.xla import xla_available

B, D, H, N = 4, 6, 10, 5  # batch, block width, hidden width of a block, blocks
F32 = 4


class MLPBlock(nn.Module):
    def __init__(self, d=D, h=H, dropout=0.0, norm=False):
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.act = nn.GELU()
        self.norm = nn.BatchNorm1d(h) if norm else nn.Identity()
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(h, d)

    def forward(self, x):
        return x + self.fc2(self.drop(self.norm(self.act(self.fc1(x)))))


def mlp(n=N, **kw):
    torch.manual_seed(0)
    return nn.Sequential(*[MLPBlock(**kw) for _ in range(n)])


def small_bert(dropout=0.0, layers=3):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                                  intermediate_size=37, vocab_size=97, max_position_embeddings=64,
                                  hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    torch.manual_seed(0)
    return transformers.BertModel(cfg)


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(model, reference):
    expected = grads(reference)
    got = grads(model)
    assert got.keys() == expected.keys()
    for name, grad in got.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def count_calls(modules):
    """Forward calls of each module, via forward hooks (independent of the wrapper)."""
    counts = {id(m): 0 for m in modules}

    def hook(m, *_):
        counts[id(m)] += 1

    handles = [m.register_forward_hook(hook) for m in modules]
    return counts, handles


# --------------------------------------------------------------------------- finding the blocks

def test_finds_bert_encoder_layers():
    container, blocks = find_repeated_blocks(small_bert(layers=4))
    assert container == "encoder.layer"
    assert [n for n, _ in blocks] == [f"encoder.layer.{i}" for i in range(4)]


def test_finds_mlp_blocks_among_other_layers_and_picks_the_biggest_group():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, D), *[MLPBlock() for _ in range(3)], nn.Linear(D, 2),
                          nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]))  # a smaller repeated group
    container, blocks = find_repeated_blocks(model)
    assert container == "" and [n for n, _ in blocks] == ["1", "2", "3"]


def test_blocks_with_different_shapes_are_not_grouped():
    model = nn.Sequential(MLPBlock(h=8), MLPBlock(h=9), MLPBlock(h=10))
    assert find_repeated_blocks(model) == ("", [])
    with pytest.warns(UserWarning, match="no repeated blocks"):
        assert auto_checkpoint(model) is model
    assert checkpoint_plan(model) is None


class TwoTowers(nn.Module):
    """Two stacks of different widths (an encoder-decoder, a two-tower model), identical Linear heads, and
    blocks holding identical experts (an MoE layer)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.narrow = nn.ModuleList([MLPBlock(d=4, h=8) for _ in range(3)])
        self.wide = nn.ModuleList([MLPBlock(d=6, h=12) for _ in range(2)])
        self.heads = nn.ModuleList([nn.Linear(6, 6), nn.Linear(6, 6)])
        self.moe = nn.ModuleList([nn.ModuleList([MLPBlock(d=6, h=4) for _ in range(2)]) for _ in range(2)])
        self.up = nn.Linear(4, 6)


def test_finds_every_stack_in_model_order_but_not_single_layers_or_blocks_inside_blocks():
    stacks = checkpoint_module.find_block_stacks(TwoTowers())
    assert [(c, [n for n, _ in blocks]) for c, blocks in stacks] == [
        ("narrow", ["narrow.0", "narrow.1", "narrow.2"]),
        ("wide", ["wide.0", "wide.1"]),
        ("moe", ["moe.0", "moe.1"]),  # the MoE layers, not the experts inside them
    ]
    # find_repeated_blocks stays the largest group alone
    assert find_repeated_blocks(TwoTowers())[0] == "wide"


def test_blocks_that_differ_only_in_parameter_free_modules_or_one_extra_parameter_are_one_stack():
    torch.manual_seed(0)
    # stochastic depth: the first block's DropPath is an nn.Identity (rate 0), the others' a Dropout-like layer
    blocks = [MLPBlock(), MLPBlock(dropout=0.1), MLPBlock(dropout=0.2)]
    blocks[0].drop = nn.Identity()
    # T5: only the first layer holds the relative attention bias
    first = MLPBlock()
    first.bias = nn.Parameter(torch.zeros(3))
    model = nn.Sequential(nn.Sequential(*blocks), nn.Sequential(first, MLPBlock(), MLPBlock()))
    stacks = checkpoint_module.find_block_stacks(model)
    assert [[n for n, _ in blocks] for _, blocks in stacks] == [["0.0", "0.1", "0.2"], ["1.0", "1.1", "1.2"]]


def test_an_encoder_decoder_checkpoints_both_stacks_with_the_plain_gradients():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    plain = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=97, d_model=32, d_ff=64, num_layers=3, num_heads=2, d_kv=16, dropout_rate=0.0,
        decoder_start_token_id=0)).train()
    wrapped = auto_checkpoint(copy.deepcopy(plain))
    plan = checkpoint_plan(wrapped)
    assert plan.containers == ["encoder.block", "decoder.block"]
    assert plan.checkpointed == [f"{side}.block.{i}" for side in ("encoder", "decoder") for i in range(3)]
    ids, labels = torch.randint(0, 97, (2, 12)), torch.randint(0, 97, (2, 7))
    # (a submodule's hooks: the recomputation calls the block's forward, not the block)
    calls, _ = count_calls([wrapped.encoder.block[0].layer[0], wrapped.decoder.block[2].layer[0]])
    wrapped(input_ids=ids, labels=labels).loss.backward()
    assert set(calls.values()) == {2}  # forward, then the recomputation in backward
    plain(input_ids=ids, labels=labels).loss.backward()
    assert_same_grads(wrapped, plain)


# --------------------------------------------------------------------------- same results

@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_bert_outputs_and_grads_match_unwrapped(dropout):
    ref = small_bert(dropout)
    model = accel.auto_checkpoint(copy.deepcopy(ref))
    assert checkpoint_plan(model).checkpointed == [f"encoder.layer.{i}" for i in range(3)]
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    outs = []
    for m in (ref, model):
        torch.manual_seed(5)  # same dropout masks: checkpointing replays the RNG on recompute
        out = m(input_ids=ids, attention_mask=mask).last_hidden_state
        (out.square().mean() + out.sum()).backward()
        outs.append(out.detach())
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    g_ref, g = grads(ref), grads(model)
    assert g.keys() == g_ref.keys() and len(g) > 10
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-6, atol=1e-7, msg=name)


def test_mlp_outputs_grads_and_recomputation():
    ref = mlp()
    model = auto_checkpoint(copy.deepcopy(ref))
    x = torch.randn(B, D, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    counts, handles = count_calls([blk.fc1 for blk in model])
    out = model(x)
    out.pow(3).sum().backward()
    ref_out = ref(xr)
    ref_out.pow(3).sum().backward()
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, xr.grad)
    for name, g in grads(ref).items():
        torch.testing.assert_close(grads(model)[name], g, msg=name)
    # each block ran twice: the forward and its recomputation in backward
    assert list(counts.values()) == [2] * N
    for h in handles:
        h.remove()


def test_eval_and_no_grad_do_not_checkpoint():
    model = auto_checkpoint(mlp())
    counts, _ = count_calls([blk.fc1 for blk in model])
    x = torch.randn(B, D)
    with torch.no_grad():
        model(x)
    model.eval()
    model(x).sum().backward()
    assert list(counts.values()) == [2] * N  # one call each time, never a recomputation
    model.train()
    model(x).sum().backward()
    assert list(counts.values()) == [4] * N  # training again: forward + recomputation


# --------------------------------------------------------------------------- saved bytes by hand

def test_activation_bytes_match_hand_count():
    """Plain block: fc1 saves its input (B x D), GELU its input (B x H), fc2 its input (B x H).
    A checkpointed block keeps only its input (B x D) for the recomputation."""
    x = torch.randn(B, D)
    model = mlp()
    assert activation_bytes(model, (x,)) == N * (B * D + 2 * B * H) * F32
    auto_checkpoint(model)
    assert activation_bytes(model, (x,)) == N * B * D * F32


def test_activation_bytes_of_bert_drop_by_more_than_half():
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    model = small_bert(layers=4)
    before = activation_bytes(model, {"input_ids": ids})
    auto_checkpoint(model)
    after = activation_bytes(model, {"input_ids": ids})
    assert after < 0.5 * before


# --------------------------------------------------------------------------- state_dict, idempotence, undo

def test_state_dict_keys_unchanged_and_loadable():
    ref = small_bert()
    keys = list(ref.state_dict())
    buf = io.BytesIO()
    torch.save(ref.state_dict(), buf)
    model = auto_checkpoint(small_bert())
    assert list(model.state_dict()) == keys
    buf.seek(0)
    model.load_state_dict(torch.load(buf))
    ids = torch.randint(0, 97, (1, 9))
    torch.testing.assert_close(model(input_ids=ids).last_hidden_state, ref(input_ids=ids).last_hidden_state)


def test_idempotent_and_undo():
    model = mlp()
    auto_checkpoint(model)
    auto_checkpoint(model)  # re-plans, does not wrap twice
    assert all(blk.__dict__["_accel_ckpt_forward"] is None for blk in model)
    counts, _ = count_calls([blk.fc1 for blk in model])
    model(torch.randn(B, D)).sum().backward()
    assert list(counts.values()) == [2] * N
    remove_checkpoint(model)
    assert checkpoint_plan(model) is None
    assert all("forward" not in blk.__dict__ for blk in model)
    model(torch.randn(B, D)).sum().backward()
    assert list(counts.values()) == [3] * N  # plain again: one call per step
    assert remove_checkpoint(model) is model  # undoing twice is harmless


def test_block_classes_and_count_take_named_blocks_outermost_first():
    """TorchAcc's gc_cls / gc_cnt: blocks by class name; only the first `count` recompute."""
    model = small_bert(layers=4)
    auto_checkpoint(model, block_classes={"BertLayer", "BertSelfAttention"}, count=3)
    plan = checkpoint_plan(model)
    layers = [f"encoder.layer.{i}" for i in range(4)]
    assert plan.blocks == layers                     # BertSelfAttention sits inside BertLayer: not wrapped
    assert plan.checkpointed == layers[:3]
    counts, _ = count_calls([layer.attention.self.query for layer in model.encoder.layer])
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    model(ids).last_hidden_state.sum().backward()
    assert list(counts.values()) == [2, 2, 2, 1]     # recomputed in backward only where checkpointed
    # switching to automatic discovery re-plans over the same blocks, all of them now
    auto_checkpoint(model)
    assert checkpoint_plan(model).checkpointed == layers


def test_block_classes_outputs_and_grads_match_unwrapped():
    ref, model = small_bert(), small_bert()
    auto_checkpoint(model, block_classes="BertLayer")
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    out_ref, out = ref(ids).last_hidden_state, model(ids).last_hidden_state
    out_ref.square().sum().backward()
    out.square().sum().backward()
    torch.testing.assert_close(out, out_ref, rtol=0, atol=0)
    for name, g in grads(ref).items():
        torch.testing.assert_close(grads(model)[name], g, rtol=1e-6, atol=1e-7)


def test_block_classes_matching_nothing_warns_and_bad_values_name_the_argument():
    model = mlp()
    with pytest.warns(UserWarning, match="NoSuchBlock"):
        assert auto_checkpoint(model, block_classes={"NoSuchBlock"}) is model
    assert checkpoint_plan(model) is None
    with pytest.raises(ValueError, match="block_classes"):
        auto_checkpoint(model, block_classes={""})
    with pytest.raises(ValueError, match="count"):
        auto_checkpoint(model, count=0)
    with pytest.raises(ValueError, match="count and memory_budget"):
        auto_checkpoint(model, memory_budget=1 << 20, count=2)


# --------------------------------------------------------------------------- memory budget

def _bytes(plain_blocks):
    return N * B * D * F32 + plain_blocks * 2 * B * H * F32


@pytest.mark.parametrize("plain", [0, 2, N])
def test_budget_with_example_inputs_checkpoints_just_enough(plain):
    x = torch.randn(B, D)
    budget = _bytes(plain) + 7  # fits `plain` unchecked blocks, not one more
    model = auto_checkpoint(mlp(), memory_budget=budget, example_inputs=(x,))
    plan = checkpoint_plan(model)
    assert plan.checkpointed == [str(i) for i in range(N - plain)]
    assert plan.measured["chosen"] == _bytes(plain) <= budget
    assert plan.measured["all"] == _bytes(0) and plan.measured["per_block"] == 2 * B * H * F32
    assert activation_bytes(model, (x,)) == _bytes(plain)


def test_budget_too_small_checkpoints_everything_and_warns():
    with pytest.warns(UserWarning, match="cannot be met"):
        model = auto_checkpoint(mlp(), memory_budget=10, example_inputs=torch.randn(B, D))
    assert checkpoint_plan(model).checkpointed == [str(i) for i in range(N)]


def test_budget_planned_lazily_at_first_forward_leaves_rng_and_buffers_untouched():
    ref = mlp(dropout=0.3, norm=True)
    x = torch.randn(B, D)
    budget = int(0.6 * activation_bytes(ref, (x,)))
    model = auto_checkpoint(copy.deepcopy(ref), memory_budget=budget)
    plan = checkpoint_plan(model)
    assert plan.pending and plan.checkpointed == []
    torch.manual_seed(3)
    out = model(x)
    torch.manual_seed(3)
    ref_out = ref(x)
    # the dry runs drew dropout masks and updated BatchNorm stats; both were restored first
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    for (name, b), (_, rb) in zip(model.named_buffers(), ref.named_buffers()):
        torch.testing.assert_close(b, rb, msg=name)
    assert not plan.pending and 0 < len(plan.checkpointed) < N
    assert plan.measured["chosen"] <= plan.memory_budget
    out.sum().backward()
    ref_out.sum().backward()
    for name, g in grads(ref).items():
        torch.testing.assert_close(grads(model)[name], g, msg=name)


def test_lazy_plan_waits_for_a_training_forward():
    model = auto_checkpoint(mlp(), memory_budget=_bytes(1) + 1)
    model.eval()
    model(torch.randn(B, D))
    assert checkpoint_plan(model).pending
    model.train()
    model(torch.randn(B, D))
    assert checkpoint_plan(model).checkpointed == [str(i) for i in range(N - 1)]


# --------------------------------------------------------------------------- bad input

def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="model"):
        auto_checkpoint("not a model")
    for bad in (0, -5, 1.5, "1GB", True):
        with pytest.raises(ValueError, match="memory_budget"):
            auto_checkpoint(mlp(), memory_budget=bad)
    with pytest.raises(ValueError, match="example_inputs"):
        auto_checkpoint(mlp(), memory_budget=100, example_inputs=3)


# --------------------------------------------------------------------------- XLA

_XLA_SCRIPT = """
import copy, torch, torch_xla
from tests.test_checkpoint import B, D, mlp, count_calls
from accel.checkpoint import auto_checkpoint
import torch_xla.utils.checkpoint as xla_ckpt
calls = []
original = xla_ckpt.checkpoint
xla_ckpt.checkpoint = lambda *a, **k: calls.append(1) or original(*a, **k)
device = torch_xla.device()
ref = mlp(n=2)
model = auto_checkpoint(copy.deepcopy(ref).to(device))
counts, _ = count_calls([blk.fc1 for blk in model])
x = torch.randn(B, D)
out = model(x.to(device))
out.pow(2).sum().backward()
torch_xla.sync()
ref_out = ref(x)
ref_out.pow(2).sum().backward()
assert len(calls) == 2, calls  # torch_xla's checkpoint, once per block
assert list(counts.values()) == [2, 2], counts  # forward + recomputation
torch.testing.assert_close(out.cpu(), ref_out, rtol=1e-5, atol=1e-6)
for (name, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
    torch.testing.assert_close(p.grad.cpu(), rp.grad, rtol=1e-5, atol=1e-6, msg=name)
# BatchNorm blocks: the reentrant recomputation leaves the running statistics as one plain step does
plain = mlp(n=2, norm=True).to(device)
model = auto_checkpoint(copy.deepcopy(plain))
for m in (plain, model):
    m(x.to(device)).pow(2).sum().backward()
    torch_xla.sync()
for (name, b), (_, pb) in zip(model.named_buffers(), plain.named_buffers()):
    torch.testing.assert_close(b.cpu(), pb.cpu(), rtol=0, atol=0, msg=name)
for (name, p), (_, pp) in zip(model.named_parameters(), plain.named_parameters()):
    torch.testing.assert_close(p.grad.cpu(), pp.grad.cpu(), rtol=1e-5, atol=1e-6, msg=name)
print("xla-ok")
"""


@pytest.mark.slow
@pytest.mark.skipif(not xla_available(), reason="torch_xla is not installed")
def test_xla_uses_xla_checkpoint_and_matches_cpu():
    # A fresh process: autograd sizes its per-device queues at the process's first backward, so
    # XLA backward fails in a process that ran a CPU backward before torch_xla made its device.
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, "-c", _XLA_SCRIPT], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "xla-ok" in proc.stdout, proc.stderr[-3000:]


# --------------------------------------------------------------------------- the budget search, measurement substituted

class _FakeMeasure:
    """Stands in for the dry-run measurement: bytes = base + the costs of the blocks that run plain,
    plus a one-time `first_extra` on the first call (what cuBLAS's workspace does to the first CUDA run).
    `fail_at`: the call that raises (an out-of-memory in a dry run)."""

    def __init__(self, costs, base=1000, first_extra=0, fail_at=None):
        self.costs, self.base, self.first_extra, self.fail_at = costs, base, first_extra, fail_at
        self.calls = 0

    def __call__(self, model, inputs):
        self.calls += 1
        if self.calls == self.fail_at:
            raise torch.OutOfMemoryError("dry run out of memory")
        plain = [c for blk, c in zip(model, self.costs) if not blk.__dict__["_accel_ckpt_on"]]
        return self.base + sum(plain) + (self.first_extra if self.calls == 1 else 0)


def _plain_suffix(model):
    return [not blk.__dict__["_accel_ckpt_on"] for blk in model]


@pytest.mark.parametrize("plain", [0, 1, 3, N])
def test_budget_search_picks_the_most_plain_blocks_that_fit_with_four_dry_runs(monkeypatch, plain):
    # A large one-time cost on the first run must not leak into the per-block estimate: the warm-up
    # run absorbs it, so the estimate is exact and one check run confirms it.
    fake = _FakeMeasure([100] * N, first_extra=250)
    monkeypatch.setattr(checkpoint_module, "_measure", fake)
    budget = 1000 + 100 * plain + 99
    model = auto_checkpoint(mlp(), memory_budget=budget, example_inputs=torch.randn(B, D))
    plan = checkpoint_plan(model)
    assert plan.checkpointed == [str(i) for i in range(N - plain)]
    assert _plain_suffix(model) == [False] * (N - plain) + [True] * plain
    assert plan.measured == {"all": 1000, "one_plain": 1100, "per_block": 100, "chosen": 1000 + 100 * plain}
    assert fake.calls == (3 if plain == 0 else 4)  # warm-up, all, one plain, (check of the plan)


def test_budget_search_tightens_when_later_blocks_cost_more(monkeypatch):
    fake = _FakeMeasure([10, 10, 10, 20, 20])
    monkeypatch.setattr(checkpoint_module, "_measure", fake)
    model = auto_checkpoint(mlp(), memory_budget=1045, example_inputs=torch.randn(B, D))
    # the estimate (10 per block) allows 4 plain blocks; they cost 60, then 3 cost 50, then 2 cost 40
    assert checkpoint_plan(model).checkpointed == ["0", "1", "2"]
    assert checkpoint_plan(model).measured["chosen"] == 1040


def test_budget_dry_run_failure_leaves_blocks_as_planned_and_planning_retries(monkeypatch):
    x = torch.randn(B, D)
    fake = _FakeMeasure([100] * N, fail_at=3)
    monkeypatch.setattr(checkpoint_module, "_measure", fake)
    model = auto_checkpoint(mlp(norm=True), memory_budget=1250)
    state = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    with pytest.raises(torch.OutOfMemoryError):
        model(x)  # the lazy plan runs, and its third dry run fails
    plan = checkpoint_plan(model)
    assert plan.pending and plan.checkpointed == [] and _plain_suffix(model) == [True] * N
    assert torch.equal(torch.get_rng_state(), rng)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, state[name], rtol=0, atol=0, msg=name)
    model(x)  # the next training forward plans again
    assert not plan.pending and plan.checkpointed == ["0", "1", "2"]


# --------------------------------------------------------------------------- the CUDA measurement, allocator substituted

class _FakeAllocator:
    """torch.cuda's memory statistics as the caching allocator keeps them, with a call log."""

    def __init__(self, monkeypatch, allocated, peak):
        self.allocated, self.peak, self.log = allocated, peak, []
        for name in ("synchronize", "memory_allocated", "reset_peak_memory_stats", "max_memory_allocated"):
            monkeypatch.setattr(torch.cuda, name, functools.partial(self._call, name))

    def _call(self, name, device=None):
        self.log.append((name, device))
        if name == "memory_allocated":
            return self.allocated
        if name == "max_memory_allocated":
            return self.peak
        if name == "reset_peak_memory_stats":
            self.peak = self.allocated
        return None

    def alloc(self, nbytes):
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)
        self.log.append(("alloc", nbytes))


class _Allocating(nn.Module):
    def __init__(self, allocator, sizes):
        super().__init__()
        self.allocator, self.sizes = allocator, sizes

    def forward(self, x):
        for size in self.sizes:
            self.allocator.alloc(size)
        return x


def test_cuda_peak_is_measured_from_a_reset_peak_above_the_baseline(monkeypatch):
    # 1000 bytes live before the forward and an older peak of 5000 that is not the forward's
    allocator = _FakeAllocator(monkeypatch, allocated=1000, peak=5000)
    device = torch.device("cuda", 1)
    model = _Allocating(allocator, [300, -100, 50])
    assert checkpoint_module._cuda_peak_bytes(model, ((torch.zeros(1),), {}), device) == 300
    assert allocator.log == [("synchronize", device), ("memory_allocated", device),
                             ("reset_peak_memory_stats", device), ("alloc", 300), ("alloc", -100),
                             ("alloc", 50), ("synchronize", device), ("max_memory_allocated", device)]


def test_dry_run_device_looks_into_nested_inputs_then_the_model():
    model = mlp(n=2)
    meta = torch.zeros(1, device="meta")
    assert checkpoint_module._dry_run_device(model, ((), {"batch": {"ids": [meta]}})) == meta.device
    assert checkpoint_module._dry_run_device(model, (("text",), {})) == torch.device("cpu")
    assert checkpoint_module._dry_run_device(nn.Sequential(nn.ReLU(), nn.ReLU()), ((), {})) is None


# --------------------------------------------------------------------------- what the dry runs must not change

class _Counter(nn.Module):
    """Replaces its buffer in forward (rather than updating it in place)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen = self.seen + 1
        return x


def test_budget_dry_runs_leave_parameters_grads_buffers_modes_optimizer_and_rng_alone():
    model = nn.Sequential(_Counter(), *mlp(dropout=0.3, norm=True))
    x = torch.randn(B, D)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(x).sum().backward()
    optimizer.step()  # grads, optimizer state and BatchNorm statistics that are not the initial ones
    model[2].norm.eval()  # a frozen BatchNorm inside a training model keeps its mode in the dry runs
    modes_in_dry_runs = []
    model[2].norm.register_forward_pre_hook(lambda m, _: modes_in_dry_runs.append(m.training))
    counter_buffer = model[0].seen
    before = copy.deepcopy({"state": model.state_dict(), "optim": optimizer.state_dict(),
                            "grads": {n: p.grad for n, p in model.named_parameters()},
                            "modes": [m.training for m in model.modules()]})
    grad_objects = [p.grad for p in model.parameters()]
    rng = torch.get_rng_state()

    auto_checkpoint(model, memory_budget=int(0.6 * activation_bytes(model, (x,))), example_inputs=(x,))

    plan = checkpoint_plan(model)
    assert 0 < len(plan.checkpointed) < N and len(modes_in_dry_runs) >= 5  # the dry runs did run
    assert modes_in_dry_runs == [False] * len(modes_in_dry_runs)
    assert torch.equal(torch.get_rng_state(), rng)
    assert model[0].seen is counter_buffer and float(counter_buffer) == float(before["state"]["0.seen"])
    for name, value in model.state_dict().items():  # parameters and every buffer, num_batches_tracked too
        torch.testing.assert_close(value, before["state"][name], rtol=0, atol=0, msg=name)
    assert [p.grad for p in model.parameters()] == grad_objects
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, before["grads"][name], rtol=0, atol=0, msg=name)
    assert [m.training for m in model.modules()] == before["modes"]
    after_optim = optimizer.state_dict()
    for i, state in before["optim"]["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(after_optim["state"][i][key], value, rtol=0, atol=0)


def test_dry_runs_of_a_model_in_eval_mode_run_it_in_training_mode_and_restore_eval():
    model = mlp(norm=True).eval()
    x = torch.randn(B, D)
    means = [blk.norm.running_mean.clone() for blk in model]
    train_bytes = activation_bytes(model, (x,))
    # In training mode BatchNorm also saves its input and the batch mean and inverse std (H each); in
    # eval mode it would save no batch statistics.
    assert train_bytes == N * (B * D + 3 * B * H + 2 * H) * F32
    assert not any(m.training for m in model.modules())
    for blk, mean in zip(model, means):
        assert torch.equal(blk.norm.running_mean, mean)


# --------------------------------------------------------------------------- CUDA (real)

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_budget_plan_restores_cuda_rng_and_fits():
    device = torch.device("cuda")
    model = mlp(dropout=0.2, norm=True).to(device)
    x = torch.randn(64, D, device=device)
    plain_bytes = activation_bytes(model, (x,))
    full = activation_bytes(auto_checkpoint(copy.deepcopy(model)), (x,))
    assert 0 < full < plain_bytes
    cuda_rng, cpu_rng = torch.cuda.get_rng_state(device), torch.get_rng_state()
    stats = copy.deepcopy(model.state_dict())
    budget = (full + plain_bytes) // 2
    auto_checkpoint(model, memory_budget=budget, example_inputs=(x,))
    plan = checkpoint_plan(model)
    assert plan.measured["per_block"] > 0 and plan.measured["chosen"] <= budget
    assert 0 < len(plan.checkpointed) < N
    assert torch.equal(torch.cuda.get_rng_state(device), cuda_rng) and torch.equal(torch.get_rng_state(), cpu_rng)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, stats[name], rtol=0, atol=0, msg=name)


# --------------------------------------------------------------------------- side effects happen once

def _buffers(model):
    return {name: b.clone() for name, b in model.named_buffers()}


def _assert_same_step(ref, model, make_input, steps=2, loss=lambda out: out.pow(2).sum(), seed=11):
    """Train-mode steps (forward + backward) of both models on the same inputs and RNG: the same outputs,
    input and parameter gradients and buffers, bit for bit where the arithmetic is the same."""
    for step in range(steps):
        x = make_input(step)
        outs, x_grads = [], []
        for m in (ref, model):
            xi = x.detach().clone().requires_grad_()
            torch.manual_seed(seed + step)
            out = m(xi)
            loss(out).backward()
            outs.append(out.detach())
            x_grads.append(xi.grad)
        torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
        torch.testing.assert_close(x_grads[1], x_grads[0], rtol=1e-6, atol=1e-7)
        g_ref, g = grads(ref), grads(model)
        assert g.keys() == g_ref.keys()
        for name in g_ref:
            torch.testing.assert_close(g[name], g_ref[name], rtol=1e-6, atol=1e-7, msg=name)
        b_ref, b = _buffers(ref), _buffers(model)
        assert b.keys() == b_ref.keys()
        for name in b_ref:
            torch.testing.assert_close(b[name], b_ref[name], rtol=0, atol=0, msg=name)


def test_batchnorm_statistics_are_updated_once_per_step():
    torch.manual_seed(0)
    ref = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)) for _ in range(3)])
    model = auto_checkpoint(copy.deepcopy(ref))
    counts, _ = count_calls([blk[0] for blk in model])
    _assert_same_step(ref, model, lambda step: torch.randn(4, 8), steps=3)
    assert list(counts.values()) == [6, 6, 6]  # still recomputed: forward + recomputation, 3 steps
    assert [int(blk[1].num_batches_tracked) for blk in model] == [3, 3, 3]


def test_dropout_and_batchnorm_blocks_match_the_unwrapped_model():
    ref = mlp(dropout=0.3, norm=True)
    model = auto_checkpoint(copy.deepcopy(ref))
    _assert_same_step(ref, model, lambda step: torch.randn(B, D), steps=2)


class _Scale(nn.Module):
    """Updates its buffer in place before reading it: the recomputation must see the value the forward
    saw (the output, hence the gradients, depend on it)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x):
        self.scale.mul_(1.5)
        return x * self.scale


class _Tally(nn.Module):
    """Rebinds its buffer (a new tensor each call) and a plain Python attribute."""

    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))
        self.calls = 0

    def forward(self, x):
        self.seen = self.seen + 1
        self.calls += 1
        return x * (1 + self.seen)


class _StatefulBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.scale = _Scale()
        self.tally = _Tally()

    def forward(self, x):
        return self.tally(self.scale(torch.tanh(self.fc(x))))


def test_buffers_updated_in_place_or_rebound_and_python_attributes_change_once():
    torch.manual_seed(0)
    ref = nn.Sequential(*[_StatefulBlock() for _ in range(3)])
    model = auto_checkpoint(copy.deepcopy(ref))
    seen_objects = [blk.tally.seen for blk in model]
    _assert_same_step(ref, model, lambda step: torch.randn(B, D), steps=2)
    for blk in model:
        assert float(blk.scale.scale) == 1.5 ** 2 and float(blk.tally.seen) == 2
        assert blk.tally.calls == 2  # the recomputation's increments are undone
    assert all(blk.tally.seen is not old for blk, old in zip(model, seen_objects))


def test_block_called_twice_per_forward_and_backward_run_twice():
    """A shared block (called twice in one forward) is recomputed once per call, each time from the
    buffers its own call saw; a retained graph recomputed by a second backward changes nothing more."""
    torch.manual_seed(0)
    blocks = [MLPBlock(norm=True), MLPBlock(norm=True)]
    ref = nn.Sequential(blocks[0], blocks[1], blocks[0])
    model = copy.deepcopy(ref)
    auto_checkpoint(model, block_classes={"MLPBlock"})
    assert checkpoint_plan(model).blocks == ["0", "1"]  # the shared block is one module
    _assert_same_step(ref, model, lambda step: torch.randn(B, D), steps=2)
    x = torch.randn(B, D)
    for m in (ref, model):
        out = m(x).square().sum()
        out.backward(retain_graph=True)
        out.backward()
    for name, g in grads(ref).items():
        torch.testing.assert_close(grads(model)[name], g, rtol=1e-6, atol=1e-6, msg=name)
    for name, b in _buffers(ref).items():
        torch.testing.assert_close(_buffers(model)[name], b, rtol=0, atol=0, msg=name)


@pytest.mark.slow
def test_compiled_batchnorm_blocks_update_statistics_once():
    """Under torch.compile the recomputation is part of the compiled backward, and AOTAutograd applies
    the buffer updates once, after the forward graph."""
    torch._dynamo.reset()
    ref = mlp(n=3, norm=True)
    model = auto_checkpoint(copy.deepcopy(ref))
    compiled = torch.compile(model)
    for step in range(2):
        x = torch.randn(B, D)
        out_ref, out = ref(x), compiled(x)
        out_ref.pow(2).sum().backward()
        out.pow(2).sum().backward()
        torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-6)
    for name, g in grads(ref).items():
        torch.testing.assert_close(grads(model)[name], g, rtol=1e-4, atol=1e-5, msg=name)
    for name, b in _buffers(ref).items():
        torch.testing.assert_close(_buffers(model)[name], b, rtol=1e-5, atol=1e-6, msg=name)
    assert [int(blk.norm.num_batches_tracked) for blk in model] == [2, 2, 2]


# --------------------------------------------------------------------------- pickling, copies, replicas

def _checkpoints_like(ref, model):
    """One step of `model` recomputes every block (two fc1 calls each) and matches `ref`."""
    counts, handles = count_calls([blk.fc1 for blk in model])
    _assert_same_step(ref, model, lambda step: torch.randn(B, D), steps=1)
    for h in handles:
        h.remove()
    assert list(counts.values()) == [2] * len(model)


@pytest.mark.parametrize("how", ["pickle", "torch.save", "deepcopy"])
def test_whole_model_saved_or_copied_keeps_checkpointing(how, monkeypatch):
    ref = mlp(dropout=0.2, norm=True)
    model = auto_checkpoint(copy.deepcopy(ref))
    if how == "pickle":
        data = pickle.dumps(model)
        monkeypatch.setattr(checkpoint_module, "_CLASSES", {})  # as in a fresh process
        clone = pickle.loads(data)
    elif how == "torch.save":
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        clone = torch.load(buf, weights_only=False)
    else:
        clone = copy.deepcopy(model)
    assert all(type(blk).__name__ == "MLPBlock" and isinstance(blk, MLPBlock) for blk in clone)
    assert list(clone.state_dict()) == list(ref.state_dict())
    assert checkpoint_plan(clone).checkpointed == checkpoint_plan(model).checkpointed
    _checkpoints_like(copy.deepcopy(ref), clone)
    _checkpoints_like(ref, model)  # the original is unaffected by its copy's steps
    remove_checkpoint(clone)
    assert all(type(blk) is MLPBlock for blk in clone)


def _replicate(model):
    """What torch.nn.parallel.replicate does to a module tree, on the CPU: _replicate_for_data_parallel
    of every module, children relinked, parameters replaced by copies (broadcasts on a GPU)."""
    replicas = {m: m._replicate_for_data_parallel() for m in model.modules()}
    for m, r in replicas.items():
        for name, child in m._modules.items():
            r._modules[name] = replicas[child]
        for name, p in m._parameters.items():
            r._parameters[name] = p.detach().clone().requires_grad_()
    return replicas[model]


def test_data_parallel_replicas_checkpoint_themselves():
    ref = mlp(norm=True)
    model = auto_checkpoint(copy.deepcopy(ref))
    replica = _replicate(model)
    with torch.no_grad():
        for p in itertools.chain(replica.parameters(), ref.parameters()):
            p.mul_(1.25)  # the replica's own weights, not the module it was made from
    calls = []
    handles = [m.register_forward_hook(lambda mod, *_: calls.append(mod)) for m in (blk.fc1 for blk in replica)]
    x = torch.randn(B, D)
    out = replica(x)
    out.sum().backward()
    for h in handles:
        h.remove()
    ref_out = ref(x)
    ref_out.sum().backward()
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    fc1s = [blk.fc1 for blk in replica]
    assert calls[:N] == fc1s and calls[N:] == fc1s[::-1]  # the forward, then recomputations in backward
    assert all(p.grad is None for p in model.parameters())
    for (name, p), (_, rp) in zip(replica.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, rp.grad, msg=name)


def test_wrapped_blocks_keep_their_class_name_signature_and_instance_forward():
    model = mlp(n=3)
    calls = []

    def traced_forward(self, x):
        calls.append(self)
        return MLPBlock.forward(self, x)

    model[1].forward = types.MethodType(traced_forward, model[1])
    auto_checkpoint(model)
    assert [type(blk).__name__ for blk in model] == ["MLPBlock"] * 3
    assert inspect.signature(model[0].forward) == inspect.signature(MLPBlock().forward)
    assert "forward" not in model[1].__dict__
    model(torch.randn(B, D)).sum().backward()
    assert calls == [model[1], model[1]]  # its own forward, under checkpointing
    replica = _replicate(model)
    replica(torch.randn(B, D)).sum().backward()
    assert calls[2:] == [replica[1], replica[1]]  # bound to the replica, not the original
    remove_checkpoint(model)
    assert model[1].forward.__func__ is traced_forward and model[1].forward.__self__ is model[1]
    assert all(type(blk) is MLPBlock for blk in model)


def test_undo_under_a_subclass_another_library_put_on_top_keeps_that_class():
    """FSDP2's fully_shard swaps a module's class for a subclass of the one it has: undoing then keeps
    that class (and with it ours) and only stops checkpointing."""
    model = auto_checkpoint(mlp(n=2))
    outer = type("FSDPMLPBlock", (type(model[0]),), {})
    model[0].__class__ = outer
    remove_checkpoint(model)
    assert type(model[0]) is outer and type(model[1]) is MLPBlock
    counts, _ = count_calls([blk.fc1 for blk in model])
    model(torch.randn(B, D)).sum().backward()
    assert list(counts.values()) == [1, 1]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_checkpointed_decoder_layers_get_no_cache_to_append_to_again(compiled, monkeypatch):
    """A transformers decoder layer appends its keys and values to the cache it is given; recomputed in backward
    it would append them again (compiled, GPT-2 then failed with a shape error; eagerly the returned cache held
    every layer's keys twice). Checkpointed layers get no cache, as transformers' own checkpointing does, and
    compute the gradients of the plain model."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    plain = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=97, n_embd=32, n_layer=2, n_head=2, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0)).train()
    wrapped = auto_checkpoint(copy.deepcopy(plain))
    monkeypatch.setattr(checkpoint_module, "_cache_warned", False)  # once per process
    ids = torch.randint(0, 97, (2, 16))
    plain_out = plain(input_ids=ids, labels=ids)
    assert plain_out.past_key_values.get_seq_length() == 16  # the plain model's cache, built by use_cache
    plain_out.loss.backward()
    if compiled:
        torch._dynamo.reset()
    run = torch.compile(wrapped) if compiled else wrapped
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run(input_ids=ids, labels=ids)
        out.loss.backward()
    assert out.past_key_values is None or out.past_key_values.get_seq_length() == 0
    assert compiled or any("no key/value cache" in str(w.message) for w in caught)
    torch.testing.assert_close(out.loss, plain_out.loss)
    assert_same_grads(wrapped, plain)
