"""PEFT models (LoRA) through accel: peft injects its adapters into the transformers model's own layers, so what
accel does to a transformers model (packing, "accel_sdpa" attention, the last layer's cut) applies to the model
inside the PeftModel, which is still what is called, trained and saved.

References are independent: each sample run alone through the same PEFT model (batch 1, no packing, no accel),
and peft's own save/load (PeftModel.from_pretrained over a fresh base model).
"""
import copy

import pytest
import torch
from torch.utils.data import DataLoader

import accel
from accel.compiler.packed import PackedModel
from accel.utils.transformers_models import transformers_model
from accel.utils.xla import xla_available
from tests.compiler.test_packed import (
    VOCAB,
    _causal_loss_weights,
    _causal_samples,
    _packed,
    _placements,
    _samples,
)

transformers = pytest.importorskip("transformers", reason="PEFT models wrap transformers models")
peft = pytest.importorskip("peft", reason="the PEFT tests need peft (pip install peft; in the test extra)")
TOLERANCE = dict(rtol=1e-4, atol=1e-5)


def _llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=64, attn_implementation="sdpa"))


def _bert_classifier():
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        attn_implementation="sdpa"))


def _lora(model, task, targets):
    torch.manual_seed(1)
    # init_lora_weights=False: B starts random, not zero, so the adapters change the outputs from the first call
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, task_type=task,
                                                      init_lora_weights=False))


def _lora_llama():
    return _lora(_llama(), "CAUSAL_LM", ["q_proj", "v_proj"])


def _lora_bert():
    return _lora(_bert_classifier(), "SEQ_CLS", ["query", "value"])


