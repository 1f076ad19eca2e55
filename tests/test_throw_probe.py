"""tools/throw_probe.py: each variant changes exactly its one thing in accel's JIT build, and a run reports
how the tests of each variant ended, a crash by its signal."""
import sys
from pathlib import Path

import pytest
import torch

from accel.runtime import _build

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import throw_probe  # noqa: E402


@pytest.fixture
def restored(monkeypatch):
    # apply() rebinds these module attributes; monkeypatch puts the originals back afterwards
    for name in ("with_cuda", "cxx_flags", "OPENMP_FLAGS"):
        monkeypatch.setattr(_build, name, getattr(_build, name))


def _build_inputs():
    return _build.cxx_flags(True), _build.sources("quick_gelu", cuda=None), _build.OPENMP_FLAGS


@pytest.mark.parametrize("variant", throw_probe.VARIANTS)
def test_each_variant_changes_its_one_thing(variant, restored, monkeypatch):
    monkeypatch.setattr(_build, "with_cuda", lambda: True)  # as on a GPU machine: the .cu is a source
    flags, srcs, omp = _build_inputs()
    assert "-march=native" in flags and any(s.endswith(".cu") for s in srcs) and "-fopenmp" in omp
    throw_probe.apply(variant)
    new_flags, new_srcs, new_omp = _build_inputs()
    assert (new_srcs == [s for s in srcs if not s.endswith(".cu")]) == (variant == "cpu-only")
    assert (new_srcs == srcs) == (variant != "cpu-only")
    assert (new_flags == [f for f in flags if f != "-march=native"]) == (variant == "no-native")
    assert (new_omp == ()) == (variant == "no-openmp")
    if variant == "no-openmp":
        assert new_flags == [f for f in flags if f != "-fopenmp"]


def test_an_unknown_variant_is_refused(restored, capsys):
    with pytest.raises(ValueError, match="variant: expected one of as-is, cpu-only"):
        throw_probe.apply("native")
    with pytest.raises(SystemExit):
        throw_probe.main(["--op", "quick_gelu", "--variants", "as-is,fast"])
    assert "--variants: expected names from" in capsys.readouterr().err


@pytest.mark.slow
def test_a_run_reports_a_crash_by_its_signal_and_a_pass_as_passed(tmp_path, capsys):
    # one real build (quick_gelu, in a folder of the run's own) and two tests in a fresh process: one
    # that runs the op (must pass; it raises nothing, so the crash the tool hunts cannot fail it on the
    # machine that has it) and one that dies of SIGSEGV
    (tmp_path / "test_cases.py").write_text(
        "import os, signal, torch\n"
        "from accel.runtime.nn.quick_gelu import quick_gelu, quick_gelu_reference\n"
        "def test_runs():\n"
        "    x = torch.randn(64, dtype=torch.float64)\n"
        "    torch.testing.assert_close(quick_gelu(x), quick_gelu_reference(x))\n"
        "def test_crashes():\n"
        "    os.kill(os.getpid(), signal.SIGSEGV)\n")
    cases = tmp_path / "test_cases.py"
    out = str(tmp_path / "out")  # the second run finds the first one's build there
    assert throw_probe.main(["--op", "quick_gelu", "--variants", "as-is,cuda-context", "--out", out,
                             f"{cases}::test_runs"]) == 0
    table = capsys.readouterr().out
    assert "| as-is | passed (" in table
    # the same build, run again after a CUDA tensor was made (where there is a GPU)
    assert ("| cuda-context | passed (" if torch.cuda.is_available() else "| cuda-context | not run: no CUDA") in table
    assert not (tmp_path / "out" / "ext" / "cuda-context").exists()
    throw_probe.main(["--op", "quick_gelu", "--variants", "as-is", "--out", out, str(cases)])
    table = capsys.readouterr().out
    assert "| as-is | killed by SIGSEGV (" in table and "libstdc++" in table
    assert "Segmentation fault" in (tmp_path / "out" / "tests_as-is.log").read_text()  # faulthandler's report
