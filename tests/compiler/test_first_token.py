"""first_token_only: the classifier's last encoder layer computes position 0 alone, and nothing the model returns
changes. The reference is the same model, unchanged (a deep copy with the same weights)."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the first-token heads are transformers models")

from accel.compiler.first_token import (  # noqa: E402
    FIRST_TOKEN_HEADS,
    IMAGE_HEADS,
    LAST_TOKEN_HEADS,
    first_token_only,
    last_layer_rows,
)


def _model(name: str, attention: str = "sdpa", layers: int = 2):
    torch.manual_seed(0)
    config_class = getattr(transformers, name.split("For")[0] + "Config")
    # dropout 0: the first-token layer draws attention dropout for one query, the full layer for all of them
    if name.startswith("DistilBert"):  # its own names
        config = config_class(vocab_size=99, dim=32, n_layers=layers, n_heads=4, hidden_dim=37, dropout=0.0,
                              attention_dropout=0.0, seq_classif_dropout=0.0, max_position_embeddings=64,
                              num_labels=3)
    else:
        # FlexAttention: heads of 16 (Inductor's on CUDA refuses narrower ones: "embedding dimension ... at least 16")
        heads = 2 if attention == "flex_attention" else 4
        config = config_class(vocab_size=99, hidden_size=32, num_hidden_layers=layers, num_attention_heads=heads,
                              intermediate_size=37, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                              max_position_embeddings=64, num_labels=3, embedding_size=32)
    config._attn_implementation = attention
    return getattr(transformers, name)(config)


def _batch(name: str, padded: bool = True):
    torch.manual_seed(1)
    shape = (2, 3, 9) if "MultipleChoice" in name else (3, 9)
    ids = torch.randint(3, 99, shape)
    mask = torch.ones(shape, dtype=torch.long)
    if padded:
        mask[1:, ..., 6:] = 0  # rows of 6 real tokens beside a full one
    classes = 2 if "NextSentence" in name else 3
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, classes, (shape[0],))}


def _query_lengths(model) -> list[int]:
    """Records how many positions the last layer's query projection sees per call."""
    seen = []
    base = model.base_model
    query = base.transformer.layer[-1].attention.q_lin if hasattr(base, "transformer") \
        else base.encoder.layer[-1].attention.self.query
    query.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[-2]))
    return seen


def _step(model, batch):
    out = model(**batch)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _assert_same_step(got, expected, tol=(1e-5, 1e-6), grad_tol=(1e-4, 1e-6)):
    """Logits, loss and every parameter's gradient of two _step results (a gradient the reference has not, e.g. the
    unused pooler of a RoBERTa classifier, must be missing too)."""
    (logits, loss, grads), (ref_logits, ref_loss, ref_grads) = got, expected
    torch.testing.assert_close(logits, ref_logits, rtol=tol[0], atol=tol[1])
    torch.testing.assert_close(loss, ref_loss, rtol=tol[0], atol=tol[1])
    assert grads.keys() == ref_grads.keys()
    for key, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[key], rtol=grad_tol[0], atol=grad_tol[1], msg=key)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("name", sorted(FIRST_TOKEN_HEADS - IMAGE_HEADS))
def test_same_logits_loss_and_gradients_as_the_full_model(name, attention):
    model = _model(name, attention)
    reference = copy.deepcopy(model)
    assert first_token_only(model)
    queries = _query_lengths(model)
    batch = _batch(name)
    _assert_same_step(_step(model, batch), _step(reference, batch))
    assert queries == [1], "the last layer computed more than the first token"


def test_unpadded_batch_and_eval_mode():
    # no padding: transformers passes no mask at all to SDPA
    model = _model("BertForSequenceClassification").eval()
    reference = copy.deepcopy(model)
    first_token_only(model)
    queries = _query_lengths(model)
    batch = _batch("BertForSequenceClassification", padded=False)
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, reference(**batch).logits, rtol=1e-5, atol=1e-6)
    assert queries == [1]


