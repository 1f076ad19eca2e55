"""PackedModel: a packed batch gives every sample the logits, loss and gradients it gets alone.

The reference is the same weights in a model with eager attention, run on each sample alone (batch 1, no
padding, default position ids), so neither the mask nor the packing code is shared with what is checked.
"""
import copy

import pytest
import torch

from accel.compiler.packed import FLEX, PackedModel, document_mask, sliding_window
from accel.compiler.unpadded_attention import ACCEL_SDPA, unpadded_attention
from accel.data.packing import LABEL_PAD, PackedCollator, PackedDataset, block_diagonal_mask
from tests._varlen_kernel import varlen_kernel

transformers = pytest.importorskip("transformers")

CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))
DEVICES = ["cpu", CUDA]
BACKENDS = ["sdpa", ACCEL_SDPA, "eager", FLEX]
HEADS = {"sequence": transformers.BertForSequenceClassification, "token": transformers.BertForMaskedLM}
LENGTHS = [7, 3, 11, 5, 9, 4, 6, 2]
ROW = 16
VOCAB = 64
NUM_LABELS = 3
# transformers always torch.compiles flex_attention; Inductor has no FlexAttention backward on the CPU.
NO_CPU_FLEX_BACKWARD = ("flex_attention has no backward on the CPU in torch 2.9: transformers torch.compiles it and "
                        "Inductor fails with 'InductorError: IndexError: tuple index out of range' "
                        "(pytorch/pytorch#169224); the CPU forward is tested")


def _tolerance(device):
    # fp32 throughout; CUDA kernels (SDPA, Triton FlexAttention) sum in other orders than the CPU.
    return dict(rtol=1e-4, atol=1e-5) if device == "cpu" else dict(rtol=1e-3, atol=1e-4)


def _config(attn_implementation, **overrides):
    if attn_implementation == ACCEL_SDPA:  # registered with transformers by switching a model to it
        unpadded_attention(transformers.BertForSequenceClassification(_config("sdpa")))
    settings = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=64, max_position_embeddings=32, type_vocab_size=2, num_labels=NUM_LABELS,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                    attn_implementation=attn_implementation)
    settings.update(overrides)
    return transformers.BertConfig(**settings)


def _models(head, backend, device, train):
    """(PackedModel with `backend` attention, the same weights with eager attention as the reference)."""
    cls = HEADS[head]
    torch.manual_seed(0)
    model = cls(_config(backend)).to(device)
    assert model.config._attn_implementation == backend
    reference = cls(_config("eager")).to(device)
    reference.load_state_dict(model.state_dict())
    model.train(train)
    reference.train(train)
    return PackedModel(model), reference


def _samples(head, seed=0):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for n in LENGTHS:
        ids = torch.randint(1, VOCAB, (n,), generator=g)
        sample = {"input_ids": ids.tolist(), "token_type_ids": torch.randint(0, 2, (n,), generator=g).tolist()}
        if head == "sequence":
            sample["labels"] = int(torch.randint(0, NUM_LABELS, (), generator=g))
        else:
            labels = torch.randint(0, VOCAB, (n,), generator=g)
            labels[torch.rand(n, generator=g) < 0.4] = LABEL_PAD
            labels[0] = ids[0]  # every sample has a labelled token, so its own loss is defined
            sample["labels"] = labels.tolist()
        samples.append(sample)
    return samples


def _packed(samples, device):
    ds = PackedDataset(samples, ROW)
    assert len(ds) < len(samples) and max(len(row) for row in ds.rows) >= 3  # rows really are shared
    batch = PackedCollator(mask="none", keep_segment_info=True)([ds[r] for r in range(len(ds))])
    return ds, {key: value.to(device) for key, value in batch.items()}


def _placements(ds):
    """(row, segment, first token, sample index) for every packed sample."""
    for r, row in enumerate(ds.rows):
        offset = 0
        for s, piece in enumerate(row):
            yield r, s, offset, ds.piece_source[piece]
            offset += ds.piece_lengths[piece]


def _alone(reference, sample, device):
    def tensor(key):
        return torch.tensor([sample[key]], device=device)
    return reference(input_ids=tensor("input_ids"), token_type_ids=tensor("token_type_ids"), labels=tensor("labels"))


def _loss_weights(head, samples):
    """Each sample's share of the batch loss: the model's mean is over samples (sequence) or over labelled
    tokens (token heads), so `model(**unpacked).loss` == sum(weight * loss alone)."""
    if head == "sequence":
        return [1.0 / len(samples)] * len(samples)
    counts = [sum(label != LABEL_PAD for label in s["labels"]) for s in samples]
    return [c / sum(counts) for c in counts]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("head", list(HEADS))
