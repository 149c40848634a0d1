"""DeepSpeed's JIT-built ops (the CPU collectives' shared-memory op, CPU Adam): one build per environment, and no
wait behind a lock that no build holds.

- Each environment builds into its own extension cache. torch's default, one per user, is shared by every clone
  and venv; their builds differ (the venv's include paths, its ninja), so each start-up in one rebuilt the op the
  other had built (35-108 s each, over and over). `environment_ops()` sets TORCH_EXTENSIONS_DIR, unless it is
  set, to `<sys.prefix>/torch_extensions` (the venv's own folder, when it may be written; a folder of its own
  inside for each linked path it is reached by) and puts the environment's ninja first on PATH while ops build
  and load.
- torch takes a lock file for each build and load (`<cache>/<op>/lock`, its FileBaton) and waits for it to go,
  forever. A build killed midway leaves it behind, and every later start-up (and `make install`) then waited
  until someone removed it. `clear_build_lock()` removes a lock that no process holds open, on a file system of
  this machine; any other is waited for at most BUILD_LOCK_WAIT_S, then an error names the file.

`python -m pretrieve.engine.ops` builds the CPU op into this environment's cache (`make install`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import sys
import time
from pathlib import Path

BUILD_LOCK_WAIT_S = 600.0  # a build takes 35-108 s on 2 cores; a lock held longer is a build gone wrong
_LOCAL_FILE_SYSTEMS = {"ext2", "ext3", "ext4", "xfs", "btrfs", "bcachefs", "zfs", "f2fs", "jfs", "reiserfs", "tmpfs",
                       "ramfs", "overlay"}  # elsewhere (NFS, Lustre, ...) a lock's holder may run on another node


def environment_cache() -> str | None:
    """The extension cache of this environment: TORCH_EXTENSIONS_DIR, or <sys.prefix>/torch_extensions when
    that may be written (None: torch's default, per user)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return os.environ["TORCH_EXTENSIONS_DIR"]
    cache = Path(sys.prefix) / "torch_extensions"
    if os.path.realpath(sys.prefix) != sys.prefix:
        # reached through a link (a linked home or venv): the build's include paths name the linked path, and a
        # build of it and one of the real path would take each other's for stale, rebuilding at every start-up
        cache = cache / f"via-{hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]}"
    existing = next(p for p in (cache, cache.parent, Path(sys.prefix)) if p.exists())
    return str(cache) if os.access(existing, os.W_OK) else None


@contextlib.contextmanager
def environment_ops():
    """Within: ops build into and load from this environment's cache, with its own ninja (torch runs the first
    `ninja` on PATH; two versions take each other's build log for stale and rebuild)."""
    saved = {key: os.environ.get(key) for key in ("TORCH_EXTENSIONS_DIR", "PATH")}
    cache = environment_cache()
    if cache:
        os.environ["TORCH_EXTENSIONS_DIR"] = cache
    here = os.path.dirname(sys.executable)
    if os.access(os.path.join(here, "ninja"), os.X_OK):
        os.environ["PATH"] = here + os.pathsep + os.environ.get("PATH", "")
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def lock_holders(lock: Path) -> list[int] | None:
    """The processes of this machine that hold `lock` open (torch's FileBaton keeps it open while it builds); None
    where that cannot be known: the lock is on a file system other nodes share."""
    import psutil

    target = os.path.realpath(lock)
    mounts = [p for p in psutil.disk_partitions(all=True) if target == p.mountpoint
              or target.startswith(p.mountpoint.rstrip("/") + "/")]
    mount = max(mounts, key=lambda p: len(p.mountpoint), default=None)
    if mount is None or mount.fstype not in _LOCAL_FILE_SYSTEMS:
        return None
    holders = []
    for proc in psutil.process_iter():
        try:
            if any(f.path == target for f in proc.open_files()):
                holders.append(proc.pid)
        except psutil.Error:  # gone, or another user's (which cannot write this user's cache)
            continue
    return holders


def clear_build_lock(build_dir: str | Path, wait: float = BUILD_LOCK_WAIT_S) -> None:
    """Return once `build_dir` has no build lock: a stale one (no holder, seen twice a second apart: a build
    releasing its lock closes it just before removing it) is removed; a held one is waited for, at most `wait`
    seconds."""
    lock = Path(build_dir) / "lock"
    deadline = time.monotonic() + wait
    stale_since = None
    while True:
        try:
            inode = lock.stat().st_ino
        except FileNotFoundError:
            return
        holders = lock_holders(lock)
        if holders == []:
            if stale_since == inode:
                with contextlib.suppress(FileNotFoundError):
                    lock.unlink()
                print(f"pretrieve: removed {lock}, the lock of a DeepSpeed op build that no process holds (a build "
                      "killed midway)", file=sys.stderr, flush=True)
                return
            stale_since = inode
        else:
            stale_since = None
        if time.monotonic() > deadline:
            held = f"held by process {', '.join(map(str, holders))}" if holders else \
                "on a file system other machines share, so its holder may run on one of them"
            raise TimeoutError(f"{lock}: a DeepSpeed op build has held this lock for over {wait:g} s ({held}); "
                               "if no build is running any more, remove the file")
        time.sleep(1.0)


class _LinesWithout:
    """A text stream that passes every line on to `stream` but those `drop` matches."""

    def __init__(self, stream, drop: re.Pattern):
        self.stream, self.drop, self.pending = stream, drop, ""

    def write(self, text: str) -> int:
        *lines, self.pending = (self.pending + text).split("\n")
        kept = "".join(line + "\n" for line in lines if not self.drop.fullmatch(line))
        if kept:
            self.stream.write(kept)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name):  # fileno, encoding, isatty, ...: the stream's
        return getattr(self.stream, name)


@contextlib.contextmanager
def without_op_load_notice():
    """Within: DeepSpeed's 'DeepSpeed <op> built successfully', which its communication backend prints on stdout
    each time it loads the CPU op, built or not, is left out (prebuild_ops says when an op really builds)."""
    filtered = _LinesWithout(sys.stdout, re.compile(r"DeepSpeed \S+ built successfully"))
    with contextlib.redirect_stdout(filtered):
        try:
            yield
        finally:
            if filtered.pending:
                filtered.stream.write(filtered.pending)


def build_directory(builder) -> Path:
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(builder.name, verbose=False))


def main() -> int:
    """`make install`: build DeepSpeed's CPU shared-memory op into this environment's cache, past a stale lock."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with environment_ops():
        import deepspeed.ops
        from deepspeed.accelerator import get_accelerator

        builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
        if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME):
            return 0
        try:
            clear_build_lock(build_directory(builder))
        except TimeoutError as e:
            print(f"pretrieve: {e}", file=sys.stderr)
            return 1
        builder.load(verbose=False)
        print(f"DeepSpeed's {builder.NAME} op is built in {build_directory(builder)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