def test_calls_that_see_every_position_run_the_full_layer():
    model = _model("BertForSequenceClassification", "eager")  # SDPA returns no attention weights
    reference = copy.deepcopy(model)
    first_token_only(model)
    queries = _query_lengths(model)
    batch = _batch("BertForSequenceClassification")
    length = batch["input_ids"].shape[1]

    out = model(**batch, output_hidden_states=True)
    ref = reference(**batch, output_hidden_states=True)
    assert out.hidden_states[-1].shape == ref.hidden_states[-1].shape
    torch.testing.assert_close(out.hidden_states[-1], ref.hidden_states[-1])
    out = model(**batch, output_attentions=True)
    assert len(out.attentions) == 2 and out.attentions[-1].shape[-2] == length
    # the encoder called by itself returns every position
    inner = model.bert(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    torch.testing.assert_close(inner.last_hidden_state,
                               reference.bert(input_ids=batch["input_ids"],
                                              attention_mask=batch["attention_mask"]).last_hidden_state)
    assert queries == [length, length, length]
    model(**batch)
    assert queries[-1] == 1


def test_a_failed_call_leaves_the_full_layer_for_the_next_encoder_call():
    model = _model("BertForSequenceClassification")
    first_token_only(model)
    queries = _query_lengths(model)
    batch = _batch("BertForSequenceClassification")
    with pytest.raises(Exception):
        model(**{**batch, "labels": torch.zeros(5, dtype=torch.long)})  # 5 labels for 3 rows: the loss fails
    model.bert(input_ids=batch["input_ids"])
    assert queries == [1, batch["input_ids"].shape[1]]


def test_other_models_are_left_alone():
    token_model = _model("BertForTokenClassification")  # reads every position
    assert not first_token_only(token_model)
    assert "forward" not in token_model.bert.encoder.layer[-1].__dict__
    assert not first_token_only(torch.nn.Linear(2, 2))
    model = _model("BertForSequenceClassification")
    assert first_token_only(model) and first_token_only(model)  # the second call changes nothing
    queries = _query_lengths(model)
    model(**_batch("BertForSequenceClassification"))
    assert queries == [1]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_flex_attention_cuts_its_block_mask_to_the_first_query(device):
    """FlexAttention: the BlockMask is rebuilt over the kept query (its row of the original mask_mod), so the last
    layer computes one token there too. CPU: forward only (transformers torch.compiles flex_attention, and Inductor
    has no FlexAttention backward on the CPU, pytorch/pytorch#169224); CUDA: a training step, gradients too."""
    model = _model("BertForSequenceClassification", "flex_attention").to(device)
    reference = copy.deepcopy(model)
    assert first_token_only(model)
    queries = _query_lengths(model)
    batch = {key: value.to(device) for key, value in _batch("BertForSequenceClassification").items()}
    if device == "cpu":
        with torch.no_grad():
            torch.testing.assert_close(model(**batch).logits, reference(**batch).logits, rtol=1e-5, atol=1e-6)
    else:
        _assert_same_step(_step(model, batch), _step(reference, batch), tol=(1e-4, 1e-5), grad_tol=(1e-3, 1e-5))
    assert queries == [1]


def test_compiled_model_matches_and_does_not_break_the_graph():
    import torch._dynamo

    model = _model("BertForSequenceClassification")
    reference = copy.deepcopy(model)
    first_token_only(model)
    batch = _batch("BertForSequenceClassification")
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(**batch)
    assert explained.graph_break_count == 0, explained.break_reasons
    model.compile(dynamic=False)
    _assert_same_step(_step(model, batch), _step(reference, batch), tol=(1e-4, 1e-5), grad_tol=(1e-4, 1e-5))


# ------------------------------------------------------------ image classifiers over pre-norm layers (ViT, DeiT)

def _image_model(name: str, attention: str = "sdpa"):
    torch.manual_seed(0)
    config_class = getattr(transformers, name.split("For")[0] + "Config")
    config = config_class(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=37, num_labels=3, attn_implementation=attention)
    return getattr(transformers, name)(config).train()


def _image_batch():
    torch.manual_seed(1)
    return {"pixel_values": torch.randn(3, 3, 16, 16), "labels": torch.tensor([0, 2, 1])}


def _image_query_lengths(model) -> list[int]:
    seen = []
    model.base_model.layers[-1].attention.q_proj.register_forward_hook(
        lambda module, args, out: seen.append(args[0].shape[-2]))
    return seen


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("name", sorted(IMAGE_HEADS))
def test_image_classifiers_same_logits_loss_and_gradients(name, attention):
    """ViT / DeiT: the last layer's query projection sees the [CLS] token alone; logits, loss and every gradient
    are the full model's."""
    model = _image_model(name, attention)
    reference = copy.deepcopy(model)
    assert first_token_only(model)
    queries = _image_query_lengths(model)
    batch = _image_batch()
    _assert_same_step(_step(model, batch), _step(reference, batch))
    assert queries == [1]


def test_image_classifier_hidden_states_and_the_base_model_see_every_position():
    model = _image_model("ViTForImageClassification", "eager")
    reference = copy.deepcopy(model)
    first_token_only(model)
    queries = _image_query_lengths(model)
    batch = _image_batch()
    out, ref = model(**batch, output_hidden_states=True), reference(**batch, output_hidden_states=True)
    torch.testing.assert_close(out.hidden_states[-1], ref.hidden_states[-1])
    inner = model.vit(pixel_values=batch["pixel_values"]).last_hidden_state
    torch.testing.assert_close(inner, reference.vit(pixel_values=batch["pixel_values"]).last_hidden_state)
    assert queries == [17, 17]  # 16 patches and [CLS], both calls
    model(**batch)
    assert queries[-1] == 1


def test_image_classifiers_reading_more_than_one_token_are_left_alone():
    for name in ("Dinov2ForImageClassification", "DeiTForImageClassificationWithTeacher"):
        config_class = getattr(transformers, name.split("For")[0] + "Config")
        model = getattr(transformers, name)(config_class(image_size=16, patch_size=4, hidden_size=32,
                                                          num_hidden_layers=1, num_attention_heads=4,
                                                          intermediate_size=37, num_labels=3))
        assert not first_token_only(model), name


def test_compiled_image_classifier_matches():
    import torch._dynamo

    model = _image_model("ViTForImageClassification")
    reference = copy.deepcopy(model)
    first_token_only(model)
    torch._dynamo.reset()
    model.compile(dynamic=False)
    _assert_same_step(_step(model, _image_batch()), _step(reference, _image_batch()), tol=(1e-4, 1e-5),
                      grad_tol=(1e-4, 1e-5))


# ------------------------------------------------- decoder classifiers: the last token that is not padding (Llama)

def _decoder_model(name: str, attention: str = "sdpa", **settings):
    torch.manual_seed(0)
    config_class = getattr(transformers, name.split("For")[0] + "Config")
    config = config_class(**{**dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, intermediate_size=37, max_position_embeddings=64,
                                    num_labels=3, pad_token_id=0), **settings})
    config._attn_implementation = attention
    return getattr(transformers, name)(config).train()