def test_packed_outputs_match_each_sample_alone(head, train, backend, device):
    packed, reference = _models(head, backend, device, train)
    samples = _samples(head)
    ds, batch = _packed(samples, device)
    weights = _loss_weights(head, samples)
    tol = _tolerance(device)
    # Under no_grad, so flex_attention also runs on the CPU (its compiled backward is what the CPU lacks).
    with torch.no_grad():
        out = packed(**batch)
        expected_loss = torch.zeros((), device=device)
        for r, s, offset, i in _placements(ds):
            alone = _alone(reference, samples[i], device)
            if head == "sequence":
                torch.testing.assert_close(out["logits"][r, s], alone.logits[0], **tol)
            else:
                n = len(samples[i]["input_ids"])
                torch.testing.assert_close(out["logits"][r, offset:offset + n], alone.logits[0], **tol)
            expected_loss += weights[i] * alone.loss
    torch.testing.assert_close(out["loss"], expected_loss, **tol)
    if head == "sequence":
        assert out["logits"].shape == (len(ds), ds.max_segments, NUM_LABELS)
        missing = batch["seq_lens"] == 0
        assert missing.any() and (out["logits"][missing] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head", list(HEADS))
def test_packed_gradients_match_each_sample_alone(head, backend, device):
    if backend == FLEX and device == "cpu":
        pytest.skip(NO_CPU_FLEX_BACKWARD)
    packed, reference = _models(head, backend, device, train=True)
    samples = _samples(head, seed=1)
    ds, batch = _packed(samples, device)
    packed(**batch)["loss"].backward()
    weights = _loss_weights(head, samples)
    sum(w * _alone(reference, sample, device).loss for w, sample in zip(weights, samples)).backward()

    reference_params = dict(reference.named_parameters())
    checked = 0
    for name, param in packed.model.named_parameters():
        expected = reference_params[name].grad
        if expected is None:
            assert param.grad is None or not param.grad.any(), name
            continue
        torch.testing.assert_close(param.grad, expected, rtol=1e-4 if device == "cpu" else 1e-3,
                                   atol=1e-6 if device == "cpu" else 1e-5, msg=lambda m: f"{name}: {m}")
        checked += bool(expected.any())
    assert checked > 10  # embeddings, every layer, the head


def test_flex_training_on_cpu_raises_a_clear_error():
    packed, _ = _models("token", FLEX, "cpu", train=True)
    _, batch = _packed(_samples("token"), "cpu")
    with pytest.raises(RuntimeError, match="flex_attention cannot train on the CPU"):
        packed(**batch)


def test_sequence_classification_segment_count_without_labels():
    packed, _ = _models("sequence", "sdpa", "cpu", train=False)
    _, batch = _packed(_samples("sequence"), "cpu")
    labels = batch.pop("labels")
    with torch.no_grad():
        with_labels = packed(**batch, labels=labels)["logits"]
        from_seq_lens = packed(**batch)  # S from seq_lens' shape
        seq_lens = batch.pop("seq_lens")
        from_segment_ids = packed(**batch)["logits"]  # S = segment_ids.max()
    assert from_seq_lens.loss is None  # a ModelOutput leaves out None fields
    torch.testing.assert_close(from_seq_lens["logits"], with_labels)
    torch.testing.assert_close(from_segment_ids, with_labels[:, :int((seq_lens > 0).sum(1).max())])


def test_without_the_document_mask_samples_leak():
    # Guards the comparison above: the same packed batch without the mask does not match the samples alone.
    packed, reference = _models("token", "sdpa", "cpu", train=False)
    samples = _samples("token")
    ds, batch = _packed(samples, "cpu")
    with torch.no_grad():
        leaky = packed.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                             token_type_ids=batch["token_type_ids"]).logits
        r, s, offset, i = next(p for p in _placements(ds) if p[1] == 1)  # a sample after another one
        alone = _alone(reference, samples[i], "cpu").logits[0]
    assert not torch.allclose(leaky[r, offset:offset + len(samples[i]["input_ids"])], alone, atol=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_document_mask_reaches_attention_unchanged(backend):
    segment_ids = torch.tensor([[1, 1, 1, 2, 2, 0, 0], [1, 1, 2, 3, 3, 3, 3]])
    mask = document_mask(segment_ids, backend)
    assert mask.shape == (2, 1, 7, 7)
    if backend == FLEX:
        from torch.nn.attention.flex_attention import create_mask
        dense = create_mask(mask.mask_mod, 2, 1, 7, 7, device="cpu")
    elif backend in ("sdpa", ACCEL_SDPA):
        assert mask.dtype == torch.bool
        dense = mask
    else:
        assert mask.dtype == torch.float32
        assert set(mask.unique().tolist()) == {0.0, torch.finfo(torch.float32).min}
        dense = mask == 0
    assert torch.equal(dense, block_diagonal_mask(segment_ids, "bool").unsqueeze(1))
    # transformers' BERT turns attention_mask into the layers' mask with create_bidirectional_mask.
    from transformers.masking_utils import create_bidirectional_mask
    assert create_bidirectional_mask(_config(backend), torch.zeros(2, 7, 32), mask) is mask


def test_state_dict_has_the_wrapped_models_keys():
    packed, _ = _models("sequence", "sdpa", "cpu", train=False)
    plain = packed.model.state_dict()
    ours = packed.state_dict()
    assert list(ours) == list(plain)
    assert all(ours[key] is plain[key] or torch.equal(ours[key], plain[key]) for key in plain)

    torch.manual_seed(1)
    other = PackedModel(transformers.BertForSequenceClassification(_config("sdpa")))
    assert other.load_state_dict(plain) is not None  # strict: no missing or unexpected keys
    assert all(torch.equal(a, b) for a, b in zip(other.model.state_dict().values(), plain.values()))
    fresh = transformers.BertForSequenceClassification(_config("sdpa"))
    fresh.load_state_dict(other.state_dict())

    # Nested in another module, the wrapper adds no "model." level either way.
    outer = torch.nn.ModuleDict({"net": other})
    saved = outer.state_dict()
    assert list(saved) == ["net." + key for key in plain]
    outer.load_state_dict(saved)


def test_document_mask_bad_arguments():
    with pytest.raises(ValueError, match="segment_ids"):
        document_mask(torch.ones(7, dtype=torch.long), "sdpa")
    with pytest.raises(ValueError, match="segment_ids"):
        document_mask(torch.ones(2, 7), "sdpa")
    with pytest.raises(ValueError, match="backend"):
        document_mask(torch.ones(2, 7, dtype=torch.long), "flash_attention_2")
    with pytest.raises(ValueError, match="dtype"):
        document_mask(torch.ones(2, 7, dtype=torch.long), "eager", dtype=torch.long)


def test_unsupported_models_are_refused_by_name():
    with pytest.raises(ValueError, match="unsupported head"):
        PackedModel(transformers.BertModel(_config("sdpa")))
    with pytest.raises(ValueError, match="decoder with an encoder's head"):
        PackedModel(transformers.BertForMaskedLM(_config("sdpa", is_decoder=True)))
    with pytest.raises(ValueError, match="encoder-decoder"):
        PackedModel(transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=VOCAB, d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16)))
    assert PackedModel(transformers.BertLMHeadModel(_config("sdpa", is_decoder=True))).head == "causal"
    with pytest.raises(ValueError, match="ALiBi"):
        PackedModel(transformers.BloomForCausalLM(transformers.BloomConfig(
            vocab_size=VOCAB, hidden_size=32, n_layer=1, n_head=2, attn_implementation="eager")))
    with pytest.raises(ValueError, match="single-label"):
        PackedModel(transformers.BertForSequenceClassification(_config("sdpa", num_labels=1)))
    with pytest.raises(ValueError, match="single-label"):
        PackedModel(transformers.BertForSequenceClassification(
            _config("sdpa", problem_type="multi_label_classification")))
    no_pooler = transformers.BertForSequenceClassification(_config("sdpa"))
    no_pooler.bert.pooler = None
    with pytest.raises(ValueError, match="pooler"):
        PackedModel(no_pooler)
    mean_pooler = transformers.BertForSequenceClassification(_config("sdpa"))
    mean_pooler.bert.pooler.forward = lambda hidden: mean_pooler.bert.pooler.dense(hidden.mean(1))
    with pytest.raises(ValueError, match="does not pool the first token"):
        PackedModel(mean_pooler)
    with pytest.raises(ValueError, match="model must be"):
        PackedModel(torch.nn.Linear(2, 2))


