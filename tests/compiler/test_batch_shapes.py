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