def _decoder_batch(padding: str = "right"):
    """Three rows of 9 tokens: one full, two with 3 pad tokens (id 0) at the end, at the start, or none."""
    torch.manual_seed(1)
    ids, mask = torch.randint(3, 99, (3, 9)), torch.ones(3, 9, dtype=torch.long)
    pads = {"right": slice(6, None), "left": slice(None, 3)}.get(padding)
    if pads is not None:
        ids[1:, pads], mask[1:, pads] = 0, 0
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 2, 1])}


def _decoder_query_lengths(model) -> list[int]:
    """The tokens a row the last layer's attention output projection sees a call: the queries it computed (every
    family has an o_proj; Phi-3 has no q_proj)."""
    seen = []
    model.base_model.layers[-1].self_attn.o_proj.register_forward_hook(
        lambda module, args, out: seen.append(args[0].shape[-2]))
    return seen


def _cache_keys(out) -> torch.Tensor:
    """The last layer's keys in the cache a call returned (`cache` in transformers >= 5.24, else past_key_values)."""
    cache = out.get("cache", out.get("past_key_values"))
    return cache.layers[-1].keys


@pytest.mark.parametrize("padding", ["right", "left", "none"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("name", sorted(LAST_TOKEN_HEADS))
def test_decoder_classifiers_same_logits_loss_gradients_and_cache(name, attention, padding):
    """The last layer's query projection sees one token per row; the logits, loss, every gradient and the key/value
    cache the call returns (transformers builds one: use_cache is on by default) are the full model's."""
    model = _decoder_model(name, attention)
    reference = copy.deepcopy(model)
    assert first_token_only(model)
    queries = _decoder_query_lengths(model)
    batch = _decoder_batch(padding)
    if padding == "none":  # no mask at all: SDPA's own causal attention in the full layer
        del batch["attention_mask"]
    _assert_same_step(_step(model, batch), _step(reference, batch))
    assert queries == [1], "the last layer computed more than the token the classifier reads"
    with torch.no_grad():
        torch.testing.assert_close(_cache_keys(model(**batch)), _cache_keys(reference(**batch)))


@pytest.mark.parametrize("name, settings", [
    ("MistralForSequenceClassification", dict(sliding_window=4)),
    ("Qwen2ForSequenceClassification", dict(use_sliding_window=True, sliding_window=4, max_window_layers=0)),
])
def test_decoder_classifiers_with_a_sliding_window_shorter_than_the_rows(name, settings):
    model = _decoder_model(name, "sdpa", **settings)
    reference = _decoder_model(name, "eager", **settings)  # transformers' eager attention with its own window mask
    reference.load_state_dict(model.state_dict())
    first_token_only(model)
    queries = _decoder_query_lengths(model)
    batch = _decoder_batch("right")
    _assert_same_step(_step(model, batch), _step(reference, batch))
    with torch.no_grad():  # and the window matters here: without it the logits differ
        unwindowed = _decoder_model(name.replace("Mistral", "Llama").replace("Qwen2", "Llama"))
        unwindowed.load_state_dict(model.state_dict(), strict=False)
        assert not torch.allclose(unwindowed(**batch).logits, reference(**batch).logits, atol=1e-4)
    assert queries == [1]


@pytest.mark.parametrize("settings", [dict(partial_rotary_factor=0.5), dict(sliding_window=4)],
                         ids=["partial_rotary", "sliding_window"])
def test_phi3_classifier_rotates_part_of_each_head_and_keeps_its_window(settings):
    """Phi-3's fused projection, its partial rotary embedding (half of each head rotated) and its sliding window
    (its eager attention, transformers' own window mask, is the reference)."""
    model = _decoder_model("Phi3ForSequenceClassification", "sdpa", **settings)
    reference = _decoder_model("Phi3ForSequenceClassification", "eager", **settings)
    reference.load_state_dict(model.state_dict())
    assert first_token_only(model)
    queries = _decoder_query_lengths(model)
    _assert_same_step(_step(model, _decoder_batch("right")), _step(reference, _decoder_batch("right")))
    assert queries == [1]


def test_decoder_classifier_after_a_cached_prefix_and_from_embeddings():
    """A call continuing a cache (the queries' diagonal shifted by the cached tokens) and a call given
    inputs_embeds (the last position is read) match the full model."""
    model = _decoder_model("LlamaForSequenceClassification").eval()
    reference = copy.deepcopy(model)
    first_token_only(model)
    queries = _decoder_query_lengths(model)
    ids = _decoder_batch("none")["input_ids"]
    with torch.no_grad():
        got, expected = model(ids[:, :5], use_cache=True), reference(ids[:, :5], use_cache=True)
        cache, ref_cache = (out.get("cache", out.get("past_key_values")) for out in (got, expected))
        # positional: the keyword is `cache` in transformers >= 5.24 and `past_key_values` before
        torch.testing.assert_close(model(ids[:, 5:], None, None, cache).logits,
                                   reference(ids[:, 5:], None, None, ref_cache).logits)
        embeds = model.get_input_embeddings()(ids)
        torch.testing.assert_close(model(inputs_embeds=embeds).logits, reference(inputs_embeds=embeds).logits)
    assert queries == [1, 1, 1]


def test_decoder_classifier_without_a_pad_id():
    """Without pad_token_id transformers reads the last position of a single row and refuses several rows; so
    does the cut model, and a refused call leaves the full layer to the next caller."""
    model = _decoder_model("LlamaForSequenceClassification", pad_token_id=None).eval()
    reference = copy.deepcopy(model)
    first_token_only(model)
    queries = _decoder_query_lengths(model)
    ids = _decoder_batch("none")["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(model(ids[:1]).logits, reference(ids[:1]).logits)
        with pytest.raises(ValueError, match="padding token"):
            model(ids)
        model.model(input_ids=ids)
    assert queries == [1, 9, 9]


def test_decoder_classifier_hidden_states_and_compiled():
    import torch._dynamo

    model = _decoder_model("Qwen3ForSequenceClassification")
    reference = copy.deepcopy(model)
    first_token_only(model)
    batch = _decoder_batch("right")
    with torch.no_grad():
        out, ref = model(**batch, output_hidden_states=True), reference(**batch, output_hidden_states=True)
        torch.testing.assert_close(out.hidden_states[-1], ref.hidden_states[-1])
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(**batch)
    assert explained.graph_break_count == 0, explained.break_reasons
    model.compile(dynamic=False)
    _assert_same_step(_step(model, batch), _step(reference, batch), tol=(1e-4, 1e-5), grad_tol=(1e-4, 1e-5))


def test_other_decoders_are_left_alone():
    gpt2 = transformers.GPT2ForSequenceClassification(transformers.GPT2Config(
        vocab_size=99, n_embd=32, n_layer=1, n_head=4, n_positions=16, pad_token_id=0))
    assert not first_token_only(gpt2)  # GPT2Block: not built like LlamaDecoderLayer
    causal = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=37))
    assert not first_token_only(causal)  # reads every position
    model = _decoder_model("LlamaForSequenceClassification")
    model.config.model_type = "olmo"  # a layer built alike whose attention may differ (Olmo clips q, k, v)
    assert last_layer_rows(model) is None
