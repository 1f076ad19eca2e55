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


# ---------------------------------------------------------------- the attention module's own dropout layer


def _with_philox_attention_dropout(attention="sdpa", p=0.3):
    """A BertForSequenceClassification whose attention modules drop with PhiloxDropout (as accelerate() swaps them
    where that kernel wins), hidden dropout off so that only the attention draws."""
    from accel.runtime.nn.bias_dropout_add import PhiloxDropout

    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(_config(attention, attention_probs_dropout_prob=p)).train()
    for layer in model.bert.encoder.layer:
        layer.attention.self.dropout.__class__ = PhiloxDropout
    return model


def test_own_dropout_layer_applies_to_the_probabilities_as_in_eager_attention(monkeypatch):
    """Reference: transformers' eager attention (the same weights) with its functional dropout drawing the same
    masks, i.e. philox_dropout in place of F.dropout; padded batch (bool mask in accel_sdpa, additive in eager)."""
    from accel.runtime.nn.bias_dropout_add import philox_dropout

    model = _with_philox_attention_dropout()
    assert unpadded_attention(model)
    reference = _with_philox_attention_dropout("eager")
    reference.load_state_dict(model.state_dict())
    batch = _batch(padded=True)
    torch.manual_seed(5)
    got = model(**batch)
    with monkeypatch.context() as patch:
        patch.setattr(torch.nn.functional, "dropout", philox_dropout)
        torch.manual_seed(5)
        expected = reference(**batch)
    got.loss.backward()
    expected.loss.backward()
    torch.testing.assert_close(got.logits, expected.logits)
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)
    # the dropout did act: another seed gives other logits
    torch.manual_seed(6)
    assert not torch.allclose(model(**batch).logits, got.logits)


def test_own_dropout_layer_is_used_only_where_sdpa_cannot_take_its_place():
    from accel.compiler.unpadded_attention import _attention

    calls = []

    def sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        calls.append(dropout)
        return query.transpose(1, 2), None

    attention = _attention(sdpa)
    model = _with_philox_attention_dropout(p=0.3)
    module = model.bert.encoder.layer[0].attention.self
    q = k = v = torch.randn(2, 4, 5, 8)
    kv2 = torch.randn(2, 2, 5, 8)

    def uses_sdpa(module, key=k, value=v, dropout=0.3, **kwargs):
        calls.clear()
        attention(module, q, key, value, None, dropout=dropout, scaling=8 ** -0.5, **kwargs)
        return calls == [dropout]

    assert not uses_sdpa(module)  # training, PhiloxDropout of the same p: plain attention
    assert uses_sdpa(module, dropout=0.0)  # nothing to drop
    assert uses_sdpa(module, dropout=0.2)  # not the layer's p
    assert uses_sdpa(module, key=kv2, value=kv2)  # grouped keys: SDPA's job
    assert uses_sdpa(module, position_bias=torch.zeros(1))
    module.eval()
    assert uses_sdpa(module)
    plain = transformers.BertForSequenceClassification(_config(attention_probs_dropout_prob=0.3)).train()
    assert uses_sdpa(plain.bert.encoder.layer[0].attention.self)  # torch's own nn.Dropout: SDPA drops


def test_compiled_model_with_own_dropout_has_no_graph_breaks():
    import torch._dynamo

    model = _with_philox_attention_dropout()
    assert unpadded_attention(model)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(**_batch(padded=True))
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(model, dynamic=False)
    out = compiled(**_batch(padded=True))
    out.loss.backward()
    assert torch.isfinite(out.loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())
