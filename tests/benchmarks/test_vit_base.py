"""benchmarks/vit_base.py: the --quick run writes a row per mode (the compute.cpu_attention A/B and the peer with
eager attention among them on the CPU), counts an image's tokens, and passes its loss check."""
import json

import torch

from benchmarks import vit_base


def test_quick_run_has_the_cpu_attention_ab_and_passes_the_loss_check(tmp_path):
    status = vit_base.main(["--quick", "--device", "cpu", "--modes",
                            "eager,peer,peer-eager-attention,accel,accel:compute.cpu_attention=sdpa",
                            "--results-dir", str(tmp_path), "--out", "quick"])
    result = json.loads((tmp_path / "quick.json").read_text())
    assert status == 0 and result["loss_check"]["verdict"] == "PASS"
    rows = {r["mode"]: r for r in result["rows"]}
    assert all(r["status"] == "ok" for r in rows.values()) and len(rows) == 5
    assert rows["peer-eager-attention"]["precision"].endswith("eager attention")
    # 4 images a step of 17 tokens each ((32 / 8)^2 patches and [CLS]), 2 timed steps
    assert rows["accel"]["samples"] == 8 and rows["accel"]["tokens"] == 8 * 17
    assert all(r["same_data"] for r in rows.values())  # images are not packed: the first losses compare
    torch.testing.assert_close(rows["accel"]["losses"], rows["accel:compute.cpu_attention=sdpa"]["losses"],
                               rtol=5e-2, atol=5e-2)
    assert (tmp_path / "quick.png").exists()


def test_default_modes_have_the_ab_row_on_the_cpu_only():
    assert "accel:compute.cpu_attention=sdpa" in vit_base.parse_args(["--device", "cpu"]).modes
    assert vit_base.parse_args(["--device", "cuda"]).modes == list(vit_base.MODES)  # parsing needs no GPU