def test_bad_forward_arguments_are_named():
    packed, _ = _models("token", "sdpa", "cpu", train=False)
    _, batch = _packed(_samples("token"), "cpu")
    with pytest.raises(ValueError, match="attention_mask"):
        packed(**batch, attention_mask=block_diagonal_mask(batch["segment_ids"], "additive"))
    with pytest.raises(ValueError, match="position_ids"):
        packed(**{**batch, "position_ids": batch["position_ids"][:, :-1]})
    with pytest.raises(ValueError, match="labels"):
        packed(**{**batch, "labels": batch["labels"][:, :3]})
    seq_packed, _ = _models("sequence", "sdpa", "cpu", train=False)
    _, seq_batch = _packed(_samples("sequence"), "cpu")
    with pytest.raises(ValueError, match="labels"):
        seq_packed(**{**seq_batch, "labels": seq_batch["labels"][:, :1]})


@pytest.mark.parametrize("kind", ["sequence", "token", "causal"])
def test_an_ordinary_batch_goes_to_the_wrapped_model(kind):
    # Evaluation or inference on padded batches with the model accelerate(dataloader.pack=True) returned: no
    # segment_ids, so the wrapped model's own call and outputs (attention_mask, labels and token types included).
    torch.manual_seed(0)
    if kind == "causal":
        model = _decoder("llama", "sdpa").eval()
    else:
        model = HEADS[kind](_config("sdpa")).eval()
    packed = PackedModel(copy.deepcopy(model))
    ids = torch.randint(1, VOCAB, (3, 9))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    batch["attention_mask"][0, 6:] = 0
    if kind == "sequence":
        batch.update(labels=torch.tensor([0, 2, 1]), token_type_ids=torch.randint(0, 2, ids.shape))
    else:
        batch["labels"] = ids.masked_fill(batch["attention_mask"] == 0, LABEL_PAD)
    with torch.no_grad():
        got, want = packed(**batch), model(**batch)
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)
    torch.testing.assert_close(got.loss, want.loss, rtol=0, atol=0)


def test_the_wrapped_models_own_methods_are_reachable(tmp_path):
    # generate, save_pretrained and the rest act on the wrapped model, as users call them after accelerate().
    torch.manual_seed(0)
    model = _decoder("llama", "sdpa").eval()
    packed = PackedModel(copy.deepcopy(model)).eval()
    prompt = torch.randint(1, VOCAB, (2, 5))
    assert torch.equal(packed.generate(prompt, max_new_tokens=4, do_sample=False),
                       model.generate(prompt, max_new_tokens=4, do_sample=False))
    assert packed.get_input_embeddings() is packed.model.get_input_embeddings()
    packed.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    twin = copy.deepcopy(packed)  # the wrapper's own machinery is untouched by the forwarding
    assert isinstance(twin, PackedModel) and twin.model is not packed.model
    with pytest.raises(AttributeError, match="no_such_attribute"):
        packed.no_such_attribute


def _last_layer_queries(packed):
    """Records how many positions per row the last layer's query projection sees per call."""
    seen = []
    packed.model.base_model.encoder.layer[-1].attention.self.query.register_forward_hook(
        lambda module, args, out: seen.append(args[0].shape[-2]))
    return seen


