"""accel.graph_step: a whole training step captured as one CUDA graph per input signature (warm-ups on a side
stream, capture, replays that copy the inputs in), plain calls off CUDA; compute.step_graph's set-up."""
import collections
import contextlib
import copy

import pytest
import torch
from torch import nn

import accel
from accel.compiler import step_graph
from accel.compiler.step_graph import GraphedStep, graph_step
from accel.config import ComputeConfig

transformers = pytest.importorskip("transformers", reason="the CUDA test trains transformers' BERT")


def test_off_cuda_the_step_runs_as_it_is():
    calls = []

    @graph_step
    def step(batch, scale=2.0):
        calls.append(batch["x"])
        return {"y": batch["x"] * scale}

    for i in range(5):
        x = torch.full((3,), float(i))
        assert torch.equal(step({"x": x})["y"], x * 2)
    assert len(calls) == 5 and step.graphs == 0 and step.__name__ == "step"


def test_tensors_on_several_devices_run_uncaptured_and_say_so():
    step = graph_step(lambda a, b: a.sum() + b.numel())
    with pytest.warns(UserWarning, match="2 devices .*runs uncaptured"):
        assert step(torch.ones(2), torch.empty(3, device="meta")) == 5
    assert step.graphs == 0


def test_bad_arguments():
    with pytest.raises(TypeError, match="fn"):
        GraphedStep("step")
    with pytest.raises(ValueError, match="warmup"):
        graph_step(lambda: None, warmup=0)
    with pytest.raises(TypeError, match="warmup"):
        graph_step(warmup=True)(lambda: None)
    with pytest.raises(ValueError, match="step_graph and compute.optimizer_cuda_graphs are exclusive"):
        ComputeConfig(step_graph=True, optimizer_cuda_graphs=True)
    with pytest.raises(ValueError, match="compute.step_graph"):
        ComputeConfig(step_graph="yes")


class _FakeCuda:
    """Stand-ins for the torch.cuda calls graph_step makes, recording them; CPU tensors play CUDA ones.
    A fake capture runs the step once (a real one records it); a fake replay runs nothing."""

    def __init__(self, monkeypatch):
        self.log = []
        fake = self

        class Stream:
            def __init__(self, device=None):
                self.name = "side"

            def wait_stream(self, other):
                fake.log.append(("wait", self.name, other.name))

        class Current(Stream):
            def __init__(self):
                self.name = "current"

        class Graph:
            def __init__(self):
                self.replays = 0

            def replay(self):
                self.replays += 1
                fake.log.append(("replay", self))

            def pool(self):
                return ("pool", id(self))

        @contextlib.contextmanager
        def stream(s):
            fake.log.append(("enter", s.name))
            yield
            fake.log.append(("exit", s.name))

        @contextlib.contextmanager
        def graph(g, pool=None, capture_error_mode="global"):
            fake.log.append(("capture", g, pool, capture_error_mode))
            yield
            fake.log.append(("captured", g))

        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Current())
        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "stream", stream)
        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "graph", graph)
        monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
        monkeypatch.setattr(step_graph, "_tensor_device",
                            lambda tensors: torch.device("cuda", 0) if tensors else None)

    def ops(self, name):
        return [e for e in self.log if e[0] == name]


def test_warm_ups_then_one_capture_per_signature_then_replays(monkeypatch):
    fake = _FakeCuda(monkeypatch)
    seen = []

    def fn(batch, flag):
        seen.append((batch["x"], flag, len(fake.ops("enter")), len(fake.ops("capture"))))
        return batch["x"] * w, flag

    w = torch.tensor(2.0, requires_grad=True)

    step = GraphedStep(fn, warmup=2)
    batches = [{"x": torch.full((2, 3), float(i))} for i in range(5)]
    outs = [step(b, "a") for b in batches]
    # calls 1-2: plain, each on a side stream that waits for the current one and is waited for after
    assert [s[0] is b["x"] for s, b in zip(seen[:2], batches)] == [True, True]
    assert [s[2] for s in seen[:2]] == [1, 2] and len(fake.ops("wait")) == 4
    # what they return is detached, as a replay's copies are: no autograd graph kept alive into the next step
    assert outs[0][0].grad_fn is None and not outs[0][0].requires_grad and torch.equal(outs[0][0], batches[0]["x"] * 2)
    # call 3: captured with static copies of the inputs (not the caller's tensors), then replayed at once
    assert len(seen) == 3 and seen[2][3] == 1 and seen[2][0] is not batches[2]["x"]
    (_, graph, pool, mode), = fake.ops("capture")
    assert pool is None and mode == "thread_local"
    # calls 4-5: no Python of fn, one replay each with that call's inputs copied in
    assert graph.replays == 3 and step.graphs == 1
    assert torch.equal(seen[2][0], batches[4]["x"])  # the static input holds the last call's batch
    # outputs are copies of the graph's (the fake replay computes nothing new: the captured values)
    assert torch.equal(outs[2][0], batches[2]["x"] * 2) and outs[3][0] is not outs[2][0] and outs[3][1] == "a"
    # another signature (shape, or a non-tensor value) warms up and is captured on its own, in the same pool
    step({"x": torch.zeros(4, 3)}, "a")
    step({"x": torch.zeros(2, 3)}, "b")
    assert step.graphs == 1 and len(seen) == 5
    step({"x": torch.zeros(4, 3)}, "a")
    step({"x": torch.zeros(4, 3)}, "a")
    assert step.graphs == 2 and fake.ops("capture")[1][2] == graph.pool()
    with torch.no_grad():  # autograd off: another graph
        step({"x": torch.zeros(4, 3)}, "a")
    assert step.graphs == 2 and len(seen) == 8  # a warm-up call: fn ran


