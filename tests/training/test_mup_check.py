"""The muP coordinate check: transferred multipliers keep activations within a small factor of the base
width's, and leaving them at 1 (the control) does not."""

from __future__ import annotations

import json

import pytest

from hybridlm.training.mup_check import (
    coordinate_check,
    spread,
    width_config,
    write_report,
)

WIDTHS = (64, 128, 256)


@pytest.fixture(scope="module")
def mup():
    return coordinate_check(WIDTHS, base_width=128, steps=5, lr=1e-2, batch=4, seq_len=32)


@pytest.fixture(scope="module")
def control():
    return coordinate_check(WIDTHS, base_width=128, steps=5, lr=1e-2, batch=4, seq_len=32, scale=False)


def test_width_config_transfers_the_multipliers():
    base, wide = width_config(128, 128), width_config(512, 128)
    assert wide.hidden_size == 512 and wide.num_attention_heads == 8 and wide.mamba_n_heads == 16
    assert base.ssm_out_multiplier == 1.0 and wide.ssm_out_multiplier == pytest.approx(0.25)
    assert wide.mlp_multiplier_down == pytest.approx(1 / 16) and wide.embedding_multiplier == 1.0
    assert width_config(512, 128, scale=False).ssm_out_multiplier == 1.0


def test_activations_stay_within_a_factor_of_the_base_width(mup):
    """After 5 updates at one lr, every layer type's RMS is within 3.5x of the base width's, at every
    width (not 1x: the width-independent init std leaves a d^-1/2 term at small widths)."""
    for view in ("rms", "delta_rms"):
        for kind, factor in spread(mup, view).items():
            assert factor < 3.5, (view, kind, factor, mup[view][kind])
    assert set(mup["rms"]) == {"embedding", "attention", "ssm", "mlp", "block", "logits"}
    for losses in mup["loss"].values():
        assert losses[-1] < losses[0]  # every width trained


def test_without_the_multipliers_the_check_fails(control):
    factors = spread(control, "rms")
    assert factors["ssm"] > 10 and factors["block"] > 10, factors  # the wide model's updates blow up


def test_report_files(mup, tmp_path):
    json_path, png_path = write_report(mup, tmp_path)
    report = json.loads(json_path.read_text())
    assert report["widths"] == list(WIDTHS) and report["base_width"] == 128
    assert set(report["spread"]["rms"]) == set(mup["rms"])
    assert len(report["rms"]["ssm"]["256"]) == 6  # steps 0..5
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png_path.stat().st_size > 10_000


def test_cli(tmp_path, capsys):
    from hybridlm.cli import main

    assert main(["mup-check", "--widths", "64", "128", "--steps", "2", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "mup_check.png").is_file() and (tmp_path / "mup_check.json").is_file()
    assert "max factor vs base width" in capsys.readouterr().out
    assert main(["mup-check", "--widths", "64", "256", "--out", str(tmp_path)]) == 2  # base 128 not listed


@pytest.mark.parametrize(
    "args, message",
    [
        (["--steps", "-1"], "--steps: must be >= 1"),
        (["--steps", "0"], "--steps: must be >= 1"),
        (["--lr", "nan"], "--lr: must be a finite number > 0"),
        (["--lr", "inf"], "--lr: must be a finite number > 0"),
        (["--lr", "-1"], "--lr: must be a finite number > 0"),
        (["--widths", "0", "128"], "--widths: every width must be a positive multiple of 64"),
        (["--widths", "100", "128"], "--widths: every width must be a positive multiple of 64"),
        (["--widths", "64", "128", "64"], "--widths repeats 64; give each width once"),
        (["--layers", "0"], "--layers: must be >= 1"),
        (["--seed", "-3"], "--seed: must be >= 0"),
    ],
)
def test_cli_refuses_bad_arguments_before_writing_anything(tmp_path, capsys, args, message):
    """Each bad argument is a clear error before any file is written (not a traceback from inside matplotlib after
    mup_check.json, and not accepted: --lr -1)."""
    from hybridlm.cli import main

    out = tmp_path / "report"
    assert main(["mup-check", "--widths", "64", "128", "--steps", "2", "--out", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mup-check: {message}") and err.count("\n") == 1, err
    assert not out.exists()


def test_cli_help_describes_every_option(capsys):
    from hybridlm.cli import main

    with pytest.raises(SystemExit):
        main(["mup-check", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--layers LAYERS decoder layers" in text and "--seed SEED seed of" in text, text


def test_report_files_keep_the_previous_report_when_a_write_fails(mup, tmp_path, monkeypatch):
    """Written through temporary names: a failed write (here fsync, as on a full disk) leaves the old files."""
    import os

    json_path, png_path = write_report(mup, tmp_path)
    before = {p.name: p.read_bytes() for p in (json_path, png_path)}
    changed = dict(mup, lr=0.5)  # another report: different bytes in both files

    def failing_fsync(fd):
        raise OSError("no space left on device")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="no space"):
        write_report(changed, tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # unchanged, no temporary files
