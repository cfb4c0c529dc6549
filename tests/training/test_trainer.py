"""The Trainer on the tiny preset and a small slice of the built-in stdlib corpus (CPU, float32, seeded)."""

from __future__ import annotations

import json
import os
import re
import signal
import pytest
import torch

from hybridlm.training.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
)
from hybridlm.training.config import ConfigError, load_config
from hybridlm.training.guard import TrainingDivergedError
from hybridlm.training.loop import TrainLoop, allocate_missing_grads
from hybridlm.training.run_dir import read_jsonl
from hybridlm.training.trainer import Trainer
from tests.training.toys import cli_sets, small_config, snapshot


def losses(trainer: Trainer) -> list[float]:
    return [r["loss"] for r in trainer.history]


def stop_at(step: int):
    def callback(trainer: Trainer, record: dict) -> None:
        if record["step"] == step:
            trainer.request_stop("test")

    return callback


def test_demo_corpus_is_bytes_of_the_stdlib(demo_dir):
    from hybridlm.data.shards import TokenDataset
    from hybridlm.data.tokenizer import HybridTokenizer
    from hybridlm.training.demo import BYTE_OFFSET, prepare_demo, stdlib_sources

    tok = HybridTokenizer.load(demo_dir / "tokenizer")
    train, held = TokenDataset(demo_dir / "train"), TokenDataset(demo_dir / "heldout")
    files = stdlib_sources(400_000)
    first = files[0].read_bytes()
    assert train.doc(0)[:64].tolist() == [b + BYTE_OFFSET for b in first[:64]]
    assert tok.decode(train.doc(0)[:-1].tolist()) == first.decode("utf-8", errors="replace")
    assert train.doc(0)[-1] == tok.eos_id == 2
    assert held.num_docs == len(files) // 4 and train.num_docs == len(files) - held.num_docs
    assert prepare_demo(demo_dir, max_bytes=400_000, heldout_every=4).train_files == train.num_docs  # idempotent


def test_short_run_loss_falls_and_writes_its_outputs(demo_dir, tmp_path):
    out = tmp_path / "run"
    config = small_config(demo_dir, out, "train.steps=30", "train.log_every=10", "train.eval_every=15",
                          "train.save_every=10", "train.samples=2", "train.sample_tokens=8", "batch.micro_batch=4",
                          "batch.seq_len=64")
    trainer = Trainer(config)
    result = trainer.train()
    assert result.status == "completed" and result.step == 30 and result.tokens == 30 * 4 * 64
    per_step = losses(trainer)
    assert per_step[0] == pytest.approx(torch.log(torch.tensor(512.0)).item(), abs=0.3)  # ~uniform at init
    assert sum(per_step[-5:]) / 5 < per_step[0] - 1.5, per_step
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [10, 20, 30]
    for m in metrics:
        assert {"step", "tokens", "loss", "lr", "wd", "grad_norm", "tokens_per_s", "skipped"} <= set(m)
        assert m["tokens"] == m["step"] * 256 and m["tokens_per_s"] > 0 and m["skipped"] == 0
    assert metrics[0]["loss"] == pytest.approx(sum(per_step[:10]) / 10)
    held = read_jsonl(out / "eval.jsonl")
    assert [h["step"] for h in held] == [15, 30] and held[1]["eval_loss"] < held[0]["eval_loss"]
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step_00000020", "step_00000030"]  # keep 2
    assert (out / "loss.png").stat().st_size > 1000
    assert load_config(out / "config.yaml") == config
    assert len(result.samples) == 2 and (out / "samples.txt").is_file()
    # The exported model loads with from_pretrained and gives the trained model's logits.
    from hybridlm.models.hf import load_model

    device = next(trainer.raw_model.parameters()).device  # "auto" trains on the GPU where there is one
    exported = load_model(out / "final").to(device)
    probe = torch.randint(0, 256, (1, 16), device=device)
    with torch.no_grad():
        assert torch.allclose(exported(probe).logits, trainer.raw_model(probe).logits, atol=1e-5)
    assert (out / "final" / "tokenizer.json").is_file()


def test_resume_continues_exactly(demo_dir, tmp_path):
    """2N updates in one go == N updates, stop, resume, N more: identical losses, weights, loader position."""
    # accumulation, a decaying lr, and dropout: training draws random numbers, so the RNG's restore is checked
    extra = ("batch.grad_accum=2", "schedule.decay_fraction=0.5", "model.overrides.attention_dropout=0.1")
    whole = Trainer(small_config(demo_dir, tmp_path / "whole", *extra))
    whole.train()

    first = Trainer(small_config(demo_dir, tmp_path / "split", *extra), callbacks=[stop_at(4)])
    assert first.train().status == "interrupted"
    assert latest_checkpoint(tmp_path / "split" / "checkpoints").name == "step_00000004"
    torch.manual_seed(1234)  # disturb the global RNG: the checkpoint must restore it
    second = Trainer(small_config(demo_dir, tmp_path / "split", *extra), resume=True)
    assert second.step == 4 and second.tokens == 4 * 2 * 2 * 32
    assert second.train().status == "completed"

    assert losses(first) + losses(second) == losses(whole)  # exact, not approximate
    assert [r["lr"] for r in first.history + second.history] == [r["lr"] for r in whole.history]
    for (name, a), (_, b) in zip(whole.raw_model.state_dict().items(), second.raw_model.state_dict().items()):
        assert torch.equal(a, b), name
    assert second.loader.state_dict() == whole.loader.state_dict()
    logged = [m["step"] for m in read_jsonl(tmp_path / "split" / "metrics.jsonl")]
    assert logged == list(range(1, 9))


