"""benchmarks/model_families.py: the --quick run trains each named family in the peer's and accel's rows, passes
their loss checks and summarises accel's speed over the peer's; bad family names are refused by name."""
import json

import pytest
import torch

from benchmarks import model_families


def test_quick_run_of_an_encoder_decoder_and_a_decoder(tmp_path):
    status = model_families.main(["--quick", "--device", "cpu", "--families", "bart,mistral",
                                  "--results-dir", str(tmp_path), "--out", "quick"])
    result = json.loads((tmp_path / "quick.json").read_text())
    assert status == 0 and result["loss_check"]["verdict"] == "PASS"
    assert [s["family"] for s in result["summary"]] == ["bart", "mistral"]
    for summary in result["summary"]:
        assert summary["speedup"] == pytest.approx(summary["peer_ms"] / summary["accel_ms"], rel=0.5)
    rows = result["rows"]
    assert [(r["family"], r["mode"], r["status"]) for r in rows] == [
        ("bart", "peer", "ok"), ("bart", "accel", "ok"), ("mistral", "peer", "ok"), ("mistral", "accel", "ok")]
    assert all(r["tokens"] == 2 * 4 * 16 for r in rows)  # 2 timed steps of 4 samples of 16 tokens
    assert (tmp_path / "quick.png").exists()


def test_every_family_builds_with_fields_of_its_task():
    for name, family in model_families.FAMILIES.items():
        model = model_families.build_model(family, model_families.QUICK_SIZE, seed=0)
        samples = model_families.make_samples(family.task, 2, 16, 500, 32, seed=0)  # two: ResNet's BatchNorm
        batch = {k: torch.stack([sample[k] for sample in samples]) for k in samples[0]}
        assert model(**batch).loss.isfinite(), name


def test_unknown_families_are_named():
    with pytest.raises(SystemExit):
        model_families.parse_args(["--families", "bart,llama9"])
    assert model_families.parse_args(["--families", "gpt2, t5"]).families == ["gpt2", "t5"]


def test_quick_masked_lm_with_the_fused_loss_row(tmp_path):
    """A masked LM (15% of its tokens labelled) in the peer's and accel's rows and accel's with
    memory.fused_lm_loss: the same losses (the loss check) from the three."""
    status = model_families.main(["--quick", "--device", "cpu", "--families", "bert_mlm", "--modes",
                                  "peer,accel,accel:memory.fused_lm_loss=true", "--results-dir", str(tmp_path),
                                  "--out", "quick"])
    result = json.loads((tmp_path / "quick.json").read_text())
    assert status == 0 and result["loss_check"]["verdict"] == "PASS"
    assert [(r["mode"], r["status"]) for r in result["rows"]] == [
        ("peer", "ok"), ("accel", "ok"), ("accel:memory.fused_lm_loss=true", "ok")]
    samples = model_families.make_samples("mlm", 50, 16, 500, 32, seed=0)
    labelled = torch.stack([s["labels"] != -100 for s in samples])
    assert labelled.any(1).all() and 0.1 < labelled.float().mean() < 0.3
