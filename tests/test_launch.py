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
WORKER = """
import json, os, sys
out_dir, extra = sys.argv[1], sys.argv[2:]
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "PJRT_DEVICE", "CPU_NUM_DEVICES", "MASTER_PORT"]
with open(os.path.join(out_dir, "rank%s.json" % os.environ["RANK"]), "w") as f:
    json.dump({"env": {k: os.environ.get(k) for k in keys}, "argv": extra}, f)
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


@pytest.mark.slow
def test_xlarun_starts_every_rank_with_torchrun_flags(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "accel.launch", "--nproc_per_node=2", f"--master_port={port}",
           str(script), str(tmp_path), "--lr", "0.1"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected_device = "TPU" if launch._tpu_attached() else "CPU"
    for rank in range(2):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert res["env"]["RANK"] == str(rank) and res["env"]["LOCAL_RANK"] == str(rank)
        assert res["env"]["WORLD_SIZE"] == "2" and res["env"]["MASTER_PORT"] == str(port)
        assert res["env"]["PJRT_DEVICE"] == expected_device
        assert res["argv"] == ["--lr", "0.1"]  # the script's own arguments pass through


def test_help_lists_torchrun_flags():
    proc = subprocess.run([sys.executable, "-m", "accel.launch", "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert "--nproc_per_node" in proc.stdout and "--rdzv_backend" in proc.stdout
