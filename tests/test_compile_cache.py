"""xlarun's persistent XLA compile cache: flags, per-rank folders, the accel.xla fallback, metrics."""
import json
import os
import socket
import subprocess
import sys
import warnings

import pytest

from accel import launch
from accel.utils.xla import xla_available

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE_VARS = (launch.CACHE_ENV, launch.XLA_CACHE_PATH, launch.XLA_CACHE_READ_ONLY)


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for key in CACHE_VARS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


# --- flags ---------------------------------------------------------------------------------------


def test_cache_is_off_unless_asked_for(clean_env):
    args, cache, explicit = launch.parse_args(["--nproc_per_node=2", "train.py", "--lr", "1"])
    assert cache is None and not explicit
    assert args.nproc_per_node == "2" and args.training_script == "train.py"
    assert args.training_script_args == ["--lr", "1"]
    assert not hasattr(args, "compile_cache") and not hasattr(args, "no_compile_cache")


def test_compile_cache_dir_and_env_default(clean_env, monkeypatch, tmp_path):
    _, cache, explicit = launch.parse_args(["--compile-cache", "~/c", "--nnodes=1", "t.py"])
    assert cache == os.path.expanduser("~/c") and explicit
    _, cache, _ = launch.parse_args(["--compile_cache=rel", "t.py"])
    assert cache == os.path.abspath("rel")
    monkeypatch.setenv(launch.CACHE_ENV, str(tmp_path / "from-env"))
    _, cache, explicit = launch.parse_args(["t.py"])
    assert cache == str(tmp_path / "from-env") and not explicit


def test_no_compile_cache(clean_env):
    args, cache, _ = launch.parse_args(["--no-compile-cache", "--standalone", "t.py", "x"])
    assert cache is None and args.standalone and args.training_script_args == ["x"]
    assert launch.parse_args(["--no_compile_cache", "t.py"])[1] is None
    with pytest.raises(SystemExit):  # contradictory: argparse says so
        launch.parse_args(["--no-compile-cache", "--compile-cache", "d", "t.py"])


def test_flags_after_the_script_belong_to_the_script(clean_env):
    argv = ["--nproc-per-node", "4", "--master_port=1234", "-m", "pkg.train",
            "--compile-cache", "d", "--no-compile-cache", "--nproc_per_node=9"]
    args, cache, explicit = launch.parse_args(argv)
    assert not explicit and cache is None
    assert args.nproc_per_node == "4" and args.master_port == 1234 and args.module
    assert args.training_script == "pkg.train"
    assert args.training_script_args == ["--compile-cache", "d", "--no-compile-cache", "--nproc_per_node=9"]


def test_xlarun_flags_do_not_clash_with_torchrun():
    from torch.distributed.run import get_args_parser

    torchrun = {s for a in get_args_parser()._actions for s in a.option_strings}
    ours = {s for a in launch.get_args_parser()._actions for s in a.option_strings} - torchrun
    assert ours == {"--compile-cache", "--compile_cache", "--no-compile-cache", "--no_compile_cache"}


def test_workers_go_through_worker_mode_only_when_a_python_command_is_run(clean_env):
    args, _, _ = launch.parse_args(["-m", "pkg.train", "--lr", "1"])
    assert launch._route_through_worker_mode(args)
    assert args.training_script == os.path.abspath(launch.__file__) and not args.module
    assert args.training_script_args == [launch._WORKER_FLAG, "-m", "pkg.train", "--lr", "1"]
    for flag in ("--no-python", "--run-path"):
        args, _, _ = launch.parse_args([flag, "train.sh"])
        assert not launch._route_through_worker_mode(args)
        assert args.training_script == "train.sh"


# --- environment -----------------------------------------------------------------------------------


def test_prepare_sets_the_root_and_drops_inherited_torch_xla_values(tmp_path):
    env = {launch.XLA_CACHE_PATH: "/elsewhere", launch.XLA_CACHE_READ_ONLY: "1"}
    assert launch.prepare_compile_cache(str(tmp_path / "c"), explicit=True, env=env)
    assert env == {launch.CACHE_ENV: str(tmp_path / "c")}
    assert not (tmp_path / "c").exists()  # the workers create their own folders


def test_prepare_keeps_the_users_own_torch_xla_cache_unless_told(tmp_path):
    env = {launch.XLA_CACHE_PATH: "/mine", launch.CACHE_ENV: "/stale"}
    assert not launch.prepare_compile_cache(str(tmp_path / "c"), explicit=False, env=env)
    assert env == {launch.XLA_CACHE_PATH: "/mine"}


