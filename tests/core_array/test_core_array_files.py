"""cairn.core_array's durable files: the atomic write (a crash at any step leaves the old or the
new file, never part of one), concurrent writers, and the checksummed-JSON format's errors."""

from __future__ import annotations

import concurrent.futures
import errno
import json
import os
import subprocess
import sys
import threading

import pytest

import cairn.core_array as ca

OLD = b"old content\n" * 1000
NEW = b"NEW CONTENT!\n" * 5000

# The child replaces ``path`` with NEW and dies (os._exit, no cleanup) at one step of the write.
_CRASH = r"""
import os, sys
from cairn.core_array import atomic_write
path, step, new = sys.argv[1], sys.argv[2], open(sys.argv[3], "rb").read()
real_fsync, real_replace = os.fsync, os.replace
def fsync(fd):
    if step == "before_file_fsync":
        os._exit(3)
    real_fsync(fd)
    if step == "after_file_fsync":
        os._exit(3)
def replace(a, b):
    real_replace(a, b)
    if step == "after_rename":  # before the directory is synced
        os._exit(3)
os.fsync, os.replace = fsync, replace
def write(tmp):
    with open(tmp, "wb") as f:
        f.write(new[: len(new) // 2])
        f.flush()
        if step == "mid_write":
            os._exit(3)
        f.write(new[len(new) // 2 :])
atomic_write(path, write)
os._exit(0)
"""

STEPS = {"mid_write": OLD, "before_file_fsync": OLD, "after_file_fsync": OLD, "after_rename": NEW, "none": NEW}


@pytest.mark.parametrize("step", list(STEPS))
def test_a_crash_at_any_step_leaves_the_old_or_the_new_file_whole(tmp_path, step):
    target = tmp_path / "state.bin"
    target.write_bytes(OLD)
    payload = tmp_path / "payload"
    payload.write_bytes(NEW)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-c", _CRASH, str(target), step, str(payload)], env=env,
                       capture_output=True, timeout=120)
    assert r.returncode == (0 if step == "none" else 3), r.stderr.decode()[-2000:]
    assert target.read_bytes() == STEPS[step]
    # what a crash can leave behind is a hidden temporary sibling, never a file under the target's name
    strays = sorted(p.name for p in tmp_path.iterdir() if p.name not in ("state.bin", "payload"))
    assert all(n.startswith(".state.bin.") and n.endswith(".tmp") for n in strays), strays
    if step in ("none", "after_rename"):
        assert strays == []


def test_the_target_is_absent_until_the_rename_for_a_new_file(tmp_path):
    target = tmp_path / "new.json"
    seen = []

    def write(tmp: str) -> None:
        seen.append(target.exists())
        with open(tmp, "w") as f:
            f.write("{}")

    ca.atomic_write(target, write)
    assert seen == [False] and target.read_text() == "{}"


def test_a_failed_write_leaves_the_target_and_no_temporary(tmp_path):
    target = tmp_path / "t.txt"
    target.write_text("before")

    def boom(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write("half")
        raise RuntimeError("writer failed")

    with pytest.raises(RuntimeError, match="writer failed"):
        ca.atomic_write(target, boom)
    with pytest.raises(TypeError):
        ca.atomic_write_json(target, {"x": object()})
    assert target.read_text() == "before"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.txt"]


def test_a_full_disk_names_the_file_and_keeps_errno(tmp_path, monkeypatch):
    target = tmp_path / "t.bin"
    target.write_bytes(OLD)
    real_fsync = os.fsync

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match=r"t\.bin") as info:
        ca.atomic_write_bytes(target, NEW)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert info.value.errno == errno.ENOSPC
    assert target.read_bytes() == OLD
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.bin"]


