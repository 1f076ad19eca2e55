"""accel.compiler.batch_shapes: the loader of a compiled model warns once when its batches keep changing shape,
naming the dimensions; static-shape loaders (a shorter last batch included) and bucketed or uncompiled ones do not."""
import warnings

import pytest
import torch
import transformers

import accel
from accel.compiler.batch_shapes import ManyShapesWarning, ShapeWatch
from accel.utils.xla import xla_available


def _batches(lengths, batch=8):
    return [{"input_ids": torch.zeros(batch, n, dtype=torch.long), "labels": torch.zeros(batch, dtype=torch.long)}
            for n in lengths]


def test_a_third_shape_warns_once_naming_the_dimension():
    batches = _batches([37, 52, 64, 70, 37])
    watched = ShapeWatch(batches)
    got = []
    with pytest.warns(ManyShapesWarning) as caught:
        for batch in watched:
            got.append(batch)
            if len(got) == 2:
                assert not caught  # two shapes: nothing yet
    assert all(a is b for a, b in zip(got, batches)) and len(got) == 5  # the batches themselves
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "3 shapes so far" in message and "batch['input_ids'] dim 1: 37, 52, 64" in message
    assert "labels" not in message  # its shape never changed
    assert caught[0].filename == __file__  # the loop's line, not accel's
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(watched)  # later passes: said once already


def test_full_batches_and_a_shorter_last_one_over_epochs_do_not_warn():
    watched = ShapeWatch(_batches([128, 128, 128]) + [_batches([128], batch=3)[0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            assert len(list(watched)) == 4


def _padded(lengths):
    rows = [{"input_ids": torch.arange(1, n + 1), "labels": torch.tensor(0)} for n in lengths]

    def pad_to_longest(samples):
        ids = torch.nn.utils.rnn.pad_sequence([s["input_ids"] for s in samples], batch_first=True)
        return {"input_ids": ids, "attention_mask": (ids != 0).long(),
                "labels": torch.stack([s["labels"] for s in samples])}

    return torch.utils.data.DataLoader(rows, batch_size=2, collate_fn=pad_to_longest)


@pytest.mark.filterwarnings("ignore:dataloader.pack. the loader's collate_fn")  # packing replaces pad_to_longest
@pytest.mark.parametrize("settings, warns", [
    ({}, True),                                              # compiled, the loader's own shapes
    ({"dataloader.buckets": [16, 32]}, False),               # padded to two lengths
    ({"dataloader.pack": True, "dataloader.max_length": 32}, False),
    ({"compute.compile": False}, False),                     # eager: shapes cost nothing
    pytest.param({"backend": "xla"}, True, marks=pytest.mark.skipif(
        not xla_available(), reason="torch_xla is not installed")),  # XLA compiles per shape by nature
])
def test_accelerate_watches_the_loader_of_a_compiled_model(settings, warns):
    config = accel.Config(backend=settings.get("backend", "cpu"))
    for name, value in settings.items():
        if name == "backend":
            continue
        section, field = name.split(".")
        setattr(getattr(config, section), field, value)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32))
    _, loader = accel.accelerate(model, _padded([3, 9, 12, 20, 5, 30, 7, 25]), config)  # 4 lengths a pass
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        list(loader)  # the loader alone: the model need not run (nor compile) for the warning
    many = [w for w in caught if issubclass(w.category, ManyShapesWarning)]
    assert len(many) == (1 if warns else 0)


def _tiny_bert():
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32))


def _shape_warnings(caught):
    return [w for w in caught if issubclass(w.category, ManyShapesWarning)]


@pytest.mark.parametrize("backend", ["cpu", pytest.param("xla", marks=pytest.mark.skipif(
    not xla_available(), reason="torch_xla is not installed"))])  # compiled: before the compiled call; xla: a hook
def test_without_a_loader_the_model_calls_are_watched(backend):
    """accelerate(model) alone (a loop that keeps its own loader, transformers' Trainer): the third input shape
    warns once, naming the argument and dimension, at the caller's line; the outputs are the model's."""
    config = accel.Config(backend=backend)
    config.compute.compile = backend == "cpu"
    config.compute.bf16 = False  # fp32, to compare with the plain model
    model = accel.accelerate(_tiny_bert().eval(), config=config)
    device = next(model.parameters()).device
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in (5, 5, 9, 5, 9):  # two shapes, over and over: what full and last batches give
            model(input_ids=torch.ones(2, n, dtype=torch.long, device=device))
        assert not _shape_warnings(caught)
        for n in (12, 20, 12):
            logits = model(input_ids=torch.ones(2, n, dtype=torch.long, device=device)).logits
    many = _shape_warnings(caught)
    assert len(many) == 1
    message = str(many[0].message)
    assert "3 input shapes so far" in message and "input_ids dim 1: 5, 9, 12" in message
    assert "gave no loader" not in message and "given no loader" in message
    assert many[0].filename == __file__  # this test's line, not accel's or torch's
    reference = _tiny_bert().eval().to(device)
    reference.load_state_dict(accel.unwrap_model(model).state_dict())
    torch.testing.assert_close(logits, reference(input_ids=torch.ones(2, 12, dtype=torch.long, device=device)).logits,
                               rtol=1e-4, atol=1e-5)


def test_evaluation_calls_count_apart_from_training_ones():
    """transformers' Trainer evaluating between training steps: training's full and last batches and evaluation's
    (eval mode, no gradients) are graphs of their own, each loop two shapes: nothing to say. A third training
    shape still warns."""
    model = accel.accelerate(_tiny_bert(), config=accel.Config(backend="cpu"))
    ids = lambda b, n: torch.ones(b, n, dtype=torch.long)  # noqa: E731
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model.train()
            model(input_ids=ids(4, 8))
            model(input_ids=ids(3, 8))  # training's last batch
            model.eval()
            with torch.no_grad():
                model(input_ids=ids(4, 8))
                model(input_ids=ids(1, 8))  # evaluation's last batch
        assert not _shape_warnings(caught)
        model.train()
        model(input_ids=ids(4, 9))
    assert len(_shape_warnings(caught)) == 1


def test_calls_are_not_watched_once_a_loader_is_given_or_when_uncompiled():
    # static shapes from a later call's bucketed loader: three buckets are three shapes, not a warning
    config = accel.Config(backend="cpu")
    model = accel.accelerate(_tiny_bert(), config=config)
    config.dataloader.buckets = [8, 16, 32]
    _, loader = accel.accelerate(model, _padded([3, 5, 12, 10, 30, 20]), config)  # 3 buckets; ids < 40
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in loader:
            model(**batch)
    assert not _shape_warnings(caught)
    # eager: shapes cost nothing, nothing to say
    config = accel.Config(backend="cpu")
    config.compute.compile = False
    model = accel.accelerate(_tiny_bert(), config=config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in (3, 4, 5, 6):
            model(input_ids=torch.ones(1, n, dtype=torch.long))
    assert not _shape_warnings(caught)


def test_generate_calls_are_not_counted():
    """transformers' generate() grows the key/value cache by a token a call (run uncompiled,
    accel.compiler.decoding): those calls say nothing about the training shapes."""
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=40, n_embd=16, n_layer=1, n_head=2,
                                                               n_positions=64))
    model = accel.accelerate(gpt2, config=accel.Config(backend="cpu"))
    model.eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.generate(torch.ones(1, 4, dtype=torch.long), max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert not _shape_warnings(caught)
