"""accel.utils.atomic_file.atomic_write: whole or nothing, with open()'s mode, through symlinks."""
import os
import stat

import pytest

from accel.utils.atomic_file import atomic_write


def _write(text):
    return lambda f: f.write(text)


def test_writes_whole_files_with_the_mode_open_gives(tmp_path):
    old = os.umask(0o022)
    try:
        path = tmp_path / "a.json"
        atomic_write(path, _write("one"), binary=False)
        atomic_write(path, _write("two"), binary=False)
    finally:
        os.umask(old)
    assert path.read_text() == "two"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert os.listdir(tmp_path) == ["a.json"]  # no temporary file left


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "a.bin"
    path.write_bytes(b"old")

    def fail(f):
        f.write(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(path, fail)
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["a.bin"]


def test_writes_through_a_symlink_and_names_the_path_when_the_folder_is_missing(tmp_path):
    target = tmp_path / "real.bin"
    link = tmp_path / "link.bin"
    target.write_bytes(b"old")
    link.symlink_to(target)
    atomic_write(link, lambda f: f.write(b"new"))
    assert link.is_symlink() and target.read_bytes() == b"new"
    missing = tmp_path / "nope" / "ck.pt"
    with pytest.raises(FileNotFoundError) as info:
        atomic_write(missing, lambda f: f.write(b"x"))
    assert info.value.filename == str(missing)
