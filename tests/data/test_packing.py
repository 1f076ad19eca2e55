"""Sequence packing: row layout against hand-built rows, and packed == alone on a real BERT model."""
import copy

import pytest
import torch

from accel.data import PackedCollator, PackedDataset, block_diagonal_mask, pack_lengths
from accel.data.packing import cu_seqlens_from_seq_lens, static_cu_seqlens


def _samples(lengths, seed=0, vocab=50):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(1, vocab, (n,), generator=g)
        out.append({"input_ids": ids.tolist(), "labels": (ids + 1).tolist(),
                    "token_type_ids": torch.randint(0, 2, (n,), generator=g).tolist()})
    return out


class TestPackLengths:
    def test_first_fit_decreasing_matches_hand_packing(self):
        # Sorted descending: 7(i1), 5(i3), 4(i0), 3(i4), 2(i2), 1(i5) into rows of 8:
        # 7 -> row0 [7]; 5 -> row1 [5]; 4 -> row2 [4]; 3 -> row1 [5,3]; 2 -> row2 [4,2]; 1 -> row0 [7,1]
        assert pack_lengths([4, 7, 2, 5, 3, 1], 8, "ffd") == [[1, 5], [3, 4], [0, 2]]

    def test_greedy_keeps_order(self):
        # next-fit: [4,2] (next 7 does not fit), [7], [5,3] (no room left for... 5+3=8), [1]
        assert pack_lengths([4, 2, 7, 5, 3, 1], 8, "greedy") == [[0, 1], [2], [3, 4], [5]]

    @pytest.mark.parametrize("strategy", ["ffd", "greedy"])
    def test_every_sample_once_and_rows_fit(self, strategy):
        lengths = torch.randint(1, 65, (500,), generator=torch.Generator().manual_seed(1)).tolist()
        rows = pack_lengths(lengths, 64, strategy)
        assert sorted(i for row in rows for i in row) == list(range(500))
        assert all(sum(lengths[i] for i in row) <= 64 for row in rows)
        assert len(rows) >= -(-sum(lengths) // 64)  # no packing beats the volume bound
        if strategy == "ffd":
            # First fit never leaves two rows that could have been merged.
            fill = sorted(sum(lengths[i] for i in row) for row in rows)
            assert fill[0] + fill[1] > 64

    def test_bad_arguments(self):
        with pytest.raises(ValueError, match="max_length"):
            pack_lengths([1], 0)
        with pytest.raises(ValueError, match="strategy"):
            pack_lengths([1], 4, "best")
        with pytest.raises(ValueError, match=r"lengths\[1\] = 9"):
            pack_lengths([1, 9], 8)


class TestPackedRows:
    def test_row_layout_matches_hand_built_row(self):
        samples = [{"input_ids": [11, 12, 13], "labels": [1, 2, 3], "token_type_ids": [0, 0, 1]},
                   {"input_ids": [21, 22], "labels": [4, 5], "token_type_ids": [1, 1]}]
        ds = PackedDataset(samples, 7, strategy="greedy", pad_token_id=99)
        assert len(ds) == 1
        row = ds[0]
        assert row["input_ids"].tolist() == [11, 12, 13, 21, 22, 99, 99]
        assert row["position_ids"].tolist() == [0, 1, 2, 0, 1, 0, 0]
        assert row["segment_ids"].tolist() == [1, 1, 1, 2, 2, 0, 0]
        assert row["labels"].tolist() == [1, 2, 3, 4, 5, -100, -100]
        assert row["token_type_ids"].tolist() == [0, 0, 1, 1, 1, 0, 0]
        assert row["seq_lens"].tolist() == [3, 2]

    def test_scalar_labels_become_a_per_segment_vector(self):
        samples = [{"input_ids": [1, 2], "labels": 3}, {"input_ids": [4], "labels": 0},
                   {"input_ids": [5, 6, 7], "labels": 1}]
        ds = PackedDataset(samples, 4, strategy="greedy")
        assert ds.max_segments == 2
        assert [ds[r]["labels"].tolist() for r in range(len(ds))] == [[3, 0], [1, -100]]

    def test_mixed_label_kinds_rejected(self):
        with pytest.raises(ValueError, match=r"samples\[1\]\['labels'\] is per-token but samples\[0\]\['labels'\] "
                                             r"is a scalar; a batch mixes scalar and per-token labels"):
            PackedDataset([{"input_ids": [1], "labels": 0}, {"input_ids": [1], "labels": [0]}], 4)

    def test_per_token_labels_must_match_length(self):
        with pytest.raises(ValueError, match=r"samples\[0\]\['labels'\] must have 2"):
            PackedDataset([{"input_ids": [1, 2], "labels": [0]}], 4)

    def test_overflow_error_names_sample(self):
        with pytest.raises(ValueError, match=r"samples\[1\] has 9 tokens, more than max_length=8"):
            PackedDataset([{"input_ids": [1]}, {"input_ids": list(range(1, 10))}], 8)

    def test_overflow_truncate_and_split(self):
        long = {"input_ids": list(range(1, 11)), "labels": list(range(101, 111))}
        cut = PackedDataset([long], 4, overflow="truncate")
        assert len(cut) == 1 and cut[0]["input_ids"].tolist() == [1, 2, 3, 4]
        split = PackedDataset([long], 4, overflow="split", strategy="greedy")
        assert [split[r]["input_ids"].tolist() for r in range(len(split))] == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 0, 0]]
        assert split[2]["labels"].tolist() == [109, 110, -100, -100]
        assert split[1]["position_ids"].tolist() == [0, 1, 2, 3]
        assert split.piece_source == [0, 0, 0]

    def test_each_token_appears_once(self):
        samples = _samples(torch.randint(1, 33, (60,), generator=torch.Generator().manual_seed(2)).tolist())
        ds = PackedDataset(samples, 32)
        seen = []
        for r in range(len(ds)):
            row = ds[r]
            for seg, piece in enumerate(ds.rows[r]):
                span = row["segment_ids"] == seg + 1
                assert row["input_ids"][span].tolist() == samples[ds.piece_source[piece]]["input_ids"]
                seen.append(ds.piece_source[piece])
        assert sorted(seen) == list(range(60))

    def test_padding_stats_hand_computed(self):
        # lengths 3, 1, 4, 2 in batches of 2: padded to longest -> 2*3 + 2*4 = 14 slots, 10 real.
        # packed into rows of 5 (ffd): [4,1], [3,2] -> 2 rows * 5 = 10 slots.
        ds = PackedDataset([{"input_ids": [1] * n} for n in (3, 1, 4, 2)], 5)
        stats = ds.padding_stats(batch_size=2)
        assert (stats.real_tokens, stats.slots_before, stats.slots_after) == (10, 14, 10)
        assert stats.pad_fraction_before == pytest.approx(4 / 14)
        assert stats.pad_fraction_after == 0.0


