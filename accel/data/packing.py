"""Sequence packing (the TorchAcc guide's Pack Dataset): several short samples share one fixed-length row.

Rows have one static shape, so the compiler path compiles once, and far fewer token slots are padding.
Each packed row carries what keeps its samples apart:
- position_ids restart at 0 for every sample;
- segment_ids number the samples 1, 2, ... (0 marks the padding tail);
- the collator turns segment ids into a block-diagonal attention mask ([B, L, L] bool, or the
  [B, 1, L, L] additive float mask a transformers model accepts as-is), or into cu_seqlens (int32
  cumulative lengths over the flattened batch, as flash-attention's varlen kernels take).
Padding tokens attend only to padding, never to a sample; that keeps every softmax row non-empty
(a fully masked row is NaN in SDPA) and their outputs are ignored anyway.

A sample that carries an "attention_mask" (a tokenizer's padding="max_length" output) is packed without the
positions its mask zeroes: only its real tokens take room in a row. Its ones must be one run (left or right
padding).

Labels: per-token labels (a list as long as input_ids) are packed like input_ids and padded with -100;
a scalar label per sample (an int, e.g. a class id) becomes a per-row vector `labels[max_segments]` in
sample order (the order of the segments), padded with -100.

A sample longer than the row length is an error by default (overflow="error"); overflow="truncate" keeps
its first max_length tokens and overflow="split" cuts it into max_length pieces, each packed as a sample
of its own (a scalar label is copied to every piece).
"""
from __future__ import annotations

import sys
import warnings
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, default_collate

from accel.data.padding_stats import PaddingStats, check_lengths, consecutive_batches, slots_padded_to_longest

LABEL_PAD = -100
_STRATEGIES = ("ffd", "greedy")
_OVERFLOWS = ("error", "truncate", "split")
_MASKS = ("additive", "bool", "cu_seqlens", "none")


def _first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    # A max segment tree over bins (all start empty) finds the leftmost bin with room in O(log n),
    # so first-fit stays fast for hundreds of thousands of samples.
    n = len(lengths)
    size = 1
    while size < max(n, 1):
        size *= 2
    room = [capacity] * (2 * size)
    rows: list[list[int]] = []
    for index in sorted(range(n), key=lambda i: -lengths[i]):
        need = lengths[index]
        node = 1
        while node < size:
            node = 2 * node if room[2 * node] >= need else 2 * node + 1
        bin_id = node - size
        if bin_id == len(rows):
            rows.append([])
        rows[bin_id].append(index)
        room[node] -= need
        node //= 2
        while node:
            room[node] = max(room[2 * node], room[2 * node + 1])
            node //= 2
    return rows


def _next_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    rows: list[list[int]] = []
    used = capacity
    for index, length in enumerate(lengths):
        if used + length > capacity:
            rows.append([])
            used = 0
        rows[-1].append(index)
        used += length
    return rows


def pack_lengths(lengths: Sequence[int], max_length: int, strategy: str = "ffd") -> list[list[int]]:
    """Group sample indices into rows whose lengths sum to at most max_length.

    strategy="ffd": first-fit decreasing (fewest rows; samples are reordered).
    strategy="greedy": next-fit in dataset order (keeps order; a few more rows).
    """
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"max_length must be an int >= 1, got {max_length!r}")
    if strategy not in _STRATEGIES:
        raise ValueError(f"strategy must be one of {_STRATEGIES}, got {strategy!r}")
    lengths = check_lengths(lengths)
    for i, length in enumerate(lengths):
        if length > max_length:
            raise ValueError(f"lengths[{i}] = {length} is outside 1..max_length={max_length}")
    if strategy == "ffd":
        return _first_fit_decreasing(lengths, max_length)
    return _next_fit(lengths, max_length)


def _as_long(values, what: str) -> torch.Tensor:
    if isinstance(values, (str, bytes)):
        raise ValueError(f"{what} is a {type(values).__name__}; packing needs a 1-D sequence of ints (tokenize it first)")
    try:
        t = torch.as_tensor(values)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{what} must be a 1-D sequence of ints ({exc})") from None
    if t.dim() == 1 and t.numel() == 0:
        raise ValueError(f"{what} is empty; every sample needs at least one token")
    if t.dim() != 1 or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"{what} must be a 1-D sequence of ints, got shape {tuple(t.shape)} dtype {t.dtype}")
    return t.to(torch.long)


