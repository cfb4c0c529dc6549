"""The output directory of `hybridlm train`: what --overwrite deletes and when, the run lock, links, a user's
config.yaml, final/'s files, a changed model on --resume, stopping at once, and the exit statuses of these refusals."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from hybridlm.training.checkpoint import latest_checkpoint, list_checkpoints
from hybridlm.training.config import ConfigError, is_run_config
from hybridlm.training.loop import TrainLoop
from hybridlm.training.run_dir import LOCK_FILE, read_jsonl
from hybridlm.training.trainer import Trainer
from tests.training.toys import cli_sets, small_config, snapshot


def train_cli(out: Path, *args: str) -> int:
    from hybridlm.cli import main

    try:
        return main(["train", "--out", str(out), *args])
    except KeyboardInterrupt as err:  # (pytest would take it for the user's Ctrl-C and stop the session)
        pytest.fail(f"KeyboardInterrupt escaped the command: {err!r}")


@pytest.fixture
def finished(demo_dir, tmp_path, capsys) -> Path:
    """A finished 2-update run (checkpoints, final/, metrics, eval, config.yaml, loss.png), made through the CLI."""
    out = tmp_path / "run"
    assert train_cli(out, *cli_sets(demo_dir, "train.steps=2")) == 0
    capsys.readouterr()
    return out


# ------------------------------------------------------------------------------------ 1. --overwrite deletes last
@pytest.mark.parametrize("bad", [
    ["model.overrides.vocab_size=100"],  # fails the vocabulary check, after the data is opened
    ["data.demo=false", "data.sources=[{name: d, path: /no/such/dataset}]"],
])
def test_overwrite_with_a_bad_setting_keeps_the_previous_run(demo_dir, finished, capsys, bad):
    before = snapshot(finished)
    assert train_cli(finished, "--overwrite", *cli_sets(demo_dir, "train.steps=2", *bad)) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: ") and err.count("\n") == 1, err
    assert snapshot(finished) == before  # checkpoints/, final/, metrics, config.yaml: all still there


def test_overwrite_reruns_from_the_runs_own_config_and_keeps_a_users_config(demo_dir, finished, capsys):
    """The run's own config.yaml as --config with --overwrite (read already, then rewritten) starts the run over; a
    config of the user's inside an output --overwrite deletes is refused, nothing deleted."""
    config = finished / "config.yaml"
    assert is_run_config(config)
    mine = finished / "final" / "mine.yaml"
    mine.write_text("# my copy\n" + config.read_text())
    before = snapshot(finished)
    assert train_cli(finished, "--overwrite", "--config", str(mine)) == 2
    err = capsys.readouterr().err
    assert f"--config: {mine.resolve()} is inside {finished / 'final'}, which --overwrite deletes" in err, err
    assert snapshot(finished) == before
    assert train_cli(finished, "--overwrite", "--config", os.path.relpath(config), "--set", "train.steps=1") == 0
    assert [m["step"] for m in read_jsonl(finished / "metrics.jsonl")] == [1] and is_run_config(config)
    assert "steps: 1" in config.read_text()


def test_overwrite_keeps_a_tokenizer_inside_the_outputs_it_would_delete(demo_dir, finished, tmp_path, capsys):
    before = snapshot(finished)
    data = ("data.demo=false", f"data.sources=[{{name: d, path: {demo_dir / 'train'}}}]",
            f"data.tokenizer={finished / 'final'}")
    assert train_cli(finished, "--overwrite", *cli_sets(demo_dir, "train.steps=1", *data)) == 2
    err = capsys.readouterr().err
    assert f"data.tokenizer: {(finished / 'final').resolve()} is inside {finished / 'final'}, which --overwrite " \
           "deletes" in err, err
    assert snapshot(finished) == before


