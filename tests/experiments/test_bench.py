"""`run_jobs`: reuse of finished runs only when the spec matches, failures isolated, the time budget;
mean ± std formatting."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from hybridlm.experiments.bench import EXIT_INCOMPLETE, Job, OldCheckpointFormat, mean_std, pm, run_jobs
from hybridlm.experiments.train import STATE_KIND
from hybridlm.training.checkpoint import save_checkpoint

RUNNER = "tests.experiments.runners:toy_runner"


def test_reuse_rerun_and_failures(tmp_path):
    lines = []
    jobs = [Job("a", RUNNER, {"x": 1}), Job("b", RUNNER, {"x": 2, "fail": True}), Job("c", RUNNER, {"x": 3})]
    results = run_jobs(jobs, tmp_path, echo=lines.append)
    assert {k: r["value"] for k, r in results.items()} == {"a": 2, "c": 6}
    assert any("FAILED b" in line and "diverged" in line for line in lines)
    assert "diverged" in (tmp_path / "runs" / "b.log").read_text()
    assert not (tmp_path / "runs" / "b.json").exists()
    stored = json.loads((tmp_path / "runs" / "a.json").read_text())
    assert stored["spec"] == {"x": 1} and stored["result"]["device"] == "cpu"
    assert results.failed == ["b"] and results.exit_status() == 1
    assert results.missing(["a", "b", "c"]) == ["b (failed: see runs/b.log)"]
    # a report of them names the failed run as failed, a run never started as not started
    lines.clear()
    report = run_jobs([*jobs, Job("d", RUNNER, {"x": 4})], tmp_path, echo=lines.append, report_only=True)
    assert report.failed == ["b"] and report.not_started == ["d"] and report.exit_status() == 1
    assert "report only: 1 run(s) failed (b: see runs/<key>.log)" in lines
    assert report.missing(["a", "b", "c", "d"]) == ["b (failed: see runs/b.log)", "d"]

    lines.clear()
    # c's spec changed: its finished run is another recipe's, kept; nothing runs until it is moved away
    with pytest.raises(ValueError, match=r"c\.json holds a finished run of another recipe \(differs in x, y\)"):
        run_jobs([Job("a", RUNNER, {"x": 1}), Job("c", RUNNER, {"x": 30, "y": {"z": 1}})], tmp_path,
                 echo=lines.append)
    assert json.loads((tmp_path / "runs" / "c.json").read_text())["result"]["value"] == 6 and not lines
    (tmp_path / "runs" / "c.json").rename(tmp_path / "c_x3.json")
    again = run_jobs([Job("a", RUNNER, {"x": 1}), Job("c", RUNNER, {"x": 30})], tmp_path, echo=lines.append)
    assert lines[0].startswith("reusing 1 finished run")  # a is reused, c runs again
    assert again["a"]["value"] == 2 and again["c"]["value"] == 60


def test_time_budget_stops_starting_runs(tmp_path):
    lines = []
    results = run_jobs([Job("a", RUNNER, {"x": 1}), Job("b", RUNNER, {"x": 2})], tmp_path, time_budget=-1.0,
                       echo=lines.append)
    assert results == {} and "2 run(s) not started" in lines[-1]
    assert results.not_started == ["a", "b"] and results.exit_status() == EXIT_INCOMPLETE
    with pytest.raises(ValueError, match="unique"):
        run_jobs([Job("a", RUNNER, {}), Job("a", RUNNER, {})], tmp_path)


def test_a_run_another_command_is_training_is_left_alone(tmp_path):
    """Two commands on one out_dir: a run whose lock another process holds fails with a clear message, untouched."""
    (tmp_path / "runs").mkdir()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True);"
        " time.sleep(60)"), str(tmp_path / "runs" / "a.lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        lines = []
        results = run_jobs([Job("a", RUNNER, {"x": 1}), Job("b", RUNNER, {"x": 2})], tmp_path, echo=lines.append)
    finally:
        holder.kill()
        holder.wait()
    assert results.failed == ["a"] and results["b"]["value"] == 4
    assert any("FAILED a" in line and "being trained by another command" in line for line in lines)
    assert not (tmp_path / "runs" / "a.json").exists()
    assert (tmp_path / "runs" / "a.lock").exists() and not (tmp_path / "runs" / "b.lock").exists()  # b's, removed


def test_a_reused_run_removes_only_its_own_leftover_checkpoint(tmp_path):
    """A finished run reused: a checkpoint left by its own spec goes (a kill between the result and the clean-up);
    one another spec saved under the same name stays."""
    runs = tmp_path / "runs"
    run_jobs([Job("a", RUNNER, {"x": 1}, resumable=False)], tmp_path, echo=lambda line: None)
    for fingerprint, kept in (({"x": 2}, True), ({"x": 1}, False)):
        save_checkpoint(runs / "a.ckpt", 1, model=torch.nn.Linear(2, 2), save_rng=False,
                        train_state={"kind": STATE_KIND, "fingerprint": fingerprint}, overwrite=True)
        lines = []
        run_jobs([Job("a", RUNNER, {"x": 1}, resumable=True)], tmp_path, echo=lines.append)
        assert (runs / "a.ckpt" / "step_00000001" / "model.safetensors").exists() == kept
        assert any("saved for another spec" in line for line in lines) == kept
    (runs / "a.ckpt" / "step_00000002.tmp").mkdir(parents=True)  # only an interrupted first save: removed
    run_jobs([Job("a", RUNNER, {"x": 1}, resumable=True)], tmp_path, echo=lambda line: None)
    assert not (runs / "a.ckpt").exists()


def _old_format_checkpoint(runs, key: str) -> list[str]:
    """The files an earlier hybridlm version left for a run stopped half way."""
    runs.mkdir(parents=True, exist_ok=True)
    names = [f"{key}.ckpt.json", f"{key}.ckpt.step00000004.safetensors"]
    (runs / names[0]).write_text(json.dumps({"format": "hybridlm-task-checkpoint", "step": 4}))
    (runs / names[1]).write_bytes(b"tensors")
    return names


def test_an_earlier_versions_checkpoint_stops_the_command_before_any_run_with_the_files_to_delete(tmp_path):
    runs = tmp_path / "runs"
    names = _old_format_checkpoint(runs, "b")
    jobs = [Job("a", RUNNER, {"x": 1}, resumable=True), Job("b", RUNNER, {"x": 2}, resumable=True)]
    with pytest.raises(OldCheckpointFormat, match=r"b\.ckpt\.json, .*b\.ckpt\.step00000004\.safetensors: .*earlier "
                                                  r"hybridlm version.*cannot resume; delete these files"):
        run_jobs(jobs, tmp_path, echo=lambda line: None)
    assert sorted(p.name for p in runs.iterdir()) == names  # nothing ran, nothing was written
    for name in names:
        (runs / name).unlink()
    assert run_jobs(jobs, tmp_path, echo=lambda line: None)["b"]["value"] == 4
    _old_format_checkpoint(runs, "b")  # beside a finished run: kept and named
    lines = []
    run_jobs(jobs, tmp_path, echo=lines.append)
    assert any("b.ckpt.json" in line and "left by an earlier hybridlm version; delete them" in line for line in lines)
    assert all((runs / name).exists() for name in names)


def test_a_worker_that_dies_fails_its_run_and_the_command_goes_on(tmp_path):
    """A worker process killed outright (no Python exception) is reported as a failed run, not a crash of the whole
    command: the report can still be written from the other runs."""
    lines = []
    jobs = [Job("a", RUNNER, {"x": 1, "die": True}), Job("b", RUNNER, {"x": 2})]
    results = run_jobs(jobs, tmp_path, devices=["cpu", "cpu"], echo=lines.append)
    assert "a" in results.failed and results.exit_status() == 1
    assert any("FAILED a" in line and "worker process died" in line for line in lines)


def test_deterministic_runs_train_under_deterministic_kernels_and_say_so(tmp_path):
    """In this process and in spawned workers; the process's own setting is back after the runs."""
    lines = []
    results = run_jobs([Job("a", RUNNER, {"x": 1}), Job("b", RUNNER, {"x": 2})], tmp_path, deterministic=True,
                       echo=lines.append)
    spawned = run_jobs([Job("c", RUNNER, {"x": 3}), Job("d", RUNNER, {"x": 4})], tmp_path, devices=["cpu", "cpu"],
                       deterministic=True, echo=lines.append)
    plain = run_jobs([Job("e", RUNNER, {"x": 5})], tmp_path, echo=lines.append)
    lines.clear()
    again = run_jobs([Job("a", RUNNER, {"x": 1}), Job("e", RUNNER, {"x": 5})], tmp_path, deterministic=True,
                     echo=lines.append)
    assert again["e"]["deterministic"] is False  # reused as it is, and named
    assert lines == [f"reusing 2 finished run(s) from {tmp_path / 'runs'}",
                     "  1 of them trained without deterministic kernels (e): move their runs/<key>.json away to "
                     "train them again deterministically"]
    assert not torch.are_deterministic_algorithms_enabled()
    for key in "abcd":
        run = {**results, **spawned}[key]
        assert run["kernels_deterministic"] is True and run["deterministic"] is True
        assert "on cpu (deterministic kernels)" in (tmp_path / "runs" / f"{key}.log").read_text()
    assert plain["e"]["kernels_deterministic"] is False and plain["e"]["deterministic"] is False
    stored = json.loads((tmp_path / "runs" / "c.json").read_text())
    assert stored["spec"] == {"x": 3} and stored["result"]["deterministic"] is True  # a result, not the spec


