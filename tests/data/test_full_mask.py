"""accel.data.full_mask: an all-ones attention mask is dropped on the host, and the model's outputs and gradients
are those of the call with the mask (the reference: the same model given the mask)."""
import pytest
import torch

from accel.data.full_mask import FullMaskDropper, reads_no_mask_as_full, without_full_mask

transformers = pytest.importorskip("transformers", reason="the models that read a missing mask as full")


def _bert(attention):
    config = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=37, max_position_embeddings=32, num_labels=3,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    config._attn_implementation = attention
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config).train()


def _batch(mask_dtype=torch.long):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 50, (3, 11), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones(3, 11, dtype=mask_dtype),
            "labels": torch.randint(0, 3, (3,), generator=g)}


@pytest.mark.parametrize("mask_dtype", [torch.long, torch.bool, torch.float32])
def test_a_mask_of_ones_is_dropped_and_the_rest_kept_as_is(mask_dtype):
    batch = _batch(mask_dtype)
    out = without_full_mask(batch)
    assert list(out) == ["input_ids", "labels"]
    assert out["input_ids"] is batch["input_ids"] and out["labels"] is batch["labels"]
    assert "attention_mask" in batch  # the loader's own batch is not changed


def test_masks_that_say_something_or_cannot_be_read_for_free_are_kept():
    padded = _batch()
    padded["attention_mask"][1, 7:] = 0
    assert without_full_mask(padded) is padded
    four_d = {"input_ids": torch.ones(2, 5), "attention_mask": torch.ones(2, 1, 5, 5)}  # not a padding mask
    assert without_full_mask(four_d) is four_d
    empty = {"input_ids": torch.ones(0, 5), "attention_mask": torch.ones(0, 5)}
    assert without_full_mask(empty) is empty
    no_mask = {"input_ids": torch.ones(2, 5)}
    assert without_full_mask(no_mask) is no_mask
    as_list = [torch.ones(2, 5), torch.ones(2, 5)]
    assert without_full_mask(as_list) is as_list
    if torch.cuda.is_available():  # reading a device mask would wait for the device
        on_device = {"attention_mask": torch.ones(2, 5, device="cuda")}
        assert without_full_mask(on_device) is on_device


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_the_model_without_the_mask_of_ones_gives_the_masked_outputs_and_gradients(attention):
    batch = _batch()
    masked, unmasked = _bert(attention), _bert(attention)
    expected = masked(**batch)
    got = unmasked(**without_full_mask(batch))
    expected.loss.backward()
    got.loss.backward()
    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-6, atol=1e-6)
    for (name, a), b in zip(unmasked.named_parameters(), masked.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_the_dropper_wraps_a_loader():
    padded = _batch()
    padded["attention_mask"][0, 5:] = 0
    loader = [_batch(), padded]
    wrapped = FullMaskDropper(loader)
    assert len(wrapped) == 2
    first, second = list(wrapped)
    assert "attention_mask" not in first and second is padded
    assert [len(b) for b in wrapped] == [2, 3]  # re-iterable


def test_only_transformers_models_that_default_the_mask_to_none_qualify():
    assert reads_no_mask_as_full(_bert("sdpa"))
    assert not reads_no_mask_as_full(torch.nn.Linear(2, 2))

    class NeedsItsMask(torch.nn.Module):
        config = object()

        def forward(self, input_ids, attention_mask):
            return input_ids * attention_mask

    assert not reads_no_mask_as_full(NeedsItsMask())