# ------------------------------------------------------------------------------------ 2. final/ is this run's model
def test_final_holds_this_runs_model_when_the_tokenizer_is_an_earlier_runs_final(demo_dir, tmp_path):
    from safetensors.torch import load_file

    from hybridlm.data.tokenizer import HybridTokenizer
    from hybridlm.models.model import HybridForCausalLM

    a = tmp_path / "a"
    Trainer(small_config(demo_dir, a, "train.steps=1")).train()
    assert (a / "final" / "model.safetensors").is_file() and (a / "final" / "tokenizer.json").is_file()
    (a / "final" / "model.safetensors.index.json").write_text("{}")  # e.g. left by a sharded save: not copied either
    b = tmp_path / "b"
    trainer = Trainer(small_config(demo_dir, b, "train.steps=1", "data.demo=false",
                                   f"data.sources=[{{name: d, path: {demo_dir / 'train'}}}]",
                                   f"data.tokenizer={a / 'final'}", "model.overrides.num_hidden_layers=2"))
    trainer.train()
    model = HybridForCausalLM.from_pretrained(b / "final")
    assert model.config.num_hidden_layers == 2 and trainer.raw_model.config.num_hidden_layers == 2
    saved = load_file(str(b / "final" / "model.safetensors"))
    assert not any(k.startswith("model.layers.3.") for k in saved)
    expected = trainer.raw_model.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    trainer.raw_model.save_pretrained(tmp_path / "model_only", safe_serialization=True)
    model_files = {p.name for p in (tmp_path / "model_only").iterdir()}
    assert {p.name for p in (b / "final").iterdir()} - model_files == \
        {"hybridlm_tokenizer.json", "tokenizer.json", "tokenizer_config.json"}  # the tokenizer's files, nothing else
    assert HybridTokenizer.load(b / "final").vocab_size == HybridTokenizer.load(a / "final").vocab_size


def test_writing_final_prints_no_progress_bar_and_keeps_the_setting(demo_dir, tmp_path, capfd):
    """train.progress=false: nothing of transformers' "Writing model shards" bar, and its global setting as it was."""
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()
    Trainer(small_config(demo_dir, tmp_path / "quiet", "train.steps=1")).train()
    captured = capfd.readouterr()
    assert "Writing model shards" not in captured.err + captured.out, captured.err
    assert (tmp_path / "quiet" / "final" / "model.safetensors").is_file() and hf_logging.is_progress_bar_enabled()


