"""unpadded_attention: "accel_sdpa" is transformers' SDPA attention that gets no mask for a batch without a
padding mask, compiled or not. The reference is the same weights with "sdpa" attention given the mask."""
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the attention registries are transformers'")

from accel.compiler.unpadded_attention import ACCEL_SDPA, unpadded_attention  # noqa: E402


def _config(attention="sdpa", **overrides):
    settings = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                    max_position_embeddings=32, num_labels=3, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0)
    settings.update(overrides)
    config = transformers.BertConfig(**settings)
    config._attn_implementation = attention
    return config


def _pair():
    """(a BertForSequenceClassification switched to accel_sdpa, the same weights with sdpa)."""
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(_config()).train()
    reference = transformers.BertForSequenceClassification(_config()).train()
    reference.load_state_dict(model.state_dict())
    assert unpadded_attention(model) and model.config._attn_implementation == ACCEL_SDPA
    return model, reference


def _batch(padded: bool):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 50, (3, 11), generator=g)
    mask = torch.ones(3, 11, dtype=torch.long)
    if padded:
        mask[1:, 7:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 3, (3,), generator=g)}


def _masks_seen(model):
    """The mask each call hands the first layer's attention."""
    seen = []
    model.bert.encoder.layer[0].attention.self.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs.get("attention_mask", args[1] if len(args) > 1 else None)),
        with_kwargs=True)
    return seen


def _check_same(model, reference, batch, model_batch, rtol=1e-5, atol=1e-6):
    got, expected = model(**model_batch), reference(**batch)
    got.loss.backward()
    expected.loss.backward()
    torch.testing.assert_close(got.logits, expected.logits, rtol=rtol, atol=atol)
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=rtol * 10, atol=atol / 10, msg=name)


@pytest.mark.parametrize("case", ["padded", "mask of ones", "no mask"])
def test_same_outputs_and_gradients_as_sdpa_with_the_mask(case):
    model, reference = _pair()
    batch = _batch(padded=case == "padded")
    model_batch = {k: v for k, v in batch.items() if not (case == "no mask" and k == "attention_mask")}
    seen = _masks_seen(model)
    _check_same(model, reference, batch, model_batch)
    assert (seen[0] is None) == (case != "padded")  # unpadded: no mask; padded: its mask


def test_compiled_attention_gets_no_mask_without_padding_and_its_mask_with():
    import torch._dynamo

    model, reference = _pair()
    unpadded = _batch(padded=False)
    without_mask = {k: v for k, v in unpadded.items() if k != "attention_mask"}
    torch._dynamo.reset()
    for batch in (without_mask, _batch(padded=True)):
        explained = torch._dynamo.explain(model)(**batch)
        assert explained.graph_break_count == 0, explained.break_reasons
    model.zero_grad()
    seen = _masks_seen(model)
    compiled = torch.compile(model, dynamic=False)
    _check_same(compiled, reference, unpadded, without_mask, rtol=1e-4, atol=1e-5)
    assert seen[-1] is None  # transformers' "sdpa" builds a [B, 1, L, L] mask here on torch 2.9-2.13
    model.zero_grad()
    reference.zero_grad()
    padded = _batch(padded=True)
    _check_same(compiled, reference, padded, padded, rtol=1e-4, atol=1e-5)
    assert isinstance(seen[-1], torch.Tensor) and seen[-1].dim() == 4 and not seen[-1].all()


def test_only_sdpa_encoders_switch():
    assert not unpadded_attention(torch.nn.Linear(2, 2))
    eager = transformers.BertForSequenceClassification(_config("eager"))
    assert not unpadded_attention(eager) and eager.config._attn_implementation == "eager"
    decoder = transformers.BertLMHeadModel(_config(is_decoder=True))  # causal masks stay transformers'
    assert not unpadded_attention(decoder) and decoder.config._attn_implementation == "sdpa"
    model, _ = _pair()
    assert unpadded_attention(model)  # a second call changes nothing


def test_the_saved_config_keeps_sdpa(tmp_path):
    model, _ = _pair()
    model.save_pretrained(tmp_path)
    loaded = transformers.BertForSequenceClassification.from_pretrained(tmp_path, attn_implementation="sdpa")
    assert ACCEL_SDPA not in (tmp_path / "config.json").read_text()
    torch.testing.assert_close(loaded.classifier.weight, model.classifier.weight)
