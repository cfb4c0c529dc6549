"""`run_jobs`: reuse of finished runs only when the spec matches, failures isolated, the time budget;
mean ± std formatting."""

from __future__ import annotations

import json
import math

import pytest

from hybridlm.eval.bench import Job, mean_std, pm, run_jobs

RUNNER = "tests.eval.test_bench:toy_runner"


def toy_runner(spec: dict, *, device: str, log_fn) -> dict:
    log_fn(f"toy {spec}")
    if spec.get("fail"):
        raise RuntimeError("diverged")
    return {"value": spec["x"] * 2}


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

    lines.clear()
    again = run_jobs([Job("a", RUNNER, {"x": 1}), Job("c", RUNNER, {"x": 30})], tmp_path, echo=lines.append)
    assert lines[0].startswith("reusing 1 finished run")  # a is reused, c's spec changed: it runs again
    assert again["a"]["value"] == 2 and again["c"]["value"] == 60


def test_time_budget_stops_starting_runs(tmp_path):
    lines = []
    results = run_jobs([Job("a", RUNNER, {"x": 1}), Job("b", RUNNER, {"x": 2})], tmp_path, time_budget=-1.0,
                       echo=lines.append)
    assert results == {} and "2 run(s) not started" in lines[-1]
    with pytest.raises(ValueError, match="unique"):
        run_jobs([Job("a", RUNNER, {}), Job("a", RUNNER, {})], tmp_path)


def test_mean_std_and_formatting():
    stat = mean_std([0.5, 0.7, float("nan")])
    assert stat["n"] == 2 and stat["mean"] == pytest.approx(0.6) and stat["std"] == pytest.approx(math.sqrt(0.02))
    assert pm(stat) == "60.0 ± 14.1"
    assert pm(mean_std([0.25])) == "25.0" and pm(mean_std([])) == "–"
