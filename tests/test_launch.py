"""xlarun (accel.launch): torchrun's flags, plus the per-process environment torch_xla needs."""
import json
import os
import socket
import subprocess
import sys

import pytest

from accel import launch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A worker that only reports its environment: no torch import, so the launch test stays fast.
# It imports a module next to it, as `python worker.py` allows, and records what a script sees of
# xlarun's worker mode (sys.argv[0], __name__, whether torch or accel were imported before it).
WORKER = """
import json, os, sys
import worker_helper
out_dir, extra = sys.argv[1], sys.argv[2:]
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "PJRT_DEVICE", "CPU_NUM_DEVICES", "MASTER_PORT",
        "ACCEL_XLA_COMPILE_CACHE", "XLA_PERSISTENT_CACHE_PATH", "XLA_PERSISTENT_CACHE_READ_ONLY"]
with open(os.path.join(out_dir, "rank%s.json" % os.environ["RANK"]), "w") as f:
    json.dump({"env": {k: os.environ.get(k) for k in keys}, "argv": extra, "argv0": sys.argv[0],
               "name": __name__, "preloaded": sorted({"torch", "accel"} & set(sys.modules))}, f)
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sets_pjrt_device_and_one_cpu_device_per_process():
    env = {}
    changed = launch.prepare_environment("2", env)
    expected = "TPU" if launch._tpu_attached() else "CPU"
    assert env["PJRT_DEVICE"] == expected
    if expected == "CPU":
        assert env["CPU_NUM_DEVICES"] == "1"
    assert changed == env


def test_keeps_the_users_values():
    env = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1"}
    assert launch.prepare_environment(4, env) == {}
    assert env == {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1"}
    env = {"PJRT_DEVICE": "TPU"}
    assert launch.prepare_environment(4, env) == {}


def test_one_process_may_use_several_cpu_devices():
    env = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}
    assert launch.prepare_environment(1, env) == {}
    assert env["CPU_NUM_DEVICES"] == "4"
    assert "CPU_NUM_DEVICES" not in launch.prepare_environment("1", {"PJRT_DEVICE": "CPU"})


def test_warns_about_several_cpu_devices_in_several_processes():
    with pytest.warns(RuntimeWarning, match="CPU_NUM_DEVICES=4"):
        launch.prepare_environment(2, {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"})


def _xlarun(tmp_path, *flags, script_args=(), env_extra=None):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    (tmp_path / "worker_helper.py").write_text("")
    port = _free_port()
    drop = ("PJRT_DEVICE", "CPU_NUM_DEVICES", "ACCEL_XLA_COMPILE_CACHE", "XLA_PERSISTENT_CACHE_PATH",
            "XLA_PERSISTENT_CACHE_READ_ONLY")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_extra or {})
    cmd = [sys.executable, "-m", "accel.launch", *flags, f"--master_port={port}",
           str(script), str(tmp_path), *script_args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return port, script


@pytest.mark.slow
def test_xlarun_starts_every_rank_with_torchrun_flags(tmp_path):
    cache = tmp_path / "cache"
    port, script = _xlarun(tmp_path, "--nproc_per_node=2", "--compile-cache", str(cache),
                           script_args=("--lr", "0.1", "--compile-cache", "mine"))
    expected_device = "TPU" if launch._tpu_attached() else "CPU"
    for rank in range(2):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert res["env"]["RANK"] == str(rank) and res["env"]["LOCAL_RANK"] == str(rank)
        assert res["env"]["WORLD_SIZE"] == "2" and res["env"]["MASTER_PORT"] == str(port)
        assert res["env"]["PJRT_DEVICE"] == expected_device
        # The script's own arguments pass through, xlarun's flag names included.
        assert res["argv"] == ["--lr", "0.1", "--compile-cache", "mine"]
        assert res["argv0"] == str(script) and res["name"] == "__main__"
        assert res["preloaded"] == []  # worker mode imports neither torch nor accel before the script
        assert res["env"]["ACCEL_XLA_COMPILE_CACHE"] == str(cache)
        assert res["env"]["XLA_PERSISTENT_CACHE_PATH"] == str(cache / f"rank{rank}")
        assert res["env"]["XLA_PERSISTENT_CACHE_READ_ONLY"] == "0"
        assert (cache / f"rank{rank}").is_dir()


@pytest.mark.slow
def test_no_compile_cache_starts_the_script_as_before(tmp_path):
    home = tmp_path / "home"
    _xlarun(tmp_path, "--nproc_per_node=1", "--no-compile-cache",
            env_extra={"HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache"),
                       "ACCEL_XLA_COMPILE_CACHE": str(tmp_path / "inherited")})
    res = json.loads((tmp_path / "rank0.json").read_text())
    assert res["env"]["ACCEL_XLA_COMPILE_CACHE"] is None and res["env"]["XLA_PERSISTENT_CACHE_PATH"] is None
    assert not home.exists() and not (tmp_path / "inherited").exists()


def test_help_lists_torchrun_flags():
    proc = subprocess.run([sys.executable, "-m", "accel.launch", "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert "--nproc_per_node" in proc.stdout and "--rdzv_backend" in proc.stdout
    assert "--compile-cache" in proc.stdout and "--no-compile-cache" in proc.stdout
