"""`hybridlm checkpoint export`'s --out: refused, before anything is written, where replacing it would lose what is
not an export (the run, its checkpoints, a folder holding it, files of the user's), and an existing model directory
replaced only with --overwrite; the newest checkpoint refused while a newer one is damaged. (The exports themselves:
tests/training/test_sharded_checkpoint.py.)"""

from __future__ import annotations

import re

import pytest

from hybridlm.cli import main
from hybridlm.training.config import ConfigError
from hybridlm.training.export import _check_out


@pytest.fixture
def run(tmp_path):
    run = tmp_path / "runs" / "x"
    (run / "checkpoints" / "step_00000010").mkdir(parents=True)
    (run / "config.yaml").write_text("train: {steps: 10}\n")
    return run


@pytest.mark.parametrize("where, message", [
    (lambda run: run, "is the run"),
    (lambda run: run / "checkpoints", "is inside the run"),
    (lambda run: run / "final" / "model", "is inside the run"),
    (lambda run: run.parent, "holds the run"),
])
def test_the_run_and_what_holds_it_are_never_the_out(run, where, message):
    for overwrite in (False, True):
        with pytest.raises(ConfigError, match=message):
            _check_out(run, where(run), overwrite)
    assert (run / "config.yaml").is_file() and (run / "checkpoints" / "step_00000010").is_dir()


def test_an_existing_out_needs_overwrite_and_must_be_a_model_directory(run, tmp_path, capsys):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "precious.txt").write_text("keep")
    a_file = tmp_path / "a_file"
    a_file.write_text("keep")
    for out in (notes, a_file):  # --overwrite would not replace them: not offered
        for overwrite in (False, True):
            with pytest.raises(ConfigError, match=rf"--out {out} exists and is not a model directory .* it is not "
                                                  "replaced; choose another --out"):
                _check_out(run, out, overwrite)
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (model / name).write_text("{}")
    with pytest.raises(ConfigError, match="already exists"):
        _check_out(run, model, False)
    _check_out(run, model, True)  # an earlier export: replaced
    (model / "checkpoints").mkdir()
    with pytest.raises(ConfigError, match="is not a model directory"):
        _check_out(run, model, True)
    # through the command line: exit 2, the reason, nothing touched
    assert main(["checkpoint", "export", "--run", str(run), "--out", str(notes), "--overwrite"]) == 2
    assert "is not a model directory" in capsys.readouterr().err
    for missing, what in ((tmp_path / "nope", "no such directory"), (a_file, "not a directory")):
        assert main(["checkpoint", "export", "--run", str(missing), "--out", str(tmp_path / "m")]) == 2
        assert f"--run {missing}: {what}; give the output directory" in capsys.readouterr().err
    assert (notes / "precious.txt").read_text() == "keep" and a_file.read_text() == "keep"


def test_an_export_without_a_tokenizer_says_so(demo_dir, tmp_path, caplog, capsys):
    """A run on prepared shards without data.tokenizer has no tokenizer to copy: its final/ and its export are
    written, each with a message saying that the tokenizer is missing and what to do (not silently without one)."""
    from hybridlm.training.trainer import Trainer
    from tests.training.toys import small_config

    run, out = tmp_path / "run", tmp_path / "model"
    sources = f"data.sources=[{{name: d, path: {demo_dir / 'train'}}}]"
    trainer = Trainer(small_config(demo_dir, run, "data.demo=false", sources, "train.steps=1"))
    trainer.train()
    trainer.close()
    assert f"{run / 'final'} has no tokenizer: the run names no tokenizer (data.tokenizer is not set)" in \
        capsys.readouterr().out
    assert main(["checkpoint", "export", "--run", str(run), "--out", str(out)]) == 0
    assert f"{out} has no tokenizer: the run names no tokenizer (data.tokenizer is not set); copy the tokenizer's " \
           "files" in caplog.text
    assert (out / "model.safetensors").is_file() and not (out / "tokenizer.json").exists()


def test_export_without_step_refuses_a_damaged_newer_checkpoint_as_resume_does(demo_dir, tmp_path, capsys):
    """A step directory newer than the newest complete checkpoint was damaged after its save: an export without --step
    refuses (exit 1), naming it, its problem and what to do, instead of exporting the older checkpoint; nothing is
    written. --step of the older one exports it; --step of the damaged one fails its checks."""
    from hybridlm.training.checkpoint import list_checkpoints
    from hybridlm.training.trainer import Trainer
    from tests.training.toys import small_config

    run, out = tmp_path / "run", tmp_path / "model"
    with Trainer(small_config(demo_dir, run, "train.steps=4", "train.save_every=2")) as trainer:
        trainer.train()
    older, newer = list_checkpoints(run / "checkpoints")
    weights = newer / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    capsys.readouterr()
    assert main(["checkpoint", "export", "--run", str(run), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert re.match(rf"checkpoint export: --run {re.escape(str(run))}: checkpoint\(s\) in .*checkpoints newer than the "
                    r"newest complete one, step_00000002, are damaged \(step_00000004: model.safetensors is [\d,]+ "
                    r"bytes, its manifest says [\d,]+\); exporting step_00000002 instead .* move them out of "
                    r".*checkpoints \(or delete them\) to export step_00000002, or pass --step 2 ", err), err
    assert not out.exists() and not out.with_name("model.tmp").exists()
    assert main(["checkpoint", "export", "--run", str(run), "--out", str(out), "--step", "4"]) == 1
    assert not out.exists() and "step_00000004" in capsys.readouterr().err
    assert main(["checkpoint", "export", "--run", str(run), "--out", str(out), "--step", "2"]) == 0
    assert (out / "model.safetensors").is_file() and older.is_dir()
