"""fuse_lm_loss: a causal LM's training loss and gradients without its logits equal the unchanged model's (a
copy with the same weights); every other call is the model's own; models whose head does more are refused."""
import copy
import pickle
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the fused loss replaces a transformers model's head")

import accel  # noqa: E402
from accel.compiler.fused_lm_loss import fuse_lm_loss, labelled_rows  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
VOCAB = 97


def _model(family: str, **extra):
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64)
    if family == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, **extra))
    if family == "gemma2":  # soft-caps its logits after lm_head
        return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**common, head_dim=8, **extra))
    if family == "mixtral":  # adds its router's auxiliary loss
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **common, num_local_experts=2, output_router_logits=True, **extra))
    if family == "granite":  # divides its logits by logits_scaling
        return transformers.GraniteForCausalLM(transformers.GraniteConfig(**common, logits_scaling=4.0, **extra))
    if family == "opt":  # a decoder of another build: learned positions, its own projection sizes
        return transformers.OPTForCausalLM(transformers.OPTConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
            word_embed_proj_dim=32, dropout=0.0, **extra))
    config_class, model_class = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                                 "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[family]
    return model_class(config_class(**common, **extra))


def _pair(family, device="cpu", **extra):
    """(fused model, the unchanged model with the same weights), both training: a causal LM, or a masked one."""
    model = (_masked_model(family, **extra) if family in MASKED_FAMILIES else _model(family, **extra)).to(device).train()
    reference = copy.deepcopy(model)
    assert fuse_lm_loss(model)
    return model, reference


def _batch(device="cpu"):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (3, 11), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt
    labels[2, 8:] = -100  # padding
    return ids.to(device), labels.to(device)


def _assert_same_grads(model, reference):
    want = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, want[name].grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _assert_same_training_call(model, reference, **batch):
    """A training call of the fused model: no logits, and the reference's output class, loss and gradients."""
    out, want = model(**batch), reference(**batch)
    assert out.logits is None and type(out) is type(want)
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=1e-6)
    out.loss.backward()
    want.loss.backward()
    _assert_same_grads(model, reference)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2", "opt"])
def test_training_loss_and_gradients_equal_the_models_own(family, device):
    model, reference = _pair(family, device)
    ids, labels = _batch(device)
    _assert_same_training_call(model, reference, input_ids=ids, labels=labels)


def test_tied_embeddings_get_both_gradients():
    model, reference = _pair("llama", tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids, labels = _batch()
    _assert_same_training_call(model, reference, input_ids=ids, labels=labels)


def test_attention_mask_shift_labels_and_items_in_batch():
    """transformers' conventions pass through: a padding mask, labels already shifted, and a loss summed over
    the tokens and divided by a count over all micro-batches (its gradient accumulation)."""
    model, reference = _pair("llama")
    ids, labels = _batch()
    mask = (labels != -100).long()
    mask[0] = 1
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    for kwargs in ({"labels": labels, "attention_mask": mask}, {"shift_labels": shifted, "labels": labels},
                   {"labels": labels, "num_items_in_batch": torch.tensor(50)}):
        torch.testing.assert_close(model(input_ids=ids, **kwargs).loss, reference(input_ids=ids, **kwargs).loss,
                                   rtol=1e-5, atol=1e-6)


def test_other_calls_are_the_models_own():
    model, reference = _pair("llama")
    ids, labels = _batch()
    with torch.no_grad():  # evaluation with labels: logits and loss
        out, want = model(input_ids=ids, labels=labels), reference(input_ids=ids, labels=labels)
        torch.testing.assert_close(out.logits, want.logits)
        torch.testing.assert_close(out.loss, want.loss)
    torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits)  # no labels
    tokens = model.generate(ids[:1, :4], max_new_tokens=3, do_sample=False)
    assert torch.equal(tokens, reference.generate(ids[:1, :4], max_new_tokens=3, do_sample=False))


def test_tuple_output_and_hidden_states():
    model, reference = _pair("llama")
    ids, labels = _batch()
    out = model(input_ids=ids, labels=labels, return_dict=False)
    assert isinstance(out, tuple)
    torch.testing.assert_close(out[0], reference(input_ids=ids, labels=labels).loss, rtol=1e-5, atol=1e-6)
    hidden = model(input_ids=ids, labels=labels, output_hidden_states=True).hidden_states
    want = reference(input_ids=ids, labels=labels, output_hidden_states=True).hidden_states
    assert len(hidden) == len(want)
    torch.testing.assert_close(hidden[-1], want[-1])