def _full_twin(packed):
    """The same weights in a PackedModel whose last layer computes every position."""
    model = HEADS["sequence"](packed.config)
    model.load_state_dict(packed.model.state_dict())
    model.train(packed.training)
    return PackedModel(model, first_tokens_only=False)


def _grads(model):
    return {name: param.grad for name, param in model.model.named_parameters()}


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_sequence_head_last_layer_computes_only_the_first_tokens(backend):
    packed, _ = _models("sequence", backend, "cpu", train=True)
    full = _full_twin(packed)
    ds, batch = _packed(_samples("sequence", seed=2), "cpu")
    cut_queries, full_queries = _last_layer_queries(packed), _last_layer_queries(full)
    out, expected = packed(**batch), full(**batch)
    out["loss"].backward()
    expected["loss"].backward()
    assert cut_queries == [ds.max_segments] and full_queries == [ROW] and ds.max_segments < ROW
    torch.testing.assert_close(out["logits"], expected["logits"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["loss"], expected["loss"], rtol=1e-5, atol=1e-6)
    expected_grads = _grads(full)
    for name, grad in _grads(packed).items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


def test_calls_that_see_every_position_keep_the_full_last_layer():
    packed, _ = _models("sequence", "eager", "cpu", train=False)  # SDPA returns no attention weights
    full = _full_twin(packed)
    _, batch = _packed(_samples("sequence"), "cpu")
    queries = _last_layer_queries(packed)
    with torch.no_grad():
        out = packed(**batch, output_hidden_states=True)
        expected = full(**batch, output_hidden_states=True)
        assert out.hidden_states[-1].shape[1] == ROW
        torch.testing.assert_close(out.hidden_states[-1], expected.hidden_states[-1])
        torch.testing.assert_close(out.logits, expected.logits)
        assert packed(**batch, output_attentions=True).attentions[-1].shape[-2] == ROW
        # a call that fails inside the encoder leaves the last layer whole for the model's other callers
        with pytest.raises(Exception):
            packed(**{**batch, "token_type_ids": torch.full_like(batch["token_type_ids"], 99)})
        packed.model.bert(input_ids=batch["input_ids"])
    assert queries == [ROW, ROW, ROW]


def test_compiled_packed_classifier_matches_without_graph_breaks():
    import torch._dynamo

    packed, _ = _models("sequence", "sdpa", "cpu", train=True)
    full = _full_twin(packed)
    _, batch = _packed(_samples("sequence"), "cpu")
    torch._dynamo.reset()
    explained = torch._dynamo.explain(packed)(**batch)
    assert explained.graph_break_count == 0, explained.break_reasons
    queries = _last_layer_queries(packed)
    compiled = torch.compile(packed, dynamic=False)
    out, expected = compiled(**batch), full(**batch)
    out["loss"].backward()
    expected["loss"].backward()
    torch.testing.assert_close(out["logits"], expected["logits"], rtol=1e-4, atol=1e-5)
    expected_grads = _grads(full)
    for name, grad in _grads(packed).items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert packed._last_layer.rows is None
    packed(**batch)  # uncompiled again: the compiled call left nothing set
    assert queries[-1] == len(batch["seq_lens"][0])


# Causal language models: each sample's tokens see only their own earlier tokens, and the loss pairs a token's
# logits with the next token's label inside its sample only. The families users pack most: GPT-2 (learned
# positions, attention in its own module) and Llama (rotary positions, grouped key/value heads).
DECODERS = ("gpt2", "llama")


def _decoder(family, attn_implementation):
    if family == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, attn_implementation=attn_implementation))
    if family == "mistral":  # a sliding window longer than the rows (Mistral's 4096 over rows of 1024): cuts nothing
        return transformers.MistralForCausalLM(transformers.MistralConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64, max_position_embeddings=32, sliding_window=24,
            attn_implementation=attn_implementation))
    # heads of 16: Inductor's FlexAttention on CUDA refuses narrower ones ("embedding dimension ... at least 16")
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, max_position_embeddings=32, attn_implementation=attn_implementation))


def _decoder_pair(build, family, backend, device):
    """(PackedModel of build(family, backend), the same weights with eager attention as the reference)."""
    if backend == FLEX and family == "gpt2":
        pytest.skip("transformers runs GPT-2 without flex_attention (GPT2LMHeadModel._supports_flex_attn is False)")
    if backend == ACCEL_SDPA:
        unpadded_attention(transformers.BertForSequenceClassification(_config("sdpa")))  # registers it
    torch.manual_seed(0)
    model = build(family, backend).to(device).train()
    reference = build(family, "eager").to(device).train()
    reference.load_state_dict(model.state_dict())
    return PackedModel(model), reference


def _causal_models(family, backend, device):
    return _decoder_pair(_decoder, family, backend, device)


def _assert_same_grads(packed, reference, device):
    reference_params = dict(reference.named_parameters())
    for name, param in packed.model.named_parameters():
        torch.testing.assert_close(param.grad, reference_params[name].grad, rtol=1e-4 if device == "cpu" else 1e-3,
                                   atol=1e-6 if device == "cpu" else 1e-5, msg=lambda m: f"{name}: {m}")