def _real_tokens(mask: torch.Tensor, n: int, index: int) -> slice:
    """The positions a sample's attention mask keeps: its ones, which must be one run (left or right padding)."""
    if mask.numel() != n:
        raise ValueError(f"samples[{index}]['attention_mask'] must have {n} entries like input_ids")
    ones = mask.nonzero().flatten()
    if ones.numel() == 0:
        raise ValueError(f"samples[{index}]['attention_mask'] keeps no token")
    start, stop = int(ones[0]), int(ones[-1]) + 1
    if stop - start != ones.numel():
        raise ValueError(f"samples[{index}]['attention_mask'] must keep one run of tokens (left or right "
                         "padding), got gaps")
    return slice(start, stop)


def _is_scalar_label(label) -> bool:
    if isinstance(label, torch.Tensor):
        return label.dim() == 0
    return isinstance(label, int) and not isinstance(label, bool)


class PackedDataset(Dataset):
    """A Dataset of packed rows of length max_length built from variable-length samples.

    Args:
        samples: a sequence of mappings with "input_ids" and optionally "labels", "token_type_ids" and
            "attention_mask" (padding to leave out; see the module docstring for label forms).
        max_length: the row length.
        strategy: "ffd" (first-fit decreasing) or "greedy" (next-fit, dataset order).
        pad_token_id: id written into the padding tail of input_ids.
        overflow: "error", "truncate" or "split" for samples longer than max_length.

    Each item is a dict of tensors: input_ids, position_ids, segment_ids, token_type_ids (when the
    samples have them), labels (when they have them), seq_lens [max_segments] (0-padded).
    `rows[r]` lists the pieces in row r and `piece_source[p]` the sample each piece came from.
    """

    def __init__(self, samples: Sequence[Mapping], max_length: int, *, strategy: str = "ffd",
                 pad_token_id: int = 0, overflow: str = "error"):
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
            raise ValueError(f"max_length must be an int >= 1, got {max_length!r}")
        if overflow not in _OVERFLOWS:
            raise ValueError(f"overflow must be one of {_OVERFLOWS}, got {overflow!r}")
        if strategy not in _STRATEGIES:
            raise ValueError(f"strategy must be one of {_STRATEGIES}, got {strategy!r}")
        if len(samples) == 0:
            raise ValueError("samples must not be empty")
        if not isinstance(samples[0], Mapping):
            raise ValueError(f"samples[0] must be a mapping with 'input_ids', got {type(samples[0]).__name__}")
        self.max_length = max_length
        self.pad_token_id = pad_token_id
        self.strategy = strategy
        self.overflow = overflow
        self.has_token_types = "token_type_ids" in samples[0]
        self.has_labels = "labels" in samples[0]
        self.scalar_labels = self.has_labels and _is_scalar_label(samples[0]["labels"])

        self.pieces: list[dict] = []
        self.piece_source: list[int] = []
        self.sample_lengths: list[int] = []
        for index, sample in enumerate(samples):
            for piece in self._cut(index, self._validate(index, sample)):
                self.pieces.append(piece)
                self.piece_source.append(index)
        self.piece_lengths = [int(p["input_ids"].numel()) for p in self.pieces]
        self.rows = pack_lengths(self.piece_lengths, max_length, strategy)
        self.max_segments = max(len(row) for row in self.rows)

    def _validate(self, index: int, sample: Mapping) -> dict:
        if not isinstance(sample, Mapping) or "input_ids" not in sample:
            raise ValueError(f"samples[{index}] must be a mapping with 'input_ids'")
        out = {"input_ids": _as_long(sample["input_ids"], f"samples[{index}]['input_ids']")}
        n = out["input_ids"].numel()
        for key, expected in (("token_type_ids", self.has_token_types), ("labels", self.has_labels)):
            if (key in sample) != expected:
                what = f"lacks {key!r}, which samples[0] has" if expected else f"has {key!r}, which samples[0] lacks"
                raise ValueError(f"samples[{index}] {what}; every sample needs the same fields")
        if self.has_token_types:
            out["token_type_ids"] = _as_long(sample["token_type_ids"], f"samples[{index}]['token_type_ids']")
            if out["token_type_ids"].numel() != n:
                raise ValueError(f"samples[{index}]['token_type_ids'] must have {n} entries like input_ids")
        if self.has_labels:
            label = sample["labels"]
            if _is_scalar_label(label) != self.scalar_labels:
                raise ValueError(f"samples[{index}]['labels'] is {'a scalar' if _is_scalar_label(label) else 'per-token'} "
                                 f"but samples[0]['labels'] is {'a scalar' if self.scalar_labels else 'per-token'}; "
                                 "a batch mixes scalar and per-token labels")
            if self.scalar_labels:
                out["labels"] = int(label)
            else:
                out["labels"] = _as_long(label, f"samples[{index}]['labels']")
                if out["labels"].numel() != n:
                    raise ValueError(f"samples[{index}]['labels'] must have {n} per-token entries like input_ids")
        if "attention_mask" in sample:
            real = _real_tokens(_as_long(sample["attention_mask"], f"samples[{index}]['attention_mask']"), n, index)
            out = {k: v if isinstance(v, int) else v[real] for k, v in out.items()}
        self.sample_lengths.append(int(out["input_ids"].numel()))
        return out

    def _cut(self, index: int, sample: dict) -> list[dict]:
        n, cap = sample["input_ids"].numel(), self.max_length
        if n <= cap:
            return [sample]
        if self.overflow == "error":
            raise ValueError(f"samples[{index}] has {n} tokens, more than max_length={cap}; "
                             "pass overflow='truncate' or overflow='split'")
        starts = [0] if self.overflow == "truncate" else range(0, n, cap)
        pieces = []
        for start in starts:
            piece = {k: (v if isinstance(v, int) else v[start:start + cap]) for k, v in sample.items()}
            pieces.append(piece)
        return pieces

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, r: int) -> dict:
        L = self.max_length
        input_ids = torch.full((L,), self.pad_token_id, dtype=torch.long)
        position_ids = torch.zeros(L, dtype=torch.long)
        segment_ids = torch.zeros(L, dtype=torch.long)
        seq_lens = torch.zeros(self.max_segments, dtype=torch.int32)
        token_type_ids = torch.zeros(L, dtype=torch.long) if self.has_token_types else None
        if self.has_labels:
            size = self.max_segments if self.scalar_labels else L
            labels = torch.full((size,), LABEL_PAD, dtype=torch.long)
        offset = 0
        for seg, piece_index in enumerate(self.rows[r]):
            piece = self.pieces[piece_index]
            n = piece["input_ids"].numel()
            span = slice(offset, offset + n)
            input_ids[span] = piece["input_ids"]
            position_ids[span] = torch.arange(n)
            segment_ids[span] = seg + 1
            seq_lens[seg] = n
            if token_type_ids is not None:
                token_type_ids[span] = piece["token_type_ids"]
            if self.has_labels:
                if self.scalar_labels:
                    labels[seg] = piece["labels"]
                else:
                    labels[span] = piece["labels"]
            offset += n
        item = {"input_ids": input_ids, "position_ids": position_ids, "segment_ids": segment_ids,
                "seq_lens": seq_lens}
        if token_type_ids is not None:
            item["token_type_ids"] = token_type_ids
        if self.has_labels:
            item["labels"] = labels
        return item

    def padding_stats(self, batch_size: int) -> PaddingStats:
        """Padding if the samples were batched `batch_size` at a time in dataset order and padded to the
        longest of each batch, against the packed rows (rows * max_length slots). Split or truncated
        samples count as their pieces in both."""
        lengths = self.piece_lengths
        before = slots_padded_to_longest(lengths, consecutive_batches(len(lengths), batch_size))
        return PaddingStats(real_tokens=sum(lengths), slots_before=before,
                            slots_after=len(self.rows) * self.max_length)



