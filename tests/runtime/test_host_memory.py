"""accel.runtime.host_memory: glibc keeps freed memory, so re-created large tensors cost no page faults."""
import subprocess
import sys
import textwrap

import pytest

from accel.runtime import host_memory

GLIBC = (host_memory._glibc() is not None and sys.platform.startswith("linux")
         and host_memory._preloaded_allocator() is None)
NOT_GLIBC = ("keep_freed_memory sets glibc's malloc options; this process's malloc is not glibc's (another C "
             "library, or jemalloc / tcmalloc / mimalloc preloaded)")
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


@pytest.mark.skipif(not GLIBC, reason=NOT_GLIBC)
def test_a_recreated_large_tensor_reuses_mapped_memory():
    # glibc's default maps a 64 MiB block afresh each time: every round faults, at least once per 2 MiB (a huge
    # page where the kernel gives one). Kept, the heap grows over the first rounds (an aligned request may not
    # fit the block just freed; on glibc 2.36 rounds 1-5 of 16 faulted, now and then one more later) and then
    # serves the tensor from memory it holds: most rounds fault on none of the 16384 pages.
    assert all(n >= 64 * MIB // (2 * MIB) for n in _faults("default"))
    assert sum(n < PAGES // 100 for n in _faults("keep")) >= 7


class _FakeLibc:
    """Records mallopt calls; returns what glibc returns on success (1)."""

    def __init__(self, result=1):
        self.calls, self.result = [], result

    def mallopt(self, option, value):
        self.calls.append((option, value))
        return self.result

    def malloc_trim(self, pad):
        self.calls.append(("malloc_trim", pad))
        return self.result


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(host_memory, "_kept", False)
    monkeypatch.setattr(host_memory, "_preloaded_allocator", lambda: None)
    libc = _FakeLibc()
    monkeypatch.setattr(host_memory, "_glibc", lambda: libc)
    return libc


def test_sets_no_mmap_and_no_trimming_once(fresh):
    assert host_memory.keep_freed_memory() is True
    # glibc <malloc.h>: M_MMAP_MAX -4, M_TRIM_THRESHOLD -1; the largest int mallopt takes
    assert fresh.calls == [(-4, 0), (-1, 2**31 - 1)]
    assert host_memory.keep_freed_memory() is True and len(fresh.calls) == 2


def test_changes_nothing_where_malloc_is_not_glibc(fresh, monkeypatch):
    monkeypatch.setattr(host_memory, "_glibc", lambda: None)
    assert host_memory.keep_freed_memory() is False


def test_leaves_a_preloaded_allocator_alone(fresh, monkeypatch):
    monkeypatch.setattr(host_memory, "_preloaded_allocator", lambda: "jemalloc")
    assert host_memory.keep_freed_memory() is False
    assert fresh.calls == []


def test_a_refused_option_is_reported(fresh):
    fresh.result = 0
    assert host_memory.keep_freed_memory() is False
    fresh.result = 1  # a later call tries again
    assert host_memory.keep_freed_memory() is True


def test_finds_a_preloaded_allocator_in_the_process_maps(monkeypatch, tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 42 /usr/lib/x86_64-linux-gnu/libtcmalloc.so.4\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(maps if path == "/proc/self/maps" else path,
                                                                        *a, **k))
    assert host_memory._preloaded_allocator() == "tcmalloc"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 42 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert host_memory._preloaded_allocator() is None


def test_return_freed_memory_trims_through_glibc(fresh, monkeypatch):
    assert host_memory.return_freed_memory() is True
    assert fresh.calls == [("malloc_trim", 0)]
    monkeypatch.setattr(host_memory, "_glibc", lambda: None)
    assert host_memory.return_freed_memory() is False


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


@pytest.mark.skipif(not GLIBC, reason=NOT_GLIBC)
def test_return_freed_memory_hands_kept_memory_back():
    out = subprocess.run([sys.executable, "-c", _RSS_PROBE], capture_output=True, text=True, check=True)
    kept, after = (int(v) for v in out.stdout.split()[-2:])
    # the freed 256 MiB stays resident while kept, and leaves with the trim
    assert kept - after >= 200
