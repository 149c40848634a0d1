"""One writer per run directory: an exclusive advisory lock (a POSIX record lock, `lockf`) on DIR/.lock, held
by the training process (rank 0) for the run's life; `pretrieve prepare` holds its output folder the same way.

Two trainers in one run directory (a second `pretrieve pretrain` started by mistake, or a requeued SLURM job
while the old one still runs) would interleave metrics, checkpoints and the export. The second one is refused
with the holder's host, pid and SLURM job id, which the holder writes into the lock file. The kernel drops the
lock when its holder dies, however it dies: a lock file left by a dead process is stale and simply taken over
(its previous holder is named in a log line). A POSIX lock, unlike `flock`, is not inherited by forked children
(DataLoader workers, tokenizer pools), so a worker that outlives a killed holder does not keep the directory
locked; within one process it does not exclude itself. On NFS it goes through the server's lock manager, so it
holds across nodes there too. The empty lock file stays in the directory after a clean end; a command that fails
removes the lock file and the folders it created (those left empty), so a failed command leaves nothing it made.
Removing a lock file is safe because a taker checks, once locked, that the path still names the file it locked.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

LOCK_FILE = ".lock"


class RunDirectoryLocked(RuntimeError):
    """Another live process holds the directory."""


def _holder() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _describe(holder: dict) -> str:
    job = f", SLURM job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
    return f"pid {holder.get('pid')} on {holder.get('host')}{job}, since {holder.get('since')}"


class DirectoryLock:
    """`with DirectoryLock(run_dir, "pretrieve pretrain"):` ... — raises RunDirectoryLocked naming the holder."""

    def __init__(self, directory: Path, purpose: str):
        self.path = Path(directory) / LOCK_FILE
        self.purpose = purpose
        self._fd: int | None = None
        self._created_dirs: list[Path] = []  # deepest first: what a failed command removes again
        self._created_file = False

    def __enter__(self) -> "DirectoryLock":
        self._created_file = False
        self._created_dirs = [d for d in (self.path.parent, *self.path.parent.parents) if not d.exists()]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd, locked_same_file = self._lock()
            if locked_same_file:
                break
            os.close(fd)  # a failed holder removed the file between our open and lock: take the new one
        previous = self._read(fd)
        if previous.get("pid"):
            print(f"pretrieve: {self.path}: taking over the stale lock of {_describe(previous)} (that process has "
                  "ended)", file=sys.stderr)
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps({**_holder(), "purpose": self.purpose}) + "\n").encode(), 0)
        self._fd = fd
        return self

    def _lock(self) -> tuple[int, bool]:
        """(fd, whether the lock taken is on the file the path names now); raises RunDirectoryLocked."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            self._created_file = True
        except FileExistsError:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EAGAIN):
                os.close(fd)
                raise
            holder = self._read(fd)
            os.close(fd)
            raise RunDirectoryLocked(
                f"{self.path.parent}: in use by another {holder.get('purpose', 'process')} ({_describe(holder)}; "
                f"lock file {self.path}). Wait for it to end or stop it, or choose another directory") from None
        try:
            return fd, os.stat(self.path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return fd, False

    @staticmethod
    def _read(fd: int) -> dict:
        try:
            return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        except (ValueError, UnicodeDecodeError):
            return {}

    def __exit__(self, exc_type, *exc) -> None:
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)  # a clean end leaves no holder to report as stale
        if exc_type is not None:
            self._remove_created()  # still locked: no other process can be using the file
        fcntl.lockf(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def _remove_created(self) -> None:
        if self._created_file:
            self.path.unlink(missing_ok=True)
        for directory in self._created_dirs:
            try:
                directory.rmdir()
            except OSError:  # not empty: the command wrote something there that it keeps (resume state)
                return
