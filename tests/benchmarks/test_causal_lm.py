"""benchmarks/causal_lm.py: the --quick run writes a row per mode, accel's on packed rows, and passes its loss
check; its collator pads as a causal LM's does."""
import json

import torch

from accel.data.packing import LABEL_PAD
from benchmarks import causal_lm


def test_quick_run_packs_accels_rows_and_passes_the_loss_check(tmp_path):
    status = causal_lm.main(["--quick", "--modes", "eager,peer,accel", "--results-dir", str(tmp_path),
                             "--out", "quick"])
    result = json.loads((tmp_path / "quick.json").read_text())
    assert status == 0 and result["loss_check"]["verdict"] == "PASS"
    rows = {r["mode"]: r for r in result["rows"]}
    assert set(rows) == {"eager", "peer", "accel"} and all(r["status"] == "ok" for r in rows.values())
    assert "packed rows" in rows["accel"]["precision"] and not rows["accel"]["same_data"]
    assert rows["eager"]["same_data"] and rows["eager"]["speedup_vs_eager"] == 1.0
    assert (tmp_path / "quick.png").exists() and (tmp_path / "quick_memory.png").exists()


def test_quick_flattened_rows_train_in_one_graph(tmp_path):
    """accel-flattened: the rows DataCollatorWithFlattening makes (batch x max_length tokens at most, one row, a
    bucket of that length), one compiled graph, every sample counted once a row; the loss check passes."""
    status = causal_lm.main(["--quick", "--modes", "accel,accel-flattened", "--results-dir", str(tmp_path),
                             "--out", "flat"])
    result = json.loads((tmp_path / "flat.json").read_text())
    rows = {r["mode"]: r for r in result["rows"]}
    assert status == 0 and result["loss_check"]["verdict"] == "PASS"
    row = rows["accel-flattened"]
    assert row["status"] == "ok" and "flattened by the collator" in row["precision"] and not row["same_data"]
    assert row["compiles"] == 1
    # the loader: every sample once, as many a row as fit batch x max_length tokens
    loader = causal_lm.Workload("causal", 4, 64, [{"input_ids": torch.arange(1, n + 1), "labels": torch.arange(n)}
                                                  for n in (20, 30, 40, 50, 60)]).flattened_loader()
    batches = list(loader)
    assert sum(b["input_ids"].shape[1] for b in batches) == 200 and all(b["input_ids"].shape[1] <= 4 * 64
                                                                        for b in batches)
    assert sum(int((b["position_ids"] == 0).sum()) for b in batches) == 5  # each sample once, in some row


def test_quick_fused_loss_row_takes_the_same_steps(tmp_path):
    """The memory.fused_lm_loss row (and --vocab, --prompt-fraction: the ignored prompts' rows skip the head's
    products): same losses as accel's packed rows; plotted over the peer."""
    mode = "accel:memory.fused_lm_loss=true"
    status = causal_lm.main(["--quick", "--modes", f"peer,accel,{mode}", "--vocab", "3000", "--prompt-fraction",
                             "0.5", "--results-dir", str(tmp_path), "--out", "fused"])
    result = json.loads((tmp_path / "fused.json").read_text())
    assert status == 0 and result["model"]["vocab_size"] == 3000
    rows = {r["mode"]: r for r in result["rows"]}
    assert rows[mode]["status"] == "ok"
    torch.testing.assert_close(rows[mode]["losses"], rows["accel"]["losses"], rtol=1e-3, atol=1e-3)
    assert (tmp_path / "fused.png").exists() and (tmp_path / "fused_memory.png").exists()


def test_quick_lora_rows_train_the_adapters_alone(tmp_path):
    """--lora R: every mode fine-tunes peft's LoRA adapters over the frozen model (accel through the model inside
    the PEFT one: packed rows); the rows pass the loss check."""
    import pytest

    pytest.importorskip("peft", reason="--lora needs peft (in the test dependencies)")
    status = causal_lm.main(["--quick", "--lora", "2", "--modes", "peer,accel", "--results-dir", str(tmp_path)])
    result = json.loads((tmp_path / "causal_lm_cpu_lora2.json").read_text())
    assert status == 0 and result["model"]["lora"] == 2
    rows = {r["mode"]: r for r in result["rows"]}
    assert all(r["status"] == "ok" for r in rows.values()) and "packed rows" in rows["accel"]["precision"]
    model = causal_lm.lora_model(causal_lm.build_model(causal_lm.model_config(quick=True), seed=0), rank=2)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)


def test_prompt_fraction_ignores_each_samples_first_labels():
    samples = causal_lm.make_samples([10, 3], vocab=50, seed=0, prompt_fraction=0.5)
    assert [(s["labels"] == LABEL_PAD).sum().item() for s in samples] == [5, 1]
    assert torch.equal(samples[0]["labels"][5:], samples[0]["input_ids"][5:])
    assert (causal_lm.make_samples([10], vocab=50, seed=0)[0]["labels"] != LABEL_PAD).all()


def test_collator_pads_ids_masks_and_labels_as_a_causal_lm_expects():
    samples = [{"input_ids": torch.tensor([5, 6, 7]), "labels": torch.tensor([5, 6, 7])},
               {"input_ids": torch.tensor([8]), "labels": torch.tensor([8])}]
    batch = causal_lm.pad_for_causal_lm(samples)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[5, 6, 7], [8, LABEL_PAD, LABEL_PAD]]
    lengths = causal_lm.instruction_lengths(1000, 512, seed=0)
    assert min(lengths) >= 16 and max(lengths) == 512 and 120 < sorted(lengths)[500] < 260


def test_sizes_and_long_rows_shape_the_config():
    """--size 1b is Llama 3.2 1B's shape: 1,235,814,400 parameters with its 128256 vocabulary and tied embeddings
    (its published 1.24B), untied here (the benchmark's LlamaConfig default) one embedding more; rows longer
    than the config's positions get positions for them."""
    import transformers

    config = causal_lm.model_config(quick=False, vocab=128256, size="1b", max_length=4096)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    assert sum(p.numel() for p in model.parameters()) == 1_235_814_400 + 128256 * 2048
    assert config["max_position_embeddings"] == 4096
    assert causal_lm.model_config(quick=False)["max_position_embeddings"] == causal_lm.LLAMA["max_position_embeddings"]
    assert causal_lm.parse_args(["--size", "1b", "--device", "cpu"]).out == "causal_lm_cpu_1b"


def test_a_spent_budget_skips_the_rows_that_would_start_after_it(tmp_path, monkeypatch):
    """--budget-s (a GPU call's time limit): a row that would start after it is skipped with the reason, and the run
    still writes its table and JSON. Here the first row "takes" 10 s of a 5 s budget."""
    import time

    from benchmarks import bert_base

    times = [0.0, 0.0, 10.0]  # started, before the first row, before the second (and after)
    monkeypatch.setattr(time, "perf_counter", lambda: times.pop(0) if len(times) > 1 else times[0])
    monkeypatch.setattr(bert_base, "run_mode", lambda mode, ctx, args: {
        "workload": ctx.workload.name, "mode": mode, "status": "skipped", "reason": "stand-in"})
    assert causal_lm.main(["--quick", "--modes", "eager,accel", "--budget-s", "5", "--results-dir", str(tmp_path),
                           "--out", "budget"]) == 0
    rows = json.loads((tmp_path / "budget.json").read_text())["rows"]
    assert [(r["mode"], r["reason"]) for r in rows] == [("eager", "stand-in"),
                                                        ("accel", "time budget (--budget-s 5) spent")]
