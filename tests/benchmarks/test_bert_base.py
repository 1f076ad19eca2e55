"""benchmarks/bert_base.py: the --quick run writes a row per requested mode and passes its loss check;
its data, counting and loss-check helpers do what the benchmark's docstring says."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from accel.utils.xla import xla_available
from benchmarks import bert_base

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path, *flags):
    """main() in --quick mode into tmp_path (never the committed results); returns (exit status, JSON)."""
    status = bert_base.main(["--quick", "--results-dir", str(tmp_path), "--out", "quick", *flags])
    return status, json.loads((tmp_path / "quick.json").read_text())


def _assert_rows(result, workloads, modes):
    rows = {(r["workload"], r["mode"]): r for r in result["rows"]}
    assert set(rows) == {(w, m) for w in workloads for m in modes}
    for row in rows.values():
        assert row["status"] in ("ok", "skipped"), row
        if row["status"] == "skipped":
            assert row["reason"]
        else:
            assert row["tokens_per_s"] > 0 and row["samples_per_s"] > 0
            assert row["step_ms_p90"] >= row["step_ms_median"] > 0
            assert row["host_ms_median"] > 0 and row["cudagraph_skips"] >= 0
            # taking the batch is part of the host's step: per step data <= host, so their medians too
            assert 0 < row["data_ms_median"] <= row["host_ms_median"]
            # a reason for every skip (distinct ones listed once): a skip without its reason is a lost clue
            assert bool(row["cudagraph_skips"]) == bool(row["cudagraph_skip_reasons"])
            if not str(row["device"]).startswith("cuda"):  # host clock, device synced after the host's part
                assert row["host_ms_median"] <= row["step_ms_median"]
                assert row["cudagraph_skips"] == 0  # no CUDA graphs asked for on the CPU, none skipped
            assert len(row["losses"]) == row["warmup"] + 2 and all(math.isfinite(x) for x in row["losses"])
    assert result["loss_check"]["verdict"] == "PASS", result["loss_check"]
    return rows


def test_quick_eager_modes_on_both_workloads(tmp_path):
    status, result = _run(tmp_path, "--workload", "both", "--modes", "eager,eager-amp")
    assert status == 0
    rows = _assert_rows(result, ["fixed 4x32", "guide 4x<=64"], ["eager", "eager-amp"])
    assert rows[("fixed 4x32", "eager")]["status"] == "ok"
    assert rows[("fixed 4x32", "eager")]["speedup_vs_eager"] == pytest.approx(1.0)
    if not bert_base.native_bf16(bert_base.default_device()):
        assert "bf16" in rows[("fixed 4x32", "eager-amp")]["reason"]
    assert (tmp_path / "quick.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["peer", "accel-kernels", "accel-xla", "accel"])
def test_quick_other_modes(tmp_path, mode):
    # eager is the loss check's reference; torch.compile and XLA compile on the first steps (slow on a CPU)
    status, result = _run(tmp_path, "--workload", "fixed", "--modes", f"eager,{mode}")
    assert status == 0
    _assert_rows(result, ["fixed 4x32"], ["eager", mode])


def test_distilbert_model_runs_the_same_rows(tmp_path):
    """--model distilbert: DistilBERT's config and classifier, the same rows and loss check."""
    status, result = _run(tmp_path, "--model", "distilbert", "--workload", "both", "--modes", "eager,accel")
    assert status == 0
    rows = _assert_rows(result, ["fixed 4x32", "guide 4x<=64"], ["eager", "accel"])
    assert rows[("guide 4x<=64", "accel")]["status"] == "ok"  # packed rows: PackedModel takes DistilBERT's head
    assert result["model"]["n_layers"] == bert_base.QUICK_DISTILBERT["n_layers"]
    assert type(bert_base.build_model(bert_base.bert_config(True, "distilbert"), 0)).__name__ == \
        "DistilBertForSequenceClassification"


@pytest.mark.slow
def test_accel_model_only_takes_the_batches_itself_and_trains_as_accel(tmp_path):
    # the A/B of accelerate()'s loader: the same steps on the same batches, so the same losses
    status, result = _run(tmp_path, "--workload", "both", "--modes", "accel,accel-model-only")
    assert status == 0
    rows = {(r["workload"], r["mode"]): r for r in result["rows"]}
    ours, own = rows[("fixed 4x32", "accel")], rows[("fixed 4x32", "accel-model-only")]
    assert own["status"] == "ok" and own["losses"] == pytest.approx(ours["losses"], rel=1e-5, abs=1e-6)
    packed = rows[("guide 4x<=64", "accel-model-only")]  # accel packs there: only its loader can
    assert packed["status"] == "skipped" and "dataloader.pack" in packed["reason"]
    assert "accel-model-only" not in bert_base.parse_args([]).modes  # only when named


