"""accel.compiler.problem_type: a compiled sequence classifier's config.problem_type is settled in front of its first
compiled call, by transformers' own rule (checked against what the plain model writes), so the second call does
not compile the model again; models with rules of their own are left alone."""
import pytest
import torch

import accel
from accel.compiler.problem_type import problem_type_for, settle_problem_type

transformers = pytest.importorskip("transformers", reason="the classifiers are transformers'")
VOCAB = 50


def _bert(num_labels=2):
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        num_labels=num_labels, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


@pytest.mark.parametrize("num_labels, labels", [
    (2, torch.tensor([0, 1])),                      # integer labels: single label
    (3, torch.tensor([0, 2])),                      # three classes
    (1, torch.tensor([0.5, -1.0])),                 # one label: regression
    (3, torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])),  # float labels: multi label
])
def test_the_rule_is_the_models_own(num_labels, labels):
    plain = _bert(num_labels)
    plain(input_ids=torch.ones(2, 5, dtype=torch.long), labels=labels)
    assert problem_type_for(num_labels, labels) == plain.config.problem_type


def test_the_second_call_of_a_compiled_classifier_compiles_nothing():
    from torch._dynamo.utils import counters

    config = accel.Config(backend="cpu")
    config.compute.bf16 = False
    model = accel.accelerate(_bert(), config=config)
    reference = _bert()
    ids, labels = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1)), torch.tensor([1, 0])
    first = model(input_ids=ids, labels=labels)
    assert model.config.problem_type == "single_label_classification"
    compiled = counters["frames"]["ok"]
    second = model(input_ids=ids, labels=labels)
    assert counters["frames"]["ok"] == compiled  # before: the guard on problem_type failed and all compiled again
    want = reference(input_ids=ids, labels=labels)
    for got in (first, second):
        torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    assert reference.config.problem_type == model.config.problem_type


def test_only_models_that_write_it_by_that_rule():
    class Compiled(torch.nn.Module):  # what settle_problem_type wraps: a compiled call
        def __init__(self, hf):
            super().__init__()
            self.hf = hf
            self.compile()

    bert = _bert()
    assert settle_problem_type(Compiled(bert), bert)  # inline rule
    torch.manual_seed(0)
    llama = transformers.LlamaForSequenceClassification(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32))
    assert settle_problem_type(Compiled(llama), llama)  # through transformers' ForSequenceClassification loss
    torch.manual_seed(0)
    deberta = transformers.DebertaV2ForSequenceClassification(transformers.DebertaV2Config(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32))
    assert not settle_problem_type(Compiled(deberta), deberta)  # its loss for problem_type None is its own
    given = _bert()
    given.config.problem_type = "multi_label_classification"
    assert not settle_problem_type(Compiled(given), given)  # the user's choice stays
    mlm = transformers.BertForMaskedLM(bert.config)
    assert not settle_problem_type(Compiled(mlm), mlm)
