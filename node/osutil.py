"""Small operating-system helpers shared by the node, the coordinator, tests and benchmarks:
durable files (fsync, hashing, removal), process bookkeeping through /proc (Linux), and a
wait for an event with a timeout that keeps a task cancellable."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
from pathlib import Path

HASH_BLOCK = 4 << 20  # bytes read at a time when hashing a file


async def woken(event: asyncio.Event, timeout: float) -> bool:
    """Wait until `event` is set (True) or `timeout` seconds pass (False). Not asyncio.wait_for:
    on Python 3.11, when the event is set in the loop iteration the waiting task is cancelled,
    wait_for returns and the cancel is lost, so a loop that waits this way serves on after its
    task was stopped (a SIGTERMed stage server did)."""
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
        return True
    except TimeoutError:
        return False


def write_json(path: Path, value) -> None:
    """`value` as JSON in `path`, replaced at once: a reader never sees half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a directory (a directory fsync makes renames and creates in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


def remove_tree(path: Path) -> None:
    """Remove a directory tree, missing or not; a symlink is unlinked, never followed."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.exists():
        shutil.rmtree(path, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stat_fields(entry: str) -> list[bytes] | None:
    """Fields of /proc/<pid>/stat after the command name: [state, ppid, pgrp, session, ...]."""
    try:
        with open(f"/proc/{entry}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _pids_where(index: int, value: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat_fields(entry)
        try:
            if fields is not None and int(fields[index]) == value and fields[0] != b"Z":
                out.append(int(entry))
        except (IndexError, ValueError):
            continue
    return out


def process_cpu(pid: int) -> tuple[str, float] | None:
    """(command name, CPU seconds it has used: user + system) of a process; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            head, _, rest = f.read().rpartition(b")")
        fields = rest.split()
        return head.partition(b"(")[2].decode(errors="replace"), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def children_of(pid: int) -> list[int]:
    """Live direct children of `pid`."""
    return _pids_where(1, pid)


def session_pids(sid: int) -> list[int]:
    """Live processes whose session id is `sid` (a process started with start_new_session and
    everything it started, unless they moved to another session)."""
    return _pids_where(3, sid)


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory for reuse instead of handing it back to the
    kernel. Averaging allocates and frees buffers of the same sizes every round, and pages handed
    back come back zero-filled on their next touch: that zeroing cost more CPU than it saved
    memory. After this call the process's footprint stays at its peak. One arena, no mmap'd chunks, no trimming. Returns
    whether it applied (False where the C library is not glibc)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
    ok = mallopt(M_ARENA_MAX, 1) == 1
    ok &= mallopt(M_MMAP_MAX, 0) == 1
    ok &= mallopt(M_TRIM_THRESHOLD, (1 << 31) - 1) == 1  # an int: the largest it takes
    return bool(ok)