def test_resume_mid_rampup_with_a_schedule_in_tokens_continues_exactly(demo_dir, tmp_path):
    """A batch rampup (2 -> 8 rows over 1024 tokens) under an effective-power schedule counted in tokens, stopped
    mid-rampup and resumed: the same batches, lr, wd, losses and weights as one uninterrupted run, bit for bit."""
    extra = ("batch.grad_accum=4", "batch.rampup_start=2", "batch.rampup_tokens=1024", "train.steps=12",
             "schedule.kind=effective_power", "schedule.unit=tokens", "schedule.warmup=256", "schedule.power_t0=512",
             "schedule.decay_fraction=0.3", "schedule.decay_shape=exponential", "schedule.min_lr_ratio=0.125",
             "model.overrides.num_hidden_layers=1", "train.eval_batches=1")
    whole = Trainer(small_config(demo_dir, tmp_path / "whole", *extra))
    whole.train()
    first = Trainer(small_config(demo_dir, tmp_path / "split", *extra), callbacks=[stop_at(5)])
    assert first.train().status == "interrupted" and first.tokens < 1024  # stopped inside the rampup
    torch.manual_seed(99)
    second = Trainer(small_config(demo_dir, tmp_path / "split", *extra), resume=True)
    second.train()

    def seen(records):
        return [(r["step_tokens"], r["lr"], r["wd"], r["loss"]) for r in records]

    assert seen(first.history + second.history) == seen(whole.history)  # exact, not approximate
    batches = [r["step_tokens"] // 32 for r in whole.history]  # rows per update
    assert batches == sorted(batches) and {2, 4, 6, 8} <= set(batches)  # the batch grows to 8 rows inside the run
    assert len({r["wd"] for r in whole.history}) > 3  # EPS moves the weight decay too
    for (name, a), (_, b) in zip(whole.raw_model.state_dict().items(), second.raw_model.state_dict().items()):
        assert torch.equal(a, b), name


def test_resume_takes_every_optimizer_hyperparameter_from_the_new_config(demo_dir, tmp_path):
    """--resume with new betas, eps, lr, wd and a multiplier: the AdamW groups hold the new values (those of a fresh
    run), not the checkpoint's, and an update equals a fresh AdamW's with the new values and the saved moments."""
    from hybridlm.training.optim import apply_schedule

    Trainer(small_config(demo_dir, tmp_path / "run", "train.steps=2")).train()
    new = ("train.steps=4", "optim.betas=[0.5, 0.6]", "optim.eps=1e-6", "optim.lr=1e-2", "optim.weight_decay=0.05",
           "optim.elr.mlp_up=2.0")
    resumed = Trainer(small_config(demo_dir, tmp_path / "run", *new), resume=True)
    fresh = Trainer(small_config(demo_dir, tmp_path / "fresh", *new))

    def hyperparameters(group):
        return {k: v for k, v in group.items() if k != "params"}

    assert [hyperparameters(g) for g in resumed.optimizer.param_groups] == \
        [hyperparameters(g) for g in fresh.optimizer.param_groups]
    assert {g["betas"] for g in resumed.optimizer.param_groups} == {(0.5, 0.6)}
    # one update against a fresh AdamW with the new settings, given the checkpoint's moments and step counts
    params = [p for g in resumed.optimizer.param_groups for p in g["params"]]
    assert all(int(resumed.optimizer.state[p]["step"]) == 2 for p in params)
    clones = iter([p.detach().clone().requires_grad_() for p in params])
    reference = torch.optim.AdamW([{**hyperparameters(g), "params": [next(clones) for _ in g["params"]]}
                                   for g in fresh.optimizer.param_groups])
    generator = torch.Generator().manual_seed(0)
    for p, c in zip(params, [c for g in reference.param_groups for c in g["params"]]):
        reference.state[c] = {k: v.clone() for k, v in resumed.optimizer.state[p].items()}
        p.grad = torch.randn(p.shape, generator=generator).to(p.device)
        c.grad = p.grad.clone()
    for optimizer in (resumed.optimizer, reference):
        apply_schedule(optimizer, 0.5, 0.5)
        optimizer.step()
    for p, c in zip(params, [c for g in reference.param_groups for c in g["params"]]):
        assert torch.equal(p, c)


def test_out_and_the_users_set_keys(tmp_path, capsys):
    """A bad --set beside --out is named itself (not the train.out_dir that --out adds); --out with --set
    train.out_dir is one setting given twice. Nothing is written either way."""
    from hybridlm.cli import main

    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--set", "train=5"]) == 2
    assert capsys.readouterr().err.startswith("config error: train: expected a mapping of keys")
    assert main(["train", "--out", str(out), "--set", f"train.out_dir={tmp_path / 'other'}"]) == 2
    assert "--out and --set train.out_dir both set the output directory" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_run_length_the_ranks_do_not_fit_is_a_config_error_of_the_cli(demo_dir, tmp_path, capsys):
    """A token budget with a decay in steps: the number of updates depends on the ranks, so load_config leaves the
    check to the trainer (here 1 rank: 640 tokens = 10 updates of 2 x 32), whose ConfigError the CLI reports in one
    line with exit status 2 (no traceback)."""
    from hybridlm.cli import main

    sets = [f"data.demo_dir={demo_dir}", "data.demo_max_bytes=400000", "data.demo_heldout_every=4",
            "batch.micro_batch=2", "batch.seq_len=32", "train.steps=null", "train.tokens=640",
            "schedule.decay_fraction=null", "schedule.decay=20", "train.progress=false"]
    assert main(["train", "--out", str(tmp_path / "cli"), *[a for s in sets for a in ("--set", s)]]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: schedule.decay: the decay (20 steps) is longer than the whole run (10 steps "
                          "at 1 data-parallel rank)"), err
    assert err.count("\n") == 1


def test_a_resumed_run_logs_the_metrics_of_an_uninterrupted_one(demo_dir, tmp_path):
    """Stopped between two records (log_every 4, stop at 3; a crash after a save at 6): the resumed run's
    metrics.jsonl holds the same records, each averaging the same updates."""
    extra = ("train.log_every=4", "train.save_every=6")
    Trainer(small_config(demo_dir, tmp_path / "whole", *extra)).train()
    first = Trainer(small_config(demo_dir, tmp_path / "split", *extra), callbacks=[stop_at(3)])
    assert first.train().status == "interrupted"
    assert [m["step"] for m in read_jsonl(tmp_path / "split" / "metrics.jsonl")] == [3]  # a partial record
    second = Trainer(small_config(demo_dir, tmp_path / "split", *extra), resume=True)
    second.train()
    # a crash right after the save at update 6 (records at 4 and 8; the checkpoint's interval holds 5 and 6)
    (tmp_path / "split" / "checkpoints" / "step_00000008").rename(tmp_path / "crashed")
    third = Trainer(small_config(demo_dir, tmp_path / "split", *extra), resume=True)
    assert third.step == 6
    third.train()

    def comparable(name):
        return [{k: m[k] for k in ("step", "tokens", "loss", "lr", "wd", "grad_norm", "skipped")}
                for m in read_jsonl(tmp_path / name / "metrics.jsonl")]

    assert [m["step"] for m in comparable("split")] == [4, 8]
    assert comparable("split") == comparable("whole")


def test_resume_with_more_steps_through_the_cli(demo_dir, tmp_path, capsys):
    from hybridlm.cli import main

    out = tmp_path / "cli"
    base = ["--set", f"data.demo_dir={demo_dir}", "--set", "batch.micro_batch=2", "--set", "batch.seq_len=32",
            "--set", "train.samples=0", "--set", "train.progress=false", "--set", "data.demo_max_bytes=400000",
            "--set", "data.demo_heldout_every=4", "--set", "train.eval_every=0"]
    assert main(["train", "--out", str(out), "--set", "train.steps=3", *base]) == 0
    assert main(["train", "--out", str(out), "--set", "train.steps=3", *base]) == 2  # exists: --resume needed
    assert main(["train", "--resume", "--out", str(out), "--set", "train.steps=5"]) == 0  # its config.yaml
    assert latest_checkpoint(out / "checkpoints").name == "step_00000005"
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")][-1] == 5
    assert load_config(out / "config.yaml").train.steps == 5
    # without its config.yaml the run's settings are unknown: said before anything is prepared or written
    saved = (out / "config.yaml").read_text()
    (out / "config.yaml").unlink()
    before = snapshot(out)
    assert main(["train", "--resume", "--out", str(out), "--set", "train.steps=6"]) == 2
    assert "config.yaml is missing, so the run's settings are unknown; pass the config it was started with" in \
        capsys.readouterr().err
    assert snapshot(out) == before
    (out / "config.yaml").write_text(saved)


def test_a_finished_run_is_never_replaced_without_overwrite(demo_dir, tmp_path, capsys):
    """Its checkpoints deleted, a finished run still has final/, metrics.jsonl and config.yaml: a new run into
    the directory, with or without --resume, is refused and leaves them as they are; only --overwrite replaces them."""
    from hybridlm.cli import main

    out = tmp_path / "finished"
    assert main(["train", "--out", str(out), *cli_sets(demo_dir, "train.steps=3")]) == 0
    import shutil

    shutil.rmtree(out / "checkpoints")
    before = snapshot(out)
    capsys.readouterr()
    assert main(["train", "--out", str(out), *cli_sets(demo_dir, "train.steps=2")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"config error: train.out_dir: {out} already holds a run (final/, metrics.jsonl, "
                          "eval.jsonl, config.yaml, loss.png)") and "--overwrite" in err, err
    assert main(["train", "--resume", "--out", str(out), *cli_sets(demo_dir, "train.steps=2")]) == 2
    err = capsys.readouterr().err
    assert "has no checkpoint but holds final/: the run looks finished" in err and "--overwrite" in err, err
    assert snapshot(out) == before
    with pytest.raises(SystemExit):  # argparse: the two contradict each other
        main(["train", "--resume", "--overwrite", "--out", str(out)])
    capsys.readouterr()
    assert main(["train", "--overwrite", "--out", str(out), *cli_sets(demo_dir, "train.steps=2")]) == 0
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [2]  # the new run's only record
    assert load_config(out / "config.yaml").train.steps == 2


def test_overwrite_removes_the_previous_runs_checkpoints(demo_dir, tmp_path):
    out = tmp_path / "again"
    Trainer(small_config(demo_dir, out, "train.steps=3")).train()
    with pytest.raises(ConfigError, match=r"already holds a run \(checkpoints/step_00000003, final/.*--resume.*"
                                          r"--overwrite"):
        Trainer(small_config(demo_dir, out, "train.steps=2"))
    trainer = Trainer(small_config(demo_dir, out, "train.steps=2"), overwrite=True)
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == []  # the old run's step 3 would win a resume
    trainer.train()
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step_00000002"]


def test_resume_refuses_fewer_steps_than_the_checkpoint_and_a_complete_run_is_left_alone(demo_dir, tmp_path, capsys):
    from hybridlm.cli import main

    out = tmp_path / "done"
    assert main(["train", "--out", str(out), *cli_sets(demo_dir, "train.steps=4")]) == 0
    before = snapshot(out)
    capsys.readouterr()
    # shorter than the checkpoint: refused before anything is trained or rewritten (final/, config.yaml)
    assert main(["train", "--resume", "--out", str(out), "--set", "train.steps=2"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("config error: train.steps: 2 is below the checkpoint's step 4"), captured.err
    assert not any(line.startswith("training ") for line in captured.out.splitlines()), captured.out
    assert snapshot(out) == before
    # a token budget that ends the run sooner (2 updates of 64 tokens), refused alike; one that the 4th update
    # crossed (200 tokens) is the run's own length
    assert main(["train", "--resume", "--out", str(out), "--set", "train.steps=null", "--set", "train.tokens=128"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("config error: train.tokens: 128 tokens end the run after 2 updates (at the "
                                   "checkpoint's 1 data-parallel rank), below the checkpoint's step 4"), captured.err
    assert snapshot(out) == before
    assert main(["train", "--resume", "--out", str(out), "--set", "train.steps=null", "--set", "train.tokens=200"]) == 0
    assert "already complete" in capsys.readouterr().out and snapshot(out) == before
    # the same length (here with another lr): already complete, nothing rewritten
    assert main(["train", "--resume", "--out", str(out), "--set", "optim.lr=1e-4"]) == 0
    captured = capsys.readouterr()
    assert "already complete" in captured.out and "n/a" not in captured.out, captured.out
    assert snapshot(out) == before
    loss = read_jsonl(out / "metrics.jsonl")[-1]["loss"]
    assert f"already complete: 4 updates, 256 tokens, loss {loss:.4f}" in captured.out, captured.out


def test_resume_at_the_last_step_without_final_finishes_the_export(demo_dir, tmp_path):
    """A run that died after its last checkpoint, before final/ was written: resuming writes final/ (and reports
    the logged loss, not "n/a")."""
    import shutil

    out = tmp_path / "export"
    Trainer(small_config(demo_dir, out, "train.steps=2")).train()
    shutil.rmtree(out / "final")
    trainer = Trainer(small_config(demo_dir, out, "train.steps=2"), resume=True)
    result = trainer.train()
    assert result.status == "completed" and (out / "final" / "model.safetensors").is_file()
    assert result.loss == read_jsonl(out / "metrics.jsonl")[-1]["loss"]


def test_the_summary_after_sigint_lists_only_outputs_that_exist(demo_dir, tmp_path, capsys, monkeypatch):
    from hybridlm.cli import main

    update = TrainLoop.update

    def interrupt_at_2(self):
        output = update(self)
        if output.step == 2:
            os.kill(os.getpid(), signal.SIGINT)  # a real signal, handled in this (main) thread
        return output

    monkeypatch.setattr(TrainLoop, "update", interrupt_at_2)
    out = tmp_path / "sigint"
    assert main(["train", "--out", str(out), *cli_sets(demo_dir, "train.steps=5")]) == 128 + signal.SIGINT
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.startswith("interrupted: 2 updates"), summary
    assert summary.endswith(f"outputs in {out} (metrics.jsonl, loss.png, checkpoints/)"), summary
    assert not (out / "final").exists()


def test_train_device_cuda_without_cuda_is_a_config_error(demo_dir, tmp_path, capsys, monkeypatch):
    from hybridlm.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "nocuda"
    assert main(["train", "--out", str(out), *cli_sets(demo_dir, "train.steps=2", "train.device=cuda")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: train.device: 'cuda' but CUDA is not available") and "train.device=cpu" in err
    assert not out.exists()


def test_samples_at_temperature_zero_are_greedy_and_written_atomically(demo_dir, tmp_path, monkeypatch):
    out = tmp_path / "greedy"
    trainer = Trainer(small_config(demo_dir, out, "train.steps=1", "train.samples=1", "train.sample_tokens=6",
                                   "train.sample_temperature=0"))
    first = trainer._write_samples()
    torch.manual_seed(99)
    assert trainer._write_samples() == first and len(first) == 1  # greedy: no randomness
    written = (out / "samples.txt").read_bytes()

    def failing_fsync(fd):
        raise OSError("no space left on device")

    trainer.config.train.sample_tokens = 12  # other samples, so other bytes
    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="no space"):
        trainer._write_samples()
    assert (out / "samples.txt").read_bytes() == written  # a failed write keeps the previous samples


def test_the_loss_plot_is_replaced_atomically(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from hybridlm.training.run_dir import plot_losses

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "tokens": 64 * s, "loss": 5.0 / s}) + "\n"
                                                    for s in (1, 2, 3)))
    before = plot_losses(tmp_path).read_bytes()
    with open(tmp_path / "metrics.jsonl", "a") as handle:
        handle.write(json.dumps({"step": 4, "tokens": 256, "loss": 0.5}) + "\n")

    def failing_fsync(fd):
        raise OSError("no space left on device")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="no space"):
        plot_losses(tmp_path)
    assert (tmp_path / "loss.png").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loss.png", "metrics.jsonl"]  # no temporary file left


def test_sigterm_saves_a_checkpoint_and_restores_the_handler(demo_dir, tmp_path):
    def send_sigterm(trainer: Trainer, record: dict) -> None:
        if record["step"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # a real signal, handled in this (main) thread
            os.kill(os.getpid(), signal.SIGTERM)  # again at once, as `timeout` does (command, then its group)

    before = signal.getsignal(signal.SIGTERM)
    trainer = Trainer(small_config(demo_dir, tmp_path / "sig"), callbacks=[send_sigterm])
    result = trainer.train()
    assert result.status == "interrupted" and result.step == 3
    assert result.checkpoint.name == "step_00000003"
    assert latest_checkpoint(tmp_path / "sig" / "checkpoints") == result.checkpoint
    assert signal.getsignal(signal.SIGTERM) is before
    resumed = Trainer(small_config(demo_dir, tmp_path / "sig"), resume=True)
    assert resumed.step == 3


def nan_loss_at(trainer: Trainer, bad_steps: set[int]) -> Trainer:
    """Make the training loss of the given (0-based) updates non-finite."""
    loss = trainer.loop.loss

    class NaNAt:
        count = staticmethod(loss.count)

        def __call__(self, model, batch):
            value = loss(model, batch)
            return value * float("nan") if trainer.step in bad_steps else value

    trainer.loop.loss = NaNAt()
    return trainer


def test_non_finite_loss_skips_the_update(demo_dir, tmp_path):
    snapshots = {}

    def snapshot(trainer, record):
        snapshots[record["step"]] = [p.detach().clone() for p in trainer.raw_model.parameters()]

    trainer = nan_loss_at(Trainer(small_config(demo_dir, tmp_path / "nan", "train.log_every=4"),
                                  callbacks=[snapshot]), {2})
    result = trainer.train()
    assert result.status == "completed"
    assert [r["skipped"] for r in trainer.history] == [False, False, True, False, False, False, False, False]
    assert all(torch.equal(a, b) for a, b in zip(snapshots[2], snapshots[3]))  # the skipped update changed nothing
    assert not all(torch.equal(a, b) for a, b in zip(snapshots[3], snapshots[4]))
    assert all(torch.isfinite(p).all() for p in trainer.raw_model.parameters())
    metrics = read_jsonl(tmp_path / "nan" / "metrics.jsonl")
    assert [m["skipped"] for m in metrics] == [1, 0]
    assert trainer.guard.total_skips == 1 and trainer.guard.consecutive_skips == 0


def test_consecutive_non_finite_losses_stop_the_run(demo_dir, tmp_path):
    trainer = nan_loss_at(Trainer(small_config(demo_dir, tmp_path / "div", "train.max_consecutive_skips=3")),
                          {1, 2, 3, 4, 5})
    with pytest.raises(TrainingDivergedError, match="3 consecutive optimizer updates skipped"):
        trainer.train()
    assert trainer.step == 3  # updates 1 and 2 (0-based) were skipped, the third skip (update 3) raised


def test_bf16_autocast_trains_with_fp32_master_weights(demo_dir, tmp_path):
    trainer = Trainer(small_config(demo_dir, tmp_path / "bf16", "train.dtype=bf16", "train.steps=4"))
    trainer.train()
    assert all(p.dtype == torch.float32 for p in trainer.raw_model.parameters())
    assert all(torch.isfinite(torch.tensor(x)) for x in losses(trainer))
    assert losses(trainer)[-1] < losses(trainer)[0]


def test_refuses_a_corrupt_checkpoint_and_an_existing_run(demo_dir, tmp_path):
    out = tmp_path / "corrupt"
    Trainer(small_config(demo_dir, out, "train.steps=2")).train()
    with pytest.raises(ConfigError, match="--resume"):
        Trainer(small_config(demo_dir, out, "train.steps=2"))
    model_file = latest_checkpoint(out / "checkpoints") / "model.safetensors"
    data = bytearray(model_file.read_bytes())
    data[-5] ^= 0xFF
    model_file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum"):
        Trainer(small_config(demo_dir, out, "train.steps=4"), resume=True)


def test_resume_refuses_when_no_checkpoint_is_complete_and_keeps_the_metrics(demo_dir, tmp_path):
    out = tmp_path / "truncated"
    Trainer(small_config(demo_dir, out, "train.steps=2")).train()
    metrics = (out / "metrics.jsonl").read_text()
    only = latest_checkpoint(out / "checkpoints")
    model_file = only / "model.safetensors"
    model_file.write_bytes(model_file.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"no checkpoint .* is complete \(step_00000002"):
        Trainer(small_config(demo_dir, out, "train.steps=4"), resume=True)
    assert (out / "metrics.jsonl").read_text() == metrics and model_file.is_file()


def test_resume_refuses_to_train_past_a_damaged_newer_checkpoint(demo_dir, tmp_path):
    """A step directory newer than the newest complete checkpoint was damaged after its save (an interrupted save
    leaves only a `.tmp` directory): --resume refuses, naming it and its problem and what to do, instead of resuming
    from the older checkpoint and replacing it with a new save; moved away, the run resumes from the older one, and a
    `.tmp` directory is still passed over."""
    out = tmp_path / "damaged"
    Trainer(small_config(demo_dir, out, "train.steps=4", "train.save_every=2")).train()
    checkpoints = out / "checkpoints"
    older, newer = list_checkpoints(checkpoints)
    metrics = (out / "metrics.jsonl").read_text()
    model_file = newer / "model.safetensors"
    model_file.write_bytes(model_file.read_bytes()[:-100])
    damaged = {p.name: p.read_bytes() for p in newer.iterdir()}
    with pytest.raises(CheckpointError, match=r"newer than the newest complete one, step_00000002, are damaged "
                       r"\(step_00000004: model.safetensors is [\d,]+ bytes, its manifest says [\d,]+\); .*"
                       r"move them out of .*checkpoints \(or delete them\) to resume from step_00000002"):
        Trainer(small_config(demo_dir, out, "train.steps=6", "train.save_every=2"), resume=True)
    assert {p.name: p.read_bytes() for p in newer.iterdir()} == damaged  # left exactly as it was
    assert (out / "metrics.jsonl").read_text() == metrics
    newer.rename(tmp_path / "set_aside")
    (checkpoints / "step_00000005.tmp").mkdir()  # an interrupted save
    trainer = Trainer(small_config(demo_dir, out, "train.steps=6", "train.save_every=2"), resume=True)
    assert trainer.resumed_from == older and trainer.step == 2


def test_resume_with_a_different_shape_names_the_changed_settings(demo_dir, tmp_path):
    out = tmp_path / "changed"
    Trainer(small_config(demo_dir, out, "train.steps=2")).train()
    config = (out / "config.yaml").read_text()
    with pytest.raises(ConfigError, match=r"does not fit this configuration .*batch\.seq_len"):
        Trainer(small_config(demo_dir, out, "train.steps=4", "batch.seq_len=64"), resume=True)
    with pytest.raises(ConfigError, match=r"does not fit this configuration .*intermediate_size"):
        Trainer(small_config(demo_dir, out, "train.steps=4", "model.overrides.intermediate_size=96"), resume=True)
    assert (out / "config.yaml").read_text() == config


def test_a_wrong_held_out_source_fails_before_training(demo_dir, tmp_path):
    overrides = ("data.demo=false", f"data.sources=[{{name: d, path: {demo_dir / 'train'}}}]",
                 f"data.eval_sources=[{{name: ho, path: {tmp_path / 'no_such_dir'}}}]")
    with pytest.raises(ConfigError, match=r"data\.eval_sources: .*no_such_dir"):
        Trainer(small_config(demo_dir, tmp_path / "ho", *overrides))


def test_a_demo_corpus_too_small_for_a_held_out_file_says_so(demo_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"data\.demo_max_bytes: .* fewer than one held-out file per 20"):
        Trainer(small_config(demo_dir, tmp_path / "run", f"data.demo_dir={tmp_path / 'small_demo'}",
                             "data.demo_max_bytes=50000", "data.demo_heldout_every=20"))


def test_a_wrong_tokenizer_fails_before_training(demo_dir, tmp_path):
    import shutil

    data = ("data.demo=false", f"data.sources=[{{name: d, path: {demo_dir / 'train'}}}]")
    with pytest.raises(ConfigError, match="data.tokenizer: .*nowhere holds no tokenizer.json"):
        Trainer(small_config(demo_dir, tmp_path / "a", *data, f"data.tokenizer={tmp_path / 'nowhere'}"))
    other = tmp_path / "other_tokenizer"
    shutil.copytree(demo_dir / "tokenizer", other)
    (other / "tokenizer.json").write_text((other / "tokenizer.json").read_text() + " ")
    with pytest.raises(ConfigError, match="data.tokenizer: .*is not the tokenizer .* was prepared with"):
        Trainer(small_config(demo_dir, tmp_path / "b", *data, f"data.tokenizer={other}"))
    Trainer(small_config(demo_dir, tmp_path / "c", *data, f"data.tokenizer={demo_dir / 'tokenizer'}"))  # the right one


def test_the_final_checkpoint_is_saved_before_the_final_evaluation(demo_dir, tmp_path, monkeypatch):
    out = tmp_path / "final_eval"
    trainer = Trainer(small_config(demo_dir, out, "train.steps=3"))

    def failing_eval(*args, **kwargs):
        raise RuntimeError("evaluation failed")

    monkeypatch.setattr(trainer, "evaluate", failing_eval)
    with pytest.raises(RuntimeError, match="evaluation failed"):
        trainer.train()
    assert latest_checkpoint(out / "checkpoints").name == "step_00000003"


def test_out_is_a_path_not_yaml(demo_dir, tmp_path):
    from hybridlm.cli import main

    out = tmp_path / "exp #3"
    assert main(["train", "--out", str(out), "--set", f"data.demo_dir={demo_dir}", "--set", "train.steps=1",
                 "--set", "batch.micro_batch=2", "--set", "batch.seq_len=32", "--set", "train.samples=0",
                 "--set", "train.progress=false", "--set", "data.demo_max_bytes=400000", "--set",
                 "data.demo_heldout_every=4", "--set", "train.eval_every=0"]) == 0
    assert (out / "checkpoints" / "step_00000001").is_dir()


def test_data_vocabulary_must_fit_the_model(demo_dir, tmp_path):
    with pytest.raises(ConfigError, match="model.overrides.vocab_size"):
        Trainer(small_config(demo_dir, tmp_path / "v", "model.overrides.vocab_size=200"))


def test_optimizer_groups_follow_the_config(demo_dir, tmp_path):
    trainer = Trainer(small_config(demo_dir, tmp_path / "groups", "optim.elr.ssm_in=2", "optim.ewd.ssm_in=0.5",
                                   "optim.vector_lr.dt_bias=0.1"))
    groups = {g["role"]: g for g in trainer.optimizer.param_groups}
    assert groups["ssm_in"]["base_lr"] == pytest.approx(3e-3 * 2 / 0.5)
    assert groups["ssm_in"]["base_weight_decay"] == pytest.approx(0.1 * 2 * 0.5)
    assert groups["dt_bias"]["base_lr"] == pytest.approx(3e-4) and groups["dt_bias"]["base_weight_decay"] == 0
    assert groups["mlp_up"]["base_lr"] == pytest.approx(3e-3)
    json.dumps(trainer._train_state())  # the checkpoint's train_state is plain JSON


def test_compiled_blocks_train_like_eager(demo_dir, tmp_path, monkeypatch):
    """train.compile (torch.compile per block, inductor; on the CPU the slow compile is paid once, in the
    reduce-overhead mode) gives eager's losses, and starts a new CUDA-graph step before every forward (on the CPU
    inductor runs without graphs; the GPU replays them). The held-out evaluation and the samples, forwards without a
    backward, run eagerly (`Trainer._eager_without_grad`)."""
    mode = "reduce-overhead"
    steps_begun = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: steps_begun.append(1))
    extra = ("train.steps=3", "batch.grad_accum=2", "train.eval_every=3", "train.eval_batches=1")
    eager = Trainer(small_config(demo_dir, tmp_path / "eager", *extra))
    eager.train()
    stances, modes = [], []
    real_stance, real_compile = torch.compiler.set_stance, torch.nn.Module.compile
    monkeypatch.setattr(torch.compiler, "set_stance", lambda stance, **kw: stances.append(stance) or
                        real_stance(stance, **kw))
    monkeypatch.setattr(torch.nn.Module, "compile", lambda module, *a, **kw: modes.append(kw.get("mode")) or
                        real_compile(module, *a, **kw))
    kept = []
    from hybridlm.training import loop

    monkeypatch.setattr(loop, "allocate_missing_grads", lambda model: kept.append(compiled.step)
                        or allocate_missing_grads(model))
    compiled = Trainer(small_config(demo_dir, tmp_path / mode, *extra, "train.compile=true",
                                    f"train.compile_mode={mode}", "train.samples=1", "train.sample_tokens=4"))
    result = compiled.train()
    assert kept == [0, 1, 2]  # before every update's first backward
    assert modes == [mode] * len(compiled.raw_model.model.layers)  # every block, in the mode asked for
    assert losses(compiled) == pytest.approx(losses(eager), rel=1e-4)
    assert len(result.samples) == 1 and stances == ["force_eager"] * 2  # the evaluation and the samples
    # Gradients stay allocated outside the graphs and are zeroed in place (a graph-owned .grad dies at the next
    # micro-batch's graph step): after the run every trainable parameter holds a zero .grad.
    assert all(p.grad is not None and not p.grad.any() for p in compiled.raw_model.parameters() if p.requires_grad)
    held = [read_jsonl(tmp_path / name / "eval.jsonl")[0]["eval_loss"] for name in ("eager", mode)]
    assert held[1] == pytest.approx(held[0], rel=1e-4)
    forwards = 3 * 2 + 1 * 2  # 3 updates of 2 micro-batches, 1 evaluation batch of 2 micro-batches
    assert len(steps_begun) == forwards


def test_compiled_fast_weight_hybrid_on_packed_documents_trains_like_eager(demo_dir, tmp_path, monkeypatch):
    """The trainer's packed documents through compiled blocks of a fast-weight hybrid (its conv on seq_idx inside the
    graphs, its op outside them): eager's losses, and the packed rows really reach the model (spied on outside the
    compiled blocks)."""
    from hybridlm.models.model import HybridModel

    extra = ("train.steps=3", "model.overrides.ssm_mixer=fast_weight", "model.overrides.fw_rule=1A")
    eager = Trainer(small_config(demo_dir, tmp_path / "eager", *extra))
    eager.train()
    packed = []
    real = HybridModel._run
    monkeypatch.setattr(HybridModel, "_run", lambda self, h, cu_seqlens, *a: packed.append(cu_seqlens is not None)
                        or real(self, h, cu_seqlens, *a))
    compiled = Trainer(small_config(demo_dir, tmp_path / "compiled", *extra, "train.compile=true"))
    compiled.train()
    assert any(packed)  # the demo corpus packs documents in rows
    assert losses(compiled) == pytest.approx(losses(eager), rel=1e-4)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.compile_mode=fast"], "train.compile_mode: must be one of"),
        (["train.compile_mode=reduce-overhead"], "needs train.compile=true"),
        (["train.compile=true", "train.compile_mode=reduce-overhead", "parallel.activation_checkpointing=true"],
         "one process without activation checkpointing"),
        (["train.compile=true", "train.compile_mode=reduce-overhead", "parallel.tp=2"], "tp = cp = 1"),
        (["train.compile=true", "train.compile_mode=reduce-overhead", "parallel.cp=2",
          "data.document_boundaries=false"],
         "tp = cp = 1"),
    ],
)
def test_compile_mode_errors(demo_dir, tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        small_config(demo_dir, tmp_path, *overrides)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)")
def test_cuda_graph_blocks_accumulate_gradients_like_eager(demo_dir, tmp_path):
    """On a GPU, reduce-overhead replays every block as a CUDA graph: 2 updates of 2 micro-batches each give eager's
    losses (a .grad left to the graphs' memory would be overwritten by the second micro-batch's graph step), and the
    held-out evaluation in between gives eager's loss (replayed as graphs without a backward, each block's replay
    overwrote the previous block's output: `Trainer._eager_without_grad`)."""
    extra = ("train.steps=2", "batch.grad_accum=2", "train.device=cuda", "train.eval_every=1", "train.eval_batches=1")
    eager = Trainer(small_config(demo_dir, tmp_path / "eager", *extra))
    eager.train()
    graphs = Trainer(small_config(demo_dir, tmp_path / "graphs", *extra, "train.compile=true",
                                  "train.compile_mode=reduce-overhead"))
    graphs.train()
    assert losses(graphs) == pytest.approx(losses(eager), rel=1e-3)
    held = [[r["eval_loss"] for r in read_jsonl(tmp_path / name / "eval.jsonl")] for name in ("eager", "graphs")]
    assert len(held[0]) >= 2 and held[1] == pytest.approx(held[0], rel=1e-3)
    for (name, a), (_, b) in zip(eager.raw_model.named_parameters(), graphs.raw_model.named_parameters()):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-4, msg=name)


def test_allocate_missing_grads_allocates_missing_gradients_only(demo_dir, tmp_path):
    trainer = Trainer(small_config(demo_dir, tmp_path, "train.compile=true", "train.compile_mode=reduce-overhead"))
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    kept = params[0].grad = torch.ones_like(params[0])
    allocate_missing_grads(trainer.model)
    assert params[0].grad is kept and kept.eq(1).all()  # an existing gradient is left alone
    assert all(p.grad is not None and not p.grad.any() for p in params[1:])


@pytest.mark.parametrize("boundaries,lm_head_loss", [(True, "chunked"), (False, "chunked"), (True, "logits")])
def test_model_inputs_come_from_the_host_offsets_and_give_the_same_loss(demo_dir, tmp_path, boundaries, lm_head_loss):
    """The trainer hands the model its documents from the loader's host offsets (a packed row with host cu_seqlens,
    or plain rows), never restarting position_ids for the model to read back from the device; the loss equals the
    model's own reading of the position_ids, with the chunked LM-head loss or with the logits
    (`train.lm_head_loss`)."""
    import torch.nn.functional as F

    trainer = Trainer(small_config(demo_dir, tmp_path, f"data.document_boundaries={str(boundaries).lower()}",
                                   f"train.lm_head_loss={lm_head_loss}"))
    assert trainer.loss.chunked == (lm_head_loss == "chunked")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (2, 16), generator=g)
    labels = torch.randint(3, 200, (2, 16), generator=g)
    documents = {  # a loader batch: documents of 5 + 11 and 16 tokens, then one document per row
        "packed": (torch.tensor([[0, 1, 2, 3, 4] + list(range(11)), list(range(16))]), torch.tensor([0, 5, 16, 32])),
        "rows": (torch.arange(16).expand(2, 16), torch.tensor([0, 16, 32])),
    }
    for name, (positions, offsets) in documents.items():
        raw = {"input_ids": ids, "labels": labels, "position_ids": positions, "cu_seqlens": offsets.to(torch.int32),
               "max_seqlen": 16}
        batch = trainer._prepare(raw)
        inputs = trainer._model_inputs(batch)
        if name == "packed" and boundaries:
            assert sorted(inputs) == ["cu_seqlens", "input_ids", "position_ids"]
            assert inputs["cu_seqlens"].device.type == "cpu" and inputs["input_ids"].shape == (1, 32)
        else:  # one document per row, or boundaries not kept: positions 0..T-1, the model's default
            assert sorted(inputs) == ["input_ids"]
        with torch.no_grad():
            got = trainer.loss(trainer.model, trainer._micro_batch(raw))
            logits = trainer.model(batch["input_ids"], position_ids=batch["position_ids"]).logits
            want = F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(), ignore_index=-100,
                                   reduction="sum")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_train_deterministic_trains_under_deterministic_kernels_only(demo_dir, tmp_path):
    """train.deterministic=true: every update under torch's deterministic mode, the process's setting back after;
    the losses are those of the default run (on the CPU both are deterministic)."""
    seen = []

    def record_mode(trainer: Trainer, record: dict) -> None:
        seen.append(torch.are_deterministic_algorithms_enabled())

    plain = Trainer(small_config(demo_dir, tmp_path / "plain", "train.steps=3"), callbacks=[record_mode])
    plain.train()
    deterministic = Trainer(small_config(demo_dir, tmp_path / "det", "train.steps=3", "train.deterministic=true"),
                            callbacks=[record_mode])
    deterministic.train()
    assert seen == [False] * 3 + [True] * 3 and not torch.are_deterministic_algorithms_enabled()
    assert losses(deterministic) == losses(plain)