def test_hooks_on_the_head_send_calls_to_the_models_own_forward():
    model, _ = _pair("llama")
    calls = []
    model.lm_head.register_forward_hook(lambda module, args, out: calls.append(out.shape))
    ids, labels = _batch()
    out = model(input_ids=ids, labels=labels)
    assert calls == [(3, 11, VOCAB)] and out.logits is not None


@pytest.mark.parametrize("family, why", [("gemma2", "logits are not lm_head"), ("granite", "logits are not lm_head"),
                                         ("mixtral", "loss is not")])
def test_a_head_that_does_more_is_refused(family, why):
    model = _model(family).train()
    reference = copy.deepcopy(model)
    with pytest.warns(UserWarning, match=f"fused_lm_loss: .* keeps its own head and loss: its {why}"):
        assert not fuse_lm_loss(model)
    assert "forward" not in model.__dict__
    ids, labels = _batch()
    torch.testing.assert_close(model(input_ids=ids, labels=labels).loss, reference(input_ids=ids, labels=labels).loss)


def test_other_models_are_left_alone_with_a_warning():
    bert = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=37))
    for model in (bert, torch.nn.Linear(2, 2)):
        with pytest.warns(UserWarning, match="holds no transformers causal or masked language model"):
            assert not fuse_lm_loss(model)
        assert "forward" not in model.__dict__


class _UserWrapper(torch.nn.Module):
    """A module around the causal LM that calls it (as a user's model, or an adapter library's, does)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, **batch):
        return self.lm(**batch)


def test_a_causal_lm_inside_a_wrapper_gets_it():
    _, reference = _pair("llama")
    wrapper = _UserWrapper(_model("llama").train())
    assert fuse_lm_loss(wrapper) and "forward" in wrapper.lm.__dict__
    ids, labels = _batch()
    out = wrapper(input_ids=ids, labels=labels)
    assert out.logits is None
    torch.testing.assert_close(out.loss, reference(input_ids=ids, labels=labels).loss, rtol=1e-5, atol=1e-6)


def test_modes_are_restored_after_the_probe():
    model = _model("llama").train()
    model.model.layers[0].eval()  # a user's mixed modes (a frozen block)
    modes = {name: m.training for name, m in model.named_modules()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fuse_lm_loss(model) and fuse_lm_loss(model)  # once; the second call keeps it
    assert {name: m.training for name, m in model.named_modules()} == modes


def test_pickles_and_copies_with_its_state_dict_unchanged():
    model, reference = _pair("llama")
    assert model.state_dict().keys() == reference.state_dict().keys()
    clone = pickle.loads(pickle.dumps(model))
    ids, labels = _batch()
    assert clone(input_ids=ids, labels=labels).logits is None
    torch.testing.assert_close(clone(input_ids=ids, labels=labels).loss, model(input_ids=ids, labels=labels).loss)


LENGTHS = (5, 9, 12, 7, 16, 3, 10, 8)  # samples' lengths: 32-token packed rows, or the 16-token ones alone


def _causal_samples() -> list[dict]:
    g = torch.Generator().manual_seed(2)
    return [{"input_ids": ids, "labels": ids} for ids in (torch.randint(1, VOCAB, (n,), generator=g).tolist()
                                                          for n in LENGTHS)]


def _accelerated_losses(model: torch.nn.Module, data: list[dict], fused: bool, pack: bool, device: str = "cpu",
                        compiled: bool = True):
    """The losses of training `model` on `data` through accelerate() (compiled unless asked, SGD), packed or the 16-token
    samples alone. On CUDA CUDA graphs replay the compiled model, the fused loss's opaque op (and the compiled
    slice functions inside it) among its kernels."""
    config = accel.Config(backend=device)
    config.compute.kernels = False
    config.compute.compile = compiled
    config.memory.fused_lm_loss = fused
    if pack:
        config.dataloader.pack, config.dataloader.max_length = True, 32
        loader = torch.utils.data.DataLoader(data, batch_size=4)
    else:
        config.dataloader.max_length = 16
        data = [{k: torch.tensor(v) for k, v in d.items()} for d in data if len(d["input_ids"]) == 16]
        loader = torch.utils.data.DataLoader(data * 4, batch_size=2)
    model, loader = accel.accelerate(model.train(), loader, config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for batch in loader:
        out = model(**batch)
        assert (out.logits is None) == fused
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(out.loss.item())
    return losses


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pack", [False, True])
def test_accelerate_trains_the_same_compiled(pack, device):
    """memory.fused_lm_loss through accelerate() (compiled), with and without packed rows: the same losses
    step after step as the model's own head and loss."""
    fused, plain = (_accelerated_losses(_model("llama"), _causal_samples(), on, pack, device) for on in (True, False))
    assert len(fused) >= 2
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-5)


