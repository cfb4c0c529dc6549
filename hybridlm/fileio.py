"""File helpers shared by the data pipeline, training and experiments: durable writes (checksums, fsync, atomic
replace), an exclusive lock on a file between processes, and the differences between two nested dicts."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import weakref
from pathlib import Path
from typing import Any, NamedTuple

try:
    import fcntl
except ImportError:  # not POSIX (Windows): FileLock cannot lock and goes on unlocked
    fcntl = None

log = logging.getLogger(__name__)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def fsync_dir(directory: Path) -> None:
    """Make a rename inside `directory` durable (a no-op where directories cannot be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_atomic(path: Path, data: bytes | memoryview) -> str:
    """Write `data` to `path` through a temporary name and os.replace; return its sha256."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return hashlib.sha256(data).hexdigest()


def save_figure_atomic(fig, path: Path, **savefig_options) -> None:
    """Save a matplotlib figure as a PNG at `path` through a temporary name and os.replace: a crash or interrupt
    mid-write never leaves a truncated image where a previous good one was."""
    import io

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", **savefig_options)
    write_atomic(Path(path), buffer.getbuffer())


class FileLockBusy(RuntimeError):
    """Another process holds the FileLock (raised by `with FileLock(path):`; `acquire` returns False instead)."""

    def __init__(self, path: Path) -> None:
        super().__init__(f"{path} is locked by another process")
        self.path = path


class FileLock:
    """An exclusive, non-blocking advisory lock (flock) on the file at `path`, kept apart between processes.

    `acquire()` creates the file if needed (never writes it) and returns False at once when another process holds
    the lock. The lock is released by `release()`, at the end of a `with` block, when this object is
    garbage-collected, or by the system when the process dies. `release(remove=True)` deletes the file first, while
    still holding the lock: a process that opened it before then finds, once it holds the lock, that the path no
    longer names its file, and takes the lock again on the path's new file, so one path never has two holders.
    Where the file system cannot lock (some network file systems: a warning is logged) or the platform has no flock
    (Windows), `acquire()` returns True without a lock: `locked` is False and `unlocked_reason` says why.

        lock = FileLock(out / ".run.lock")
        if not lock.acquire():
            raise SomeError("another run is writing to out; wait for it to end")
        try: ...
        finally: lock.release()

    or `with FileLock(path): ...`, which raises FileLockBusy when the lock is held elsewhere.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.unlocked_reason: str | None = None
        self._release: weakref.finalize | None = None

    @property
    def locked(self) -> bool:
        """Whether this object holds the lock now."""
        return self._release is not None and self._release.alive

    def acquire(self) -> bool:
        """Take the lock unless another process holds it (False then). Taking it again while held is a no-op.
        OSError when the file cannot be opened or created."""
        if self.locked:
            return True
        if fcntl is None:
            self.unlocked_reason = "this platform has no flock"
            return True
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                os.close(fd)
                if err.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                    return False
                self.unlocked_reason = f"the file system cannot lock it ({err})"
                log.warning("cannot lock %s (%s): going on unlocked, so a second process is not kept out", self.path,
                            err)
                return True
            if _names_file(self.path, fd):
                break
            _unlock_fd(fd)  # its holder removed it between our open and our lock: lock the path's file now
        self.unlocked_reason = None
        self._release = weakref.finalize(self, _unlock_fd, fd)
        return True

    def release(self, *, remove: bool = False) -> None:
        """Let another process take the lock (a no-op when not held); `remove`: delete the file first."""
        if self._release is not None:
            if remove:
                self.path.unlink(missing_ok=True)
            self._release()
            self._release = None

    def __enter__(self) -> FileLock:
        if not self.acquire():
            raise FileLockBusy(self.path)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def _names_file(path: Path, fd: int) -> bool:
    """Whether `path` names the open file `fd` (not a file created there since, nor nothing)."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def _unlock_fd(fd: int) -> None:
    """Unlock explicitly (a forked child may hold a copy of the descriptor, which would keep the lock) and close."""
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)
    with contextlib.suppress(OSError):
        os.close(fd)


class Difference(NamedTuple):
    """One leaf that differs between two nested dicts: its dotted key ("" for two unequal non-dicts at the top)
    and its value on each side (the `missing` value of `diff_nested` where a side lacks the key)."""

    key: str
    old: Any
    new: Any


def diff_nested(old: Any, new: Any, *, missing: Any = None, sort_keys: bool = True) -> list[Difference]:
    """The leaves that differ between two nested dicts, compared with `==` wherever the two sides are not both
    dicts. A key present on one side only counts as holding `missing` on the other (so with the default None,
    an absent key equals a None value). Keys come in sorted order (by str) with `sort_keys`, otherwise in the
    order first seen (`old`'s keys, then those only `new` has)."""
    out: list[Difference] = []
    _diff_into(out, old, new, "", missing, sort_keys)
    return out


def _diff_into(out: list[Difference], old: Any, new: Any, key: str, missing: Any, sort_keys: bool) -> None:
    if isinstance(old, dict) and isinstance(new, dict):
        keys = [*old, *(k for k in new if k not in old)]
        for k in sorted(keys, key=str) if sort_keys else keys:
            _diff_into(out, old.get(k, missing), new.get(k, missing), f"{key}.{k}" if key else str(k), missing,
                       sort_keys)
    elif old != new:
        out.append(Difference(key, old, new))
