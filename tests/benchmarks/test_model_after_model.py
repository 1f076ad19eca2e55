"""benchmarks/model_after_model.py: the --quick run times two models a mode, and the second model built like the
first compiles nothing, for accel as for the peer (each uses the graphs of the one before)."""
import json

import pytest
import torch

from benchmarks import model_after_model


def test_quick_run_second_models_compile_nothing(tmp_path):
    torch._dynamo.reset()  # the first model of each mode compiles, whatever ran before in this process
    assert model_after_model.main(["--quick", "--device", "cpu", "--results-dir", str(tmp_path),
                                   "--out", "quick"]) == 0
    rows = json.loads((tmp_path / "quick.json").read_text())["rows"]
    assert [(r["mode"], r["model"], r["status"]) for r in rows] == [
        ("peer", 1, "ok"), ("peer", 2, "ok"), ("accel", 1, "ok"), ("accel", 2, "ok")]
    assert [r["compiles"] for r in rows] == [1, 0, 1, 0]
    assert (tmp_path / "quick.png").exists()


def test_one_model_is_refused():
    with pytest.raises(SystemExit):
        model_after_model.parse_args(["--models", "1"])
