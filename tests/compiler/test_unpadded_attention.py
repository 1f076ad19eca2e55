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


def test_only_sdpa_models_switch():
    assert not unpadded_attention(torch.nn.Linear(2, 2))
    eager = transformers.BertForSequenceClassification(_config("eager"))
    assert not unpadded_attention(eager) and eager.config._attn_implementation == "eager"
    model, _ = _pair()
    assert unpadded_attention(model)  # a second call changes nothing


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_a_decoders_causal_masks_stay_transformers(padded):
    """A BERT decoder (causal self-attention): its masks are transformers' own under accel_sdpa, so the same outputs
    and gradients as with sdpa."""
    torch.manual_seed(0)
    model = transformers.BertLMHeadModel(_config(is_decoder=True)).train()
    reference = transformers.BertLMHeadModel(_config(is_decoder=True)).train()
    reference.load_state_dict(model.state_dict())
    assert unpadded_attention(model) and model.config._attn_implementation == ACCEL_SDPA
    batch = _batch(padded)
    batch["labels"] = batch["input_ids"]
    _check_same(model, reference, batch, batch)


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


# ------------------------------------------------ 16-bit unmasked training attention in plain ops on the CPU

def _sdpa_calls(monkeypatch):
    """The calls of F.scaled_dot_product_attention (transformers' SDPA attention looks it up at each call)."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *args, **kwargs: (calls.append(args[0].shape), sdpa(*args, **kwargs))[1])
    return calls


def _bf16_pair(plain_training: bool):
    """(a bf16 BERT classifier switched to accel_sdpa with plain_training, the same weights in fp32 with sdpa)."""
    model, reference = _pair()
    assert unpadded_attention(model, plain_training=plain_training)
    return model.to(torch.bfloat16), reference


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_plain_training_attention_matches_sdpa_and_leaves_out_sdpa(monkeypatch, compiled):
    """bf16 training without a mask: the plain ops instead of SDPA, the fp32 SDPA model's logits and gradients to
    bf16's precision; without gradients (evaluation) SDPA again."""
    import torch._dynamo

    torch._dynamo.reset()
    model, reference = _bf16_pair(plain_training=True)
    batch = _batch(padded=False)
    want = reference(**batch)
    want.loss.backward()
    calls = _sdpa_calls(monkeypatch)
    unmasked = {k: v for k, v in batch.items() if k != "attention_mask"}
    run = torch.compile(model, dynamic=False) if compiled else model
    got = run(**unmasked)
    got.loss.backward()
    assert calls == []
    torch.testing.assert_close(got.logits.float(), want.logits, rtol=3e-2, atol=3e-2)
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        # the attention's own parameters, what its backward feeds; not the key's bias, whose gradient is 0 (a shift
        # of every key's score leaves the softmax as it is): rounding alone in bf16
        if "attention.self" in name and not name.endswith("key.bias"):
            torch.testing.assert_close(a.grad.float(), b.grad, rtol=6e-2, atol=6e-2 * b.grad.abs().max().item(),
                                       msg=name)
    with torch.no_grad():
        run(**unmasked)
    assert len(calls) == model.config.num_hidden_layers


def test_plain_training_attention_takes_padded_batches_too(monkeypatch):
    """A padded bf16 batch: the plain ops with the padding mask, the fp32 SDPA model's logits and attention
    gradients given the same mask."""
    model, reference = _bf16_pair(plain_training=True)
    batch = _batch(padded=True)
    want = reference(**batch)
    want.loss.backward()
    calls = _sdpa_calls(monkeypatch)
    got = model(**batch)
    got.loss.backward()
    assert calls == []
    torch.testing.assert_close(got.logits.float(), want.logits, rtol=3e-2, atol=3e-2)
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        if "attention.self" in name and not name.endswith("key.bias"):  # see the unpadded test
            torch.testing.assert_close(a.grad.float(), b.grad, rtol=6e-2, atol=6e-2 * b.grad.abs().max().item(),
                                       msg=name)


