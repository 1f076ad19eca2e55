"""benchmarks/decoder_classifier.py: the --quick runs (padded samples packed by accel, and --fixed) write a row per
mode, the first_token_only A/B among them, and pass the loss check."""
import json

import torch

from benchmarks import decoder_classifier


def _run(tmp_path, *extra) -> dict:
    status = decoder_classifier.main(["--quick", "--device", "cpu", "--results-dir", str(tmp_path), "--out", "quick",
                                      "--modes", "eager,peer,accel,accel:compute.first_token_only=false", *extra])
    result = json.loads((tmp_path / "quick.json").read_text())
    assert status == 0 and result["loss_check"]["verdict"] == "PASS"
    rows = {r["mode"]: r for r in result["rows"]}
    assert all(r["status"] == "ok" for r in rows.values()) and len(rows) == 4
    return rows


def test_quick_padded_run_packs_for_accel_and_passes_the_loss_check(tmp_path):
    rows = _run(tmp_path)
    assert rows["accel"]["precision"].endswith("packed rows")
    # the cut last layer changes no loss (the same packed batches, the same weights)
    torch.testing.assert_close(rows["accel"]["losses"], rows["accel:compute.first_token_only=false"]["losses"],
                               rtol=2e-2, atol=2e-2)
    assert (tmp_path / "quick.png").exists()


def test_quick_fixed_run_has_the_same_data_in_every_mode(tmp_path):
    rows = _run(tmp_path, "--fixed", "2x32")
    assert all(r["same_data"] for r in rows.values())
    assert rows["accel"]["samples"] == 2 * 2 and rows["accel"]["tokens"] == 2 * 2 * 32  # 2 timed steps


def test_quick_lora_run_packs_the_peft_classifier(tmp_path):
    """--lora R: a LoRA classifier (peft's SEQ_CLS: adapters on the projections, the score head trained whole) in
    every mode; accel packs it, its last layer cut or not, and the rows pass the loss check."""
    import pytest

    pytest.importorskip("peft", reason="--lora needs peft (in the test dependencies)")
    rows = _run(tmp_path, "--lora", "2")
    assert rows["accel"]["precision"].endswith("packed rows")
    torch.testing.assert_close(rows["accel"]["losses"], rows["accel:compute.first_token_only=false"]["losses"],
                               rtol=2e-2, atol=2e-2)
    model = decoder_classifier.causal_lm.lora_model(decoder_classifier.build_model(
        decoder_classifier.causal_lm.model_config(quick=True), seed=0), 2, task="SEQ_CLS")
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert any("lora_" in name for name in trainable) and any("score" in name for name in trainable)
    assert all("lora_" in name or "score" in name for name in trainable)
