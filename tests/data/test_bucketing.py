"""Bucketing: only bucket shapes ever appear; padding statistics against hand-computed values."""
import pytest
import torch

from accel.data import BucketBatchSampler, BucketingCollate, BucketingLoader
from accel.data.bucketing import bucket_for, bucket_padding_stats, pad_to_bucket

BUCKETS = (8, 16, 32, 64)


def _dataset(n, seed=0, max_len=64):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (n,), generator=g).tolist()
    return [{"input_ids": list(range(1, k + 1)), "labels": k % 3} for k in lengths]


def test_bucket_for():
    assert [bucket_for(n, BUCKETS) for n in (1, 8, 9, 33, 64)] == [8, 8, 16, 64, 64]
    assert bucket_for(100, BUCKETS, "truncate") == 64
    with pytest.raises(ValueError, match="length 65 is longer than the largest bucket 64"):
        bucket_for(65, BUCKETS)


def test_collate_pads_to_bucket_and_keeps_values():
    collate = BucketingCollate(BUCKETS, pad_token_id=7)
    batch = collate([{"input_ids": [1, 2, 3], "labels": [4, 5, 6], "token_type_ids": [0, 1, 1]},
                     {"input_ids": list(range(1, 11)), "labels": list(range(10)), "token_type_ids": [1] * 10}])
    assert batch["input_ids"].shape == (2, 16)
    assert batch["input_ids"][0].tolist() == [1, 2, 3] + [7] * 13
    assert batch["labels"][0].tolist() == [4, 5, 6] + [-100] * 13
    assert batch["token_type_ids"][0].tolist() == [0, 1, 1] + [0] * 13
    assert batch["attention_mask"].sum(1).tolist() == [3, 10]
    assert batch["input_ids"][1, :10].tolist() == list(range(1, 11))


