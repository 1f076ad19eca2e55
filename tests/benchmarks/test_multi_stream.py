"""benchmarks/multi_stream.py: its workloads and timing run on the CPU too (where multi_apply_multi_stream is
multi_apply), so the benchmark cannot rot between GPU sessions."""
import json

import pytest
import torch

from benchmarks import multi_stream


def test_every_quick_workload_gives_one_row_per_mode_against_multi_apply():
    rows = multi_stream.run(6, multi_stream.QUICK_WORKLOADS, min_time=0.01, device=torch.device("cpu"))
    modes = ["multi_apply"] + [f"multi_stream {n}" for n in multi_stream.STREAMS]
    assert [r["mode"] for r in rows] == modes * len(multi_stream.QUICK_WORKLOADS)
    for r in rows:
        assert r["ms"] > 0 and 0 < r["issue_ms"] <= r["ms"] and r["ratio"] > 0
        assert r["workload"].startswith("6 calls x ")
    assert all(r["ratio"] == 1.0 for r in rows if r["mode"] == "multi_apply")


def test_top_scores_is_the_sorted_top_k():
    scores = torch.tensor([0.1, 0.9, 0.5, 0.7])
    values, order = multi_stream.top_scores(scores, k=2)
    assert values.tolist() == pytest.approx([0.9, 0.7]) and order.tolist() == [1, 3]


def test_main(tmp_path, capsys):
    assert multi_stream.main(["--quick", "--calls", "4", "--min-time", "0.02", "--results-dir", str(tmp_path)]) == 0
    if torch.cuda.is_available():
        result = json.loads((tmp_path / "multi_stream.json").read_text())
        assert result["quick"] and len(result["rows"]) == 4 * len(multi_stream.QUICK_WORKLOADS)
    else:  # nothing to measure without CUDA streams, and it says so
        assert "no CUDA device" in capsys.readouterr().out and not list(tmp_path.iterdir())
