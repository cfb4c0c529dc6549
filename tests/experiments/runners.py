"""Toy runs for `hybridlm.experiments.bench.run_jobs` in the tests (a helper module: the bench imports a job's
runner by its "module:function" name, also in spawned worker processes)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from hybridlm.experiments.train import TrainingInterrupted


def toy_runner(spec: dict, *, device: str, log_fn, checkpoint=None, should_stop=None) -> dict:
    """A run that doubles spec["x"] (resumable jobs' checkpoint and should_stop are taken and not used)."""
    log_fn(f"toy {spec}")
    if spec.get("fail"):
        raise RuntimeError("diverged")
    if spec.get("die"):
        os._exit(9)  # as a worker killed by the kernel's OOM killer would vanish
    return {"value": spec["x"] * 2, "kernels_deterministic": torch.are_deterministic_algorithms_enabled()}


def waiting_runner(spec: dict, *, device: str, log_fn, checkpoint, should_stop) -> dict:
    """A resumable toy run: works until told to stop (a worker process gets the parent's stop through an Event)."""
    while not should_stop():
        time.sleep(0.01)
    raise TrainingInterrupted(1, 2, None)


def runner_with_a_child(spec: dict, *, device: str, log_fn, checkpoint, should_stop) -> dict:
    """A resumable toy run with a subprocess of its own (as torch.compile's compiler workers are)."""
    out = Path(spec["out"])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (out / f"started_{spec['x']}").write_text(str(child.pid))
        while not should_stop():
            time.sleep(0.01)
        (out / f"child_{spec['x']}").write_text("alive" if child.poll() is None else "killed")
    finally:
        child.kill()
        child.wait()
    raise TrainingInterrupted(1, 2, None)