class TestMasks:
    def test_block_diagonal_bool_and_additive(self):
        seg = torch.tensor([[1, 1, 2, 0]])
        expected = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]], dtype=torch.bool)
        assert torch.equal(block_diagonal_mask(seg, "bool")[0], expected)
        add = block_diagonal_mask(seg, "additive", torch.float32)
        assert add.shape == (1, 1, 4, 4)
        assert torch.equal(add[0, 0] == 0, expected)
        assert add[0, 0, 0, 2].item() == torch.finfo(torch.float32).min

    def test_cu_seqlens_flatten_rows_with_padding_tails(self):
        cu, max_len = cu_seqlens_from_seq_lens(torch.tensor([[3, 2, 0], [4, 0, 0]]), 6)
        # row 0: 3, 2, tail 1; row 1: 4, tail 2 -> offsets 0,3,5,6,10,12
        assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 5, 6, 10, 12] and max_len == 4

    def test_static_cu_seqlens_has_the_same_offsets_in_a_fixed_shape(self):
        """The on-device offsets: S + 1 per row whatever the row holds (empty samples repeat an offset), at the
        boundaries of the dataset's own samples and rows; no host read, so compiled graphs keep them."""
        ds = PackedDataset(_samples([5, 3, 7, 2, 8, 1]), 8)
        seq_lens = torch.stack([ds[r]["seq_lens"] for r in range(len(ds))])
        cu = static_cu_seqlens(seq_lens, 8)
        assert cu.dtype == torch.int32 and cu.shape == (len(ds) * (ds.max_segments + 1) + 1,)
        boundaries, start = {0}, 0
        for row in ds.rows:  # each sample's end, then the row's end
            end = start
            for piece in row:
                end += ds.piece_lengths[piece]
                boundaries.add(end)
            start += 8
            boundaries.add(start)
        assert torch.unique_consecutive(cu).tolist() == sorted(boundaries)
        # by hand: row 0 holds 3 and 2 (tail 1), row 1 a full row of 6, row 2 nothing
        cu = static_cu_seqlens(torch.tensor([[3, 2], [6, 0], [0, 0]]), 6)
        assert cu.tolist() == [0, 3, 5, 6, 12, 12, 12, 12, 12, 18]
        traced = torch.compile(static_cu_seqlens, fullgraph=True, dynamic=False)
        assert torch.equal(traced(torch.tensor([[3, 2], [6, 0], [0, 0]]), 6), cu)
        with pytest.raises(ValueError, match="seq_lens must be \\[B, S\\]"):
            static_cu_seqlens(torch.tensor([3, 2]), 6)

    def test_collator_outputs_model_inputs(self):
        ds = PackedDataset(_samples([5, 3, 7, 2]), 8)
        batch = PackedCollator("additive")([ds[r] for r in range(len(ds))])
        assert set(batch) == {"input_ids", "labels", "token_type_ids", "position_ids", "attention_mask"}
        assert batch["attention_mask"].shape == (len(ds), 1, 8, 8)
        flash = PackedCollator("cu_seqlens")([ds[r] for r in range(len(ds))])
        assert flash["cu_seqlens"][-1].item() == len(ds) * 8
        with pytest.raises(ValueError, match="mask"):
            PackedCollator("causal")