def test_plain_training_attention_only_in_16_bit_and_where_told(monkeypatch):
    """fp32, or plain_training off: SDPA in every layer."""
    for plain_training, dtype in ((True, torch.float32), (False, torch.bfloat16)):
        model, _ = _bf16_pair(plain_training)
        calls = _sdpa_calls(monkeypatch)
        model.to(dtype)(**_batch(padded=True)).loss.backward()
        assert len(calls) == model.config.num_hidden_layers, (plain_training, dtype)
        monkeypatch.undo()


def test_plain_training_attention_asks_each_call():
    from torch import nn

    from accel.compiler.unpadded_attention import PLAIN_CAUSAL, PLAIN_TRAINING, _plain_training

    module = nn.Module()
    setattr(module, PLAIN_TRAINING, True)
    q = torch.randn(2, 4, 8, 16, dtype=torch.bfloat16, requires_grad=True)
    assert _plain_training(module, q, q, None, 0.0, {})
    assert _plain_training(module, q, q, torch.ones(2, 1, 8, 8, dtype=torch.bool), 0.0, {})  # a padding mask
    assert _plain_training(module, q, q[:, :2], None, 0.0, {})  # grouped-query heads: repeated
    assert not _plain_training(module, q, q[:, :3], None, 0.0, {})  # 4 query heads over 3 key heads
    assert not _plain_training(module, q, q, object(), 0.0, {})  # e.g. FlexAttention's BlockMask
    assert not _plain_training(module, q, q, torch.ones(2, 8, dtype=torch.bool), 0.0, {})  # not a [B, H, L, L] one
    assert not _plain_training(module, q, q, None, 0.1, {})  # dropout: SDPA's own path (or the module's layer)
    assert not _plain_training(module, q, q, None, 0.0, {"is_causal": True})
    assert _plain_training(module, q, q[:, :, :4], None, 0.0, {})  # cross-attention: other keys than queries
    long_keys = torch.randn(2, 4, 1025, 16, dtype=torch.bfloat16)
    assert not _plain_training(module, q, long_keys, None, 0.0, {})  # [B, H, Lq, Lk] kept for the backward
    assert not _plain_training(module, q.detach(), q, None, 0.0, {})  # no gradient: forward alone ties
    assert not _plain_training(module, q.float(), q, None, 0.0, {})
    long = torch.randn(1, 1, 1025, 8, dtype=torch.bfloat16, requires_grad=True)
    assert not _plain_training(module, long, long, None, 0.0, {})  # [B, H, L, L] kept for the backward
    module.is_causal = True  # a causal module follows its own marker
    assert not _plain_training(module, q, q, None, 0.0, {})
    setattr(module, PLAIN_CAUSAL, True)
    assert _plain_training(module, q, q, None, 0.0, {})
    assert _plain_training(module, q, q[:, :2], None, 0.0, {"sliding_window": None})  # Qwen2's full layers
    assert _plain_training(module, q, q, torch.ones(2, 1, 8, 8, dtype=torch.bool), 0.0, {"sliding_window": 4})  # in it
    assert not _plain_training(module, q, q[:, :, :4], None, 0.0, {})  # causal over other keys: a cache
    causal_long = torch.randn(1, 1, 513, 8, dtype=torch.bfloat16, requires_grad=True)
    assert not _plain_training(module, causal_long, causal_long, None, 0.0, {})  # SDPA's causal kernel leads there
    setattr(module, PLAIN_TRAINING, False)
    assert _plain_training(module, q, q, None, 0.0, {})
    assert not _plain_training(nn.Module(), q, q, None, 0.0, {})  # not told to