# ------------------------------------------------------------------------------------ 3. one run per directory
def hold_lock(out: Path) -> int:
    """What a second process in the directory sees: the lock taken through another open file."""
    import fcntl

    fd = os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def lock_is_free(out: Path) -> bool:
    import fcntl

    fd = os.open(out / LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_a_second_run_in_a_busy_directory_is_refused_at_once(demo_dir, finished, capsys):
    pytest.importorskip("fcntl")
    before = snapshot(finished)
    fd = hold_lock(finished)  # a live run (a job started twice)
    try:
        for args in (["--resume"], ["--overwrite"]):
            assert train_cli(finished, *args, *cli_sets(demo_dir, "train.steps=4")) == 2
            err = capsys.readouterr().err
            assert err == f"config error: train.out_dir: another `hybridlm train` is running in {finished} (it holds " \
                          f"{LOCK_FILE}); wait for it to end or stop it, or choose another --out (in Python: " \
                          "close() a Trainer of this process that will not train, or build it in a with " \
                          "statement)\n", err
        assert snapshot(finished) == before and (finished / LOCK_FILE).is_file()  # --overwrite left the lock alone
        assert not lock_is_free(finished)
    finally:
        os.close(fd)
    assert train_cli(finished, "--resume", *cli_sets(demo_dir, "train.steps=3")) == 0
    assert latest_checkpoint(finished / "checkpoints").name == "step_00000003"


def test_the_lock_is_held_from_the_start_to_the_end_of_train(demo_dir, tmp_path):
    pytest.importorskip("fcntl")
    out = tmp_path / "locked"
    seen = []
    trainer = Trainer(small_config(demo_dir, out, "train.steps=2"),
                      callbacks=[lambda t, r: seen.append(lock_is_free(out))])
    assert not lock_is_free(out)
    with pytest.raises(ConfigError, match="another `hybridlm train` is running in"):
        Trainer(small_config(demo_dir, out, "train.steps=2"), overwrite=True)
    trainer.train()
    assert seen == [False, False] and lock_is_free(out)
    with pytest.raises(ConfigError, match="already holds a run"):  # a failed start releases the lock
        Trainer(small_config(demo_dir, out, "train.steps=2"))
    assert lock_is_free(out)
    Trainer(small_config(demo_dir, out, "train.steps=3"), resume=True).train()  # one after the other: fine
    assert lock_is_free(out)
    with Trainer(small_config(demo_dir, out, "train.steps=3"), resume=True) as idle:  # built, never trained
        assert not lock_is_free(out) and idle.already_complete
    assert lock_is_free(out)


def test_a_config_error_after_the_lock_leaves_nothing_behind(demo_dir, finished, tmp_path, capsys):
    """A config error found once the directory is locked (a data.tokenizer that is not there; sft's damaged
    model.init) removes the lock file, the output directory and the folders above it that the command created; an
    empty directory that was there before stays, empty."""
    from hybridlm.cli import main

    nowhere = tmp_path / "nowhere"
    data = ("data.demo=false", f"data.sources=[{{name: d, path: {demo_dir / 'train'}}}]", f"data.tokenizer={nowhere}")
    new, existing = tmp_path / "runs" / "bad", tmp_path / "existing"
    existing.mkdir()
    for out in (new, existing):
        assert train_cli(out, *cli_sets(demo_dir, "train.steps=1", *data)) == 2
        err = capsys.readouterr().err
        assert err == f"config error: data.tokenizer: {nowhere} holds no tokenizer.json\n", err
    assert not (tmp_path / "runs").exists()
    assert existing.is_dir() and list(existing.iterdir()) == []
    damaged = tmp_path / "damaged"
    shutil.copytree(finished / "final", damaged)
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    assert main(["sft", "--model", str(damaged), "--out", str(new), "--set", "train.steps=2", "--set",
                 "train.progress=false"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"config error: model.init: {damaged}: a weights file is damaged"), err
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------------------------ 4. links and files in the way
def test_overwrite_unlinks_linked_outputs_and_keeps_their_targets(demo_dir, finished, tmp_path, capsys):
    elsewhere = tmp_path / "big_disk"
    elsewhere.mkdir()
    for name in ("checkpoints", "final"):
        shutil.move(finished / name, elsewhere / name)
        (finished / name).symlink_to(elsewhere / name, target_is_directory=True)
    kept = snapshot(elsewhere)
    assert train_cli(finished, "--overwrite", *cli_sets(demo_dir, "train.steps=1")) == 0
    assert "removed the link" in capsys.readouterr().out
    assert snapshot(elsewhere) == kept  # the targets' contents untouched
    for name in ("checkpoints", "final"):
        assert (finished / name).is_dir() and not (finished / name).is_symlink()
    assert [p.name for p in list_checkpoints(finished / "checkpoints")] == ["step_00000001"]


def test_a_dangling_link_or_a_file_where_a_directory_goes_is_refused_before_training(demo_dir, tmp_path, capsys):
    out = tmp_path / "in_the_way"
    out.mkdir()
    (out / "checkpoints").write_text("not a directory")
    for args in ([], ["--overwrite"]):
        assert train_cli(out, *args, *cli_sets(demo_dir, "train.steps=1")) == 2
        err = capsys.readouterr().err
        assert err == f"config error: train.out_dir: {out / 'checkpoints'} is a file, not a directory (the run writes " \
                      "its checkpoints there); move it away or choose another --out\n", err
        assert not (out / "metrics.jsonl").exists() and (out / "checkpoints").read_text() == "not a directory"
    (out / "checkpoints").unlink()
    (out / "checkpoints").symlink_to(tmp_path / "unmounted", target_is_directory=True)
    assert train_cli(out, "--resume", *cli_sets(demo_dir, "train.steps=1")) == 2
    assert "is a symbolic link to" in capsys.readouterr().err
    assert train_cli(out, "--overwrite", *cli_sets(demo_dir, "train.steps=1")) == 0  # the link goes, nothing else
    assert (out / "checkpoints").is_dir() and not (tmp_path / "unmounted").exists()


# ------------------------------------------------------------------------------------ 5. the user's config.yaml
def test_a_users_config_yaml_in_the_output_directory_is_never_replaced(demo_dir, tmp_path, capsys):
    """A config.yaml the trainer did not write (no header line), with no run output beside it, is the user's: every
    way of starting a run there is refused and leaves it as it was; moved elsewhere, as the message says, it runs."""
    out = tmp_path / "mine"
    out.mkdir()
    mine = out / "config.yaml"
    text = "# my experiment: keep these comments\n" + (Path(__file__).parents[2] / "configs" / "demo.yaml").read_text()
    mine.write_text(text)
    other = tmp_path / "other.yaml"
    other.write_text(text)
    sets = cli_sets(demo_dir, "train.steps=1")
    for args in (["--config", str(mine)], ["--config", str(mine), "--overwrite"], ["--resume"],
                 ["--config", str(mine), "--resume"], ["--config", str(other)],
                 ["--config", str(other), "--overwrite"]):
        assert train_cli(out, *args, *sets) == 2, args
        err = capsys.readouterr().err
        assert f"{mine} is not a run's record (a config of yours?)" in err and err.count("\n") == 1, err
        assert mine.read_text() == text and [p.name for p in out.iterdir()] == ["config.yaml"]
    shutil.move(mine, other)  # kept elsewhere, as the message says
    assert train_cli(out, "--config", str(other), *sets) == 0
    assert other.read_text() == text and is_run_config(mine)


def test_resume_of_a_run_killed_before_its_first_checkpoint_starts_it(demo_dir, tmp_path, capsys):
    """A run killed after writing its config.yaml (and a metrics record) but before its first checkpoint: --resume
    starts it from scratch, as a preemptible job that always passes --resume needs; without --resume the directory
    holds a run."""
    out = tmp_path / "killed"
    trainer = Trainer(small_config(demo_dir, out, "train.steps=2"))  # writes config.yaml, as a start does
    trainer.close()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 6.0}\n')
    assert is_run_config(out / "config.yaml")
    assert train_cli(out, *cli_sets(demo_dir, "train.steps=2")) == 2
    assert "already holds a run (metrics.jsonl, config.yaml)" in capsys.readouterr().err
    assert train_cli(out, "--resume") == 0
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [1, 2]
    assert list_checkpoints(out / "checkpoints")


def test_resume_of_a_directory_without_a_run_says_it_starts_one(demo_dir, tmp_path, capsys):
    out = tmp_path / "mistyped"
    assert train_cli(out, "--resume", *cli_sets(demo_dir, "train.steps=1")) == 0
    assert f"--resume: {out} holds no run (no config.yaml); starting a new one from `hybridlm train`'s defaults" \
        in capsys.readouterr().err
    assert list_checkpoints(out / "checkpoints")


def test_resume_from_a_checkpoint_still_rewrites_the_runs_own_config(demo_dir, finished):
    config = finished / "config.yaml"
    assert train_cli(finished, "--resume", "--config", str(config), "--set", "train.steps=3") == 0
    assert "steps: 3" in config.read_text()
    assert train_cli(finished, "--resume", "--set", "train.steps=4") == 0
    assert "steps: 4" in config.read_text()


# ------------------------------------------------------------------------------------ 6. a changed model on --resume
def test_resume_with_another_layer_count_is_a_config_error(demo_dir, finished, capsys):
    config = (finished / "config.yaml").read_text()
    assert train_cli(finished, "--resume", "--set", "train.steps=4", "--set",
                     "model.overrides.num_hidden_layers=3") == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: --resume: ") and "Settings changed since it was saved: " \
           "model.overrides.num_hidden_layers: None -> 3" in err and err.count("\n") == 1, err
    assert (finished / "config.yaml").read_text() == config
    with pytest.raises(ConfigError, match=r"parameter group .* saved for other parameters.*Settings changed"):
        Trainer(small_config(demo_dir, finished, "train.steps=4", "model.overrides.num_hidden_layers=5"), resume=True)


# ------------------------------------------------------------------------------------ 7. stopping at once
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_stops_at_once_in_one_line(demo_dir, tmp_path, capsys, monkeypatch, sig):
    from hybridlm.training.stop import StopRequest

    monkeypatch.setattr(StopRequest, "REPEAT_WINDOW", -1.0)  # the second signal counts as "more than 2 s later"
    update = TrainLoop.update

    def signal_twice_at_2(self):
        output = update(self)
        if output.step == 2:
            os.kill(os.getpid(), sig)  # a real signal, handled in this (main) thread: finish, then save
            os.kill(os.getpid(), sig)  # again: stop at once
        return output

    monkeypatch.setattr(TrainLoop, "update", signal_twice_at_2)
    out = tmp_path / "twice"
    assert train_cli(out, *cli_sets(demo_dir, "train.steps=5", "train.save_every=1")) == 128 + sig
    err = capsys.readouterr().err
    assert err == f"stopped at once ({sig.name}) at update 2; the newest checkpoint is step_00000001 (continue with " \
                  f"`hybridlm train --resume --out {out}`)\n", err
    assert lock_is_free(out)


@pytest.mark.parametrize("where", ["_write_samples", "export"])
def test_ctrl_c_while_writing_samples_or_final_is_one_line_and_resume_finishes(demo_dir, tmp_path, capsys,
                                                                               monkeypatch, where):
    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt  # what SIGINT's default handler raises there

    out = tmp_path / "late"
    with monkeypatch.context() as m:
        m.setattr(Trainer, where, ctrl_c)
        assert train_cli(out, *cli_sets(demo_dir, "train.steps=2")) == 130
    err = capsys.readouterr().err
    assert err == f"stopped at once (SIGINT) at update 2; the newest checkpoint is step_00000002 (continue with " \
                  f"`hybridlm train --resume --out {out}`)\n", err
    assert not (out / "final").exists()
    assert train_cli(out, "--resume") == 0
    assert (out / "final" / "model.safetensors").is_file()


def test_a_write_that_fails_is_one_line_and_leaves_without_waiting_for_peers(demo_dir, tmp_path, capsys, monkeypatch):
    """Writing samples.txt fails (a full disk): the run fails in one line (exit 1), and the trainer leaves the
    process group without the closing barrier (under torchrun its peers may be inside a collective this rank never
    joins: the barrier would wait out the group's timeout). A run that ends normally leaves together."""
    from hybridlm.training import distributed

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device", "samples.txt")

    leaving = []
    monkeypatch.setattr(distributed, "destroy_distributed", lambda ctx, together=True: leaving.append(together))
    out = tmp_path / "unwritable"
    with monkeypatch.context() as m:
        m.setattr(Trainer, "_write_samples", disk_full)
        assert train_cli(out, *cli_sets(demo_dir, "train.steps=2")) == 1
    err = capsys.readouterr().err
    assert err == "training failed: [Errno 28] No space left on device: 'samples.txt'\n", err
    assert leaving == [False] and lock_is_free(out)
    assert train_cli(tmp_path / "fine", *cli_sets(demo_dir, "train.steps=1")) == 0
    assert leaving == [False, True]
