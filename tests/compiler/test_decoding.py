"""accel.compiler.decoding: generate() after accelerate() runs uncompiled, giving the plain model's tokens
without a compilation per token; training calls stay compiled."""
import copy
import inspect

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import accel
from accel.compiler.decoding import carries_kv_cache, eager_when_decoding, no_cache_when_training

transformers = pytest.importorskip("transformers")


def _gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=97, n_embd=32, n_layer=2, n_head=2, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0)).train()


def _compiled_graphs():
    return counters["stats"]["unique_graphs"]


def test_generate_after_accelerate_compiles_nothing_and_gives_the_plain_tokens():
    torch._dynamo.reset()
    plain = _gpt2()
    ids = torch.randint(1, 97, (2, 16))
    model, batches = accel.accelerate(copy.deepcopy(plain), [{"input_ids": ids, "labels": ids}],
                                      accel.Config(backend="cpu"))
    before = _compiled_graphs()
    for batch in batches:
        model(**batch)["loss"].backward()
    assert _compiled_graphs() > before  # training calls are compiled
    model.eval()
    plain.eval()
    prompt = ids[:1, :5]
    trained = _compiled_graphs()
    tokens = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert _compiled_graphs() == trained  # no compilation per generated token
    torch.testing.assert_close(tokens, plain.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0))


def test_calls_with_a_cache_are_told_apart():
    cache = transformers.DynamicCache()
    assert carries_kv_cache((), {"past_key_values": cache})
    assert carries_kv_cache((torch.ones(1), cache), {})
    assert carries_kv_cache((), {"past_key_values": ((torch.ones(1), torch.ones(1)),)})  # a legacy tuple
    assert not carries_kv_cache((torch.ones(1),), {"past_key_values": None, "labels": torch.ones(1)})


def test_only_a_compiled_module_is_accepted():
    with pytest.raises(ValueError, match="model: expected a module compiled"):
        eager_when_decoding(torch.nn.Linear(2, 2))


def _flattened_rows(lengths=(5, 7, 4), rows=2):
    """Rows as DataCollatorWithFlattening and TRL's packing make them: samples side by side, position ids restarting
    at each, no attention mask; (batch, the samples of each row)."""
    g = torch.Generator().manual_seed(1)
    samples = [[torch.randint(1, 97, (n,), generator=g) for n in lengths] for _ in range(rows)]
    ids = torch.stack([torch.cat(row) for row in samples])
    positions = torch.cat([torch.arange(n) for n in lengths]).expand(rows, -1)
    return {"input_ids": ids, "position_ids": positions, "labels": ids}, samples


@pytest.mark.parametrize("compile", [True, False])
def test_training_on_flattened_rows_attends_within_each_sample(compile):
    """accelerate()'s Llama in training, compiled or not: each flattened sample's logits are those it has alone (no
    cache built, so transformers reads the packed position ids), and the loss is the plain call's with
    use_cache=False."""
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, attn_implementation="sdpa")).train()
    assert plain.config.use_cache
    batch, samples = _flattened_rows()
    config = accel.Config(backend="cpu", compute=accel.config.ComputeConfig(compile=compile))
    model = accel.accelerate(copy.deepcopy(plain), config=config)
    out = model(**batch)
    assert out.past_key_values is None
    for r, row in enumerate(samples):
        start = 0
        for ids in row:
            alone = plain(input_ids=ids.unsqueeze(0)).logits[0]
            torch.testing.assert_close(out.logits[r, start:start + len(ids)], alone, rtol=1e-4, atol=1e-5)
            start += len(ids)
    torch.testing.assert_close(out.loss, plain(**batch, use_cache=False).loss, rtol=1e-5, atol=1e-6)
    out.loss.backward()  # a training step runs as usual
    with torch.no_grad():  # other calls keep the model's default: evaluation builds its cache
        assert model(input_ids=batch["input_ids"][:, :5]).past_key_values is not None


def test_models_without_a_cache_are_left_alone():
    bert = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=97, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37))
    assert not no_cache_when_training(bert)  # its forward takes no use_cache
    gpt2 = _gpt2()
    gpt2.config.use_cache = False
    assert not no_cache_when_training(gpt2)  # off already
    assert not bert._forward_pre_hooks and not gpt2._forward_pre_hooks


@pytest.mark.parametrize("compile", [False, True])
def test_training_calls_build_no_cache(compile):
    """Training calls without use_cache build no cache, compiled (the pre-hook inside the graph) or not; a call
    that passes use_cache (by keyword or in its place), evaluation and calls without gradients keep theirs."""
    model = _gpt2()
    assert no_cache_when_training(model)
    if compile:
        model.compile(backend="eager")
    ids = torch.randint(1, 97, (1, 6))
    assert model(ids).past_key_values is None
    assert model(ids, use_cache=True).past_key_values is not None
    position = list(inspect.signature(type(model).forward).parameters).index("use_cache") - 1
    assert model(ids, *[None] * (position - 1), True).past_key_values is not None
    with torch.no_grad():
        assert model(ids).past_key_values is not None
    assert model.eval()(ids).past_key_values is not None