def test_vit_trains_its_attention_in_plain_ops_as_with_sdpa(monkeypatch):
    """ViT (no attention dropout: a model this is for; its attention modules are named otherwise by each
    transformers version): no SDPA call while training in bf16, the fp32 SDPA model's logits; told again, off."""
    torch.manual_seed(0)
    config = transformers.ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, intermediate_size=37, num_labels=3,
                                    attn_implementation="sdpa")
    model = transformers.ViTForImageClassification(config).train()
    reference = transformers.ViTForImageClassification(config).train()
    reference.load_state_dict(model.state_dict())
    assert unpadded_attention(model, plain_training=True)
    calls = _sdpa_calls(monkeypatch)
    images, labels = torch.randn(2, 3, 16, 16), torch.tensor([0, 2])
    got = model.to(torch.bfloat16)(pixel_values=images.bfloat16(), labels=labels)
    assert calls == []
    want = reference(pixel_values=images, labels=labels)
    assert calls == [torch.Size([2, 4, 17, 8])] * 2  # the reference's, which is not told
    torch.testing.assert_close(got.logits.float(), want.logits, rtol=3e-2, atol=3e-2)
    assert unpadded_attention(model, plain_training=False)
    model(pixel_values=images.bfloat16(), labels=labels)
    assert len(calls) == 4


def test_a_composite_models_towers_are_told_too(monkeypatch):
    """CLIP: transformers switches the sub-configs with the model's; the vision tower's unmasked attention takes
    plain ops, the text tower's causal, masked one keeps SDPA."""
    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37)
    config = transformers.CLIPConfig(text_config=dict(vocab_size=50, **small),
                                     vision_config=dict(image_size=16, patch_size=4, **small))
    config._attn_implementation = "sdpa"
    model = transformers.CLIPModel(config).train()
    assert unpadded_attention(model, plain_training=True)
    calls = _sdpa_calls(monkeypatch)
    out = model.to(torch.bfloat16)(pixel_values=torch.randn(2, 3, 16, 16).bfloat16(),
                                   input_ids=torch.randint(1, 50, (2, 7)), return_loss=True)
    out.loss.backward()
    assert calls == [torch.Size([2, 4, 7, 8])] * 2  # the text tower's two layers


def _llama(cls, **settings):
    config = transformers.LlamaConfig(**{**dict(vocab_size=99, hidden_size=32, num_hidden_layers=2,
                                                num_attention_heads=4, num_key_value_heads=2, intermediate_size=37,
                                                max_position_embeddings=1100, num_labels=3, pad_token_id=0,
                                                attn_implementation="sdpa"), **settings})
    torch.manual_seed(0)
    return cls(config).train()


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("head", ["LlamaForCausalLM", "LlamaForSequenceClassification"])
def test_causal_training_attention_in_plain_ops_matches_sdpa(monkeypatch, head, compiled, padded):
    """A decoder (Llama: causal, grouped key/value heads) trained in bf16 with plain_causal: no SDPA call, the fp32
    SDPA model's logits, loss and attention gradients to bf16's precision; without gradients SDPA again."""
    import torch._dynamo

    torch._dynamo.reset()
    cls = getattr(transformers, head)
    model, reference = _llama(cls), _llama(cls)
    assert unpadded_attention(model, plain_causal=True)
    model.to(torch.bfloat16)
    torch.manual_seed(1)
    ids = torch.randint(3, 99, (3, 9))
    batch = {"input_ids": ids, "labels": ids if head.endswith("CausalLM") else torch.tensor([0, 2, 1])}
    if padded:  # right padding: the mask holds causality and padding, no is_causal
        ids[1:, 6:] = 0
        batch["attention_mask"] = (ids != 0).long()
    _train_plain_against_sdpa(monkeypatch, model, reference, batch, compiled, lambda name: "self_attn" in name,
                              calls_without_gradients=model.config.num_hidden_layers)