# Masked LMs: the model's own forward runs with its output embeddings passing their input through.

MASKED_FAMILIES = ("bert", "roberta", "distilbert", "albert", "modernbert")


def _masked_model(family: str):
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    if family == "distilbert":  # its head inline in the model's forward
        return transformers.DistilBertForMaskedLM(transformers.DistilBertConfig(
            vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=64, dropout=0.0,
            attention_dropout=0.0))
    if family == "modernbert":  # divides its loss by num_items_in_batch (transformers' loss_function)
        return transformers.ModernBertForMaskedLM(transformers.ModernBertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=64, global_attn_every_n_layers=1, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, cls_token_id=1, sep_token_id=2))
    if family == "albert":  # a factorised embedding: the decoder reads 16 features
        return transformers.AlbertForMaskedLM(transformers.AlbertConfig(**common, embedding_size=16))
    config_class, model_class = {"bert": (transformers.BertConfig, transformers.BertForMaskedLM),
                                 "roberta": (transformers.RobertaConfig, transformers.RobertaForMaskedLM)}[family]
    return model_class(config_class(**common))


def _masked_batch(device="cpu"):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (3, 12), generator=g)
    labels = torch.where(torch.rand(3, 12, generator=g) < 0.3, ids, -100)
    labels[0, 0] = ids[0, 0]  # at least one
    return ids.to(device), labels.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", MASKED_FAMILIES)
def test_masked_lm_loss_and_gradients_equal_the_models_own(family, device):
    model, reference = _pair(family, device)
    ids, labels = _masked_batch(device)
    _assert_same_training_call(model, reference, input_ids=ids, labels=labels)


def test_masked_lm_tied_decoder_gets_both_gradients_and_items_follow_the_model():
    """BERT ties its decoder to the word embeddings (both gradients reach the one tensor) and ignores
    num_items_in_batch (its loss is the mean); ModernBERT's loss divides by it: each as the model's own."""
    ids, labels = _masked_batch()
    for family in ("bert", "modernbert"):
        model, reference = _pair(family)
        if family == "bert":
            assert model.get_output_embeddings().weight is model.bert.embeddings.word_embeddings.weight
        _assert_same_training_call(model, reference, input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(50))


def test_masked_lm_other_calls_are_the_models_own():
    model, reference = _pair("bert")
    ids, labels = _masked_batch()
    with torch.no_grad():  # evaluation with labels: logits and loss
        out, want = model(input_ids=ids, labels=labels), reference(input_ids=ids, labels=labels)
        torch.testing.assert_close(out.logits, want.logits)
        torch.testing.assert_close(out.loss, want.loss)
    torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits)  # no labels
    hidden = torch.randn(2, 32)  # the decoder called by itself computes its product
    torch.testing.assert_close(model.get_output_embeddings()(hidden), reference.get_output_embeddings()(hidden))
    out = model(input_ids=ids, labels=labels, return_dict=False)
    assert isinstance(out, tuple)
    torch.testing.assert_close(out[0], want.loss, rtol=1e-5, atol=1e-6)


def test_masked_lm_head_hooked_or_replaced_is_the_models_own():
    model, reference = _pair("bert")
    ids, labels = _masked_batch()
    calls = []
    handle = model.get_output_embeddings().register_forward_hook(lambda module, args, out: calls.append(out.shape))
    out = model(input_ids=ids, labels=labels)
    assert calls == [(3, 12, VOCAB)] and out.logits is not None
    handle.remove()
    # resize_token_embeddings gives the tied decoder a larger weight: the fused loss reads it (equal to the model's
    # own forward, which a call without gradients runs)
    model.resize_token_embeddings(VOCAB + 3)
    out = model(input_ids=ids, labels=labels)
    with torch.no_grad():
        own = model(input_ids=ids, labels=labels)
    assert out.logits is None and own.logits.shape == (3, 12, VOCAB + 3)
    torch.testing.assert_close(out.loss, own.loss, rtol=1e-5, atol=1e-6)
    # a decoder module set in its place does not pass its input through: the model's own forward
    model.set_output_embeddings(torch.nn.Linear(32, VOCAB + 3))
    out = model(input_ids=ids, labels=labels)
    with torch.no_grad():
        own = model(input_ids=ids, labels=labels)
    assert out.logits.shape == (3, 12, VOCAB + 3)
    torch.testing.assert_close(out.loss, own.loss)