def _causal_samples(seed=0):
    """Token ids as labels, the first tokens of some samples unlabelled (a prompt), every sample with a target."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for n in LENGTHS:
        ids = torch.randint(1, VOCAB, (n,), generator=g)
        labels = ids.clone()
        labels[:int(torch.randint(0, n - 1, (), generator=g))] = LABEL_PAD
        samples.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return samples


def _decoder_alone(reference, sample, device):
    return reference(input_ids=torch.tensor([sample["input_ids"]], device=device),
                     labels=torch.tensor([sample["labels"]], device=device))


def _causal_loss_weights(samples):
    """The model's loss is the mean over (token, next label) pairs with a label: each sample's share."""
    counts = [sum(label != LABEL_PAD for label in s["labels"][1:]) for s in samples]
    return [c / sum(counts) for c in counts]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", DECODERS)
def test_packed_causal_lm_outputs_match_each_sample_alone(family, backend, device):
    packed, reference = _causal_models(family, backend, device)
    samples = _causal_samples()
    ds, batch = _packed(samples, device)
    weights = _causal_loss_weights(samples)
    tol = _tolerance(device)
    with torch.no_grad():  # flex_attention also runs forward on the CPU
        out = packed(**batch)
        expected_loss = torch.zeros((), device=device)
        for r, _, offset, i in _placements(ds):
            alone = _decoder_alone(reference, samples[i], device)
            n = len(samples[i]["input_ids"])
            torch.testing.assert_close(out["logits"][r, offset:offset + n], alone.logits[0], **tol)
            expected_loss += weights[i] * alone.loss
    torch.testing.assert_close(out["loss"], expected_loss, **tol)
    assert batch["labels"][batch["position_ids"] == 0].ne(LABEL_PAD).any()  # first labels were there to ignore


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", DECODERS)
def test_packed_causal_lm_gradients_match_each_sample_alone(family, backend, device):
    if backend == FLEX and device == "cpu":
        pytest.skip(NO_CPU_FLEX_BACKWARD)
    packed, reference = _causal_models(family, backend, device)
    samples = _causal_samples(seed=1)
    _, batch = _packed(samples, device)
    packed(**batch)["loss"].backward()
    weights = _causal_loss_weights(samples)
    sum(w * _decoder_alone(reference, s, device).loss for w, s in zip(weights, samples)).backward()
    _assert_same_grads(packed, reference, device)


def test_causal_document_mask_by_hand():
    segments = torch.tensor([[1, 1, 2, 2, 2, 0]])
    expected = torch.tensor([[1, 0, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0, 0],
                             [0, 0, 1, 0, 0, 0],
                             [0, 0, 1, 1, 0, 0],
                             [0, 0, 1, 1, 1, 0],
                             [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(document_mask(segments, "sdpa", causal=True)[0, 0], expected)
    additive = document_mask(segments, "eager", causal=True)[0, 0]
    assert torch.equal(additive == 0, expected) and (additive[~expected] == torch.finfo(torch.float32).min).all()
    flex = document_mask(segments, FLEX, causal=True)
    zero = torch.zeros((), dtype=torch.long)
    assert torch.equal(flex.mask_mod(zero, zero, torch.arange(6).view(6, 1), torch.arange(6).view(1, 6)), expected)


# A decoder's sequence classifier (reward models, classification with GPT-2/Llama) scores each sample's last
# token: transformers' ForSequenceClassification of a decoder, `score` over the last non-pad token.
def _decoder_classifier(family, attn_implementation):
    decoder = _decoder(family, attn_implementation)
    config = decoder.config
    config.num_labels, config.pad_token_id = NUM_LABELS, 0
    cls = transformers.GPT2ForSequenceClassification if family == "gpt2" else transformers.LlamaForSequenceClassification
    return cls(config)


def _classifier_models(family, backend, device):
    packed, reference = _decoder_pair(_decoder_classifier, family, backend, device)
    assert packed.head == "last_token"
    return packed, reference


def _decoder_query_lengths(packed) -> list[int]:
    """Records how many positions per row the last layer's query projection (Llama) or fused projection (GPT-2)
    sees per call."""
    layer = packed.model.base_model.layers[-1].self_attn.q_proj if hasattr(packed.model.base_model, "layers") \
        else packed.model.base_model.h[-1].attn.c_attn
    seen = []
    layer.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[-2]))
    return seen


def _class_samples(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, VOCAB, (n,), generator=g).tolist(),
             "labels": int(torch.randint(0, NUM_LABELS, (), generator=g))} for n in LENGTHS]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", DECODERS)
def test_packed_decoder_classifier_matches_each_sample_alone(family, backend, device):
    packed, reference = _classifier_models(family, backend, device)
    samples = _class_samples()
    ds, batch = _packed(samples, device)
    tol = _tolerance(device)
    queries = _decoder_query_lengths(packed)
    with torch.no_grad():
        out = packed(**batch)
    # Llama's last layer computes each sample's last token alone (FlexAttention's BlockMask rebuilt over those
    # queries); GPT-2's block is not built like LlamaDecoderLayer and runs whole
    assert queries == ([ds.max_segments] if family == "llama" else [ROW])
    with torch.no_grad():
        for r, s, _, i in _placements(ds):
            torch.testing.assert_close(out["logits"][r, s], _decoder_alone(reference, samples[i], device).logits[0],
                                       **tol)
        expected = sum(_decoder_alone(reference, sample, device).loss for sample in samples) / len(samples)
    torch.testing.assert_close(out["loss"], expected, **tol)
    missing = batch["seq_lens"] == 0
    assert missing.any() and (out["logits"][missing] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["sdpa", FLEX])
@pytest.mark.parametrize("family", DECODERS)
def test_packed_decoder_classifier_gradients_match_each_sample_alone(family, backend, device):
    if backend == FLEX and device == "cpu":
        pytest.skip(NO_CPU_FLEX_BACKWARD)
    packed, reference = _classifier_models(family, backend, device)
    samples = _class_samples(seed=1)
    _, batch = _packed(samples, device)
    packed(**batch)["loss"].backward()
    (sum(_decoder_alone(reference, sample, device).loss for sample in samples) / len(samples)).backward()
    _assert_same_grads(packed, reference, device)


# Sliding-window attention: a token sees only the last W tokens of its sample. Mistral's layers all slide; Gemma's
# alternate local (sliding) and global layers, and take a mask per kind of layer. Samples longer than W = 4 and
# rows of 16 make the window matter (without it the logits were 0.13 (Mistral) and 0.45 (Gemma 2) off).
# Gemma 2 has no SDPA in transformers; Gemma 3's first layer is local, its second global. With "accel_sdpa" on the
# CPU every layer computes each sample alone (varlen_attention), the local ones cutting their window inside it.
SLIDING = [("mistral", "sdpa"), ("mistral", "eager"), ("mistral", ACCEL_SDPA), ("gemma2", "eager"), ("gemma3", "sdpa"),
           ("gemma3", ACCEL_SDPA)]


def _sliding_decoder(family, attn_implementation):
    switch = attn_implementation == ACCEL_SDPA
    settings = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32, sliding_window=4,
                    attn_implementation="sdpa" if switch else attn_implementation)
    if family == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**settings))
    elif family == "gemma2":
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**settings, head_dim=8))
    else:
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**settings, head_dim=8,
                                                                            sliding_window_pattern=2))
        assert model.config.layer_types == ["sliding_attention", "full_attention"]
    assert not switch or unpadded_attention(model)
    return model


@pytest.mark.parametrize("family, backend", SLIDING)
def test_packed_sliding_window_decoders_match_each_sample_alone(monkeypatch, family, backend):
    import accel.runtime.nn.varlen_attention as va

    torch.manual_seed(0)
    model = _sliding_decoder(family, backend).train()
    reference = _sliding_decoder(family, "eager").train()
    reference.load_state_dict(model.state_dict())
    packed = PackedModel(model)
    samples = _causal_samples(seed=2)
    assert max(len(s["input_ids"]) for s in samples) > model.config.sliding_window
    ds, batch = _packed(samples, "cpu")
    alone, flash = [], va._flash
    monkeypatch.setattr(va, "_flash", lambda q, *args, **kw: (alone.append(q.shape[2]), flash(q, *args, **kw))[1])
    out = packed(**batch)
    # every layer's samples (and each row's padding) one at a time: only under "accel_sdpa"
    runs = sum(len(row) for row in va.segment_runs(batch["segment_ids"]))
    assert len(alone) == (runs * model.config.num_hidden_layers if backend == ACCEL_SDPA else 0)
    out["loss"].backward()
    weights = _causal_loss_weights(samples)
    expected_loss = 0.0
    for r, _, offset, i in _placements(ds):
        alone = _decoder_alone(reference, samples[i], "cpu")
        n = len(samples[i]["input_ids"])
        torch.testing.assert_close(out["logits"][r, offset:offset + n], alone.logits[0], **_tolerance("cpu"))
        expected_loss = expected_loss + weights[i] * alone.loss
    torch.testing.assert_close(out["loss"], expected_loss, **_tolerance("cpu"))
    expected_loss.backward()
    _assert_same_grads(packed, reference, "cpu")


def test_sliding_window_document_mask_by_hand_and_the_configs_that_slide():
    segments = torch.tensor([[1, 1, 1, 1, 2, 2]])
    expected = torch.tensor([[1, 0, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0, 0],
                             [0, 1, 1, 0, 0, 0],
                             [0, 0, 1, 1, 0, 0],
                             [0, 0, 0, 0, 1, 0],
                             [0, 0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(document_mask(segments, "sdpa", causal=True, window=2)[0, 0], expected)
    flex = document_mask(segments, FLEX, causal=True, window=2)
    zero = torch.zeros((), dtype=torch.long)
    assert torch.equal(flex.mask_mod(zero, zero, torch.arange(6).view(6, 1), torch.arange(6).view(1, 6)), expected)
    for window, causal in ((0, True), (2, False), (True, True)):
        with pytest.raises(ValueError, match="window"):
            document_mask(segments, "sdpa", causal=causal, window=window)
    assert sliding_window(transformers.MistralConfig(sliding_window=8)) == (8, True)
    assert sliding_window(transformers.MistralConfig(sliding_window=8), 9) == (8, True)
    assert sliding_window(transformers.MistralConfig(sliding_window=8), 8) == (None, False)  # cuts nothing
    assert sliding_window(transformers.Gemma2Config(sliding_window=8, num_hidden_layers=2)) == (8, False)
    assert sliding_window(transformers.Qwen2Config(sliding_window=8, use_sliding_window=False)) == (None, False)
    assert sliding_window(transformers.LlamaConfig()) == (None, False)


def _varlen_model(family, plain_training=False, plain_causal=False):
    """A model with "accel_sdpa" attention and no attention dropout: a causal Llama or GPT-2, a BERT masked LM;
    told to compute its CPU training attention in plain products (compute.cpu_attention): `plain_training` the
    bidirectional one, `plain_causal` the causal one."""
    torch.manual_seed(0)
    if family == "bert":
        model = transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="sdpa"))
    else:
        model = _decoder(family, "sdpa")
    assert unpadded_attention(model, plain_training=plain_training, plain_causal=plain_causal)
    return model.train()


@pytest.mark.parametrize("markers", [(False, False), (True, True), (True, False), (False, True)],
                         ids=["flash", "plain", "plain_bidirectional", "plain_causal"])
@pytest.mark.parametrize("family", ["llama", "gpt2", "bert", "mistral"])
def test_accel_sdpa_computes_each_packed_sample_alone_on_the_cpu(monkeypatch, family, markers):
    """Packed rows with "accel_sdpa" attention on the CPU: each sample's attention is the flash kernel over that
    sample alone, or plain products where the model was told (accel.runtime.nn.varlen_attention: the work of the
    samples, not of the masked row; causal for the decoders, bidirectional for BERT), with the same logits, loss
    and gradients as the row's document mask gives (the attention told nothing of segments)."""
    import accel.runtime.nn.varlen_attention as va

    packed = PackedModel(_varlen_model(family, *markers))
    masked = PackedModel(copy.deepcopy(packed.model))
    masked._passes_kwargs = False  # the document mask alone
    runs = []
    flash = va._flash

    def counted(q, k, v, dropout, causal, **kwargs):
        runs.append((q.shape[2], causal))
        return flash(q, k, v, dropout, causal, **kwargs)

    monkeypatch.setattr(va, "_flash", counted)
    backwards = []
    plain_backward, flash_backward = va._plain_backward, va._flash_backward
    monkeypatch.setattr(va, "_plain_backward", lambda g, *args: (backwards.append((g.shape[2], "plain")),
                                                                  plain_backward(g, *args))[1])
    monkeypatch.setattr(va, "_flash_backward", lambda g, *args, **kwargs: (backwards.append((g.shape[2], "flash")),
                                                                            flash_backward(g, *args, **kwargs))[1])
    segment_ids = torch.tensor([[1] * 7 + [2] * 3 + [3] * 11 + [0] * 3])
    position_ids = torch.tensor([list(range(7)) + list(range(3)) + list(range(11)) + list(range(3))])
    ids = torch.randint(1, VOCAB, (1, 24), generator=torch.Generator().manual_seed(0))
    out = packed(input_ids=ids, position_ids=position_ids, segment_ids=segment_ids, labels=ids)
    causal = family != "bert"
    plain = markers[1] if causal else markers[0]  # the decoders follow the causal marker, BERT the other
    assert runs == [(7, causal), (3, causal), (11, causal), (3, causal)] * packed.config.num_hidden_layers
    runs.clear()
    want = masked(input_ids=ids, position_ids=position_ids, segment_ids=segment_ids, labels=ids)
    assert runs == []
    torch.testing.assert_close(out.logits, want.logits, rtol=1e-5, atol=1e-5)
    out.loss.backward()
    way = "plain" if plain else "flash"  # plain: each sample's backward in plain products
    assert backwards == [(7, way), (3, way), (11, way), (3, way)] * packed.config.num_hidden_layers
    backwards.clear()
    want.loss.backward()
    assert backwards == []
    _assert_same_grads(packed, masked.model, "cpu")