def test_mean_std_and_formatting():
    stat = mean_std([0.5, 0.7, float("nan")])
    assert stat["n"] == 2 and stat["mean"] == pytest.approx(0.6) and stat["std"] == pytest.approx(math.sqrt(0.02))
    assert pm(stat) == "60.0 ± 14.1"
    assert pm(mean_std([0.25])) == "25.0" and pm(mean_std([])) == "–"


def test_bench_plots_replace_the_png_atomically(tmp_path, monkeypatch):
    """A crash mid-write (disk full, a kill) leaves the previous PNG, not a truncated one, at the report's path."""
    from matplotlib.figure import Figure

    from hybridlm.experiments import addition, allocation, recall

    def write_half_then_fail(self, target, **options):
        if isinstance(target, (str, os.PathLike)):
            with open(target, "wb") as handle:
                handle.write(b"\x89PNG\r\n\x1a\n half")
        else:
            target.write(b"\x89PNG\r\n\x1a\n half")
        raise OSError("No space left on device")

    previous = b"\x89PNG\r\n\x1a\n the previous report's image"
    plots = {"addition": lambda path: addition.plot_accuracy({}, addition.AdditionRecipe(), path),
             "recall": lambda path: recall._plot({}, recall.RecallRecipe(), path),
             "allocation": lambda path: allocation._plot([], path)}
    monkeypatch.setattr(Figure, "savefig", write_half_then_fail)
    for name, plot in plots.items():
        path = tmp_path / f"{name}.png"
        path.write_bytes(previous)
        with pytest.raises(OSError, match="No space left"):
            plot(path)
        assert path.read_bytes() == previous, name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["addition.png", "allocation.png", "recall.png"]