def test_concurrent_writers_and_readers_see_only_whole_files(tmp_path):
    target = tmp_path / "shared.json"
    payloads = [json.dumps({"writer": w, "pad": "x" * (20_000 + 997 * w)}) for w in range(4)]
    ca.atomic_write_text(target, payloads[0])
    stop = threading.Event()
    bad: list[str] = []

    def reader() -> None:
        while not stop.is_set():
            text = target.read_text()
            if text not in payloads:
                bad.append(text[:80])

    def writer(w: int) -> None:
        for _ in range(25):
            ca.atomic_write_text(target, payloads[w])

    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        read = pool.submit(reader)
        for done in [pool.submit(writer, w) for w in range(4)]:
            done.result()
        stop.set()
        read.result()
    assert bad == []
    assert target.read_text() in payloads
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shared.json"]


def test_atomic_write_json_and_text_round_trip(tmp_path):
    ca.atomic_write_json(tmp_path / "a.json", {"b": [1, 2.5, None]}, sort_keys=True)
    assert json.loads((tmp_path / "a.json").read_text()) == {"b": [1, 2.5, None]}
    ca.atomic_write_text(tmp_path / "t.txt", "héllo")
    assert (tmp_path / "t.txt").read_bytes() == "héllo".encode()


def test_atomic_rename_and_fsync_tree_commit_a_directory(tmp_path):
    tmp = tmp_path / ".out.tmp"
    (tmp / "sub").mkdir(parents=True)
    (tmp / "sub" / "f").write_bytes(b"1")
    ca.fsync_tree(tmp)
    ca.atomic_rename(tmp, tmp_path / "out")
    assert (tmp_path / "out" / "sub" / "f").read_bytes() == b"1" and not tmp.exists()
    with pytest.raises(OSError, match="out"):
        ca.atomic_rename(tmp_path / "missing", tmp_path / "out2")


# --- checksummed JSON ---


def test_checksummed_json_round_trips_and_is_plain_json(tmp_path):
    doc = {"step": 3, "names": ["a/b", "c"], "x": 1.5}
    path = tmp_path / "m.json"
    ca.write_checksummed_json(path, doc)
    assert ca.read_checksummed_json(path) == doc
    outer = json.loads(path.read_bytes())
    assert set(outer) == {"checksum", "body"} and outer["body"] == doc
    assert outer["checksum"].startswith("sha256:") and len(outer["checksum"]) == 7 + 64


def _damaged(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :]


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda d: _damaged(d, len(d) - 10), "checksum mismatch"),
        (lambda d: d[: len(d) - 5], "damaged or the file is truncated"),
        (lambda d: _damaged(d, 3), "damaged or the file is truncated"),
        (lambda d: d[:30] + b"z" + d[31:], "damaged or the file is truncated"),  # a digit of the digest
        (lambda d: _damaged(d, 30), "checksum mismatch"),  # another hex digit
        (lambda d: json.dumps(json.loads(d)["body"]).encode(), "lacks the sha256 checksum"),
        (lambda d: b"{not json", "lacks the sha256 checksum"),
    ],
)
def test_damage_raises_corrupt_file_error_naming_the_file(tmp_path, damage, reason):
    path = tmp_path / "meta.json"
    ca.write_checksummed_json(path, {"a": list(range(20))})
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ca.CorruptFileError, match=reason) as info:
        ca.read_checksummed_json(path)
    assert info.value.path == str(path) and str(path) in str(info.value)
    assert isinstance(info.value, ValueError)


def test_plain_json_is_read_only_when_no_checksum_is_required(tmp_path):
    path = tmp_path / "old.json"
    path.write_text('{"a": 1}')
    assert ca.read_checksummed_json(path, require_checksum=False) == {"a": 1}
    assert ca.loads_checksummed_json(b'{"a": 1}', "old.json", require_checksum=False) == ({"a": 1}, False)
    with pytest.raises(ca.CorruptFileError, match=r"old\.json is corrupt: not valid JSON"):
        ca.loads_checksummed_json(b'{"a": ', "old.json", require_checksum=False)


def test_a_body_that_is_not_json_is_named(tmp_path):
    body = b"{bad json"
    import hashlib

    data = b'{"checksum": "sha256:' + hashlib.sha256(body).hexdigest().encode() + b'", "body": ' + body + b"}\n"
    with pytest.raises(ca.CorruptFileError, match=r"x\.json is corrupt: not valid JSON"):
        ca.loads_checksummed_json(data, "x.json")