# DistilBERT's classifier: no pooler; pre_classifier, ReLU, dropout and classifier over the first token.
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_packed_distilbert_classifier_matches_each_sample_alone(backend):
    def distilbert(attn_implementation):
        torch.manual_seed(0)
        return transformers.DistilBertForSequenceClassification(transformers.DistilBertConfig(
            vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=32,
            num_labels=NUM_LABELS, dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0,
            attn_implementation=attn_implementation)).train()

    model, reference = distilbert(backend), distilbert("eager")
    packed = PackedModel(model)
    samples = [{k: v for k, v in s.items() if k != "token_type_ids"} for s in _samples("sequence", seed=3)]
    ds, batch = _packed(samples, "cpu")
    queries = []
    model.distilbert.transformer.layer[-1].attention.q_lin.register_forward_hook(
        lambda module, args, out: queries.append(args[0].shape[-2]))
    out = packed(**batch)
    out["loss"].backward()
    assert queries == [ds.max_segments]  # the last layer computes each sample's first token alone
    expected = 0
    for r, s, _, i in _placements(ds):
        alone = reference(input_ids=torch.tensor([samples[i]["input_ids"]]),
                          labels=torch.tensor([samples[i]["labels"]]))
        torch.testing.assert_close(out["logits"][r, s], alone.logits[0], **_tolerance("cpu"))
        expected = expected + alone.loss / len(samples)
    expected.backward()
    torch.testing.assert_close(out["loss"], expected, **_tolerance("cpu"))
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


