"""Readers never delete a live writer's save; only provably dead writers' leftovers go."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

import cairn.checkpoint as cc
from cairn.checkpoint import _ownership

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_ckpt_race_worker.py")
sys.path.insert(0, HERE)
from _ckpt_race_worker import check  # noqa: E402


def _race(tmp_path, steps: int, readers: int) -> dict:
    """A writer saves ``steps`` steps while ``readers`` processes re-open the manager and
    restore the latest step in a loop; then every step the writer was told was committed
    must restore with the right values."""
    d = str(tmp_path / "ckpts")
    stop = str(tmp_path / "stop")
    rs = [
        subprocess.Popen([sys.executable, WORKER, "reader", d, stop], stdout=subprocess.PIPE, text=True)
        for _ in range(readers)
    ]
    try:
        w = subprocess.run(
            [sys.executable, WORKER, "writer", d, str(steps)], capture_output=True, text=True, timeout=600
        )
    finally:
        open(stop, "w").close()
        outs = [r.communicate(timeout=120)[0] for r in rs]
    assert w.returncode == 0, w.stderr[-3000:]
    committed = [int(line.split()[1]) for line in w.stdout.splitlines() if line.startswith("COMMITTED")]
    failed = [line for line in w.stdout.splitlines() if line.startswith("FAILED")]
    bad = [line for out in outs for line in out.splitlines() if line.startswith("BAD")]
    reads = [int(line.split()[1]) for out in outs for line in out.splitlines() if line.startswith("READS")]
    mngr = cc.CheckpointManager(d)
    lost = []
    for step in committed:
        try:
            check(mngr.restore(step), step)
        except Exception as err:  # noqa: BLE001 - collected, then asserted empty
            lost.append((step, repr(err)[:300]))
    assert lost == [], f"{len(lost)} of {len(committed)} committed steps lost: {lost[:5]}"
    assert failed == [], f"{len(failed)} saves failed: {failed[:3]}"
    assert committed == list(range(steps))
    assert bad == [], f"{len(bad)} failed reads: {bad[:3]}"
    assert len(reads) == readers and all(n > 0 for n in reads), reads
    assert sorted(os.listdir(d)) == sorted(str(s) for s in committed)  # no leftovers
    print(f"reader race: {len(committed)} steps, {readers} readers, {sum(reads)} restores, 0 lost")
    return {"steps": len(committed), "readers": readers, "reads": sum(reads), "lost": len(lost)}


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
@pytest.mark.multiprocess
def test_polling_readers_never_destroy_a_live_save(tmp_path):
    out = _race(tmp_path, steps=30, readers=3)
    assert out["lost"] == 0


@pytest.mark.slow
@pytest.mark.multiprocess
def test_polling_readers_never_destroy_a_live_save_hundreds_of_steps(tmp_path):
    out = _race(tmp_path, steps=300, readers=4)
    assert out["lost"] == 0


def _owned(tmp_path, step: int, host: str, hid: str, pid: int, start: int):
    p = tmp_path / f"{step}.{host}_{hid}_{pid}_{start}.cairn-tmp"
    (p / "x").mkdir(parents=True)
    return p


def test_cleanup_removes_only_provably_abandoned_saves(tmp_path):
    short, hid = _ownership.host_identity()
    live = subprocess.Popen(["sleep", "60"])
    dead = subprocess.Popen(["sleep", "60"])
    try:
        live_start = _ownership._proc_stat(live.pid)[1]
        dead_start = _ownership._proc_stat(dead.pid)[1]
        dead.kill()
        dead.wait()
        keep = {
            "live writer on this host": _owned(tmp_path, 1, short, hid, live.pid, live_start),
            "another host, fresh lease": _owned(tmp_path, 2, "other", "0123456789ab", 42, 7),
            "no owner (old version), fresh": tmp_path / "3.cairn-tmp",
        }
        keep["no owner (old version), fresh"].mkdir()
        gone = {
            "exited writer": _owned(tmp_path, 4, short, hid, dead.pid, dead_start),
            "reused pid (other start time)": _owned(tmp_path, 5, short, hid, live.pid, live_start + 1),
            "another host, stale lease": _owned(tmp_path, 6, "other", "0123456789ab", 42, 7),
            "no owner (old version), stale": tmp_path / "7.cairn-tmp",
            "interrupted delete": tmp_path / "8.cairn-del",
        }
        gone["no owner (old version), stale"].mkdir()
        gone["interrupted delete"].mkdir()
        old = time.time() - 700
        for p in (gone["another host, stale lease"], gone["no owner (old version), stale"]):
            os.utime(p, (old, old))
        removed = _ownership.cleanup_incomplete(str(tmp_path), lease_timeout_s=600)
        assert sorted(removed) == sorted(str(p) for p in gone.values())
        for why, p in keep.items():
            assert p.exists(), why
        for why, p in gone.items():
            assert not p.exists(), why
    finally:
        live.kill()
        live.wait()


def test_a_second_manager_in_the_same_process_keeps_the_running_save(tmp_path, monkeypatch):
    """A reader opened while this process's own async save runs leaves it alone; the save
    commits and verifies."""
    from cairn.checkpoint import _tree

    opened = []
    orig = _tree.write

    def write(snap, directory, **kw):
        opened.append(cc.CheckpointManager(tmp_path))  # a reader opens mid-save
        assert os.path.isdir(directory)
        orig(snap, directory, **kw)

    monkeypatch.setattr(_tree, "write", write)
    with cc.CheckpointManager(tmp_path) as mngr:
        mngr.save(1, {"m": {"w": np.arange(4.0)}})
    assert opened and cc.CheckpointManager(tmp_path).all_steps() == [1]


def test_save_fails_loudly_when_its_step_is_damaged_during_the_commit(tmp_path, monkeypatch):
    """The writer verifies the committed step before reporting success: a step whose files
    were removed under it (what an old reader's cleanup did) raises instead of succeeding."""
    from cairn.checkpoint import _fs

    orig = _fs.commit

    def commit(tmp, final, info):
        os.remove(os.path.join(tmp, "m", "_METADATA.json"))  # someone deletes part of the save
        orig(tmp, final, info)

    monkeypatch.setattr(_fs, "commit", commit)
    mngr = cc.CheckpointManager(tmp_path)
    mngr.save(1, {"m": {"w": np.arange(4.0)}})
    with pytest.raises(cc.CheckpointError, match=r"was committed but does not verify.*_METADATA.json"):
        mngr.wait_until_finished()
    assert mngr.all_steps() == [] and 1 in mngr.corrupt_steps()


def test_lease_timeout_option_is_validated():
    with pytest.raises(ValueError, match="tmp_lease_timeout_secs"):
        cc.CheckpointManagerOptions(tmp_lease_timeout_secs=5)


def test_a_running_save_renews_its_lease_and_stops_when_done(tmp_path):
    final = str(tmp_path / "5")
    tmp = _ownership.claim(final)
    try:
        old = time.time() - 1000
        os.utime(tmp, (old, old))
        _ownership.renew_leases()  # what the heartbeat thread does every HEARTBEAT_S
        assert time.time() - os.stat(tmp).st_mtime < 60
        # a reader with a short lease timeout still keeps it: same host, live writer
        assert _ownership.cleanup_incomplete(str(tmp_path), lease_timeout_s=30) == []
    finally:
        _ownership.release(tmp, remove=False)
    os.utime(tmp, (old, old))
    _ownership.renew_leases()
    assert os.stat(tmp).st_mtime == pytest.approx(old)  # released: no longer renewed
    assert _ownership.cleanup_incomplete(str(tmp_path)) == [tmp]  # this process's failed save