class _ScaledBertForMaskedLM(transformers.BertForMaskedLM):
    """A masked LM whose logits are not its decoder's product (scaled after it)."""

    __module__ = "transformers.models.bert.scaled"  # read as a transformers model, as a family of its own is

    def forward(self, *args, **kwargs):
        labels = kwargs.pop("labels", None)
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2.0
        if labels is not None:
            out.loss = torch.nn.functional.cross_entropy(out.logits.view(-1, VOCAB), labels.view(-1))
        return out


def test_masked_lm_whose_head_does_more_is_refused():
    model = _ScaledBertForMaskedLM(_masked_model("bert").config).train()
    with pytest.warns(UserWarning, match="fused_lm_loss: _ScaledBertForMaskedLM keeps its own head and loss: its logits are not"):
        assert not fuse_lm_loss(model)
    assert "forward" not in model.__dict__ and "forward" not in model.get_output_embeddings().__dict__


def test_masked_lm_pickles_and_copies():
    model, _ = _pair("bert")
    ids, labels = _masked_batch()
    for clone in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        out = clone(input_ids=ids, labels=labels)
        assert out.logits is None
        torch.testing.assert_close(out.loss, model(input_ids=ids, labels=labels).loss)


# On the CPU the last layer of a masked LM computes the labelled positions alone (BERT, RoBERTa, DistilBERT).

CUT_FAMILIES = {"bert": lambda m: m.bert.encoder.layer[-1].attention.self.query,
                "roberta": lambda m: m.roberta.encoder.layer[-1].attention.self.query,
                "distilbert": lambda m: m.distilbert.transformer.layer[-1].attention.q_lin}


def _queries_seen(model, family: str) -> list:
    """The sequence lengths the last layer's query projection is called with, call after call."""
    seen = []
    CUT_FAMILIES[family](model).register_forward_hook(lambda module, args, out: seen.append(args[0].shape[1]))
    return seen


def test_labelled_rows_rounds_the_most_labelled_row_up_to_an_eighth():
    labels = torch.full((2, 16), -100)
    labels[0, [1, 5, 9]] = 7
    labels[1, :5] = 7  # 5 labelled: 6, a multiple of 16 / 8
    assert labelled_rows(labels) == 6
    assert labelled_rows(torch.full((2, 16), -100)) == 2  # none labelled: one eighth
    assert labelled_rows(torch.full((2, 10), 3)) is None  # every position: the whole row
    labels = torch.full((1, 512), -100)
    labels[0, :77] = 1  # 15% of 512: 128
    assert labelled_rows(labels) == 128
    assert labelled_rows(None) is None and labelled_rows(torch.full((16,), -100)) is None


@pytest.mark.parametrize("family", sorted(CUT_FAMILIES))
def test_masked_lm_last_layer_computes_the_labelled_positions(family):
    model, reference = _pair(family)
    ids, labels = _masked_batch()
    seen = _queries_seen(model, family)
    _assert_same_training_call(model, reference, input_ids=ids, labels=labels)  # loss and every gradient
    assert seen == [labelled_rows(labels)] and seen[0] < ids.shape[1]
    # calls the cut would show are the full layer's: hidden states of every position, no gradients, no labels
    out = model(input_ids=ids, labels=labels, output_hidden_states=True)
    want = reference(input_ids=ids, labels=labels, output_hidden_states=True)
    torch.testing.assert_close(out.hidden_states[-1], want.hidden_states[-1])
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        model(input_ids=ids, labels=labels)
    model(input_ids=ids)
    assert seen == [labelled_rows(labels)] + [ids.shape[1]] * 3


def test_masked_lm_layers_that_cannot_be_cut_compute_every_position():
    """ALBERT shares its layers, ModernBERT's are built otherwise: the loss alone is fused. Labels off the CPU would
    have to be counted on their device (a wait each call): not cut either (tested where a GPU is)."""
    from accel.utils.instance_forward import installed_forward

    for family in ("albert", "modernbert"):
        model, _ = _pair(family)
        assert installed_forward(model).last_layer is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="labels on a GPU need one")