# compute.cuda_packed_attention="varlen": on CUDA, "accel_sdpa" self-attention over packed rows by torch's FlashAttention varlen
# kernel, given static cu_seqlens. On the CPU the kernel is replaced by its plain reference
# (accel.runtime.nn.varlen_attention.reference_varlen_attn) and fp32 let through: what PackedModel and the attention
# function hand the kernel (offsets, causality, windows, grouped heads) is checked exactly; on a GPU, torch's own.
# each layer's FlashAttention window (left, right): causal (-1, 0), a window of 4 (3, 0), bidirectional (-1, -1)
VARLEN_FAMILIES = {"llama": [(-1, 0)] * 2, "mistral_window": [(3, 0)] * 2, "gemma3": [(3, 0), (-1, 0)],
                   "gpt2": [(-1, 0)] * 2, "bert": [(-1, -1)] * 2}


def _window_sizes(calls):
    return [kwargs["window_size"] for _, kwargs in calls]


def _cuda_varlen_model(family, attn_pdrop=0.0):
    """An "accel_sdpa" model: a Llama (grouped key/value heads), a Mistral whose window of 4 cuts inside rows of 16,
    a Gemma 3 with a local and a global layer, a GPT-2, a BERT masked LM."""
    torch.manual_seed(0)
    if family == "gemma3":
        return _sliding_decoder("gemma3", ACCEL_SDPA).train()
    if family == "mistral_window":
        model = _sliding_decoder("mistral", "sdpa")
    elif family == "gpt2" and attn_pdrop:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=32, attn_pdrop=attn_pdrop,
            attn_implementation="sdpa"))
    else:
        return _varlen_model(family)
    assert unpadded_attention(model)
    return model.train()


