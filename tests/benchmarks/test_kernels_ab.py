"""benchmarks/kernels_ab.py: the A/B table of a kernel change, from two kernels.py results."""
import json

import pytest

from benchmarks import kernels_ab


def _result(device, rows):
    return {"device": device, "date": "2026-11-27 03:00 UTC", "torch": "2.11", "copy_bandwidth_gbps": 4200.0,
            "rows": [{"op": op, "size": size, "ours_ms": ms, "copy_frac": frac, "ratio": ratio}
                     for op, size, ms, frac, ratio in rows]}


def test_rows_matched_by_op_and_size_with_base_over_new(tmp_path):
    new = _result("H200", [("layer_norm fwd", "16384x768 bfloat16", 0.020, 0.60, 1.8),
                           ("layer_norm bwd", "16384x768 bfloat16", 0.050, 0.36, 2.0),
                           ("fmha fwd", "B32", 0.010, 0.3, 2.0)])
    base = _result("H200", [("layer_norm bwd", "16384x768 bfloat16", 0.040, 0.45, 2.56),
                            ("layer_norm fwd", "16384x768 bfloat16", 0.025, 0.48, 1.5),
                            ("nms", "1000 boxes", 0.3, None, 1.03)])
    (tmp_path / "kernels_cuda.json").write_text(json.dumps(new))
    (tmp_path / "base.json").write_text(json.dumps(base))
    assert kernels_ab.main([str(tmp_path / "kernels_cuda.json"), str(tmp_path / "base.json"),
                            "--results-dir", str(tmp_path / "out")]) == 0
    out = json.loads((tmp_path / "out" / "kernels_ab_cuda.json").read_text())
    by_op = {r["op"]: r for r in out["rows"]}
    assert by_op["layer_norm fwd"]["speedup"] == pytest.approx(0.025 / 0.020)  # the change is faster
    assert by_op["layer_norm bwd"]["speedup"] == pytest.approx(0.040 / 0.050)  # slower: to revert
    assert by_op["layer_norm bwd"]["base_copy"] == 0.45 and by_op["layer_norm bwd"]["new_vs_peer"] == 2.0
    assert sorted(out["unmatched"]) == ["base only: nms 1000 boxes", "new only: fmha fwd B32"]
    assert (tmp_path / "out" / "kernels_ab_cuda.png").stat().st_size > 0


def test_runs_of_different_machines_are_refused(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(_result("NVIDIA H200", [])))
    (tmp_path / "b.json").write_text(json.dumps(_result("NVIDIA H100 80GB HBM3", [])))
    with pytest.raises(SystemExit, match="different devices"):
        kernels_ab.main([str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--results-dir", str(tmp_path)])
