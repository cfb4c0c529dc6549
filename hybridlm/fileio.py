"""Durable file writes shared by the data pipeline and checkpoints: checksums, fsync, atomic replace."""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path


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