def test_masked_lm_labels_on_cuda_are_not_counted():
    model, reference = _pair("bert", "cuda")
    ids, labels = _masked_batch("cuda")
    seen = _queries_seen(model, "bert")
    _assert_same_training_call(model, reference, input_ids=ids, labels=labels)
    assert seen == [ids.shape[1]]


def test_accelerate_counts_the_labels_of_each_compiled_call():
    """Compiled, the count is made in front of the call: losses equal the model's own as the count changes, a graph
    for each count, and a count seen before runs its graph again."""
    torch.manual_seed(0)
    model = _masked_model("bert").train()
    reference = copy.deepcopy(model)
    config = accel.Config(backend="cpu")
    config.compute.kernels = False
    config.memory.fused_lm_loss = True
    model = accel.accelerate(model, config=config)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, VOCAB, (3, 16), generator=g)
    batches = []
    for labelled in (3, 9, 3):  # positions labelled in row 1: counts of 4, 10 and 4 again
        labels = torch.where(torch.rand(3, 16, generator=g) < 0.1, ids, -100)
        labels[1] = -100
        labels[1, :labelled] = ids[1, :labelled]
        batches.append(labels)
    assert [labelled_rows(labels) for labels in batches] == [4, 10, 4]
    for i, labels in enumerate(batches):
        with torch.compiler.set_stance("fail_on_recompile" if i == 2 else "default"):
            out = model(input_ids=ids, labels=labels)
        assert out.logits is None
        want = reference(input_ids=ids, labels=labels)
        torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=1e-6)
        out.loss.backward()
        want.loss.backward()
        _assert_same_grads(model, reference)
        model.zero_grad()
        reference.zero_grad()


def test_labels_are_counted_only_where_they_reach_the_masked_lm():
    """A user's module around the model may change the labels on their way: its compiled calls compute every position
    (the count would be of other labels); so do compiled calls of the model without the fused loss."""
    from accel.compiler.fused_lm_loss import count_labels_before_calls

    class Around(torch.nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, input_ids, labels):
            return self.lm(input_ids=input_ids, labels=labels)

    lm = _masked_model("bert")
    assert fuse_lm_loss(lm)
    around = Around(lm)
    around.compile()
    assert not count_labels_before_calls(around, lm)
    plain = _masked_model("bert")
    plain.compile()
    assert not count_labels_before_calls(plain, plain)
    lm.compile()
    assert count_labels_before_calls(lm, lm)


def _masked_samples() -> list[dict]:
    g = torch.Generator().manual_seed(4)
    data = []
    for n in LENGTHS:
        ids = torch.randint(3, VOCAB, (n,), generator=g)
        labels = torch.where(torch.rand(n, generator=g) < 0.3, ids, -100)
        labels[0] = ids[0]
        data.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return data


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pack", [False, True])
def test_accelerate_trains_a_masked_lm_the_same_compiled(pack, device):
    fused, plain = (_accelerated_losses(_masked_model("bert"), _masked_samples(), on, pack, device)
                    for on in (True, False))
    assert len(fused) >= 2
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-5)


def test_accelerate_trains_a_packed_masked_lm_the_same_uncompiled():
    """Uncompiled, the packed rows' labels are counted in the call; the cut last layer's queries take the rows of
    the packed document mask (per-sample attention takes whole rows)."""
    fused, plain = (_accelerated_losses(_masked_model("bert"), _masked_samples(), on, True, compiled=False)
                    for on in (True, False))
    assert len(fused) >= 2
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-5)


def test_a_second_masked_lm_runs_the_graphs_of_the_first():
    """The input-through flag and the fused forward are per model, their code shared: a masked LM built like the
    first (other weights) runs the first one's compiled graphs, with its own loss."""
    ids, labels = _masked_batch()
    for seed, stance in ((0, "default"), (1, "fail_on_recompile")):
        torch.manual_seed(seed)
        model = transformers.BertForMaskedLM(_masked_model("bert").config)
        reference = copy.deepcopy(model)
        config = accel.Config(backend="cpu")
        config.compute.kernels = False
        config.memory.fused_lm_loss = True
        model = accel.accelerate(model, config=config)
        with torch.compiler.set_stance(stance):
            out = model(input_ids=ids, labels=labels)
        assert out.logits is None
        torch.testing.assert_close(out.loss, reference(input_ids=ids, labels=labels).loss, rtol=1e-5, atol=1e-6)
