"""benchmarks/gpu_session.sh (the GPU work of a session, run on a lent machine) and the time budget of
benchmarks/kernels.py it relies on: checked here with `echo` standing in for python, so a change to the
script's step selection or budgets cannot go unnoticed until the next GPU is lent."""
import json
import os
import subprocess
from pathlib import Path

import pytest

from benchmarks import kernels

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_session.sh"


def _session(tmp_path, steps=None, session_s=570, **extra):
    fake_gdb = tmp_path / "cuda-gdb"  # found before any real one when tmp_path leads PATH (crash_bt)
    fake_gdb.write_text('#!/bin/sh\necho "$@"\n')
    fake_gdb.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": "echo", "GPU_SESSION_S": str(session_s), **extra}
    if steps is not None:
        env["STEPS"] = steps
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    return proc, out


def _steps_run(out):
    return [line.split()[0] for line in (out / "exit_codes.txt").read_text().splitlines()]


def test_steps_select_what_runs_and_the_benchmarks_get_a_budget(tmp_path):
    proc, out = _session(tmp_path, "build bert_base kernels")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ran = _steps_run(out)
    ops = sorted(p.stem for p in (ROOT / "csrc" / "cpu").glob("*.cpp"))
    assert ran == [f"build_{op}" for op in ops] + ["bert_base", "kernels"]
    # the benchmarks stop themselves before the step's timeout: 570 s less what build (its cap, at most
    # 150 s) and the kernels' reserve leave, less the margins the script documents
    bert_args = (out / "bert_base.log").read_text().split()
    kernels_args = (out / "kernels.log").read_text().split()
    assert 0 < float(bert_args[bert_args.index("--budget-s") + 1]) <= 330 - 100
    assert 0 < float(kernels_args[kernels_args.index("--budget-s") + 1]) <= 420 - 40


def test_the_first_call_of_a_session_leaves_bert_base_its_reserve(tmp_path):
    proc, out = _session(tmp_path, "env build pytest bert_base")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pytest_timeout = int(proc.stdout.split("== pytest (timeout ")[1].split("s)")[0])
    assert 120 <= pytest_timeout <= 570 - 260  # bert_base's reserve is kept
    assert "-v" in (out / "pytest.log").read_text().split()  # a timed-out run still lists its tests
    bert_args = (out / "bert_base.log").read_text().split()
    assert float(bert_args[bert_args.index("--budget-s") + 1]) >= 150


def test_tests_first_lead_the_pytest_paths(tmp_path):
    first = "tests/runtime/test_layer_norm.py tests/runtime/test_fmha.py"
    proc, out = _session(tmp_path, "pytest", TESTS_FIRST=first)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    args = (out / "pytest.log").read_text().split()
    paths = [a for a in args if a.startswith("tests/") and "::" not in a]
    assert paths[:3] == ["tests/runtime/test_layer_norm.py", "tests/runtime/test_fmha.py", "tests/runtime"]


def test_pytest_paths_take_node_ids_and_k_selects_by_name(tmp_path):
    node = "tests/runtime/test_fmha.py::test_cuda_second_device"
    proc, out = _session(tmp_path, "pytest", PYTEST_PATHS=f"{node} tests/nowhere.py::test_x", PYTEST_K="cuda")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    args = (out / "pytest.log").read_text().split()
    assert args[-1] == node and "tests/nowhere.py::test_x" not in args
    assert args[args.index("-k") + 1] == "cuda"
    assert "note: tests/nowhere.py::test_x does not exist, not tested" in proc.stderr
    proc, out = _session(tmp_path, "pytest", PYTEST_PATHS=node)
    assert "-k" not in (out / "pytest.log").read_text().split()


def test_bert_args_replace_the_workload_arguments(tmp_path):
    proc, out = _session(tmp_path, "bert_base", BERT_ARGS="--workload guide --modes peer,accel")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    args = (out / "bert_base.log").read_text().split()
    assert args[args.index("--workload") + 1] == "guide" and "--fixed-sizes" not in args
    assert args[args.index("--modes") + 1] == "peer,accel" and "--budget-s" in args


@pytest.mark.parametrize("name, variable", [("vit_base", "VIT_ARGS"), ("decoder_classifier", "CLASSIFIER_ARGS"),
                                            ("model_families", "FAMILIES_ARGS")])
