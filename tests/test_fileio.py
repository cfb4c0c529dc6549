"""hybridlm.fileio: atomic writes keep the previous file whole when a write fails; FileLock keeps a second process
out; diff_nested names the leaves that differ."""

from __future__ import annotations

import errno
import gc
import logging
import os
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from hybridlm.fileio import (  # noqa: E402
    Difference,
    FileLock,
    FileLockBusy,
    diff_nested,
    fcntl,
    save_figure_atomic,
    write_atomic,
)


def test_save_figure_atomic_writes_a_png_and_keeps_the_old_one_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "curve.png"
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    save_figure_atomic(fig, path, dpi=40)
    first = path.read_bytes()
    assert first.startswith(b"\x89PNG\r\n\x1a\n")

    def broken_savefig(target, **options):
        target.write(b"\x89PNG half an image")
        raise OSError("disk full")

    monkeypatch.setattr(fig, "savefig", broken_savefig)
    with pytest.raises(OSError, match="disk full"):
        save_figure_atomic(fig, path, dpi=40)
    assert path.read_bytes() == first and sorted(p.name for p in tmp_path.iterdir()) == ["curve.png"]
    plt.close(fig)


def test_write_atomic_leaves_no_temporary_file_when_the_write_fails(tmp_path):
    path = tmp_path / "data.bin"
    write_atomic(path, b"old")
    with pytest.raises(TypeError):
        write_atomic(path, "not bytes")  # type: ignore[arg-type]
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["data.bin"]


# ------------------------------------------------------------------------------------------------ FileLock
needs_flock = pytest.mark.skipif(fcntl is None, reason="no flock on this platform")


@needs_flock
def test_file_lock_keeps_a_second_holder_out_until_released(tmp_path):
    path = tmp_path / "run.lock"
    first, second = FileLock(path), FileLock(path)  # two open files: what two processes see
    assert first.acquire() and first.locked and first.unlocked_reason is None
    assert first.acquire()  # taking it again while held is a no-op
    assert not second.acquire() and not second.locked
    with pytest.raises(FileLockBusy, match="locked by another process") as caught:
        with second:
            pass
    assert caught.value.path == path
    first.release()
    first.release()  # releasing twice is a no-op
    with second:
        assert second.locked and not FileLock(path).acquire()
    assert not second.locked and FileLock(path).acquire()
    assert path.read_bytes() == b""  # the file is created, never written, and left in place


@needs_flock
def test_a_removed_lock_file_never_has_two_holders(tmp_path, monkeypatch):
    path = tmp_path / "run.lock"
    first = FileLock(path)
    assert first.acquire()
    first.release(remove=True)
    assert not path.exists()
    # A process that opened the file just before its holder removed it and let go: once it holds the lock on that
    # file, the path no longer names it, so it takes the lock on the path's new file.
    real_flock, calls = fcntl.flock, []

    def flock_after_removal(fd, operation):
        if operation & fcntl.LOCK_EX:
            if not calls:
                os.unlink(path)  # what release(remove=True) of the holder did
            calls.append(fd)
        return real_flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", flock_after_removal)
    second = FileLock(path)
    assert second.acquire() and path.is_file()
    monkeypatch.setattr(fcntl, "flock", real_flock)
    assert not FileLock(path).acquire()  # a newcomer sees the holder's file
    assert len(calls) == 2  # the removed file, then the path's new one
    second.release(remove=True)
    assert not path.exists() and FileLock(path).acquire()


@needs_flock
def test_file_lock_is_released_when_its_holder_is_collected_or_its_process_dies(tmp_path):
    path = tmp_path / "run.lock"
    held = FileLock(path)
    assert held.acquire()
    del held
    gc.collect()
    assert FileLock(path).acquire()

    holder = ("import sys, time; from hybridlm.fileio import FileLock; lock = FileLock(sys.argv[1]); "
              "assert lock.acquire(); print('held', flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", holder, str(tmp_path / "b")], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "held\n"
        assert not FileLock(tmp_path / "b").acquire()
    finally:
        child.kill()
        child.wait()
    assert FileLock(tmp_path / "b").acquire()


@needs_flock
def test_file_lock_goes_on_unlocked_where_the_file_system_cannot_lock(tmp_path, monkeypatch, caplog):
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    lock = FileLock(tmp_path / "run.lock")
    with caplog.at_level(logging.WARNING, logger="hybridlm.fileio"):
        assert lock.acquire()
    assert not lock.locked and "No locks available" in lock.unlocked_reason
    assert "going on unlocked" in caplog.text and str(tmp_path / "run.lock") in caplog.text
    with lock:  # the context manager goes on unlocked too
        assert not lock.locked


def test_file_lock_reports_a_directory_it_cannot_create_the_file_in(tmp_path):
    with pytest.raises(FileNotFoundError):
        FileLock(tmp_path / "missing" / "run.lock").acquire()


# ------------------------------------------------------------------------------------------------ diff_nested
def test_diff_nested_lists_the_differing_leaves_by_dotted_key():
    old = {"model": {"width": 64, "depth": 2, "rope": {"theta": 1e4}}, "lr": 1e-3, "only_old": 1, "none": None}
    new = {"model": {"width": 96, "depth": 2, "rope": {"theta": 1e4}}, "lr": 1e-3, "added": [1], "model2": {}}
    assert diff_nested(old, new) == [
        Difference("added", None, [1]), Difference("model.width", 64, 96), Difference("model2", None, {}),
        Difference("only_old", 1, None)]  # sorted; an absent key equals None ("none")
    assert diff_nested(old, new, missing="(absent)", sort_keys=False) == [
        Difference("model.width", 64, 96), Difference("only_old", 1, "(absent)"),
        Difference("none", None, "(absent)"), Difference("added", "(absent)", [1]),
        Difference("model2", "(absent)", {})]  # old's keys first, then new's, in their order


def test_diff_nested_compares_non_dicts_whole():
    assert diff_nested({"a": {"b": 1}}, {"a": [1]}) == [Difference("a", {"b": 1}, [1])]
    assert diff_nested(3, 4) == [Difference("", 3, 4)] and diff_nested([1, {"x": 1}], [1, {"x": 1}]) == []
    assert diff_nested({1: "a", "1b": {2: 0}}, {1: "b", "1b": {2: 1}}) == [Difference("1", "a", "b"),
                                                                         Difference("1b.2", 0, 1)]
