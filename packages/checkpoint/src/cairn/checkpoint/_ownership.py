"""Who owns an in-progress save: owner-named temporary directories, heartbeats, safe cleanup.

A save writes into ``<final>.<host>_<hostid>_<pid>_<start>.cairn-tmp``: ``host`` is the
short host name (for people), ``hostid`` 12 hex digits of SHA-256 of (host name, kernel
boot id, PID namespace), ``pid`` the writing process and ``start`` its start time in clock
ticks since boot (``/proc/<pid>/stat``; 0 where there is no ``/proc``). One ``mkdir``
creates the name, so a temporary directory is never without its owner. While the save
runs, a heartbeat thread of the writing process touches the directory every
:data:`HEARTBEAT_S` seconds (its mtime is the lease).

:func:`cleanup_incomplete` (run when a manager opens, by readers too) removes a temporary
directory only when its writer is provably gone:

- same host id: the pid is not running, is a zombie, or started at another time (a reused
  pid); a directory of this very process is kept while its save runs;
- another host id (another machine, a rebooted one, another PID namespace) or a directory
  without an owner (written by cairn.checkpoint before ownership): its mtime is older than
  the lease timeout (:data:`DEFAULT_LEASE_TIMEOUT_S`, option ``tmp_lease_timeout_secs``).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import shutil
import socket
import threading
import time

from cairn.checkpoint._errors import CheckpointError
from cairn.checkpoint._fs import DELETE_SUFFIX, TMP_SUFFIX

HEARTBEAT_S = 10.0
DEFAULT_LEASE_TIMEOUT_S = 600.0

_log = logging.getLogger("cairn.checkpoint")
_TMP_RE = re.compile(
    r"(?P<final>.+?)(?:\.(?P<host>[A-Za-z0-9-]{0,32})_(?P<hid>[0-9a-f]{12})_(?P<pid>\d+)_(?P<start>\d+))?"
    + re.escape(TMP_SUFFIX)
)
_HAVE_PROC = os.path.isdir("/proc/self")

_lock = threading.Lock()
_live: set[str] = set()  # temporary directories this process is writing now
_heartbeat_pid: int | None = None


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


@functools.cache
def host_identity() -> tuple[str, str]:
    """(short host name made file-name safe, 12-hex-digit id of host, boot and PID namespace)."""
    host = socket.gethostname()
    boot = _read_text("/proc/sys/kernel/random/boot_id")
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = ""
    hid = hashlib.sha256(f"{host}\0{boot}\0{pidns}".encode()).hexdigest()[:12]
    short = re.sub(r"[^A-Za-z0-9-]", "-", host.split(".")[0])[:32]
    return short, hid


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of a running ``pid``, ``None`` if none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2 :].split()
    return fields[0].decode(), int(fields[19])  # fields 3 (state) and 22 (starttime)


def owner_token() -> str:
    short, hid = host_identity()
    pid = os.getpid()
    st = _proc_stat(pid) if _HAVE_PROC else None
    return f"{short}_{hid}_{pid}_{st[1] if st else 0}"


def tmp_name(final: str) -> str:
    """This process's temporary directory for ``final``."""
    return f"{os.path.abspath(final)}.{owner_token()}{TMP_SUFFIX}"


def _writer_alive(pid: int, start: int) -> bool:
    if not _HAVE_PROC:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    st = _proc_stat(pid)
    return st is not None and st[0] not in ("Z", "X") and (start == 0 or st[1] == start)


def renew_leases() -> None:
    """Touch every temporary directory this process is writing (their mtime is the lease)."""
    with _lock:
        live = list(_live)
    for tmp in live:
        try:
            os.utime(tmp)
        except OSError:
            pass


def _heartbeat() -> None:
    while True:
        time.sleep(HEARTBEAT_S)
        renew_leases()


def claim(final: str) -> str:
    """Create and register this process's temporary directory for ``final``; return it.

    A leftover of this process's own earlier failed save of ``final`` is replaced.
    """
    global _heartbeat_pid
    tmp = tmp_name(final)
    os.makedirs(os.path.dirname(tmp), exist_ok=True)
    with _lock:
        if tmp in _live:
            raise CheckpointError(f"{final} is already being saved by this process")
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
        os.makedirs(tmp)
        _live.add(tmp)
        if _heartbeat_pid != os.getpid():  # none yet, or we are a forked child
            _heartbeat_pid = os.getpid()
            threading.Thread(target=_heartbeat, name="cairn-checkpoint heartbeat", daemon=True).start()
    return tmp


def release(tmp: str, *, remove: bool) -> None:
    """The save into ``tmp`` ended (committed, or failed: then ``remove`` deletes it)."""
    with _lock:
        _live.discard(tmp)
    if remove:
        shutil.rmtree(tmp, ignore_errors=True)


def abandoned(full: str, lease_timeout_s: float) -> str | None:
    """Why the temporary directory ``full`` may be removed, or ``None`` if it may not."""
    m = _TMP_RE.fullmatch(os.path.basename(full))
    if m is None:
        return None
    if m["hid"] is not None and m["hid"] == host_identity()[1]:
        pid, start = int(m["pid"]), int(m["start"])
        if os.path.basename(full).endswith(f".{owner_token()}{TMP_SUFFIX}"):
            return None if full in _live else "left by a failed save of this process"
        if _writer_alive(pid, start):
            return None
        return f"its writer (pid {pid} on this host) has exited"
    try:
        age = time.time() - os.stat(full).st_mtime
    except OSError:
        return None
    if age <= lease_timeout_s:
        return None
    who = f"host {m['host']}" if m["hid"] else "an unknown writer"
    return f"its lease (owner: {who}) was not renewed for {age:.0f} s > {lease_timeout_s:.0f} s"


def cleanup_incomplete(
    parent: str, *, lease_timeout_s: float = DEFAULT_LEASE_TIMEOUT_S, final: str | None = None
) -> list[str]:
    """Remove leftovers of interrupted saves and deletes in ``parent`` whose writer is gone.

    Never touches a temporary directory whose writer may still be running (see the module
    docstring). ``final`` restricts the sweep to the temporary directories of that name.
    Returns what was removed.
    """
    removed: list[str] = []
    if not os.path.isdir(parent):
        return removed
    for name in os.listdir(parent):
        full = os.path.join(os.path.abspath(parent), name)
        if name.endswith(DELETE_SUFFIX) and final is None:
            why: str | None = "an interrupted delete"  # already invisible; its deleter ignores errors
            shutil.rmtree(full, ignore_errors=True)
        elif name.endswith(TMP_SUFFIX):
            m = _TMP_RE.fullmatch(name)
            if m is None or (final is not None and m["final"] != final):
                continue
            with _lock:  # a save of this process cannot register in between
                why = abandoned(full, lease_timeout_s)
                if why is not None:
                    shutil.rmtree(full, ignore_errors=True)
            if why is None:
                continue
        else:
            continue
        _log.info("cairn.checkpoint: removed %s (%s)", full, why)
        removed.append(full)
    return removed


def pending(final: str) -> bool:
    """Whether some save of ``final`` left or is writing a temporary directory."""
    parent, base = os.path.split(os.path.abspath(final))
    try:
        names = os.listdir(parent)
    except OSError:
        return False
    for name in names:
        m = _TMP_RE.fullmatch(name)
        if m is not None and m["final"] == base:
            return True
    return False