def test_single_workload_benchmarks_run_only_when_named_with_their_arguments(tmp_path, name, variable):
    proc, out = _session(tmp_path, name, **{variable: "--modes peer,accel"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _steps_run(out) == [name]
    # a 200 s step (300 s for model_families, which paces itself): rows stop starting 100 s before its end
    paced = [] if name == "model_families" else ["--budget-s", "100"]
    assert (out / f"{name}.log").read_text().split() == [f"benchmarks/{name}.py", *paced, "--modes", "peer,accel"]
    default = tmp_path / "default"
    default.mkdir()
    proc, out = _session(default, None, session_s=60)
    assert name not in _steps_run(out)


def test_crash_bt_runs_the_named_tests_under_a_debugger_and_only_when_asked(tmp_path):
    node = "tests/runtime/test_dcn_v2.py::test_kernels_check_their_arguments"
    proc, out = _session(tmp_path, "crash_bt", CRASH_TESTS=node, PATH=f"{tmp_path}:{os.environ['PATH']}")
    # a stand-in debugger on PATH (first): it records its arguments as the step's log
    assert proc.returncode == 0, proc.stdout + proc.stderr
    args = (out / "crash_bt.log").read_text().split()
    assert args[:2] == ["-q", "-batch"] and "bt 60" in " ".join(args)
    assert args[args.index("--args") + 1:] == ["echo", "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", node]
    proc, _ = _session(tmp_path, "crash_bt", PATH=f"{tmp_path}:{os.environ['PATH']}")
    assert proc.returncode != 0 and "set CRASH_TESTS" in proc.stderr


def test_kernels_base_runs_the_baseline_tree_s_kernels_py_only_when_asked(tmp_path):
    base = tmp_path / "base_tree"
    proc, out = _session(tmp_path, "kernels kernels_base", BASELINE_TREE=str(base), KERNELS_ARGS="--ops layer_norm")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _steps_run(out) == ["kernels", "kernels_base"]
    args = (out / "kernels_base.log").read_text().split()
    assert args[0] == f"{base}/benchmarks/kernels.py"  # the baseline's script, so its own tree comes first
    assert args[args.index("--results-dir") + 1] == str(out / "base")  # not the current tree's results
    assert args[args.index("--ops") + 1] == "layer_norm" and "--budget-s" in args
    proc, _ = _session(tmp_path, "kernels_base")
    assert proc.returncode != 0 and "set BASELINE_TREE" in proc.stderr


def test_build_also_builds_the_baseline_tree_when_one_is_given(tmp_path):
    base = tmp_path / "base_tree"
    (base / "csrc" / "cpu").mkdir(parents=True)
    (base / "csrc" / "cpu" / "old_op.cpp").write_text("")  # the baseline's ops, not the current tree's
    proc, out = _session(tmp_path, "build", BASELINE_TREE=str(base))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ops = sorted(p.stem for p in (ROOT / "csrc" / "cpu").glob("*.cpp"))
    assert _steps_run(out) == [f"build_{op}" for op in ops] + ["build_base_old_op"]
    assert "_build.load('old_op')" in (out / "build_base_old_op.log").read_text()


def test_every_step_by_default_and_unknown_steps_refused(tmp_path):
    proc, out = _session(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ran = [s for s in _steps_run(out) if not s.startswith("build_")]
    assert ran == ["env", "pytest", "bert_base", "step_profile", "multi_stream", "host_cost", "kernels"]

    proc, _ = _session(tmp_path, "build kernals")
    assert proc.returncode == 2 and "unknown step 'kernals'" in proc.stderr


def test_kernels_past_its_budget_skips_cases_and_still_writes_its_table(tmp_path):
    assert kernels.main(["--device", "cpu", "--quick", "--ops", "quick_gelu", "--budget-s", "0",
                         "--results-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "kernels_cpu.json").read_text())
    assert result["rows"] == []
    assert result["skipped"] and all(s["op"].startswith("quick_gelu") for s in result["skipped"])
    assert all("--budget-s 0" in s["reason"] for s in result["skipped"])


def test_causal_lm_runs_only_when_named_and_takes_its_arguments(tmp_path):
    for name in ("default", "named"):
        (tmp_path / name).mkdir()
    proc, out = _session(tmp_path / "default")
    assert "causal_lm" not in _steps_run(out)
    proc, out = _session(tmp_path / "named", "causal_lm", CAUSAL_ARGS="--steps 3 --modes peer,accel")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _steps_run(out) == ["causal_lm"]
    args = (out / "causal_lm.log").read_text().split()
    assert args == ["benchmarks/causal_lm.py", "--budget-s", "320", "--steps", "3", "--modes", "peer,accel"]