@pytest.mark.slow
def test_accel_step_graph_captures_on_cuda_and_is_skipped_elsewhere(tmp_path):
    # 4 warm-up steps: graph_step's 3 plain ones and its capture, then the timed steps replay
    status, result = _run(tmp_path, "--workload", "fixed", "--modes", "accel,accel-step-graph", "--warmup", "4",
                          "--steps", "3")
    assert status == 0
    row = {r["mode"]: r for r in result["rows"]}["accel-step-graph"]
    if torch.cuda.is_available():
        assert row["status"] == "ok", row
    else:
        assert row["status"] == "skipped" and "CUDA only" in row["reason"]
    assert "accel-step-graph" not in bert_base.parse_args([]).modes  # only when named


def test_headline_rows_run_first_and_a_spent_budget_skips_the_rest(tmp_path):
    order = bert_base.run_order(2, ["eager", "peer", "accel-kernels", "accel"])
    assert order == [(0, "peer"), (0, "accel"), (1, "peer"), (1, "accel"),
                     (0, "eager"), (0, "accel-kernels"), (1, "eager"), (1, "accel-kernels")]
    status, result = _run(tmp_path, "--workload", "fixed", "--modes", "eager,eager-amp", "--budget-s", "0")
    assert [(r["mode"], r["status"]) for r in result["rows"]] == [("eager", "skipped"), ("eager-amp", "skipped")]
    assert "budget" in result["rows"][0]["reason"]


def test_pad_to_longest_pads_like_data_collator_with_padding():
    samples = bert_base.make_samples([3, 5], vocab=50, seed=0)
    batch = bert_base.pad_to_longest(samples)
    assert batch["input_ids"].shape == (2, 5)
    assert batch["input_ids"][0, 3:].tolist() == [0, 0]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert batch["token_type_ids"].abs().sum() == 0
    assert batch["labels"].tolist() == [int(s["input_ids"][0]) % 2 for s in samples]