def _tiny_bert(attn_implementation):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=64, type_vocab_size=2,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                     attn_implementation=attn_implementation)
    torch.manual_seed(0)
    model = transformers.BertModel(config, add_pooling_layer=False).eval()
    assert model.config._attn_implementation == attn_implementation
    return model


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_packed_bert_matches_each_sample_alone(attn_implementation):
    model = _tiny_bert(attn_implementation)
    samples = _samples([9, 4, 13, 6, 3, 11, 7], seed=3)
    ds = PackedDataset(samples, 24)
    assert len(ds) < len(samples)  # several samples really share rows
    batch = PackedCollator("additive")([ds[r] for r in range(len(ds))])
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"], token_type_ids=batch["token_type_ids"]).last_hidden_state
        checked = 0
        for r, row in enumerate(ds.rows):
            offset = 0
            for piece in row:
                sample = samples[ds.piece_source[piece]]
                n = len(sample["input_ids"])
                alone = model(input_ids=torch.tensor([sample["input_ids"]]),
                              token_type_ids=torch.tensor([sample["token_type_ids"]])).last_hidden_state[0]
                torch.testing.assert_close(packed[r, offset:offset + n], alone, atol=1e-5, rtol=1e-5)
                offset += n
                checked += 1
    assert checked == len(samples)


def test_packed_bert_bool_mask_with_sdpa():
    model = _tiny_bert("sdpa")
    samples = _samples([5, 8, 3], seed=4)
    ds = PackedDataset(samples, 16, strategy="greedy")
    batch = PackedCollator("bool")([ds[0]])
    with torch.no_grad():
        # A bool mask goes to SDPA as [B, 1, L, L] (True = attend).
        packed = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"][:, None],
                       position_ids=batch["position_ids"], token_type_ids=batch["token_type_ids"]).last_hidden_state
        alone = model(input_ids=torch.tensor([samples[1]["input_ids"]]),
                      token_type_ids=torch.tensor([samples[1]["token_type_ids"]])).last_hidden_state[0]
    torch.testing.assert_close(packed[0, 5:13], alone, atol=1e-5, rtol=1e-5)


class TestPackingRefusals:
    def test_empty_sample_says_it_is_empty(self):
        with pytest.raises(ValueError, match=r"samples\[1\]\['input_ids'\] is empty"):
            PackedDataset([{"input_ids": [1]}, {"input_ids": []}], 4)

    def test_text_instead_of_token_ids(self):
        with pytest.raises(ValueError, match=r"samples\[0\]\['input_ids'\] is a str; packing needs a 1-D sequence"):
            PackedDataset([{"input_ids": "hello"}], 4)

    def test_field_only_a_later_sample_has(self):
        with pytest.raises(ValueError, match=r"samples\[1\] has 'labels', which samples\[0\] lacks"):
            PackedDataset([{"input_ids": [1]}, {"input_ids": [2], "labels": [0]}], 4)

    @pytest.mark.parametrize("bad", [2.5, 2.0])
    def test_float_lengths_rejected(self, bad):
        from accel.data.packing import pack_lengths
        with pytest.raises(TypeError, match=r"lengths\[0\] must be an int"):
            pack_lengths([bad, 1], 4)


