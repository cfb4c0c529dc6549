"""hybridlm.fileio: atomic writes keep the previous file whole when a write fails."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from hybridlm.fileio import save_figure_atomic, write_atomic  # noqa: E402


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
