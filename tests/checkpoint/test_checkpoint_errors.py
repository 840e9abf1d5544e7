"""Bad input and failing disks raise errors that name the path, pattern or file."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

import cairn.checkpoint as cc


@pytest.fixture
def saved(tmp_path):
    d = tmp_path / "c"
    cc.save(d, {"n": 3, "s": "run-1", "flag": True, "x": 0.5, "w": np.arange(3, dtype=np.int64)})
    return d


@pytest.mark.parametrize(
    "target,message",
    [
        ({"n": "3"}, r"'n': checkpoint has a int scalar, the target a str"),
        ({"s": 0}, r"'s': checkpoint has a str scalar, the target a int"),
        ({"s": 0.0}, r"'s': checkpoint has a str scalar, the target a float"),
        ({"flag": "yes"}, r"'flag': checkpoint has a bool scalar, the target a str"),
        ({"n": False}, r"'n': checkpoint has a int scalar, the target a bool"),
        ({"w": "abc"}, r"'w': checkpoint has an array \(shape \(3,\) int64\), the target a str"),
    ],
)
def test_scalar_target_of_another_type_raises_naming_the_path(saved, target, message):
    with pytest.raises(cc.TargetMismatchError, match=message):
        cc.restore(saved, target, partial=True)


def test_numeric_scalar_targets_still_accept_numbers(saved):
    got = cc.restore(saved, {"n": 0, "x": 0.0, "s": "", "flag": False}, partial=True)
    assert got == {"n": 3, "x": 0.5, "s": "run-1", "flag": True}


@pytest.mark.parametrize("paths", ["w(", ["n", "[x"], "*"])
def test_bad_paths_regex_raises_value_error_naming_the_pattern(saved, paths):
    bad = paths if isinstance(paths, str) else paths[1]
    with pytest.raises(ValueError, match=rf"paths pattern '{__import__('re').escape(bad)}' is not a valid regular"):
        cc.restore(saved, paths=paths)


def test_bad_paths_regex_is_core_array_path_error(saved):
    """Patterns compile through core_array.compile_pattern, as every package's do."""
    from cairn.core_array import PathError

    with pytest.raises(PathError, match=r"paths pattern 'w\(' is not a valid regular expression: missing \)"):
        cc.restore(saved, paths="w(")
    with pytest.raises(TypeError, match="paths must be a regex string"):
        cc.restore(saved, paths=[3])


def _enospc_on_fsync(monkeypatch, name: str) -> list[str]:
    """Make fsync of files named ``name`` fail as a full disk does: ENOSPC, no file name."""
    real = os.fsync
    hits: list[str] = []

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if os.path.basename(path) == name:
            hits.append(path)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return hits


FILES = ["_REGIONS.process_0.json", "_METADATA.json", "state.process_0.json", "_STEP.json", "COMMIT"]


class It:
    def get_state(self):
        return {"i": 1}

    def set_state(self, s):
        pass


@pytest.mark.parametrize("enable_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("name", FILES)
def test_full_disk_names_the_file_keeps_errno_and_earlier_steps(tmp_path, monkeypatch, name, enable_async):
    mngr = cc.CheckpointManager(tmp_path, cc.CheckpointManagerOptions(enable_async=enable_async))
    mngr.save(1, {"m": {"w": np.ones(8)}, "it": It()})
    mngr.wait_until_finished()
    hits = _enospc_on_fsync(monkeypatch, name)
    with pytest.raises(cc.CheckpointWriteError, match=rf"cannot write .*/{name}: No space left") as info:
        mngr.save(2, {"m": {"w": np.zeros(8)}, "it": It()})
        mngr.wait_until_finished()
    assert hits and info.value.errno == errno.ENOSPC and isinstance(info.value, OSError)
    monkeypatch.undo()
    assert mngr.all_steps() == [1] and sorted(os.listdir(tmp_path)) == ["1"]  # nothing left over
    np.testing.assert_array_equal(mngr.restore(1)["m"]["w"], np.ones(8))


def test_full_disk_in_single_directory_save_names_the_file(tmp_path, monkeypatch):
    _enospc_on_fsync(monkeypatch, "_METADATA.json")
    with pytest.raises(cc.CheckpointWriteError, match=r"cannot write .*c\..*cairn-tmp/_METADATA.json") as info:
        cc.save(tmp_path / "c", {"w": np.ones(3)})
    assert info.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []


def test_read_only_directory_raises_and_keeps_earlier_steps(tmp_path, monkeypatch):
    """Tests run as root, where chmod does not stop writes: the read-only file system is
    injected where a save first writes (creating its temporary directory)."""
    mngr = cc.CheckpointManager(tmp_path, cc.CheckpointManagerOptions(enable_async=True))
    mngr.save(1, {"m": {"w": np.ones(8)}})
    mngr.wait_until_finished()
    real = os.mkdir

    def mkdir(path, *a, **k):
        if str(path).endswith(".cairn-tmp"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real(path, *a, **k)

    monkeypatch.setattr(os, "mkdir", mkdir)
    with pytest.raises(OSError, match=r"Read-only file system: '.*/2\..*\.cairn-tmp'") as info:
        mngr.save(2, {"m": {"w": np.zeros(8)}})
    assert info.value.errno == errno.EROFS
    monkeypatch.undo()
    assert mngr.all_steps() == [1] and sorted(os.listdir(tmp_path)) == ["1"]
    np.testing.assert_array_equal(cc.CheckpointManager(tmp_path).restore()["m"]["w"], np.ones(8))
