"""The compiled CUDA step: accelerate() on cuda (torch.compile, CUDA graphs, compiled optimizer step) runs
whole fp16 and bf16 training steps without a host sync, and an inf in the fp16 loss skips the update.

Needs a CUDA GPU; skipped elsewhere (the CPU compile path is tested in tests/test_accelerate.py)."""
import contextlib
import copy

import pytest
import torch

import accel
from accel.amp import GradScaler, syncfree
from accel.compiler.graph_pool_grads import has_graph_pool_grad_check
from accel.compiler.optimizer import has_compiled_step, has_cuda_graph_step, uses_fused_kernel

transformers = pytest.importorskip("transformers", reason="the compiled step is tested on transformers' BERT")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
VOCAB, BATCH, SEQ, WARMUP = 101, 4, 32, 3


def tiny_bert(dropout=0.1):
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=128, max_position_embeddings=SEQ, num_labels=2,
                                  hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(cfg).train()


def batches(n):
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(1, VOCAB, (BATCH, SEQ), generator=g),
             "attention_mask": torch.ones(BATCH, SEQ, dtype=torch.long),
             "labels": torch.randint(0, 2, (BATCH,), generator=g)} for _ in range(n)]


def accelerated(precision, dropout=0.1, optimizer_graphs=False):
    torch._dynamo.reset()
    config = accel.Config(backend="cuda")
    config.compute.optimizer_cuda_graphs = optimizer_graphs
    if precision is not None:
        setattr(config.compute, precision, True)
    return accel.accelerate(tiny_bert(dropout), batches(WARMUP + 3), config)


@contextlib.contextmanager
def no_host_sync(on: bool):
    """torch raises on any host sync inside (after the warm-up steps, which compile and record graphs)."""
    if not on:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


# compute.optimizer_cuda_graphs: the optimizer's compiled step replayed with CUDA graphs too
OPTIMIZER_GRAPHS = pytest.mark.parametrize("optimizer_graphs", [False, True],
                                           ids=["optimizer_compiled", "optimizer_graphs"])


@OPTIMIZER_GRAPHS
def test_fp16_step_is_sync_free_and_an_inf_skips_the_update(optimizer_graphs):
    model, loader = accelerated("fp16", optimizer_graphs=optimizer_graphs)
    opt = syncfree.AdamW(model.parameters(), lr=1e-3)
    scaler = GradScaler()
    on_gpu = iter(loader)
    for i in range(WARMUP + 3):
        inf_step = i == WARMUP + 1
        with no_host_sync(i >= WARMUP):
            batch = next(on_gpu)  # taking the batch is part of the step: the Prefetcher must not sync either
            loss = model(**batch)["loss"]
            if inf_step:
                before = [p.detach().clone() for p in model.parameters()]
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=False)
            if inf_step:
                after = [p.detach().clone() for p in model.parameters()]
    assert has_compiled_step(opt) and has_cuda_graph_step(opt) == optimizer_graphs
    for old, new in zip(before, after):
        assert torch.equal(old, new)  # the inf step changed no weight
    assert scaler.get_scale() < 2.0**16  # and backed the scale off


@OPTIMIZER_GRAPHS
def test_bf16_step_is_sync_free_and_trains_like_eager(optimizer_graphs):
    model, loader = accelerated("bf16", optimizer_graphs=optimizer_graphs)
    ref = tiny_bert().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    losses, ref_losses = [], []
    on_gpu = iter(loader)
    for i, plain in enumerate(batches(WARMUP + 3)):
        with no_host_sync(i >= WARMUP):
            batch = next(on_gpu)  # taking the batch is part of the step: the Prefetcher must not sync either
            loss = model(**batch)["loss"]
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            losses.append(loss.detach().clone())
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ref_loss = ref(**{k: v.cuda() for k, v in plain.items()})["loss"]
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.detach())
    # torch's AdamW at its defaults runs torch's fused kernel, never compiled (Dynamo does not trace into it)
    assert uses_fused_kernel(opt) and not has_compiled_step(opt)
    torch.testing.assert_close(torch.stack(losses).float(), torch.stack(ref_losses).float(), rtol=3e-2, atol=3e-2)


def test_gradients_summed_over_micro_batches_match_eager():
    # zero_grad every second batch: the first backward's .grad, which autograd took from the CUDA-graph
    # replay's memory, must outlive the second batch's replay (pytorch/pytorch#169545); fp32, no dropout
    model, loader = accelerated(None, dropout=0.0)
    assert has_graph_pool_grad_check(model)
    ref = tiny_bert(dropout=0.0).cuda()
    for i, (batch, plain) in enumerate(zip(loader, batches(WARMUP + 3))):
        if i % 2 == 0:
            model.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
        model(**batch)["loss"].backward()
        ref(**{k: v.cuda() for k, v in plain.items()})["loss"].backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-2, atol=1e-3, msg=name)


def test_accelerate_on_cuda_keeps_the_model_in_place_and_loads_batches_onto_the_gpu():
    model, loader = accelerated("bf16")
    assert all(p.is_cuda for p in model.parameters())
    assert set(model.state_dict()) == set(tiny_bert().state_dict())  # compiled in place: same keys
    batch = next(iter(loader))
    assert batch["input_ids"].is_cuda
    copy.deepcopy(model.state_dict())


def graph_launches(step) -> float:
    """Graph launches the host makes while running step(), counted as benchmarks/step_profile.py counts them."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.step_profile import host_calls

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return host_calls(prof, steps=1)["graph launches"]


@pytest.mark.parametrize("drop_full_masks", [False, True], ids=["mask", "no_mask"])
def test_forward_and_backward_replay_as_cuda_graphs(drop_full_masks):
    # what benchmarks/bert_base.py's accel row runs: if Inductor skipped the CUDA graphs asked for, every kernel
    # would cost a host launch (BERT-base 32x128: a host-bound step) and it would say so only in a log
    from torch._dynamo.utils import counters

    from accel.compiler import cudagraph_skips

    torch._dynamo.reset()
    config = accel.Config(backend="cuda")
    config.compute.bf16 = True
    config.dataloader.drop_full_masks = drop_full_masks
    skips, heard = counters["inductor"]["cudagraph_skips"], len(cudagraph_skips.reasons())
    model, loader = accel.accelerate(tiny_bert(), batches(WARMUP + 2), config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    on_gpu = iter(loader)

    def step():
        loss = model(**next(on_gpu))["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(WARMUP + 1):
        step()
    assert cudagraph_skips.reasons()[heard:] == []
    assert counters["inductor"]["cudagraph_skips"] == skips
    assert graph_launches(step) >= 2  # the forward's graph and the backward's
