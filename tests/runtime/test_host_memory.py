"""accel.runtime.host_memory: freed large CPU tensors' memory kept for reuse (accel's caching allocator), so
re-created large tensors cost no page faults, and memory stays bounded when their sizes change."""
import subprocess
import sys
import textwrap
import warnings

import pytest

from accel.runtime import host_memory

LINUX = sys.platform.startswith("linux") and host_memory._preloaded_allocator() is None
NOT_LINUX = ("page faults and resident memory are read from Linux's /proc and getrusage, with glibc's malloc as the "
             "default (no jemalloc / tcmalloc / mimalloc preloaded)")
MIB = 1 << 20

# In a fresh process (mallopt changes the whole process): touch a 64 MiB tensor and free it, 6 warm-up rounds
# and 10 measured ones, and print each measured round's minor page faults.
_PROBE = textwrap.dedent("""
    import resource, sys
    import torch
    from accel.runtime.host_memory import keep_freed_memory
    if sys.argv[1] == "keep":
        assert keep_freed_memory()
    def touch():
        t = torch.empty(64 << 20, dtype=torch.uint8)
        t.fill_(1)
        del t
    for _ in range(6):
        touch()
    for _ in range(10):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        touch()
        print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")
PAGES = 64 * MIB // 4096


def _faults(mode: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True)
    return [int(v) for v in out.stdout.split()[-10:]]


@pytest.mark.skipif(not LINUX, reason=NOT_LINUX)
def test_a_recreated_large_tensor_reuses_mapped_memory():
    # glibc's default maps a 64 MiB block afresh each time: every round faults, at least once per 2 MiB (a huge
    # page where the kernel gives one). Kept, the block freed is the next tensor's: no measured round faults on
    # more than 1% of its 16384 pages.
    assert all(n >= 64 * MIB // (2 * MIB) for n in _faults("default"))
    assert all(n < PAGES // 100 for n in _faults("keep"))


@pytest.fixture
def fresh(monkeypatch):
    """keep_freed_memory() as in a process that has not called it, accel's ops recorded (a fake)."""
    calls = []

    class FakeOps:
        def host_memory_install(self, min_bytes):
            calls.append(("install", min_bytes))
            return True

    monkeypatch.setattr(host_memory, "_kept", False)
    monkeypatch.setattr(host_memory, "_build_error", None)
    monkeypatch.setattr(host_memory, "_preloaded_allocator", lambda: None)
    monkeypatch.setattr(host_memory, "_ops", FakeOps)
    return calls


def test_installs_the_allocator_once_for_blocks_of_1_mib(fresh):
    assert host_memory.keep_freed_memory() is True
    assert host_memory.keep_freed_memory() is True
    assert fresh == [("install", MIB)] and host_memory.MIN_BYTES == MIB


def test_leaves_a_preloaded_allocator_alone(fresh, monkeypatch):
    monkeypatch.setattr(host_memory, "_preloaded_allocator", lambda: "jemalloc")
    assert host_memory.keep_freed_memory() is False
    assert fresh == []


def test_a_failed_build_warns_and_changes_nothing(fresh, monkeypatch):
    def no_compiler():
        raise RuntimeError("Error building extension 'accel_host_memory'")

    monkeypatch.setattr(host_memory, "_ops", no_compiler)
    with pytest.warns(UserWarning, match="keep_freed_memory: accel's host allocator could not be built"):
        assert host_memory.keep_freed_memory() is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: a later call neither builds again nor warns again
        assert host_memory.keep_freed_memory() is False
    assert host_memory.kept_memory_stats() == dict.fromkeys(
        ("mapped_bytes", "kept_bytes", "hits", "misses", "peak_live_bytes", "min_bytes"), 0)


def test_finds_a_preloaded_allocator_in_the_process_maps(monkeypatch, tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 42 /usr/lib/x86_64-linux-gnu/libtcmalloc.so.4\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(maps if path == "/proc/self/maps" else path,
                                                                        *a, **k))
    assert host_memory._preloaded_allocator() == "tcmalloc"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 42 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert host_memory._preloaded_allocator() is None


_RSS_PROBE = textwrap.dedent("""
    import torch
    from accel.runtime.host_memory import keep_freed_memory, return_freed_memory
    def rss_mib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 >> 20
    assert keep_freed_memory()
    t = torch.empty(256 << 20, dtype=torch.uint8)
    t.fill_(1)
    del t
    kept = rss_mib()
    assert return_freed_memory()
    print(kept, rss_mib())
""")


@pytest.mark.skipif(not LINUX, reason=NOT_LINUX)
def test_return_freed_memory_hands_kept_memory_back():
    out = subprocess.run([sys.executable, "-c", _RSS_PROBE], capture_output=True, text=True, check=True)
    kept, after = (int(v) for v in out.stdout.split()[-2:])
    # the freed 256 MiB stays resident while kept, and leaves with the trim
    assert kept - after >= 200


# Sizes that change every round (8-64 MiB, 3 live at a time, 60 rounds), then a static step's sizes again and
# again; prints the allocator's stats after each phase, the largest live bytes, and whether every tensor held
# what was written to it.
_SIZES_PROBE = textwrap.dedent("""
    import json, random
    import torch
    from accel.runtime.host_memory import keep_freed_memory, kept_memory_stats
    assert keep_freed_memory()
    rng = random.Random(0)
    live, peak, intact = [], 0, True
    for i in range(60):
        n = rng.randrange(8 << 20, 64 << 20)
        t = torch.empty(n, dtype=torch.uint8).fill_(i % 251)
        live.append((t, i % 251))
        peak = max(peak, sum(t.numel() for t, _ in live))
        if len(live) > 3:
            old, value = live.pop(0)
            intact &= bool((old == value).all())
    live.clear()
    del t, old
    changing = kept_memory_stats()
    for i in range(20):
        step = [torch.full((s << 20,), i, dtype=torch.uint8) for s in (24, 40, 24, 3)]
        intact &= all(bool((t == i).all()) for t in step)
        del step
        if i == 0:
            first = kept_memory_stats()
    print(json.dumps({"changing": changing, "first": first, "static": kept_memory_stats(), "peak": peak,
                      "intact": intact}))
""")


def test_changing_sizes_keep_memory_bounded_and_static_ones_hit():
    import json

    out = subprocess.run([sys.executable, "-c", _SIZES_PROBE], capture_output=True, text=True, check=True)
    report = json.loads(out.stdout.splitlines()[-1])
    changing, static, peak = report["changing"], report["static"], report["peak"]
    assert report["intact"]  # a reused block is the new tensor's alone
    # the live peak: 4 tensors at once, and at most a comparison's 64 MiB of booleans beside them
    assert peak <= changing["peak_live_bytes"] <= peak + 64 * MIB + 4 * 4096
    # never more mapped than a quarter above the live peak, plus the one block of a miss (64 MiB at most)
    assert changing["mapped_bytes"] <= changing["peak_live_bytes"] * 5 // 4 + 64 * MIB
    assert changing["mapped_bytes"] == changing["kept_bytes"]  # nothing live once the tensors are gone
    # the static step (4 tensors and 4 comparisons a round): its first round maps what the kept blocks cannot
    # serve, every later round finds all 8 blocks kept
    first = report["first"]
    assert static["misses"] == first["misses"] and static["hits"] - first["hits"] == 19 * 8


_FORK_PROBE = textwrap.dedent("""
    import torch
    from accel.runtime.host_memory import keep_freed_memory
    assert keep_freed_memory()

    class Big(torch.utils.data.Dataset):
        def __len__(self):
            return 8
        def __getitem__(self, i):
            return torch.full((2 << 20,), float(i))  # 8 MiB: the allocator's, in the worker

    keep = torch.empty(16 << 20)  # a block live in the parent at the fork
    loader = torch.utils.data.DataLoader(Big(), batch_size=2, num_workers=2, multiprocessing_context="fork")
    print(sum(float(b[:, 0].sum()) for b in loader))
""")


@pytest.mark.skipif(not LINUX, reason=NOT_LINUX)
def test_forked_loader_workers_allocate_through_it():
    out = subprocess.run([sys.executable, "-c", _FORK_PROBE], capture_output=True, text=True, check=True, timeout=300)
    assert float(out.stdout.split()[-1]) == sum(range(8))