def _trainable_grads(model):
    return {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


def test_transformers_model_is_the_one_the_adapters_sit_in():
    lora = _lora_llama()
    assert type(transformers_model(lora)) is transformers.LlamaForCausalLM
    assert transformers_model(lora) is lora.get_base_model()
    plain = _llama()
    assert transformers_model(plain) is plain
    torch.manual_seed(0)
    prompt = peft.get_peft_model(_llama(), peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    assert transformers_model(prompt) is prompt  # virtual tokens: not the model's own call
    with pytest.raises(ValueError, match="adds virtual tokens to every call"):
        PackedModel(prompt)


def test_packed_lora_causal_lm_gives_each_sample_its_own_logits_loss_and_gradients():
    lora = _lora_llama().train()
    reference = copy.deepcopy(lora)
    packed = PackedModel(lora)
    samples = _causal_samples(seed=2)
    ds, batch = _packed(samples, "cpu")
    out = packed(**batch)
    out.loss.backward()
    expected = 0.0
    for r, _, offset, i in _placements(ds):
        ids = torch.tensor([samples[i]["input_ids"]])
        alone = reference(input_ids=ids, labels=torch.tensor([samples[i]["labels"]]))
        torch.testing.assert_close(out.logits[r, offset:offset + ids.shape[1]], alone.logits[0], **TOLERANCE)
        expected = expected + _causal_loss_weights(samples)[i] * alone.loss
    torch.testing.assert_close(out.loss, expected, **TOLERANCE)
    expected.backward()
    want = _trainable_grads(reference)
    assert set(want) == set(_trainable_grads(lora)) and all("lora_" in name for name in want)
    for name, grad in _trainable_grads(lora).items():
        torch.testing.assert_close(grad, want[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_packed_lora_classifier_pools_each_sample_and_cuts_the_last_layer():
    lora = _lora_bert().train()
    reference = copy.deepcopy(lora)
    packed = PackedModel(lora)
    samples = _samples("sequence")
    ds, batch = _packed(samples, "cpu")
    queries = []
    last = lora.get_base_model().bert.encoder.layer[-1].attention.self.query  # peft's LoRA layer
    assert isinstance(last, peft.tuners.lora.LoraLayer)
    last.register_forward_hook(lambda module, args, out: queries.append(args[0].shape[1]))
    out = packed(**batch)
    assert queries == [batch["seq_lens"].shape[1]]  # one query a sample in the last layer, not the row
    for r, s, _, i in _placements(ds):
        alone = reference(input_ids=torch.tensor([samples[i]["input_ids"]]),
                          token_type_ids=torch.tensor([samples[i]["token_type_ids"]]))
        torch.testing.assert_close(out.logits[r, s], alone.logits[0], **TOLERANCE)



def test_packed_lora_distilbert_classifier_runs_the_adapters_copies_of_its_head():
    """PEFT's SEQ_CLS task trains copies of the head (modules_to_save: ModulesToSaveWrapper, not nn.Linear); with
    pre_classifier among them too, PackedModel takes DistilBERT's head through the wrappers and their copies are
    what it runs and trains."""
    torch.manual_seed(0)
    base = transformers.DistilBertForSequenceClassification(transformers.DistilBertConfig(
        vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=32, num_labels=3,
        dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0, attn_implementation="sdpa"))
    torch.manual_seed(1)
    lora = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_lin", "v_lin"], task_type="SEQ_CLS",
                                                     modules_to_save=["pre_classifier"], init_lora_weights=False))
    head = lora.get_base_model()
    assert all(isinstance(getattr(head, n), peft.utils.other.ModulesToSaveWrapper)
               for n in ("pre_classifier", "classifier"))
    with torch.no_grad():  # the trained copies differ from the frozen originals, so using either one shows
        for n in ("pre_classifier", "classifier"):
            getattr(head, n).modules_to_save["default"].weight.mul_(-2.0)
    lora.train()
    reference = copy.deepcopy(lora)
    packed = PackedModel(lora)
    samples = [{k: v for k, v in s.items() if k != "token_type_ids"} for s in _samples("sequence", seed=4)]
    ds, batch = _packed(samples, "cpu")
    out = packed(**batch)
    out["loss"].backward()
    expected = 0.0
    for r, s, _, i in _placements(ds):
        alone = reference(input_ids=torch.tensor([samples[i]["input_ids"]]),
                          labels=torch.tensor([samples[i]["labels"]]))
        torch.testing.assert_close(out["logits"][r, s], alone.logits[0], **TOLERANCE)
        expected = expected + alone.loss / len(samples)
    torch.testing.assert_close(out["loss"], expected, **TOLERANCE)
    expected.backward()
    want, got = _trainable_grads(reference), _trainable_grads(lora)
    assert set(want) == set(got) and any("modules_to_save" in name for name in want)
    for name, grad in got.items():
        torch.testing.assert_close(grad, want[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")

def _lm_loader():
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(1, VOCAB, (int(n),), generator=g).tolist()}
            for n in torch.randint(5, 30, (16,), generator=g)]
    return DataLoader([dict(d, labels=d["input_ids"]) for d in data], batch_size=4)


@pytest.mark.parametrize("backend", ["cpu", pytest.param("xla", marks=[pytest.mark.slow, pytest.mark.skipif(
    not xla_available(), reason="the xla backend needs torch_xla")])])
def test_accelerate_trains_a_packed_lora_model_and_saves_its_adapters(tmp_path, backend):
    config = accel.Config(backend=backend)
    config.compute.kernels = False
    config.dataloader.pack, config.dataloader.max_length = True, 32
    lora = _lora_llama()
    frozen = {name: p.detach().clone() for name, p in lora.named_parameters() if not p.requires_grad}
    model, loader = accel.accelerate(lora, _lm_loader(), config)
    assert accel.unwrap_model(model) is lora
    assert lora.get_base_model().config._attn_implementation == "accel_sdpa"  # through the PEFT model
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for batch in loader:
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert all(torch.equal(p.cpu(), frozen[name]) for name, p in lora.named_parameters() if not p.requires_grad)
    accel.save_model(model, tmp_path / "adapters")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(p.name for p in (tmp_path / "adapters").iterdir())
    loaded = peft.PeftModel.from_pretrained(_llama(), tmp_path / "adapters").eval()
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = loaded(input_ids=ids).logits
        got = copy.deepcopy(lora).cpu().eval()(input_ids=ids).logits  # the trained adapters, outside accel's wrappers
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(want, _lora_llama().eval()(input_ids=ids).logits)  # the adapters did train


def test_accelerate_cuts_the_last_layer_of_a_lora_classifier_on_padded_batches():
    """Unpacked: first_token_only's switch hooks sit on the PEFT model (peft calls the model's forward, which
    would skip hooks on the model itself)."""
    config = accel.Config(backend="cpu")
    config.compute.compile = config.compute.kernels = False
    lora = _lora_bert()
    model = accel.accelerate(lora, config=config)
    queries = []
    lora.get_base_model().bert.encoder.layer[-1].attention.self.query.register_forward_hook(
        lambda module, args, out: queries.append(args[0].shape[1]))
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    logits = model(input_ids=ids).logits
    assert queries == [1]
    with torch.no_grad():
        reference = _lora_bert()
        reference.load_state_dict(lora.state_dict())
        torch.testing.assert_close(logits, reference(input_ids=ids).logits, **TOLERANCE)
