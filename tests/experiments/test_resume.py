"""Resumable experiment training: `train_on_task(checkpoint=...)` continues bit for bit, refuses corrupt or
foreign checkpoints, and `hybridlm bench addition` stopped by SIGTERM or its time budget finishes when re-run."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridlm.experiments import addition as A
from hybridlm.experiments import bench
from hybridlm.experiments.models import build_model, task_config
from hybridlm.experiments.train import TrainingInterrupted, generator_state, remove_checkpoint, train_on_task
from hybridlm.training.checkpoint import CheckpointError, CheckpointMismatchError, list_checkpoints
from hybridlm.training.stop import StopRequest

STEPS = 8


def _model(name: str = "hybrid-fw-1A"):
    # attention dropout on: training draws from torch's generator too, so its state must be restored as well
    config = dataclasses.replace(task_config(name, vocab_size=A.MODEL_VOCAB_SIZE, size="tiny"), attention_dropout=0.1)
    return build_model(config, seed=0)


def _train(checkpoint=None, stop_at=(), *, model_name: str = "hybrid-fw-1A", lr: float = 3e-3,
           fingerprint=None, falling_scores: bool = False):
    """A tiny addition run: batches from a numpy Generator, validation every 2 steps, a loss line every 2.
    `falling_scores`: validation scores 1 / step instead of the accuracy, so the first evaluation stays the best."""
    model = _model(model_name)
    rng = np.random.default_rng([0, 7])
    val = A.eval_sets(range(1, 4), 2, seed=5)

    def batch_fn(step: int) -> dict:
        return A.train_batch(rng, 4, max_width=3)

    def eval_fn(m) -> tuple[float, float]:
        per_width = A.evaluate(m, val, device="cpu")
        loss = float(np.mean([r["loss"] for r in per_width.values()]))
        if falling_scores:
            return 1.0 / steps_done[0], loss
        return float(np.mean([r["token_acc"] for r in per_width.values()])), loss

    def should_stop() -> bool:
        return steps_done[0] in stop_at

    steps_done = [0]

    def counted_batch_fn(step: int) -> dict:
        steps_done[0] = step + 1
        return batch_fn(step)

    result = train_on_task(model, counted_batch_fn, steps=STEPS, lr=lr, warmup=2, eval_fn=eval_fn, eval_every=2,
                           log_every=2, checkpoint=checkpoint, batch_state=generator_state(rng),
                           fingerprint=fingerprint or {"task": "test", "seed": 0}, should_stop=should_stop)
    return model, result


def _same_result(a, b) -> None:
    assert a.losses == b.losses and a.evals == b.evals
    assert (a.best_step, a.best_score, a.best_loss) == (b.best_step, b.best_score, b.best_loss)


def test_interrupted_and_resumed_training_equals_an_uninterrupted_run(tmp_path):
    straight_model, straight = _train()
    directory = tmp_path / "run.ckpt"
    # stop after 3 updates (mid log interval: a partial loss sum is carried), resume, stop again after 5, resume
    for stop_at in (3, 5):
        with pytest.raises(TrainingInterrupted) as stopped:
            _train(directory, stop_at=(stop_at,))
        assert stopped.value.step == stop_at and stopped.value.checkpoint == directory / f"step_{stop_at:08d}"
        assert list_checkpoints(directory) == [stopped.value.checkpoint]  # the previous one is gone
    resumed_model, resumed = _train(directory)
    _same_result(resumed, straight)
    assert [e["step"] for e in resumed.evals] == [2, 4, 6, 8] and [s for s, _ in resumed.losses] == [2, 4, 6, 8]
    straight_state, resumed_state = straight_model.state_dict(), resumed_model.state_dict()
    assert straight_state.keys() == resumed_state.keys()
    for key, value in straight_state.items():  # the best evaluation's weights, restored at the end: exactly equal
        assert torch.equal(value, resumed_state[key]), key
    # the finished state stays until the result is recorded; a second call returns it without training
    assert [p.name for p in list_checkpoints(directory)] == [f"step_{STEPS:08d}"]
    assert json.loads((directory / f"step_{STEPS:08d}" / "train_state.json").read_text())["step"] == STEPS
    _, again = _train(directory, stop_at=tuple(range(STEPS + 1)))
    _same_result(again, straight)
    assert remove_checkpoint(directory) and not directory.exists() and not remove_checkpoint(directory)


def test_a_best_evaluation_before_the_stop_survives_the_resume(tmp_path):
    """The best evaluation (step 2) comes before the stop (step 3): the resumed run still ends on step 2's weights
    and reports step 2 as its best, as the uninterrupted run does."""
    straight_model, straight = _train(falling_scores=True)
    assert straight.best_step == 2
    directory = tmp_path / "run.ckpt"
    with pytest.raises(TrainingInterrupted):
        _train(directory, stop_at=(3,), falling_scores=True)
    resumed_model, resumed = _train(directory, falling_scores=True)
    _same_result(resumed, straight)
    for key, value in straight_model.state_dict().items():
        assert torch.equal(value, resumed_model.state_dict()[key]), key


def _files(directory) -> dict:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_corrupt_or_foreign_checkpoints_raise_and_are_kept(tmp_path):
    directory = tmp_path / "run.ckpt"
    with pytest.raises(TrainingInterrupted):
        _train(directory, stop_at=(2,))
    before = _files(directory)
    step = directory / "step_00000002"
    weights, state, manifest = step / "model.safetensors", step / "train_state.json", step / "manifest.json"

    def damaged(path, data: bytes, message: str) -> None:
        path.write_bytes(data)
        with pytest.raises(CheckpointError, match=message):
            _train(directory)
        path.write_bytes(before[str(path.relative_to(directory))])

    data = before["step_00000002/model.safetensors"]
    damaged(weights, data[:-100], r"model\.safetensors has .* bytes.*truncated.*remove .*step_00000002")
    damaged(weights, data[:-1] + bytes([data[-1] ^ 1]), "model.safetensors fails its checksum")  # one bit flipped
    damaged(state, before["step_00000002/train_state.json"][:200], r"train_state\.json has .* bytes.*truncated")
    damaged(manifest, before["step_00000002/manifest.json"][:100], r"manifest\.json is unreadable")
    assert _files(directory) == before  # nothing was overwritten by the failed attempts

    with pytest.raises(CheckpointError, match=r"saved by a different run \(lr: saved 0\.003, now 0\.001.*delete "
                                              r".*run\.ckpt .*to start this run over"):
        _train(directory, lr=1e-3)
    with pytest.raises(CheckpointError, match=r"fingerprint\.seed: saved 0, now 1"):
        _train(directory, fingerprint={"task": "test", "seed": 1})
    with pytest.raises(CheckpointMismatchError, match=r"saved for another model: delete .*run\.ckpt"):
        _train(directory, model_name="hybrid-mamba2")
    assert _files(directory) == before
    _, result = _train(directory)  # the intact checkpoint still resumes
    assert result.evals[-1]["step"] == STEPS


# --- the command line ------------------------------------------------------------------------------

ARGS = ["bench", "addition", "--models", "transformer", "--seeds", "2", "--size", "tiny", "--steps", "6",
        "--batch-size", "4", "--eval-per-width", "2", "--val-per-width", "1", "--eval-every", "2",
        "--train-max-width", "4", "--eval-max-width", "6", "--device", "cpu"]


def _runs(out) -> dict:
    """runs/<key>.json without what depends on the clock or the machine."""
    runs = {}
    for path in sorted((out / "runs").glob("*.json")):
        result = json.loads(path.read_text())["result"]
        for key in ("seconds", "device"):
            result.pop(key)
        result["train"].pop("seconds")
        runs[path.name] = result
    return runs


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    from hybridlm.cli import main

    out = tmp_path_factory.mktemp("straight")
    assert main([*ARGS, "--out", str(out)]) == 0
    assert [p.name for p in (out / "runs").glob("*.ckpt*")] == []  # finished runs leave no checkpoint
    return _runs(out)


def _count_batches(monkeypatch, at: int, action) -> None:
    real = A.train_batch
    calls = [0]

    def train_batch(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at:
            action()
        return real(*args, **kwargs)

    monkeypatch.setattr(A, "train_batch", train_batch)


def test_bench_stopped_by_sigterm_finishes_when_run_again(tmp_path, monkeypatch, capsys, uninterrupted):
    from hybridlm.cli import main

    out = tmp_path / "addition"
    handler = signal.getsignal(signal.SIGTERM)

    def timeout() -> None:  # `timeout` signals the command, then its process group: the command gets it twice
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)

    with monkeypatch.context() as patch:  # during the 4th update of the first run
        _count_batches(patch, 4, timeout)
        assert main([*ARGS, "--out", str(out)]) == bench.EXIT_INCOMPLETE
    text = capsys.readouterr().out
    assert "stopped transformer_seed0: stopped after 4/6 updates" in text and "1 run(s) not started" in text
    assert signal.getsignal(signal.SIGTERM) is handler  # the bench's handler is gone with the run
    runs = out / "runs"
    assert not (runs / "transformer_seed0.json").exists()
    assert [p.name for p in runs.glob("*.ckpt*")] == ["transformer_seed0.ckpt"]
    assert [p.name for p in list_checkpoints(runs / "transformer_seed0.ckpt")] == ["step_00000004"]
    assert "continue; read a failed run's log first): transformer_seed0, transformer_seed1" in (out / "results.md").read_text()

    assert main([*ARGS, "--out", str(out)]) == 0
    assert "resumed from" in (runs / "transformer_seed0.log").read_text()
    assert _runs(out) == uninterrupted
    assert list(runs.glob("*.ckpt*")) == []


def test_a_second_signal_later_aborts_at_once():
    stop = StopRequest()
    stop._on_signal(signal.SIGTERM, None)
    stop._on_signal(signal.SIGTERM, None)  # the same signal delivered twice (by `timeout`): one request
    assert stop.reason == "SIGTERM"
    stop._first_signal -= 10.0
    with pytest.raises(KeyboardInterrupt, match="second SIGINT"):
        stop._on_signal(signal.SIGINT, None)


def test_bench_stopped_by_its_time_budget_finishes_when_run_again(tmp_path, monkeypatch, capsys, uninterrupted):
    from hybridlm.cli import main

    out = tmp_path / "addition"
    clock = [0.0]  # a fake clock for the budget: every training batch takes 100 s
    with monkeypatch.context() as patch:
        patch.setattr(bench, "time", types.SimpleNamespace(monotonic=lambda: clock[0], perf_counter=time.perf_counter,
                                                           strftime=time.strftime))

        def tick() -> None:
            clock[0] += 100.0

        real = A.train_batch
        patch.setattr(A, "train_batch", lambda *a, **k: (tick(), real(*a, **k))[1])
        assert main([*ARGS, "--time-budget", "250", "--out", str(out)]) == bench.EXIT_INCOMPLETE
    assert "stopped after 3/6 updates" in capsys.readouterr().out
    assert [p.name for p in list_checkpoints(out / "runs" / "transformer_seed0.ckpt")] == ["step_00000003"]
    assert main([*ARGS, "--out", str(out)]) == 0
    assert _runs(out) == uninterrupted
    assert list((out / "runs").glob("*.ckpt*")) == []


def test_report_only_starts_nothing_and_reports_the_finished_runs(tmp_path, capsys):
    """--report-only (e.g. on a CPU machine, from runs a GPU trained): the report covers the finished seed and lists
    the missing one, which is neither started nor given a checkpoint or a log."""
    from hybridlm.cli import main

    out = tmp_path / "addition"
    assert main([*ARGS, "--seeds", "1", "--out", str(out)]) == 0
    before = sorted(p.name for p in (out / "runs").iterdir())
    capsys.readouterr()
    # the GPU machine's command line, on a machine without one: --device is not looked at
    assert main([*ARGS, "--report-only", "--device", "cuda:7", "--out", str(out)]) == bench.EXIT_INCOMPLETE
    assert "report only: 1 run(s) not started (transformer_seed1)\n" in capsys.readouterr().out
    assert sorted(p.name for p in (out / "runs").iterdir()) == before
    report = (out / "results.md").read_text()
    assert "transformer_seed1" in report and "| 1 |" in report  # the missing run named; one seed in the row
    assert main([*ARGS, "--report-only", "--time-budget", "5", "--out", str(out)]) == 2  # a bad argument
    assert "--report-only starts no run; drop --time-budget" in capsys.readouterr().err


def test_report_only_prepares_no_corpus(tmp_path, capsys, monkeypatch):
    """`bench lm --report-only` reads runs only: no corpus is checked for or prepared (the runners' job), so it runs
    where the training text is not installed."""
    from hybridlm.cli import main
    from hybridlm.training import demo

    def not_installed():
        raise FileNotFoundError("the Shakespeare corpus is not installed")

    monkeypatch.setattr(demo, "shakespeare_plays", not_installed)
    out = tmp_path / "lm"
    assert main(["bench", "lm", "--report-only", "--models", "transformer", "--out", str(out)]) == bench.EXIT_INCOMPLETE
    assert "report only: 1 run(s) not started (transformer_seed0)" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["lm.png", "results.json", "results.md", "runs"]


def test_time_budget_stops_runs_in_worker_processes(tmp_path):
    lines = []
    jobs = [bench.Job(k, "tests.experiments.runners:waiting_runner", {"x": k}, resumable=True) for k in "ab"]
    started = time.monotonic()
    results = bench.run_jobs(jobs, tmp_path, devices=["cpu", "cpu"], time_budget=0.5, echo=lines.append)
    assert results == {} and time.monotonic() - started < 60
    assert "2 run(s) stopped with a checkpoint" in "\n".join(lines)


@pytest.mark.parametrize("data", ["synthetic", "shards"])
def test_allocation_runs_resume_exactly(tmp_path, shards_dir, data):
    """The sweep resumes too: a Generator's state (synthetic language) or the packed loader's position (shards)."""
    from hybridlm.experiments.allocation import AllocationRecipe, run_allocation

    fields = {"data_dir": str(shards_dir), "val_dir": str(shards_dir), "val_max_tokens": 200} if data == "shards" else {}
    recipe = AllocationRecipe(hidden_size=64, layers=1, steps=6, warmup=1, batch_size=2, seq_len=32, data=data,
                              val_docs=4, **fields)
    straight = run_allocation("SA_M", (2, 1, 5), 0, recipe)
    calls = [0]

    def should_stop() -> bool:
        calls[0] += 1
        return calls[0] == 3

    directory = tmp_path / "alloc.ckpt"
    with pytest.raises(TrainingInterrupted):
        run_allocation("SA_M", (2, 1, 5), 0, recipe, checkpoint=directory, should_stop=should_stop)
    resumed = run_allocation("SA_M", (2, 1, 5), 0, recipe, checkpoint=directory)
    for result in (straight, resumed):
        result["train"].pop("seconds")
    assert resumed == straight


def test_timeout_stops_worker_runs_through_the_parent_and_spares_their_subprocesses(tmp_path):
    """`timeout` signals the command and then its whole process group. The workers have groups of their
    own, so only the parent is hit; it stops them through its Event, and their subprocesses live on."""
    code = (
        "from hybridlm.experiments import bench\n"
        f"jobs = [bench.Job(k, 'tests.experiments.runners:runner_with_a_child', {{'x': k, 'out': {str(tmp_path)!r}}}, "
        "resumable=True) for k in 'ab']\n"
        f"bench.run_jobs(jobs, {str(tmp_path / 'bench')!r}, devices=['cpu', 'cpu'])\n"
        "print('run_jobs returned')\n"
    )
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=root, start_new_session=True, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"started_{k}").exists() for k in "ab"):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else ""
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGTERM)  # what `timeout` does: the command, then its process group
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "2 run(s) stopped with a checkpoint" in out and "run_jobs returned" in out, out
    assert [(tmp_path / f"child_{k}").read_text() for k in "ab"] == ["alive", "alive"]