class _Encoding(collections.UserDict):
    """What transformers' collators return (BatchEncoding): a UserDict with attribute access."""

    def __getattr__(self, name):
        try:
            return self.data[name]
        except KeyError:
            raise AttributeError(name) from None


def test_the_inputs_keep_their_containers_in_the_capture(monkeypatch):
    fake = _FakeCuda(monkeypatch)
    got = []
    step = GraphedStep(lambda batch: got.append(batch) or batch.input_ids.sum(), warmup=1)
    for i in range(4):
        step(_Encoding(input_ids=torch.full((2, 3), i), labels=torch.tensor([i, i])))
    assert step.graphs == 1 and len(got) == 2 and len(fake.ops("capture")) == 1
    captured = got[1]  # the capture's call: static copies, in a BatchEncoding-like container still
    assert type(captured) is _Encoding and torch.equal(captured.input_ids, torch.full((2, 3), 3))
    assert torch.equal(captured["labels"], torch.tensor([3, 3]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs: needs a CUDA device")
def test_bert_trains_as_eager_with_the_step_as_one_graph():
    """accelerate(compute.step_graph) + graph_step: the same losses and weights as the plain model trained on
    the same batches, two bucket shapes (two graphs), a scheduler stepped outside the graph reaching the
    replays through the tensor lr, and replays that never wait for the host."""
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=64, num_labels=2,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ref = transformers.BertForSequenceClassification(cfg).cuda().train()
    model = copy.deepcopy(ref)
    config = accel.Config(backend="cuda")
    config.compute.step_graph = True
    model = accel.accelerate(model, None, config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.7)

    @accel.graph_step(warmup=2)
    def train_step(batch):
        loss = model(**batch)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    g = torch.Generator().manual_seed(1)
    batches = [{"input_ids": torch.randint(1, 97, (4, n), generator=g).cuda(),
                "labels": torch.randint(0, 2, (4,), generator=g).cuda()} for n in [16, 32] * 5]
    losses, ref_losses = [], []
    for i, batch in enumerate(batches):
        before = torch.cuda.get_sync_debug_mode()
        if i >= 6:  # both signatures captured: a replay must not wait for the host
            torch.cuda.set_sync_debug_mode("error")
        try:
            losses.append(train_step(batch))
        finally:
            torch.cuda.set_sync_debug_mode(before)
        sched.step()
        loss = ref(**batch)["loss"]
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        ref_sched.step()
        ref_losses.append(loss.detach())
    assert train_step.graphs == 2
    assert all(isinstance(group["lr"], torch.Tensor) and group["capturable"] for group in opt.param_groups)
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-4, atol=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_step_graph_on_the_cpu_leaves_the_optimizer_as_torch_builds_it():
    model = nn.Linear(4, 2)
    config = accel.Config(backend="cpu")
    config.compute.step_graph = True
    config.compute.compile = False
    model = accel.accelerate(model, None, config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    assert opt.param_groups[0]["lr"] == 1e-3 and not opt.param_groups[0]["capturable"]


def test_step_graph_refuses_several_ranks(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as the launcher sets it, before any process group
    config = accel.Config(backend="cpu")
    config.compute.step_graph = True
    with pytest.raises(ValueError, match="compute.step_graph: one process only"):
        accel.accelerate(nn.Linear(2, 2), None, config)


def test_ever_new_signatures_are_said_to_keep_changing(monkeypatch):
    _FakeCuda(monkeypatch)
    step = GraphedStep(lambda x: x.sum(), warmup=2)
    with pytest.warns(UserWarning, match="16 input signatures so far"):
        for n in range(1, 17):  # a new length every call: nothing is ever captured
            step(torch.ones(n))
    assert step.graphs == 0