def test_samples_padded_by_a_tokenizer_pack_only_their_real_tokens():
    """padding="max_length" samples carry an attention_mask: its zeroed positions take no room in a row."""
    real = [{"input_ids": [5, 6, 7], "token_type_ids": [0, 0, 1], "labels": [5, 6, 7]},
            {"input_ids": [8, 9, 4, 3], "token_type_ids": [1, 1, 0, 0], "labels": [8, -100, 4, 3]}]
    padded = [  # right padding, then left padding, to 6 tokens
        {"input_ids": [5, 6, 7, 0, 0, 0], "token_type_ids": [0, 0, 1, 0, 0, 0], "labels": [5, 6, 7, -100, -100, -100],
         "attention_mask": [1, 1, 1, 0, 0, 0]},
        {"input_ids": [0, 0, 8, 9, 4, 3], "token_type_ids": [0, 0, 1, 1, 0, 0], "labels": [-100, -100, 8, -100, 4, 3],
         "attention_mask": [0, 0, 1, 1, 1, 1]}]
    expected, got = PackedDataset(real, 8), PackedDataset(padded, 8)
    assert got.piece_lengths == [3, 4] and got.rows == expected.rows
    for r in range(len(expected)):
        for key, value in expected[r].items():
            assert torch.equal(got[r][key], value), key


@pytest.mark.parametrize("mask, message", [
    ([1, 0, 1], "must keep one run"), ([0, 0, 0], "keeps no token"), ([1, 1], "must have 3 entries")])
def test_attention_masks_that_do_not_mark_one_run_of_tokens_are_refused(mask, message):
    with pytest.raises(ValueError, match=rf"samples\[0\]\['attention_mask'\] {message}"):
        PackedDataset([{"input_ids": [5, 6, 7], "attention_mask": mask}], 8)


def test_packing_warns_when_the_loaders_collate_fn_did_more_than_pad():
    import warnings

    from accel.data.packing import packed_loader_like

    transformers = pytest.importorskip("transformers")
    samples = [{"input_ids": torch.arange(1, n + 1)} for n in (3, 5, 2)]

    class Tokenizer:  # what DataCollatorWithPadding needs of one
        pad_token_id = 0
    padding = transformers.DataCollatorWithPadding(Tokenizer())
    masked_lm = transformers.DataCollatorForLanguageModeling(_word_tokenizer(transformers, 10))  # applied to rows
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for collate_fn in (None, transformers.default_data_collator, padding, masked_lm):
            packed_loader_like(torch.utils.data.DataLoader(samples, batch_size=2, collate_fn=collate_fn), 8)

    def mask_tokens(batch):  # a masked-LM collator: its masking would be lost
        return batch
    with pytest.warns(UserWarning, match=r"collate_fn \(mask_tokens\) is replaced by PackedCollator"):
        packed_loader_like(torch.utils.data.DataLoader(samples, batch_size=2, collate_fn=mask_tokens), 8)


def test_packing_a_loader_counts_the_tokens_truncation_drops():
    from accel.data.packing import packed_loader_like

    samples = [{"input_ids": torch.arange(1, n + 1)} for n in (3, 12, 10, 5)]
    with pytest.warns(UserWarning, match=r"2 of 4 samples are longer than max_length=8 and lose their last 6 tokens"):
        loader = packed_loader_like(torch.utils.data.DataLoader(samples, batch_size=2), 8)
    assert sorted(loader.dataset.piece_lengths) == [3, 5, 8, 8]


def _word_tokenizer(transformers, words: int, pad: str = "[PAD]"):
    """A BERT tokenizer over [PAD] [UNK] [CLS] [SEP] [MASK] w0 .. w{words-1} (ids 0-4, then 5 on), built in
    memory; pad names its padding token."""
    vocab = {token: i for i, token in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])}
    vocab.update({f"w{i}": 5 + i for i in range(words)})
    return transformers.BertTokenizerFast(vocab=vocab, pad_token=pad)


def _cls_sep_samples(n: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 30, (n,), generator=g).tolist()
    return [{"input_ids": torch.cat([torch.tensor([2]), torch.randint(5, 105, (k,), generator=g), torch.tensor([3])])}
            for k in lengths]