def block_diagonal_mask(segment_ids: torch.Tensor, form: str = "bool", dtype: torch.dtype = torch.float32):
    """Attention mask that lets a token see only tokens of its own segment.

    segment_ids: [B, L] (or [L]) ints, one id per packed sample, 0 for padding (padding sees padding).
    form="bool": [B, L, L], True where attention is allowed.
    form="additive": [B, 1, L, L] in `dtype`, 0 where allowed and dtype's most negative value elsewhere;
    transformers models take a 4-D mask as-is, for both eager and SDPA attention.
    """
    if form not in ("bool", "additive"):
        raise ValueError(f"form must be 'bool' or 'additive', got {form!r}")
    if segment_ids.dim() == 1:
        segment_ids = segment_ids.unsqueeze(0)
    if segment_ids.dim() != 2:
        raise ValueError(f"segment_ids must be [B, L] or [L], got shape {tuple(segment_ids.shape)}")
    allowed = segment_ids.unsqueeze(-1) == segment_ids.unsqueeze(-2)
    if form == "bool":
        return allowed
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating dtype for an additive mask, got {dtype}")
    additive = torch.zeros(allowed.shape, dtype=dtype, device=segment_ids.device)
    additive.masked_fill_(~allowed, torch.finfo(dtype).min)
    return additive.unsqueeze(1)


