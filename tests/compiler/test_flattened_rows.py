"""accel.compiler.flattened_rows: rows packed by the user's collator (DataCollatorWithFlattening, TRL: position ids
restarting per sample, no attention mask) get FlexAttention with their document BlockMask on CUDA, against
transformers' own dense packed mask (the same model without the hook, use_cache=False) and each sample alone.

On the CPU, where Inductor has no FlexAttention backward (torch 2.9), the route is let through (flex_runs_on) for
forward passes without gradients; on CUDA a bf16 training step and accelerate()'s compiled step.
"""
import copy

import pytest
import torch

import accel.compiler.flex_rows as flex_rows
from accel.compiler.flattened_rows import flattened_segments, flex_for_flattened_rows
from tests.compiler.test_flex_rows import CUDA, _model, flex_calls
from tests.compiler.test_packed import VOCAB, _close_in_norm

transformers = pytest.importorskip("transformers")

LENGTHS = (5, 7, 4)  # one row of 16


def _flattened(device, rows=2, lengths=LENGTHS):
    """(batch as DataCollatorWithFlattening makes it, each row's samples)."""
    g = torch.Generator().manual_seed(3)
    samples = [[torch.randint(1, VOCAB, (n,), generator=g) for n in lengths] for _ in range(rows)]
    ids = torch.stack([torch.cat(row) for row in samples]).to(device)
    positions = torch.cat([torch.arange(n) for n in lengths]).expand(rows, -1).to(device)
    return {"input_ids": ids, "position_ids": positions, "labels": ids.clone()}, samples


def _pair(family, device, route="flex"):
    """(the model with the hook, its twin without: transformers' packed mask), both "accel_sdpa"."""
    model = _model(family).to(device)
    twin = copy.deepcopy(model)
    assert flex_for_flattened_rows(model, model, route)
    return model, twin


def test_segments_are_transformers_packed_sequences_counted_from_one():
    from transformers.masking_utils import find_packed_sequence_indices

    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 0, 1, 2], [3, 4, 5, 6, 0, 1, 2, 3, 4, 5]])
    want = find_packed_sequence_indices(positions) + 1
    torch.testing.assert_close(flattened_segments(positions), want)
    assert flattened_segments(positions)[0].tolist() == [1, 1, 1, 2, 2, 3, 4, 5, 5, 5]


@pytest.mark.parametrize("family", ["llama", "mistral_window", "gemma3"])
def test_flattened_rows_take_flex_attention_with_transformers_logits(monkeypatch, family):
    calls = flex_calls(monkeypatch, "cpu")
    model, twin = _pair(family, "cpu")
    batch, samples = _flattened("cpu")
    with torch.no_grad():
        out = model(**batch, use_cache=False)
        want = {"llama": ["same_segment_causal"] * 2, "mistral_window": ["same_segment_window"] * 2,
                "gemma3": ["same_segment_window", "same_segment_causal"]}[family]
        assert calls == want
        reference = twin(**batch, use_cache=False)
        torch.testing.assert_close(out.logits, reference.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.loss, reference.loss, rtol=1e-5, atol=1e-6)
        start = 0
        for ids in samples[1]:  # and each sample's logits are its own alone
            alone = twin(input_ids=ids.unsqueeze(0), use_cache=False).logits[0]
            torch.testing.assert_close(out.logits[1, start:start + len(ids)], alone, rtol=1e-4, atol=1e-5)
            start += len(ids)


def test_only_uncached_unmasked_flattened_calls_of_long_enough_rows_are_changed(monkeypatch):
    """A call with a cache (or use_cache left on: transformers then reads no packing from the position ids), with an
    attention mask, or without position ids keeps transformers' attention; "auto" takes rows of AUTO_MIN_ROW
    tokens or more; "mask" and "varlen" and models that are not causal LMs with "accel_sdpa" get no hook."""
    calls = flex_calls(monkeypatch, "cpu")
    batch, _ = _flattened("cpu")
    model, _ = _pair("llama", "cpu")
    with torch.no_grad():
        model(**batch)  # the config's use_cache (on)
        model(**batch, use_cache=False, attention_mask=torch.ones_like(batch["input_ids"]))
        model(input_ids=batch["input_ids"], use_cache=False)
        assert calls == []
        auto, _ = _pair("llama", "cpu", route="auto")
        auto(**batch, use_cache=False)  # rows of 16
        assert calls == []
        monkeypatch.setattr(flex_rows, "AUTO_MIN_ROW", 16)
        auto(**batch, use_cache=False)
        assert calls == ["same_segment_causal"] * 2
        calls.clear()
        model.config.use_cache = False
        model(**batch)
        assert calls == ["same_segment_causal"] * 2
    llama = _model("llama")
    assert not flex_for_flattened_rows(llama, llama, "mask") and not flex_for_flattened_rows(llama, llama, "varlen")
    bert = _model("bert")
    assert not flex_for_flattened_rows(bert, bert, "flex")  # a masked LM: bidirectional
    sdpa = transformers.LlamaForCausalLM(llama.config)
    sdpa.config._attn_implementation = "sdpa"
    assert not flex_for_flattened_rows(sdpa, sdpa, "flex")  # not accel_sdpa: the keywords would reach nothing
    assert not flex_for_flattened_rows(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), "flex")


@pytest.mark.parametrize("family", ["llama", "mistral_window", "gemma3"])
@pytest.mark.parametrize("device", [CUDA])
def test_a_cuda_training_step_matches_transformers_packed_mask(monkeypatch, family, device):
    calls = flex_calls(monkeypatch, device)
    model, twin = _pair(family, device)
    batch, _ = _flattened(device)
    with torch.autocast(device, dtype=torch.bfloat16):
        out = model(**batch, use_cache=False)
        want = twin(**batch, use_cache=False)
    assert len(calls) == 2
    out.loss.backward()
    want.loss.backward()
    _close_in_norm(out.logits, want.logits, 2e-2)
    _close_in_norm(out.loss, want.loss, 1e-2)
    reference = dict(twin.named_parameters())
    largest = max(param.grad.float().norm() for param in twin.parameters())
    for name, param in model.named_parameters():
        _close_in_norm(param.grad, reference[name].grad, 5e-2, floor=1e-3 * largest)


@pytest.mark.parametrize("device", [CUDA])
def test_accelerate_trains_flattened_rows_with_flex_attention_as_with_the_mask(monkeypatch, device):
    """Through accelerate() (compiled, CUDA graphs, fp32, use_cache left to accel's training calls): the BlockMasks
    built inside the compiled graph, the same losses step after step as compute.cuda_packed_attention="mask"."""
    import accel

    calls = flex_calls(monkeypatch, device)
    losses = {}
    for route in ("mask", "flex"):
        config = accel.Config(backend=device)
        config.compute.kernels = False
        config.compute.cuda_packed_attention = route
        model = accel.accelerate(_model("llama"), config=config)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        losses[route] = []
        for seed in range(3):
            batch, _ = _flattened(device, rows=1 + seed % 2)
            loss = model(**batch)["loss"]
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[route].append(loss.item())
        assert bool(calls) == (route == "flex")
    torch.testing.assert_close(losses["flex"], losses["mask"], rtol=1e-4, atol=1e-5)