def _close_in_norm(got, want, tol, floor=0.0):
    """Within tol of want, relative to want's norm or floor where that is larger (16-bit kernels round element by
    element; a gradient that is 0 in exact arithmetic, as a key bias's under softmax, is rounding noise alone)."""
    assert (got.float() - want.float()).norm() <= tol * max(want.float().norm(), floor), (got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", list(VARLEN_FAMILIES))
def test_cuda_varlen_computes_each_packed_sample_alone(monkeypatch, family, device):
    """The kernel is called once a layer with each layer's window, and the packed model's logits, loss and gradients
    are the document mask's (CPU: exactly, fp32; CUDA: bf16 autocast, each within 16-bit rounding)."""
    calls = varlen_kernel(monkeypatch, device)
    model = _cuda_varlen_model(family).to(device)
    packed, masked = PackedModel(model, cuda_attention="varlen"), PackedModel(copy.deepcopy(model))
    masked._passes_kwargs = False  # the document mask alone
    samples = _samples("token") if family == "bert" else _causal_samples(seed=2)
    if family in ("mistral_window", "gemma3"):
        assert max(len(s["input_ids"]) for s in samples) > model.config.sliding_window
    _, batch = _packed(samples, device)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        out = packed(**batch)
        assert _window_sizes(calls) == VARLEN_FAMILIES[family]
        want = masked(**batch)
    assert len(calls) == model.config.num_hidden_layers  # the masked twin never calls it
    out.loss.backward()
    want.loss.backward()
    reference = dict(masked.model.named_parameters())
    if device == "cpu":
        torch.testing.assert_close(out.logits, want.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=1e-6)
        _assert_same_grads(packed, masked.model, "cpu")
        return
    _close_in_norm(out.logits, want.logits, 2e-2)
    _close_in_norm(out.loss, want.loss, 1e-2)
    largest = max(param.grad.float().norm() for param in masked.model.parameters())
    for name, param in packed.model.named_parameters():
        _close_in_norm(param.grad, reference[name].grad, 5e-2, floor=1e-3 * largest)


def test_cuda_varlen_keeps_the_mask_where_the_kernel_cannot_follow(monkeypatch):
    """Attention dropout while training (GPT-2's attn_pdrop): the kernel has none, so the mask stays; in eval the
    kernel computes. A batch without seq_lens keeps the mask too (no static offsets to give)."""
    calls = varlen_kernel(monkeypatch)
    packed = PackedModel(_cuda_varlen_model("gpt2", attn_pdrop=0.1), cuda_attention="varlen")
    _, batch = _packed(_causal_samples(), "cpu")
    packed(**batch)
    assert calls == []
    packed.eval()
    with torch.no_grad():
        packed(**batch)
        assert len(calls) == 2
        packed(**{k: v for k, v in batch.items() if k != "seq_lens"})
    assert len(calls) == 2
    with pytest.raises(ValueError, match="seq_lens must be \\[B=3, S\\]"):
        packed(**dict(batch, seq_lens=batch["seq_lens"][:1]))


def test_cuda_varlen_compiles_into_one_graph(monkeypatch):
    """A compiled packed Llama with the kernel route traces without graph breaks (the offsets are computed on the
    device; the kernel is an opaque op, here a custom op over the reference) and matches eager."""
    import torch._dynamo

    import accel.runtime.nn.varlen_attention as va

    varlen_kernel(monkeypatch)

    @torch.library.custom_op("accel_test::reference_varlen_attn", mutates_args=())
    def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_q: int, max_k: int,
               scale: float, left: int, right: int) -> torch.Tensor:
        return va.reference_varlen_attn(q, k, v, cu, cu, max_q, max_k, scale=scale, window_size=(left, right),
                                        enable_gqa=True)

    kernel.register_fake(lambda q, k, v, cu, max_q, max_k, scale, left, right: torch.empty_like(q))
    monkeypatch.setattr(va, "torch_varlen", lambda q, k, v, cu, cu_k, max_q, max_k, scale, window_size, **_:
                        kernel(q, k, v, cu, max_q, max_k, scale, *window_size))
    packed = PackedModel(_cuda_varlen_model("llama"), cuda_attention="varlen").eval()
    _, batch = _packed(_causal_samples(), "cpu")
    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(packed)(**batch)
        assert explained.graph_break_count == 0, explained.break_reasons
        out = torch.compile(packed, dynamic=False, fullgraph=True)(**batch)
        torch.testing.assert_close(out.logits, packed(**batch).logits, rtol=1e-4, atol=1e-5)