def cu_seqlens_from_seq_lens(seq_lens: torch.Tensor, row_length: int) -> tuple[torch.Tensor, int]:
    """cu_seqlens (int32, starting at 0) and max_seqlen for the batch flattened to [B * row_length].

    seq_lens: [B, S] 0-padded sample lengths per row. Each row's padding tail counts as one more
    sequence, so the offsets cover every token and rows never run into each other.
    """
    if seq_lens.dim() != 2:
        raise ValueError(f"seq_lens must be [B, S], got shape {tuple(seq_lens.shape)}")
    real = seq_lens.cpu().clamp(min=0)
    for row, total in zip(seq_lens.tolist(), real.sum(dim=1).tolist()):
        if total > row_length:
            raise ValueError(f"seq_lens row {row} sums to more than row_length={row_length}")
    # static_cu_seqlens' offsets without its empty sequences (the repeated offsets)
    cu = torch.unique_consecutive(static_cu_seqlens(real, row_length))
    return cu, int(cu.diff().max())


def static_cu_seqlens(seq_lens: torch.Tensor, row_length: int) -> torch.Tensor:
    """cu_seqlens for the batch flattened to [B * row_length], of a shape fixed by seq_lens' [B, S]: int32
    [B * (S + 1) + 1], computed on seq_lens' device without reading it on the host (a compiled graph and a CUDA
    graph replay keep it). Every row gives S + 1 sequences, its samples then its padding tail, the missing ones
    empty (repeated offsets): the same boundaries as cu_seqlens_from_seq_lens, which leaves the empty ones out.

    Assumes seq_lens[b] lists row b's samples in order from its first token, as PackedDataset lays them out, and
    sums to at most row_length (not checked: that would read it on the host).
    """
    if seq_lens.dim() != 2:
        raise ValueError(f"seq_lens must be [B, S], got shape {tuple(seq_lens.shape)}")
    lengths = seq_lens.to(torch.int32)
    tails = row_length - lengths.sum(dim=1, keepdim=True, dtype=torch.int32)
    ends = torch.cat([lengths, tails], dim=1).flatten().cumsum(0, dtype=torch.int32)
    return F.pad(ends, (1, 0))