def test_guide_lengths_are_short_with_a_tail_to_the_maximum():
    lengths = bert_base.sst2_like_lengths(4096, 512, seed=0)
    assert min(lengths) >= 4 and max(lengths) == 512
    assert sorted(lengths)[len(lengths) // 2] < 40  # most sentences are short
    assert sum(n > 256 for n in lengths) > 40       # and a batch of 128 usually holds a long one


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_batch_counts_padded_and_packed(device):
    padded = {"attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], device=device)}
    packed = {"segment_ids": torch.tensor([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1]], device=device)}
    unmasked = {"input_ids": torch.ones(2, 5, dtype=torch.long, device=device)}  # accelerate() dropped a mask of ones
    images = {"pixel_values": torch.zeros(3, 3, 8, 8, device=device)}  # vit_base.py's: 17 tokens an image
    # DataCollatorWithFlattening's row of samples of 2, 3 and 1 tokens, padded (token id 0) to a bucket of 9
    flattened = {"input_ids": torch.tensor([[4, 5, 6, 7, 8, 9, 0, 0, 0]], device=device),
                 "position_ids": torch.tensor([[0, 1, 0, 1, 2, 0, 0, 1, 2]], device=device)}
    # counted every step while CUDA steps are timed without a host sync: counting must not sync either
    if device == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    try:
        counts = [bert_base.batch_counts(padded, packed=False), bert_base.batch_counts(packed, packed=True),
                  bert_base.batch_counts(unmasked, packed=False), bert_base.batch_counts(images, False, 17),
                  bert_base.batch_counts(flattened, False, flattened=True)]
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    assert [c.tolist() for c in counts] == [[2, 5, 9 + 4], [3, 11, 4 + 9 + 36], [2, 10, 25 + 25], [3, 51, 3 * 289],
                                            [3, 6, 4 + 9 + 1]]


def _row(mode, first, final, same_data=True):
    return {"mode": mode, "status": "ok", "first_loss": first, "final_loss": final, "losses": [first, final],
            "same_data": same_data}


def test_loss_check_flags_diverging_and_failed_modes():
    eager = _row("eager", 0.70, 0.65)
    assert bert_base.check_losses([eager, _row("peer", 0.71, 0.66)], 2e-2) == []
    assert bert_base.check_losses([eager, _row("accel", 0.90, 0.70, same_data=False)], 2e-2) == []
    assert len(bert_base.check_losses([eager, _row("peer", 0.75, 0.66)], 2e-2)) == 1
    assert len(bert_base.check_losses([eager, _row("peer", 0.70, float("nan"))], 2e-2)) == 1
    assert len(bert_base.check_losses([eager, _row("peer", 0.70, 1.2)], 2e-2)) == 1
    failed = {"mode": "peer", "status": "failed", "reason": "RuntimeError: boom"}
    assert bert_base.check_losses([eager, failed], 2e-2) == ["peer: RuntimeError: boom"]


def test_size_and_mode_flags():
    assert bert_base.parse_sizes("32x128,64X512") == ((32, 128), (64, 512))
    with pytest.raises(Exception):
        bert_base.parse_sizes("32by128")
    with pytest.raises(Exception):
        bert_base.parse_modes("eager,fast")
    args = bert_base.parse_args(["--device", "cpu", "--batch", "16", "--seq", "512"])
    assert args.fixed_sizes == ((16, 512),) and args.guide_batch == 16 and args.workload == "fixed"
    assert args.out == "bert_base_cpu"


def test_accel_variants_set_config_fields():
    modes = bert_base.parse_modes("peer,accel,accel:compute.fuse_qkv=true+memory.gc=true+memory.gc_cnt=2")
    assert bert_base.split_mode(modes[2]) == ("accel", {"compute.fuse_qkv": "true", "memory.gc": "true",
                                                        "memory.gc_cnt": "2"})
    config = bert_base.accel_config(bert_base.split_mode(modes[2])[1])
    assert config.compute.fuse_qkv is True and config.memory.gc is True and config.memory.gc_cnt == 2
    assert bert_base.accel_config({}).compute == type(config.compute)()  # no fields: the defaults
    # a name past a dict field is that dict's key
    inductor = bert_base.parse_modes("accel:compute.inductor_options.combo_kernels=true")[0]
    assert bert_base.accel_config(bert_base.split_mode(inductor)[1]).compute.inductor_options == {"combo_kernels": True}
    # accel-flattened takes them too (its route A/B on CUDA); other modes do not
    flat = bert_base.parse_modes("accel-flattened:compute.cuda_packed_attention=mask")[0]
    assert bert_base.split_mode(flat) == ("accel-flattened", {"compute.cuda_packed_attention": "mask"})
    with pytest.raises(Exception, match="only accel and accel-flattened take Config fields"):
        bert_base.split_mode("peer:compute.bf16=true")
    # variants are headline rows too, in the order given
    assert bert_base.run_order(1, ["eager", "accel:compute.kernels=false", "peer"]) == [
        (0, "accel:compute.kernels=false"), (0, "peer"), (0, "eager")]
    for bad in ("accel:compute.nothing=1", "peer:compute.bf16=true", "accel:compute.bf16", "accel:compute.bf16=3",
                "accel:compute.inductor_options.no_such_setting=1"):
        with pytest.raises(Exception):
            bert_base.parse_modes(bad)


# In a fresh process: importing torch_xla changes Dynamo's settings once per process.
START_XLA = """
import sys, torch._dynamo
from benchmarks.bert_base import XLA_DYNAMO_SETTINGS, start_xla_if_needed
before = {name: getattr(torch._dynamo.config, name) for name in XLA_DYNAMO_SETTINGS}
start_xla_if_needed(sys.argv[1].split(","))
after = {name: getattr(torch._dynamo.config, name) for name in XLA_DYNAMO_SETTINGS}
print("torch_xla" in sys.modules, before == after, before["automatic_dynamic_shapes"])
"""


@pytest.mark.skipif(not xla_available(), reason="checks what starting torch_xla does; torch_xla is not installed")
@pytest.mark.parametrize("modes, imports_xla", [("eager,peer,accel", False), ("eager,peer,accel-xla", True)])
def test_xla_starts_only_for_the_xla_modes_and_leaves_dynamo_as_torch_sets_it(modes, imports_xla):
    """accel runs on the cpu (or cuda) backend here; the peer keeps Dynamo's automatic dynamic shapes either way."""
    env = dict(os.environ, PJRT_DEVICE="CPU")
    proc = subprocess.run([sys.executable, "-c", START_XLA, modes], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-3:] == [str(imports_xla), "True", "True"]


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_step_clock_times_each_step_from_the_end_of_the_one_before(device):
    import time

    clock = bert_base.StepClock(torch.device(device))
    x = torch.ones(256, 256, device=device)
    for work in (1, 30, 1):
        for _ in range(work):
            x = (x @ x).clamp_(-1, 1)
        if device == "cpu":
            time.sleep(0.005 * work)  # the host's clock: sleeping is part of the step
        clock.step_ended()
    times = clock.step_times()
    assert len(times) == 3 and all(t > 0 for t in times)
    assert times[1] > times[0] and times[1] > times[2]  # the step that did 30x the work took longest


def test_a_skip_reason_is_listed_once_with_its_count():
    assert bert_base.distinct(["b", "a", "b", "b"]) == ["b (x3)", "a"]
    assert bert_base.distinct([]) == []
