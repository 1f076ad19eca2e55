"""accel.compiler.flattened_rows: rows packed by the user's collator (DataCollatorWithFlattening, TRL: position ids
restarting per sample, no attention mask) get each sample's attention alone, against transformers' own dense
packed mask (the same model without the hook, use_cache=False) and each sample alone: on the CPU by
varlen_attention (a training step, and accelerate()'s compiled one); FlexAttention with their document BlockMask
on CUDA, checked on the CPU with the route let through (flex_runs_on) for forward passes without gradients
(Inductor has no FlexAttention backward there, torch 2.9), on CUDA in a bf16 training step and accelerate()'s
compiled step.
"""
import copy

import pytest
import torch

import accel
import accel.compiler.flex_rows as flex_rows
import accel.runtime.nn.varlen_attention as varlen
from accel.compiler.flattened_rows import flattened_segments, per_sample_flattened_rows
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
    assert per_sample_flattened_rows(model, model, route)
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


def test_only_uncached_unmasked_flattened_calls_of_long_enough_rows_take_flex(monkeypatch):
    """A call with a cache (or use_cache left on: transformers then reads no packing from the position ids), with an
    attention mask, or without position ids keeps transformers' attention; "auto" takes FlexAttention for rows of
    AUTO_MIN_ROW tokens or more, "mask" and "varlen" never (on the CPU: each sample alone, varlen_attention); models
    that are not causal LMs with "accel_sdpa" get no hook."""
    calls = flex_calls(monkeypatch, "cpu")
    batch, _ = _flattened("cpu")
    model, _ = _pair("llama", "cpu")
    with torch.no_grad():
        model(**batch)  # the config's use_cache (on)
        model(**batch, use_cache=False, attention_mask=torch.ones_like(batch["input_ids"]))
        model(input_ids=batch["input_ids"], use_cache=False)
        assert calls == []
        for route in ("auto", "mask", "varlen"):
            other, _ = _pair("llama", "cpu", route=route)
            other(**batch, use_cache=False)  # rows of 16
        assert calls == []
        monkeypatch.setattr(flex_rows, "AUTO_MIN_ROW", 16)
        other, _ = _pair("llama", "cpu", route="auto")
        other(**batch, use_cache=False)
        assert calls == ["same_segment_causal"] * 2
        calls.clear()
        model.config.use_cache = False
        model(**batch)
        assert calls == ["same_segment_causal"] * 2
    bert = _model("bert")
    assert not per_sample_flattened_rows(bert, bert)  # a masked LM: bidirectional
    llama = _model("llama")
    sdpa = transformers.LlamaForCausalLM(llama.config)
    sdpa.config._attn_implementation = "sdpa"
    assert not per_sample_flattened_rows(sdpa, sdpa)  # not accel_sdpa: the keywords would reach nothing
    assert not per_sample_flattened_rows(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))


def varlen_calls(monkeypatch) -> list:
    """The segment ids the CPU's per-sample attention is called with."""
    calls, original = [], varlen.varlen_attention

    def recorded(query, key, value, segment_ids, **kwargs):
        calls.append(segment_ids)
        return original(query, key, value, segment_ids, **kwargs)

    monkeypatch.setattr(varlen, "varlen_attention", recorded)
    return calls


@pytest.mark.parametrize("family", ["llama", "mistral_window"])
def test_a_cpu_training_step_computes_each_sample_alone(monkeypatch, family):
    """fp32 on the CPU: each layer's attention per sample (the rows' segments as transformers finds them), logits,
    loss and every gradient equal to transformers' packed mask's."""
    calls = varlen_calls(monkeypatch)
    model, twin = _pair(family, "cpu", route="mask")
    batch, _ = _flattened("cpu")
    out, want = model(**batch, use_cache=False), twin(**batch, use_cache=False)
    assert len(calls) == 2 and all(torch.equal(c, flattened_segments(batch["position_ids"])) for c in calls)
    torch.testing.assert_close(out.logits, want.logits, rtol=1e-5, atol=1e-5)
    out.loss.backward()
    want.loss.backward()
    reference = dict(twin.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, reference[name].grad, rtol=1e-4, atol=1e-6, msg=name)


def test_accelerate_on_the_cpu_trains_flattened_rows_per_sample(monkeypatch):
    """transformers' DataCollatorWithFlattening behind accelerate()'s buckets, compiled: rows of static length (the
    padding one sample of its own: position ids 0, 1, ...), the attention per sample, and each loss the plain
    model's over the same samples flattened without a cache (accel's compiled training calls build none)."""
    calls = varlen_calls(monkeypatch)
    plain = _model("llama")
    assert plain.config.use_cache
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(1, VOCAB, (int(n),), generator=g).tolist()}
            for n in torch.randint(4, 20, (12,), generator=g)]
    collate = transformers.DataCollatorWithFlattening()
    config = accel.Config(backend="cpu")
    config.dataloader.buckets = [64, 96]
    model, loader = accel.accelerate(copy.deepcopy(plain), torch.utils.data.DataLoader(data, batch_size=4,
                                                                                       collate_fn=collate), config)
    for i, batch in enumerate(loader):
        assert batch["input_ids"].shape == (1, 64)
        want = plain(**collate(data[4 * i:4 * i + 4]), use_cache=False).loss
        torch.testing.assert_close(model(**batch)["loss"], want, rtol=1e-5, atol=1e-6)
    assert i == 2 and calls


@pytest.mark.parametrize("compile", [True, False])
def test_an_accelerated_model_with_the_hooks_still_pickles(tmp_path, compile):
    """torch.save(model) of a whole accelerated causal LM (its hooks are functions of accel's modules, not
    closures): the loaded model trains flattened rows per sample as the one saved, with no cache built."""
    plain = _model("llama")
    config = accel.Config(backend="cpu")
    config.compute.compile = compile
    model = accel.accelerate(copy.deepcopy(plain), config=config)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    batch, _ = _flattened("cpu")
    out = loaded(**batch)
    assert out.past_key_values is None
    want = plain(**batch, use_cache=False).loss
    torch.testing.assert_close(out.loss, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model(**batch)["loss"], want, rtol=1e-5, atol=1e-6)


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