def _train_plain_against_sdpa(monkeypatch, model, reference, batch, compiled: bool, is_attention,
                              calls_without_gradients: int) -> None:
    """One bf16 training call of `model` (told to take plain ops) against the fp32 SDPA `reference`: no SDPA call,
    the logits, the loss and the gradients of the parameters is_attention(name) picks to bf16's precision; a call
    without gradients then takes SDPA calls_without_gradients times."""
    want = reference(**batch)
    want.loss.backward()
    calls = _sdpa_calls(monkeypatch)
    run = torch.compile(model, dynamic=False) if compiled else model
    got = run(**batch)
    got.loss.backward()
    assert calls == []
    torch.testing.assert_close(got.logits.float(), want.logits, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(got.loss.float(), want.loss, rtol=3e-2, atol=3e-2)
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        if is_attention(name):
            torch.testing.assert_close(a.grad.float(), b.grad, rtol=6e-2, atol=6e-2 * b.grad.abs().max().item(),
                                       msg=name)
    with torch.no_grad():
        run(**batch)
    assert len(calls) == calls_without_gradients


@pytest.mark.parametrize("window", [4, 4096], ids=["window_cuts", "window_longer_than_rows"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_sliding_window_attention_in_plain_ops_matches_sdpa(monkeypatch, compiled, window):
    """Mistral passes its window to the attention function, and transformers puts it in the mask where it cuts (SDPA
    never reads the keyword): the plain ops take that mask, no SDPA call, the fp32 SDPA model's logits."""
    import torch._dynamo

    torch._dynamo.reset()
    settings = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=37, max_position_embeddings=64, sliding_window=window, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(**settings)).train()
    reference = transformers.MistralForCausalLM(transformers.MistralConfig(**settings)).train()
    reference.load_state_dict(model.state_dict())
    assert unpadded_attention(model, plain_causal=True)
    model.to(torch.bfloat16)
    ids = torch.randint(3, 99, (2, 11))
    want = reference(input_ids=ids, labels=ids)
    calls = _sdpa_calls(monkeypatch)
    run = torch.compile(model, dynamic=False) if compiled else model
    got = run(input_ids=ids, labels=ids)
    got.loss.backward()
    assert calls == []
    torch.testing.assert_close(got.logits.float(), want.logits, rtol=3e-2, atol=3e-2)
    if window == 4:  # the window matters here: a causal mask without it gives other logits
        unwindowed = transformers.MistralForCausalLM(transformers.MistralConfig(**{**settings, "sliding_window": None}))
        unwindowed.load_state_dict(reference.state_dict())
        assert (unwindowed(input_ids=ids).logits - want.logits).abs().max() > 0.1


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_causal_plain_ops_under_autocast_take_the_fp32_queries_of_the_rotary_embedding(monkeypatch, compiled):
    """fp32 weights under bf16 autocast (accelerate()'s way): Llama's rotary embedding hands the attention fp32
    queries, which autocast casts to bf16 for SDPA; the plain ops run instead (their products autocast alike), the
    fp32 model's logits to bf16's precision."""
    import torch._dynamo

    torch._dynamo.reset()
    model, reference = _llama(transformers.LlamaForCausalLM), _llama(transformers.LlamaForCausalLM)
    assert unpadded_attention(model, plain_causal=True)
    ids = torch.randint(3, 99, (3, 9))
    want = reference(input_ids=ids, labels=ids)
    calls = _sdpa_calls(monkeypatch)
    run = torch.compile(model, dynamic=False) if compiled else model
    with torch.autocast("cpu", torch.bfloat16):
        got = run(input_ids=ids, labels=ids)
    got.loss.backward()
    assert calls == []
    torch.testing.assert_close(got.logits.float(), want.logits, rtol=3e-2, atol=3e-2)
    got = run(input_ids=ids, labels=ids)  # fp32 without autocast: SDPA
    assert len(calls) == model.config.num_hidden_layers


def test_causal_plain_ops_stop_at_their_length_and_follow_their_own_marker(monkeypatch):
    """Rows longer than MAX_PLAIN_CAUSAL_LENGTH keep SDPA; plain_training alone (the bidirectional marker) leaves a
    causal model's attention to SDPA."""
    from accel.compiler.unpadded_attention import MAX_PLAIN_CAUSAL_LENGTH

    model = _llama(transformers.LlamaForCausalLM)
    assert unpadded_attention(model, plain_causal=True)
    model.to(torch.bfloat16)
    calls = _sdpa_calls(monkeypatch)
    ids = torch.randint(3, 99, (1, MAX_PLAIN_CAUSAL_LENGTH + 1))
    model(input_ids=ids, labels=ids).loss.backward()
    assert len(calls) == 2
    assert unpadded_attention(model, plain_training=True, plain_causal=False)
    model(input_ids=ids[:, :9], labels=ids[:, :9]).loss.backward()
    assert len(calls) == 4


def test_probe_measures_a_speedup_once_per_kind():
    from accel.compiler.unpadded_attention import plain_attention_speedup

    for causal in (False, True):
        speedup = plain_attention_speedup(torch.bfloat16, causal=causal)
        assert 0 < speedup < float("inf")
        assert plain_attention_speedup(torch.bfloat16, causal=causal) == speedup  # cached: once per process


@pytest.mark.parametrize("choice, speedup, bf16, expected", [
    ("plain", 0.5, True, True), ("auto", 2.0, True, True), ("auto", 1.1, True, False), ("sdpa", 9.0, True, False),
    ("plain", 9.0, False, False),
], ids=["plain", "auto_where_it_wins", "auto_where_it_loses", "sdpa", "fp32"])
def test_accelerate_follows_cpu_attention_and_the_probe(monkeypatch, choice, speedup, bf16, expected):
    import accel
    import accel.compiler.unpadded_attention as ua
    import accel.utils.cpu as cpu
    from accel.compiler.unpadded_attention import PLAIN_CAUSAL, PLAIN_TRAINING

    probed = []
    monkeypatch.setattr(ua, "plain_attention_speedup", lambda dtype, causal: probed.append(causal) or speedup)
    monkeypatch.setattr(cpu, "native_bf16", lambda: True)  # bf16 autocast, whatever this CPU has
    config = accel.Config(backend="cpu")
    config.compute.bf16, config.compute.cpu_attention, config.compute.compile = bf16, choice, False
    for model, kind, attention_class in ((_pair()[0], PLAIN_TRAINING, "BertSelfAttention"),
                                         (_llama(transformers.LlamaForCausalLM), PLAIN_CAUSAL, "LlamaAttention")):
        probed.clear()
        model = accel.accelerate(model, None, config)
        attention = [m for m in model.modules() if type(m).__name__ == attention_class]
        assert attention and all(getattr(m, kind) == expected for m in attention)
        # one probe, of the model's kind of attention, where "auto" decides
        assert probed == ([kind == PLAIN_CAUSAL] if choice == "auto" and bf16 else [])


def test_accelerate_probes_only_for_a_model_it_switches(monkeypatch):
    import accel
    import accel.compiler.unpadded_attention as ua
    import accel.utils.cpu as cpu

    def probe(dtype, causal=False):
        raise AssertionError("probed for a model without an attention to switch")

    monkeypatch.setattr(ua, "plain_attention_speedup", probe)
    monkeypatch.setattr(cpu, "native_bf16", lambda: True)
    config = accel.Config(backend="cpu")
    config.compute.bf16, config.compute.compile = True, False
    accel.accelerate(torch.nn.Sequential(torch.nn.Linear(4, 4)), None, config)
    eager = transformers.BertForSequenceClassification(_config("eager"))
    accel.accelerate(eager, None, config)


def test_auto_takes_plain_ops_only_where_every_rank_found_them_faster(monkeypatch):
    import accel
    import accel.compiler.unpadded_attention as ua
    import accel.utils.cpu as cpu
    from accel import distributed
    from accel.compiler.unpadded_attention import PLAIN_TRAINING

    monkeypatch.setattr(ua, "plain_attention_speedup", lambda dtype, causal=False: 9.0)
    monkeypatch.setattr(cpu, "native_bf16", lambda: True)
    monkeypatch.setattr(distributed, "all_ranks_agree", lambda flag: False)  # another rank's probe lost
    config = accel.Config(backend="cpu")
    config.compute.bf16, config.compute.compile = True, False
    model, _ = _pair()
    model = accel.accelerate(model, None, config)
    assert not any(getattr(m, PLAIN_TRAINING, False) for m in model.modules())


def _bart(seed=0):
    config = transformers.BartConfig(vocab_size=99, d_model=32, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=37,
                                     decoder_ffn_dim=37, max_position_embeddings=64, dropout=0.0,
                                     attn_implementation="sdpa")
    torch.manual_seed(seed)
    return transformers.BartForConditionalGeneration(config).train()


def _bart_batch(padded: bool):
    g = torch.Generator().manual_seed(2)
    batch = {"input_ids": torch.randint(3, 99, (3, 13), generator=g), "labels": torch.randint(3, 99, (3, 7), generator=g)}
    if padded:  # the encoder's padding: its self-attention's and the cross-attention's masks
        batch["attention_mask"] = torch.ones(3, 13, dtype=torch.long)
        batch["attention_mask"][1:, 9:] = 0
    return batch


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_an_encoder_decoder_switched_gives_sdpas_results(padded):
    model, reference = _bart(), _bart()
    assert unpadded_attention(model) and model.config._attn_implementation == ACCEL_SDPA
    batch = _bart_batch(padded)
    _check_same(model, reference, batch, batch)


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_an_encoder_decoder_trains_every_attention_in_plain_ops(monkeypatch, compiled, padded):
    """BART in bf16 with both markers: the encoder's self-attention, the decoder's causal self-attention and the
    cross-attention (7 queries over 13 keys) all in plain ops, no SDPA call; the fp32 SDPA model's logits, loss and
    attention gradients to bf16's precision."""
    import torch._dynamo

    torch._dynamo.reset()
    model, reference = _bart(), _bart()
    assert unpadded_attention(model, plain_training=True, plain_causal=True)
    model.to(torch.bfloat16)
    # a key bias moves every score of a query alike, which softmax ignores: its gradient is 0 up to rounding;
    # without gradients SDPA: 2 encoder + 2 x 2 decoder layers' attentions
    _train_plain_against_sdpa(monkeypatch, model, reference, _bart_batch(padded), compiled,
                              lambda name: "attn" in name and not name.endswith("k_proj.bias"), calls_without_gradients=6)


def test_plain_cross_attention_stops_at_its_length(monkeypatch):
    """Keys longer than MAX_PLAIN_LENGTH (an encoder's long input) keep SDPA for the attentions over them."""
    from accel.compiler.unpadded_attention import MAX_PLAIN_LENGTH

    config = transformers.BartConfig(vocab_size=99, d_model=16, encoder_layers=1, decoder_layers=1,
                                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=8,
                                     decoder_ffn_dim=8, max_position_embeddings=MAX_PLAIN_LENGTH + 8,
                                     attn_implementation="sdpa")
    model = transformers.BartForConditionalGeneration(config).train()
    assert unpadded_attention(model, plain_training=True, plain_causal=True)
    model.to(torch.bfloat16)
    calls = _sdpa_calls(monkeypatch)
    ids = torch.randint(3, 99, (1, MAX_PLAIN_LENGTH + 1))
    model(input_ids=ids, labels=ids[:, :5]).loss.backward()
    assert calls == [torch.Size([1, 2, MAX_PLAIN_LENGTH + 1, 8]), torch.Size([1, 2, 5, 8])]  # encoder, cross