def test_pad_to_bucket_counts_position_ids_on_over_the_padding():
    """A collated batch padded to its bucket: the pad values asked for, position ids 0, 1, ... over the padding
    (rows packed by position ids then hold one padding sample, as transformers finds samples), unless named."""
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8, 9]]), "position_ids": torch.tensor([[0, 1, 2, 0, 1]]),
             "labels": torch.tensor([[-100, 6, 7, -100, 9]]), "num_items": 3}
    padded = pad_to_bucket(batch, BUCKETS, {"input_ids": 0, "labels": -100})
    assert padded["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0, 0, 0]]
    assert padded["labels"].tolist() == [[-100, 6, 7, -100, 9, -100, -100, -100]]
    assert padded["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]] and padded["num_items"] == 3
    masking = pytest.importorskip("transformers.masking_utils")
    assert masking.find_packed_sequence_indices(padded["position_ids"]).tolist() == [[0, 0, 0, 1, 1, 2, 2, 2]]
    assert pad_to_bucket(batch, BUCKETS, {"position_ids": 0})["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 0, 0]]
    three = {"input_ids": batch["input_ids"], "position_ids": torch.arange(15).view(1, 5, 3)}  # a position a row each
    assert pad_to_bucket(three, BUCKETS, {})["position_ids"][0, 5:].eq(0).all()


def test_random_batches_only_ever_see_bucket_shapes():
    collate = BucketingCollate(BUCKETS)
    data = _dataset(400, seed=1)
    g = torch.Generator().manual_seed(2)
    shapes = set()
    for _ in range(200):
        size = int(torch.randint(1, 9, (1,), generator=g))
        picks = torch.randint(0, len(data), (size,), generator=g).tolist()
        shapes.add(collate([data[i] for i in picks])["input_ids"].shape[1])
    assert shapes <= set(BUCKETS)
    assert len(shapes) > 1  # the test data really spans several buckets


def test_loader_with_drop_last_has_fully_static_shapes():
    data = _dataset(300, seed=3)
    loader = BucketingLoader(data, batch_size=4, buckets=BUCKETS, drop_last=True, seed=5)
    shapes = {tuple(batch["input_ids"].shape) for batch in loader}
    assert shapes <= {(4, b) for b in BUCKETS}
    assert len(loader) == len(loader.batch_sampler.batches())


def test_overflow_error_names_sample_and_truncate_cuts():
    sample = {"input_ids": list(range(1, 71)), "labels": list(range(70))}
    with pytest.raises(ValueError, match=r"samples\[1\] has 70 tokens, more than the largest bucket 64"):
        BucketingCollate(BUCKETS)([{"input_ids": [1]}, {"input_ids": sample["input_ids"]}])
    batch = BucketingCollate(BUCKETS, overflow="truncate")([sample])
    assert batch["input_ids"].shape == (1, 64)
    assert batch["labels"][0].tolist() == list(range(64))


def test_pad_batch_to_keeps_batch_dimension_static():
    batch = BucketingCollate(BUCKETS, pad_batch_to=4)([{"input_ids": [1, 2], "labels": 1}])
    assert batch["input_ids"].shape == (4, 8)
    assert batch["labels"].tolist() == [1, -100, -100, -100]
    assert batch["attention_mask"][1:].sum().item() == 0


def test_collate_stats_hand_computed():
    collate = BucketingCollate(BUCKETS)
    collate([{"input_ids": [1] * 3}, {"input_ids": [1] * 10}])  # real 13, longest 2*10=20, bucket 2*16=32
    collate([{"input_ids": [1] * 8}])                             # real 8, longest 8, bucket 8
    s = collate.stats
    assert (s.real_tokens, s.slots_before, s.slots_after) == (21, 28, 40)
    assert s.pad_fraction_before == pytest.approx(7 / 28)
    assert s.pad_fraction_after == pytest.approx(19 / 40)


def test_sampler_yields_every_index_once_in_single_bucket_batches():
    lengths = [len(x["input_ids"]) for x in _dataset(250, seed=4)]
    sampler = BucketBatchSampler(lengths, batch_size=8, buckets=BUCKETS, seed=1)
    batches = list(sampler)
    assert len(batches) == len(sampler)
    assert sorted(i for b in batches for i in b) == list(range(250))
    for b in batches:
        assert len({bucket_for(lengths[i], BUCKETS) for i in b}) == 1
    sampler.set_epoch(1)
    assert list(sampler) != batches  # a new epoch reshuffles


def test_sampler_padding_stats_hand_computed():
    # lengths 3, 20, 5 in buckets (8, 32): batches by bucket -> [0, 2] (bucket 8) and [1] (bucket 32).
    sampler = BucketBatchSampler([3, 20, 5], batch_size=2, buckets=(8, 32), shuffle=False)
    assert sampler.batches() == [[0, 2], [1]]
    s = sampler.padding_stats()
    assert (s.real_tokens, s.slots_before, s.slots_after) == (28, 30, 48)
    stats = bucket_padding_stats([3, 20, 5], [[0, 1], [2]], (8, 32))  # random order: one mixed batch
    assert (stats.slots_before, stats.slots_after) == (45, 72)


def test_bad_arguments():
    with pytest.raises(ValueError, match="buckets"):
        BucketingCollate(())
    with pytest.raises(ValueError, match="overflow"):
        BucketingCollate(BUCKETS, overflow="drop")
    with pytest.raises(ValueError, match="batch_size"):
        BucketBatchSampler([1, 2], batch_size=0)
    with pytest.raises(ValueError, match=r"lengths\[1\]"):
        BucketBatchSampler([1, 99], batch_size=2, buckets=BUCKETS)
    with pytest.raises(ValueError, match="collate_fn"):
        BucketingLoader(_dataset(4), batch_size=2, collate_fn=list)


class TestCollateRefusesWhatItCannotBatch:
    """Nothing is dropped silently: each refusal names the sample and the field and says what is supported."""

    def test_a_field_only_a_later_sample_has(self):
        collate = BucketingCollate(BUCKETS)
        with pytest.raises(ValueError, match=r"samples\[1\] has 'labels', which samples\[0\] lacks"):
            collate([{"input_ids": [1, 2]}, {"input_ids": [3], "labels": [0]}])

    def test_a_field_a_later_sample_lacks(self):
        collate = BucketingCollate(BUCKETS)
        with pytest.raises(ValueError, match=r"samples\[2\] lacks 'labels', which samples\[0\] has"):
            collate([{"input_ids": [1], "labels": 1}, {"input_ids": [2], "labels": 0}, {"input_ids": [3]}])

    def test_attention_mask_may_differ_as_it_is_rebuilt(self):
        batch = BucketingCollate(BUCKETS)([{"input_ids": [1, 2], "attention_mask": [1, 1]}, {"input_ids": [3]}])
        assert batch["attention_mask"].tolist() == [[1, 1] + [0] * 6, [1] + [0] * 7]

    @pytest.mark.parametrize("value", ["a sentence", b"raw", ["a", "b"]])
    def test_text_fields(self, value):
        with pytest.raises(ValueError, match=r"samples\[0\]\['text'\] .*BucketingCollate batches numbers"):
            BucketingCollate(BUCKETS)([{"input_ids": [1, 2], "text": value}])

    def test_scalar_and_per_token_labels_mixed(self):
        collate = BucketingCollate(BUCKETS)
        with pytest.raises(ValueError, match=r"samples\[1\]\['labels'\] is per-token \(1-D\) but samples\[0\]"
                                             r"\['labels'\] is per-sample \(shape \(\)\)"):
            collate([{"input_ids": [1, 2], "labels": 3}, {"input_ids": [4, 5], "labels": [0, 1]}])
        with pytest.raises(ValueError, match=r"samples\[1\]\['labels'\] is per-sample"):
            collate([{"input_ids": [1, 2], "labels": [0, 1]}, {"input_ids": [4, 5], "labels": 3}])

    def test_per_sample_values_of_one_shape_are_stacked_and_of_two_refused(self):
        collate = BucketingCollate(BUCKETS)
        batch = collate([{"input_ids": [1], "pixel_values": torch.ones(2, 3)},
                         {"input_ids": [2, 3], "pixel_values": torch.zeros(2, 3)}])
        assert batch["pixel_values"].shape == (2, 2, 3)
        with pytest.raises(ValueError, match=r"samples\[1\]\['pixel_values'\] is per-sample \(shape \(3, 2\)\)"):
            collate([{"input_ids": [1], "pixel_values": torch.ones(2, 3)},
                     {"input_ids": [2], "pixel_values": torch.ones(3, 2)}])

    def test_empty_sequence_says_it_is_empty(self):
        with pytest.raises(ValueError, match=r"samples\[1\]\['input_ids'\] is empty"):
            BucketingCollate(BUCKETS)([{"input_ids": [1]}, {"input_ids": []}])

    def test_float_token_ids(self):
        with pytest.raises(ValueError, match=r"samples\[0\]\['input_ids'\] must be a 1-D sequence of ints, "
                                             r"got shape \(2,\) dtype float32"):
            BucketingCollate(BUCKETS)([{"input_ids": [1.0, 2.5]}])

    @pytest.mark.parametrize("bad", [3.7, 3.0, True, "3"])
    def test_non_int_lengths_rejected_not_truncated(self, bad):
        with pytest.raises(TypeError, match=r"lengths\[1\] must be an int"):
            BucketBatchSampler([2, bad], batch_size=1, buckets=BUCKETS)

    def test_integer_like_lengths_accepted(self):
        import numpy as np
        sampler = BucketBatchSampler([np.int64(3), torch.tensor(9), 2], batch_size=1, buckets=BUCKETS, shuffle=False)
        assert sampler.lengths == [3, 9, 2] and all(type(n) is int for n in sampler.lengths)