def test_masked_lm_collator_masks_the_packed_rows():
    # A DataCollatorForLanguageModeling given to a packed loader masks the rows' tokens as it masks a padded
    # batch: the same output as the collator on those rows under the same seed, labels only on the tokens it
    # chose (never [CLS], [SEP] or a row's padding tail), the original token as the label.
    from accel.data.packing import packed_loader_like

    transformers = pytest.importorskip("transformers")
    collator = transformers.DataCollatorForLanguageModeling(_word_tokenizer(transformers, 100), mlm_probability=0.3)
    loader = packed_loader_like(torch.utils.data.DataLoader(_cls_sep_samples(80), batch_size=8, collate_fn=collator), 64)
    rows = loader.dataset
    chosen = eligible = 0
    for k, batch in enumerate(loader):
        members = [rows[r] for r in range(k * loader.batch_size, k * loader.batch_size + len(batch["input_ids"]))]
        original = torch.stack([row["input_ids"] for row in members])
        tail, special = batch["segment_ids"] == 0, (original == 2) | (original == 3)
        labeled = batch["labels"] != -100
        assert not (labeled & (tail | special)).any()
        assert torch.equal(batch["labels"][labeled], original[labeled])
        assert torch.equal(batch["input_ids"][~labeled], original[~labeled])  # unchosen tokens are kept
        chosen, eligible = chosen + int(labeled.sum()), eligible + int((~tail & ~special).sum())
        # the collator's own output on the rows, under the same seed
        torch.manual_seed(k)
        got = loader.collate_fn(members)
        torch.manual_seed(k)
        want = collator(list(original))
        assert torch.equal(got["input_ids"], want["input_ids"])
        assert torch.equal(got["labels"], want["labels"].masked_fill(tail, -100))
    assert abs(chosen / eligible - 0.3) < 0.05  # of ~1300 eligible tokens


def test_causal_lm_collator_labels_the_packed_rows_but_not_their_tails():
    # mlm=False: every token of a sample is its own label (the model shifts them); the rows' tails, padded with
    # packing's id 0, get none although the tokenizer pads with another id.
    from accel.data.packing import packed_loader_like

    transformers = pytest.importorskip("transformers")
    collator = transformers.DataCollatorForLanguageModeling(_word_tokenizer(transformers, 100, pad="[UNK]"), mlm=False)
    loader = packed_loader_like(torch.utils.data.DataLoader(_cls_sep_samples(20), batch_size=4, collate_fn=collator), 64)
    tails = 0
    for batch in loader:
        tail = batch["segment_ids"] == 0
        assert torch.equal(batch["labels"], batch["input_ids"].masked_fill(tail, -100))
        tails += int(tail.sum())
    assert tails > 0


def test_accelerate_packs_a_masked_lm_loader():
    # The loop's usual masked-LM loader (transformers' collator) through dataloader.pack: every batch is packed
    # rows of max_length with the collator's labels, and the model's loss over them is the loss of the samples
    # run one at a time on the same masked tokens.
    import accel
    from accel.data.packing import LABEL_PAD

    transformers = pytest.importorskip("transformers")
    collator = transformers.DataCollatorForLanguageModeling(_word_tokenizer(transformers, 100))
    config = transformers.BertConfig(vocab_size=105, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    reference = transformers.BertForMaskedLM(config).eval()
    settings = accel.Config(backend="cpu")
    settings.compute.compile, settings.compute.bf16 = False, False
    settings.dataloader.pack, settings.dataloader.max_length = True, 64
    model, loader = accel.accelerate(
        copy.deepcopy(reference), torch.utils.data.DataLoader(_cls_sep_samples(24), batch_size=6, collate_fn=collator),
        settings)
    for batch in loader:
        assert batch["input_ids"].shape[1] == 64 and (batch["labels"] != LABEL_PAD).any()
        loss = model(**batch).loss
        per_token = []
        for ids, labels, segments in zip(batch["input_ids"], batch["labels"], batch["segment_ids"]):
            for s in set(segments.tolist()) - {0}:  # segment 0: the tail
                keep = segments == s
                logits = reference(input_ids=ids[keep][None]).logits[0]
                per_token.append(torch.nn.functional.cross_entropy(logits, labels[keep], reduction="none",
                                                                   ignore_index=LABEL_PAD)[labels[keep] != LABEL_PAD])
        torch.testing.assert_close(loss, torch.cat(per_token).mean(), rtol=1e-5, atol=1e-5)
    # and an ordinary padded batch (evaluation) goes to the model as it is
    ids = torch.nn.utils.rnn.pad_sequence([s["input_ids"] for s in _cls_sep_samples(3, seed=5)], batch_first=True)
    ordinary = {"input_ids": ids, "attention_mask": (ids != 0).long()}
    torch.testing.assert_close(model(**ordinary).logits, reference(**ordinary).logits, rtol=1e-5, atol=1e-5)
