"""accel.gather_for_metrics with 2 processes (gloo, CPU): the evaluation loader accelerate() shards gives, gathered
batch by batch, every sample exactly once in the sampler's order (its repeats dropped), the same on every rank;
shapes that differ between ranks raise on both; one process gets its data back; bad loaders are named."""
from __future__ import annotations

import datetime
import json
import os
import traceback

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accel
from tests._spawn import run_processes

WORLD, SAMPLES, BATCH = 2, 11, 3  # 6 positions a rank, the last one of rank 1 a repeat
DEADLINE_S = 180


def _eval_loader(shuffle: bool):
    data = TensorDataset(torch.arange(SAMPLES, dtype=torch.float32).unsqueeze(1), torch.arange(SAMPLES))
    config = accel.Config(backend="cpu")
    config.compute.compile = False
    _, loader = accel.accelerate(nn.Linear(1, 1), DataLoader(data, batch_size=BATCH, shuffle=shuffle), config)
    return loader


def _worker(rank: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out, 'rendezvous')}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=120))
    result = {}
    try:
        for shuffle in (False, True):
            loader = _eval_loader(shuffle)
            seen, doubled = [], []
            for x, index in loader:
                got = accel.gather_for_metrics({"index": index, "pair": (x.squeeze(1) * 2, index)}, loader)
                seen += got["index"].tolist()
                doubled += got["pair"][0].tolist()
                assert torch.equal(got["pair"][1], got["index"])
            result[f"shuffle={shuffle}"] = {"seen": seen, "doubled": doubled,
                                            "order": list(loader.resumable.loader.sampler)}
        loader = _eval_loader(False)
        _, index = next(iter(loader))
        try:  # rank 1 gives one row less: both ranks must raise, neither may hang
            accel.gather_for_metrics(index if rank == 0 else index[:-1], loader)
            result["mismatch"] = "no error"
        except ValueError as e:
            result["mismatch"] = str(e)
        # per-token values of batches padded to their own longest sample: 4 tokens on rank 0, 6 on rank 1
        tokens = index.unsqueeze(1).expand(-1, 4 + 2 * rank).contiguous()
        result["padded"] = accel.gather_for_metrics(tokens, loader, pad_index=-1).tolist()
    except Exception:  # noqa: BLE001 - reported by the test
        result["error"] = traceback.format_exc()
    finally:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("gather"))
    run_processes(_worker, (out,), WORLD, DEADLINE_S)
    per_rank = []
    for rank in range(WORLD):
        with open(os.path.join(out, f"rank{rank}.json")) as f:
            per_rank.append(json.load(f))
    for rank, result in enumerate(per_rank):
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
    return per_rank


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")
@pytest.mark.parametrize("shuffle", [False, True])
def test_every_sample_once_in_the_samplers_order_on_every_rank(results, shuffle):
    key = f"shuffle={shuffle}"
    first = results[0][key]
    # The sampler's global order: rank r's k-th sample is position k * WORLD + r; positions >= SAMPLES repeat.
    ranks = [result[key]["order"] for result in results]
    positions = [ranks[r][k] for k in range(len(ranks[0])) for r in range(WORLD)][:SAMPLES]
    assert first["seen"] == positions and sorted(first["seen"]) == list(range(SAMPLES))
    assert first["doubled"] == [2.0 * i for i in positions]
    if not shuffle:
        assert first["seen"] == list(range(SAMPLES))  # the dataset's order
    assert all(result[key] == {**first, "order": result[key]["order"]} for result in results)


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")
def test_shapes_that_differ_between_ranks_raise_on_every_rank_or_are_padded(results):
    # rows of the first batch: positions 0..5, rank 0's even ones (4 tokens, padded with -1), rank 1's odd (6)
    want = [[i] * 4 + [-1, -1] if i % 2 == 0 else [i] * 6 for i in range(2 * BATCH)]
    for result in results:
        assert "shapes differ between ranks" in result["mismatch"]  # rows differ: no padding helps
        assert result["padded"] == want


def test_one_process_gets_its_data_back_and_bad_loaders_are_named():
    loader = _eval_loader(False)
    _, index = next(iter(loader))
    assert accel.gather_for_metrics(index, loader) is index
    with pytest.raises(ValueError, match="loader: expected the loader accel.accelerate"):
        accel.gather_for_metrics(index, DataLoader([1, 2]))