@pytest.mark.parametrize("setting,recomputes", [("true", True), ("false", False), ("all", True), ("none", False),
                                                 ("fast_weight", False)])
def test_recompute_mixers_reaches_the_model(demo_dir, tmp_path, setting, recomputes):
    """The demo's Mamba-2 mixers recompute under "all" (YAML's true) only: the default, "fast_weight", keeps them."""
    from hybridlm.layers.mamba2 import Mamba2Mixer

    trainer = Trainer(small_config(demo_dir, tmp_path, f"parallel.recompute_mixers={setting}"))
    mixers = [m for m in trainer.model.modules() if isinstance(m, Mamba2Mixer)]
    assert mixers and all(m.recompute == recomputes for m in mixers)


def test_recompute_mixers_refuses_an_unknown_setting(demo_dir, tmp_path):
    with pytest.raises(ConfigError, match="parallel.recompute_mixers: must be one of fast_weight, all, none"):
        Trainer(small_config(demo_dir, tmp_path, "parallel.recompute_mixers=mamba"))


def test_resume_with_fewer_steps_is_refused_before_any_note_or_data_preparation(demo_dir, tmp_path, capsys):
    """The config error comes first: no "warmup shortened" note (2 steps shorten it) and no demo corpus preparation
    before it."""
    from hybridlm.cli import main

    out = tmp_path / "run"
    assert main(["train", "--out", str(out), *cli_sets(demo_dir, "train.steps=4")]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", "--out", str(out), "--set", "train.steps=2"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("config error: train.steps: 2 is below the checkpoint's step 4"), captured.err
    assert captured.out == ""


def _short_documents(demo_dir, directory, count: int = 8):
    """A prepared dataset (the demo's byte tokenizer) of `count` documents of 12 tokens each ("value = 000" + eos)."""
    from hybridlm.data.shards import prepare

    texts = directory.with_suffix(".jsonl")
    texts.write_text("".join(json.dumps({"text": f"value = {i:03d}"}) + "\n" for i in range(count)))
    prepare([texts], demo_dir / "tokenizer", directory, workers=1, progress=False)
    return directory


@pytest.mark.parametrize("batch, fits", [(["batch.micro_batch=8"], False), (["batch.grad_accum=4"], False),
                                         (["batch.grad_accum=2"], True)],
                         ids=["micro-batch", "global-batch", "fits"])
def test_a_batch_larger_than_the_training_data_is_a_config_error(demo_dir, tmp_path, capsys, batch, fits):
    """A micro-batch, or one update's global batch, of more tokens than the training data holds (12 documents of 12
    tokens: 144) is a config error before training, not a run that repeats the data in every update (or exhausts
    memory doing so). Rows of 32 tokens: 2 x 2 x 32 = 128 fit."""
    from hybridlm.cli import main

    data = _short_documents(demo_dir, tmp_path / "short", count=12)
    out = tmp_path / "run"
    sets = cli_sets(demo_dir, "data.demo=false", f"data.sources=[{{name: short, path: {data}}}]", "train.steps=2",
                    *batch)
    assert main(["train", "--out", str(out), *sets]) == (0 if fits else 2)
    captured = capsys.readouterr()
    if fits:
        return
    assert re.match(r"config error: batch: an update takes 256 tokens \(batch.micro_batch \d x batch.grad_accum \d x 1 "
                    r"data-parallel rank x batch.seq_len 32\), more than the training data holds: 144 "
                    r"\(data.sources\); every update would repeat data", captured.err), captured.err
    assert not any(line.startswith("training ") for line in captured.out.splitlines()), captured.out
    assert not (out / "checkpoints").exists()


@pytest.mark.parametrize("epochs, steps, fits", [(1, 2, True), (1, 3, False), (3, 6, True), (3, 7, False)])
def test_a_run_longer_than_the_sources_max_epochs_allow_is_a_config_error(demo_dir, tmp_path, capsys, epochs, steps,
                                                                         fits):
    """12 documents of 12 tokens (144) at max_epochs 1 hold two updates of 2 x 32 tokens (128 + the one token the
    last batch reads past its rows), not three; at max_epochs 3 (432 tokens) six, not seven."""
    from hybridlm.cli import main

    data = _short_documents(demo_dir, tmp_path / "short", count=12)
    out = tmp_path / "run"
    sets = cli_sets(demo_dir, "data.demo=false", f"data.sources=[{{name: short, path: {data}, max_epochs: {epochs}}}]",
                    f"train.steps={steps}", "batch.micro_batch=2")
    assert main(["train", "--out", str(out), *sets]) == (0 if fits else 2)
    captured = capsys.readouterr()
    if fits:
        return
    assert captured.err == (f"config error: train: the run takes {steps * 64:,} tokens ({steps} updates) but "
                            f"data.sources hold at most {144 * epochs} at their max_epochs, so the data would run out "
                            "before the end; lower train.steps / train.tokens, or raise the sources' max_epochs\n")
    assert not (out / "checkpoints").exists()


def test_no_samples_says_why(demo_dir, tmp_path, capsys):
    """train.samples > 0 and held-out documents too short to give a prompt: a line saying so, no samples.txt."""
    short = _short_documents(demo_dir, tmp_path / "short")
    out = tmp_path / "run"
    trainer = Trainer(small_config(
        demo_dir, out, "data.demo=false", f"data.sources=[{{name: d, path: {demo_dir / 'train'}}}]",
        f"data.eval_sources=[{{name: short, path: {short}}}]", f"data.tokenizer={demo_dir / 'tokenizer'}",
        "train.steps=1", "train.samples=3", "train.sample_tokens=4"))
    result = trainer.train()
    trainer.close()
    assert result.samples == [] and not (out / "samples.txt").exists()
    assert (f"no samples (train.samples=3): a sample continues the first 32 tokens of a held-out document, and the "
            f"first 8 documents of short ({short}) are all 32 tokens or shorter") in capsys.readouterr().out