class PackedCollator:
    """collate_fn for PackedDataset: stacks rows and adds what keeps the samples apart.

    mask="additive": attention_mask [B, 1, L, L] float (feed a transformers model with **batch).
    mask="bool": attention_mask [B, L, L] bool.
    mask="cu_seqlens": cu_seqlens int32 [num_seqs + 1] and max_seqlen (int) for flash-attention varlen.
    mask="none": neither.
    segment_ids and seq_lens are bookkeeping a model's forward() does not take; they are dropped
    unless keep_segment_info=True.
    """

    def __init__(self, mask: str = "additive", dtype: torch.dtype = torch.float32, keep_segment_info: bool = False):
        if mask not in _MASKS:
            raise ValueError(f"mask must be one of {_MASKS}, got {mask!r}")
        self.mask = mask
        self.dtype = dtype
        self.keep_segment_info = keep_segment_info

    def __call__(self, rows: Sequence[Mapping]) -> dict:
        if len(rows) == 0:
            raise ValueError("rows must not be empty")
        batch = {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
        if self.mask in ("additive", "bool"):
            batch["attention_mask"] = block_diagonal_mask(batch["segment_ids"], self.mask, self.dtype)
        elif self.mask == "cu_seqlens":
            batch["cu_seqlens"], batch["max_seqlen"] = cu_seqlens_from_seq_lens(
                batch["seq_lens"], batch["input_ids"].shape[1])
        if not self.keep_segment_info:
            del batch["segment_ids"], batch["seq_lens"]
        return batch


class LanguageModelingRows:
    """collate_fn for PackedDataset rows through a transformers language-modeling collator
    (DataCollatorForLanguageModeling or a subclass; masked LM or, mlm=False, causal LM): the rows are packed by
    `packed` (keep_segment_info=True), then the collator masks their tokens and builds their labels as it does
    for a padded batch. Its work is per token, so a row's sample boundaries do not matter to it (special tokens
    and its tokenizer's padding are never masked); the rows' padding tails get no label whatever their id."""

    def __init__(self, packed: PackedCollator, lm_collator):
        if not packed.keep_segment_info:
            raise ValueError("packed: LanguageModelingRows needs a PackedCollator with keep_segment_info=True")
        self.packed = packed
        self.lm_collator = lm_collator

    def __call__(self, rows: Sequence[Mapping]) -> dict:
        batch = self.packed(rows)
        # A list of equal-length id tensors: the collator stacks them (nothing to pad) and masks.
        lm = self.lm_collator(list(batch["input_ids"]))
        batch["input_ids"] = lm["input_ids"]
        batch["labels"] = lm["labels"].masked_fill(batch["segment_ids"] == 0, LABEL_PAD)
        return batch


# transformers' collators that only stack or pad: packing does their work itself
_PADDING_COLLATORS = ("default_data_collator", "DataCollatorWithPadding", "DefaultDataCollator")


def _language_modeling_collator(collate_fn) -> bool:
    """Whether collate_fn is a transformers DataCollatorForLanguageModeling (or a subclass): it masks tokens and
    builds labels per token, which it can do on packed rows (LanguageModelingRows)."""
    collators = sys.modules.get("transformers.data.data_collator")  # loaded wherever such a collator was built
    cls = getattr(collators, "DataCollatorForLanguageModeling", None)
    return cls is not None and isinstance(collate_fn, cls)


def _only_pads(collate_fn) -> bool:
    """Whether a loader's collate_fn is known to do nothing but stack or pad samples."""
    if collate_fn is default_collate:
        return True
    name = getattr(collate_fn, "__name__", type(collate_fn).__name__)
    module = getattr(collate_fn, "__module__", type(collate_fn).__module__) or ""
    return module.startswith("transformers.") and name in _PADDING_COLLATORS


def packed_loader_like(loader, max_length: int, *, pad_token_id: int = 0, overflow: str = "truncate"):
    """A DataLoader of packed rows over the samples of `loader` (a DataLoader over a map-style dataset
    whose items are mappings with "input_ids", before collation), keeping its shuffling, workers,
    pinning and drop_last.

    Samples longer than max_length are truncated (overflow="truncate", with a warning that counts them) or cut
    into pieces (overflow="split"). Rows per batch keep the real tokens per step about where they were:
    round(batch_size * mean sample length / max_length), at least 1. Batches carry segment_ids (accel.compiler.packed.PackedModel
    builds the attention mask from them) and no attention_mask. The loader's own collate_fn batches samples, not
    rows: a transformers DataCollatorForLanguageModeling (masked or causal LM) masks and labels the packed rows'
    tokens instead (LanguageModelingRows); any other one not known to only stack or pad (torch's default,
    transformers' padding collators) is not used, with a warning, as what it did beyond padding is not done.
    """
    from torch.utils.data import DataLoader, RandomSampler

    if not isinstance(loader, DataLoader) or loader.batch_size is None:
        raise ValueError("dataloader: packing rebuilds the loader, so it must be a torch DataLoader with a "
                         f"batch_size over a map-style dataset, got {type(loader).__name__}")
    language_modeling = _language_modeling_collator(loader.collate_fn)
    if not language_modeling and not _only_pads(loader.collate_fn):
        name = getattr(loader.collate_fn, "__name__", type(loader.collate_fn).__name__)
        warnings.warn(f"dataloader.pack: the loader's collate_fn ({name}) is replaced by PackedCollator, which packs "
                      "the dataset's samples as they are; what the collate_fn did beyond padding (masking tokens for "
                      "a masked LM, building labels) is not done: do it in the dataset instead", stacklevel=3)
    dataset = loader.dataset
    try:
        samples = [dataset[i] for i in range(len(dataset))]
    except TypeError as exc:
        raise ValueError("dataloader: packing needs a map-style dataset (len() and [i]), got "
                         f"{type(dataset).__name__}") from exc
    packed = PackedDataset(samples, max_length, pad_token_id=pad_token_id, overflow=overflow)
    longer = [n for n in packed.sample_lengths if n > max_length]
    if longer and overflow != "split":
        warnings.warn(f"dataloader.pack: {len(longer)} of {len(samples)} samples are longer than max_length="
                      f"{max_length} and lose their last {sum(longer) - max_length * len(longer)} tokens in all "
                      "(overflow='truncate'); raise dataloader.max_length to keep them", stacklevel=3)
    mean_length = sum(packed.piece_lengths) / len(packed.piece_lengths)
    rows = max(1, round(loader.batch_size * mean_length / max_length))
    collate = PackedCollator(mask="none", keep_segment_info=True)
    if language_modeling:
        collate = LanguageModelingRows(collate, loader.collate_fn)
    return DataLoader(packed, batch_size=rows, shuffle=isinstance(loader.sampler, RandomSampler), collate_fn=collate,
                      num_workers=loader.num_workers, pin_memory=loader.pin_memory, drop_last=loader.drop_last)
