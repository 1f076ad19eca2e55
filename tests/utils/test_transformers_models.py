"""accel.utils.transformers_models.name_the_default_loss: GPT-2's causal LM loss named, so its forward computes the
same loss without transformers' per-call fallback warning, which breaks a torch.compile graph."""
import copy

import pytest
import torch

import accel
from accel.utils.transformers_models import name_the_default_loss

transformers = pytest.importorskip("transformers")


def _gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0)).eval()


def test_gpt2_gets_the_loss_transformers_falls_back_to_without_the_graph_break():
    model = _gpt2()
    assert model.loss_type is None  # what transformers reads from "GPT2LMHeadModel": nothing
    ids = torch.randint(0, 50, (2, 8))
    want = model(input_ids=ids, labels=ids).loss
    named = copy.deepcopy(model)
    name_the_default_loss(named)
    assert named.loss_type == "ForCausalLM"
    torch.testing.assert_close(named(input_ids=ids, labels=ids).loss, want, rtol=0, atol=0)
    explained = torch._dynamo.explain(named)(input_ids=ids, labels=ids)
    assert explained.graph_break_count == 0
    assert torch._dynamo.explain(model)(input_ids=ids, labels=ids).graph_break_count > 0  # the fallback's warning


def test_other_heads_and_modules_are_left_alone():
    bert = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32))
    before = bert.loss_type
    name_the_default_loss(bert)
    name_the_default_loss(torch.nn.Linear(2, 2))
    assert bert.loss_type == before == "ForMaskedLM"


def test_accelerate_names_it():
    config = accel.Config(backend="cpu")
    config.compute.compile = False
    assert accel.accelerate(_gpt2(), None, config).loss_type == "ForCausalLM"
