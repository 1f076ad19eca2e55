"""accel.compiler.decoding: generate() after accelerate() runs uncompiled, giving the plain model's tokens
without a compilation per token; training calls stay compiled."""
import copy

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import accel
from accel.compiler.decoding import carries_kv_cache, eager_when_decoding

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