def test_no_cache_clears_every_cache_variable():
    env = {k: "x" for k in CACHE_VARS}
    env["OTHER"] = "y"
    assert not launch.prepare_compile_cache(None, env=env)
    assert env == {"OTHER": "y"}


def test_an_uncreatable_root_warns_and_turns_the_cache_off(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    env = {}
    with pytest.warns(RuntimeWarning, match="compile cache off"):
        assert not launch.prepare_compile_cache(str(blocker / "c"), env=env)
    assert env == {}


def test_worker_points_torch_xla_at_its_rank_folder(tmp_path):
    env = {launch.CACHE_ENV: str(tmp_path), "RANK": "3"}
    assert launch.set_worker_cache_env(env) == str(tmp_path / "rank3")
    assert env[launch.XLA_CACHE_PATH] == str(tmp_path / "rank3") and env[launch.XLA_CACHE_READ_ONLY] == "0"
    assert os.listdir(tmp_path) == ["rank3"] and os.listdir(tmp_path / "rank3") == []
    assert launch.set_worker_cache_env({}) is None
    env = {launch.CACHE_ENV: str(tmp_path)}  # no RANK: a single process is rank 0
    assert launch.set_worker_cache_env(env) == str(tmp_path / "rank0")


def test_read_only_folder_is_read_and_not_written(tmp_path, monkeypatch):
    (tmp_path / "rank0").mkdir()
    # root passes permission checks, so the write probe is what the test makes fail.
    monkeypatch.setattr(launch, "_writable", lambda path: False)
    env = {launch.CACHE_ENV: str(tmp_path), "RANK": "0"}
    with pytest.warns(RuntimeWarning, match="not writable"):
        assert launch.set_worker_cache_env(env) == str(tmp_path / "rank0")
    assert env[launch.XLA_CACHE_READ_ONLY] == "1"


def test_read_only_parent_of_a_missing_folder_turns_the_cache_off(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "_writable", lambda path: False)
    env = {launch.CACHE_ENV: str(tmp_path / "new"), "RANK": "0"}
    with pytest.warns(RuntimeWarning, match="compile cache off: cannot create .*read-only"):
        assert launch.set_worker_cache_env(env) is None
    assert launch.XLA_CACHE_PATH not in env


def test_a_folder_that_cannot_be_made_turns_the_cache_off(tmp_path):
    # /proc passes access(W_OK) for root, yet nothing can be created in it: torch_xla would raise
    # from the first training step.
    env = {launch.CACHE_ENV: "/proc/self/no-such-dir", "RANK": "0"}
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc")
    with pytest.warns(RuntimeWarning, match="compile cache off: cannot create"):
        assert launch.set_worker_cache_env(env) is None


def test_unusable_rank_folder_leaves_torch_xla_without_a_cache(tmp_path):
    (tmp_path / "rank0").write_text("a file where the folder should be")
    env = {launch.CACHE_ENV: str(tmp_path), "RANK": "0"}
    with pytest.warns(RuntimeWarning, match="compile cache off"):
        assert launch.set_worker_cache_env(env) is None
    assert launch.XLA_CACHE_PATH not in env


# --- metrics -------------------------------------------------------------------------------------------


def test_metrics_snapshot_carries_the_persistent_cache_counters():
    from accel.xla import XlaMetrics

    later = XlaMetrics(compiles=3, persistent_cache_hits=5, persistent_cache_misses=2,
                       persistent_cache_load_failures=1)
    earlier = XlaMetrics(compiles=1, persistent_cache_hits=1)
    delta = later - earlier
    assert (delta.compiles, delta.persistent_cache_hits, delta.persistent_cache_misses,
            delta.persistent_cache_load_failures) == (2, 4, 2, 1)
    assert "persistent compile cache: 4 loaded, 2 not found, 1 unloadable" in delta.report()
    assert "persistent" not in XlaMetrics(compiles=1).report()


# --- accel.xla's fallback (workers xlarun cannot wrap, other launchers) -----------------------------

needs_xla = pytest.mark.skipif(not xla_available(), reason="torch_xla is not installed")

HOOK_SCRIPT = r"""
import json, os, sys, warnings
import torch
import accel.xla as xm
warnings.simplefilter("error")  # no warning expected on this path
dev = xm.xla_device()
xm.xla_device()  # a second call must not initialise torch_xla's cache again
(torch.ones(3, device=dev) * 2).sum().item()
m = xm.metrics()
print(json.dumps({"path": os.environ.get("XLA_PERSISTENT_CACHE_PATH"), "misses": m.persistent_cache_misses,
                  "compiles": m.compiles}))
"""


@needs_xla
@pytest.mark.slow
def test_accel_xla_device_starts_the_cache_without_xlarun(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in CACHE_VARS}
    env.update({"PYTHONPATH": REPO + os.pathsep + env.get("PYTHONPATH", ""), "PJRT_DEVICE": "CPU",
                launch.CACHE_ENV: str(tmp_path), "RANK": "1"})
    proc = subprocess.run([sys.executable, "-c", HOOK_SCRIPT], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["path"] == str(tmp_path / "rank1")
    assert res["misses"] == res["compiles"] >= 1
    assert len(os.listdir(tmp_path / "rank1")) == res["compiles"]  # one entry per compiled graph


@needs_xla
def test_accel_xla_device_warns_when_torch_xla_compiled_first(monkeypatch, tmp_path):
    import torch
    import torch_xla

    from accel.xla import _device

    (torch.ones(2, device=torch_xla.device()) + 1).sum().item()  # the computation cache exists now
    for key in CACHE_VARS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv(launch.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(_device, "_compile_cache_checked", False)
    with pytest.warns(RuntimeWarning, match="compiled a graph before"):
        _device.xla_device()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _device.xla_device()  # checked once per process
    assert os.listdir(tmp_path) == []


# --- end to end --------------------------------------------------------------------------------------

# Uses torch_xla directly (no accel.xla.xla_device), so only xlarun's worker mode can have set the
# cache up; accel.xla.metrics() reads the counters. Two batch sizes: two graphs.
TRAIN = r"""
import json, os, sys
import torch, torch_xla
import accel.xla as xm

dev = torch_xla.device()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).to(dev)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for batch in (4, 4, 6):
    loss = model(torch.randn(batch, 8).to(dev)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    torch_xla.sync()
m = xm.metrics()
with open(os.path.join(sys.argv[1], "rank%s.json" % os.environ["RANK"]), "w") as f:
    json.dump({"compiles": m.compiles, "hits": m.persistent_cache_hits, "misses": m.persistent_cache_misses,
               "load_failures": m.persistent_cache_load_failures, "loss": loss.item()}, f)
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_twice(tmp_path, nproc):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k not in CACHE_VARS + ("CPU_NUM_DEVICES",)}
    env.update({"PYTHONPATH": REPO + os.pathsep + env.get("PYTHONPATH", ""), "PJRT_DEVICE": "CPU"})
    results = []
    for run in ("cold", "warm"):
        out = tmp_path / run
        out.mkdir()
        cmd = [sys.executable, "-m", "accel.launch", f"--nproc_per_node={nproc}", f"--master_port={_free_port()}",
               "--compile-cache", str(cache), str(script), str(out)]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results.append([json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)])
    return cache, results


@needs_xla
@pytest.mark.slow
def test_second_run_loads_every_graph_from_the_cache(tmp_path):
    nproc = 1  # two ranks double the run time on a 2-core machine; the launch test covers rank folders
    cache, (cold, warm) = _run_twice(tmp_path, nproc)
    for rank in range(nproc):
        entries = os.listdir(cache / f"rank{rank}")
        c, w = cold[rank], warm[rank]
        assert c["compiles"] == 2 and c["misses"] == 2 and c["hits"] == 0
        assert len(entries) == c["compiles"]
        assert w["loss"] == pytest.approx(c["loss"])
        # Every graph of the warm run was found on disk: loaded, or found but not loadable.
        assert w["misses"] == 0 and w["hits"] + w["load_failures"] == c["compiles"]
    if any(w["load_failures"] for w in warm):
        # torch_xla 2.9 serialises executables but its PJRT client cannot load them back
        # ("Deserializing serialized executable not supported"; pytorch/xla#9094 on TPU, #8930 on GPU,
        # the same on CPU), so the warm run compiles everything again.
        pytest.xfail("this torch_xla cannot load the executables it cached (pytorch/xla#9094)")
    assert all(w["compiles"] == 0 and w["hits"] == 2 for w in warm)
