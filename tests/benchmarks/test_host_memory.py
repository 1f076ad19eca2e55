"""benchmarks/host_memory.py in its quick mode (one tiny row, each setting in its own process) and its arguments."""
import json

import pytest

from accel.runtime import host_memory as host_memory_module
from benchmarks import host_memory

NOT_GLIBC = "the benchmark's peer is glibc's own setting; this process's malloc is not glibc's"


@pytest.mark.skipif(host_memory_module._glibc() is None or host_memory_module._preloaded_allocator() is not None,
                    reason=NOT_GLIBC)
def test_quick_run_writes_a_row_per_size(tmp_path):
    assert host_memory.main(["--quick", "--results-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "host_memory_cpu.json").read_text())
    (row,) = result["rows"]
    assert row["size"] == "2x32"
    assert all(row[f"{key}_ms"] > 0 and row[f"{key}_peak_mb"] > 0 for key in ("default", "glibc_kept", "kept"))
    assert row["speedup"] == pytest.approx(row["default_ms"] / row["kept_ms"])
    assert row["vs_glibc_kept"] == pytest.approx(row["glibc_kept_ms"] / row["kept_ms"])
    assert (tmp_path / "host_memory_cpu.png").stat().st_size > 0


@pytest.mark.parametrize("sizes", ["16by512", "0x128", "8x", ","])
def test_bad_sizes_name_the_argument(sizes):
    with pytest.raises(SystemExit, match="--sizes"):
        host_memory.main(["--sizes", sizes])


@pytest.mark.parametrize("flag", ["--layers", "--steps", "--rounds"])
def test_counts_below_one_name_the_argument(flag):
    with pytest.raises(SystemExit, match=flag):
        host_memory.main([flag, "0"])
