"""One run per output directory: an exclusive lock, and no fresh run over an old one.

    lock = RunLock(out)                 # raises RunDirError naming the holder if another run has it
    lock.acquire()                      # held until this process exits (or lock.release())
    refuse_reuse(out, resuming=False)   # a fresh run into a directory with a run in it: refused
    old = move_aside(out)               # --overwrite: renames OUT to OUT.old-20261201-021500

The lock is fcntl.flock on OUT/.lock. The kernel drops it when the process dies, however it dies,
so a crashed run never leaves a stale lock behind. The file holds the holder's pid, host and start
time for the message a second run prints. flock works on local disks and on NFSv4; on other
network filesystems it may be a no-op, so give every concurrent run its own --out anyway.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time


class RunDirError(ValueError):
    """The output directory cannot take this run; the message says why and what to do."""


def holder(out: str) -> str:
    """Who holds OUT's lock, as the lock file says (pid, host, start time)."""
    try:
        with open(os.path.join(out, ".lock")) as f:
            return f.read().strip() or "unknown process"
    except OSError:
        return "unknown process"


class RunLock:
    """An exclusive, non-blocking flock on OUT/.lock for the lifetime of the run."""

    def __init__(self, out: str):
        self.out, self.path, self.fd = out, os.path.join(out, ".lock"), None

    def acquire(self) -> RunLock:
        os.makedirs(self.out, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunDirError(
                f"--out {self.out} is in use by another run ({holder(self.out)}); wait for it to "
                f"finish, stop it, or pass another --out"
            ) from None
        # Written only once we hold it: the holder's line is never overwritten by a loser.
        stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, started {stamp}\n".encode(), 0)
        self.fd = fd
        return self

    def probe(self) -> None:
        """Raise RunDirError if another run holds the lock; take nothing (for --check-only)."""
        if os.path.isdir(self.out):
            self.acquire()
            self.release()

    def release(self) -> None:
        if self.fd is not None:
            os.close(
                self.fd
            )  # closing drops the flock; the file stays (deleting it races with waiters)
            self.fd = None


def previous_run(out: str, metrics_file: str = "") -> list[str]:
    """What in OUT belongs to an earlier run: a non-empty metrics file, checkpoints, an export."""
    found = []
    for m in {
        metrics_file or os.path.join(out, "metrics.jsonl"),
        os.path.join(out, "metrics.jsonl"),
    }:
        if os.path.isfile(m) and os.path.getsize(m) > 0:
            found.append(os.path.relpath(m, out) if m.startswith(out) else m)
    ck = os.path.join(out, "checkpoints")
    if os.path.isdir(ck) and any(n.startswith("step_") for n in os.listdir(ck)):
        found.append("checkpoints/")
    if os.path.isdir(os.path.join(out, "final")):
        found.append("final/")
    return sorted(found)


def refuse_reuse(out: str, *, resuming: bool, overwrite: bool, metrics_file: str = "") -> None:
    """A fresh run into a directory that holds another run's results is refused, never mixed in."""
    if resuming or overwrite:
        return
    found = previous_run(out, metrics_file)
    if found:
        raise RunDirError(
            f"--out {out} already holds a run ({', '.join(found)}); continue it with "
            f"--resume auto, or pass a new --out (or --overwrite to move the old run aside)"
        )


def check_out_writable(out: str) -> None:
    """--out is a directory we can create or write into."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise RunDirError(f"--out {out} is a file, not a directory; pass a directory path")
    probe = os.path.abspath(out)
    while not os.path.exists(probe):  # the nearest existing ancestor must let us create the rest
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise RunDirError(
            f"--out {out}: {probe} is a file, so the directory cannot be created; "
            f"pass another --out"
        )
    if not os.access(probe, os.W_OK | os.X_OK):
        raise RunDirError(
            f"--out {out}: {probe} is not writable; pass a directory you can write to"
        )


def move_aside(out: str, lock: RunLock) -> str:
    """--overwrite: rename OUT to OUT.old-<UTC time> (kept, not deleted) and lock a fresh OUT.

    The caller holds `lock` on the old directory; the rename carries the lock with it, so no other
    run can slip into the old one. The new directory is locked before the old lock is dropped."""
    old = f"{out.rstrip('/')}.old-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    os.rename(out, old)
    fresh = RunLock(out).acquire()
    lock.release()
    lock.fd, fresh.fd = fresh.fd, None
    return old
