"""What the `hybridlm bench ...` commands share: resumable runs spread over devices, mean ± std, markdown.

    results = run_jobs(jobs, out_dir, devices=["cuda:0", "cuda:1"], per_device=4, time_budget=540)

A job is one training run (a model and a seed, or one allocation) described by a JSON-able `spec`
holding everything that determines its result (task, model, seed, recipe). `run_jobs` writes each
finished run to `out_dir/runs/<key>.json` as soon as it ends, with its spec; a later call with the same
`out_dir` reuses every run whose stored spec equals the job's spec and runs only the rest (a finished run
stored under a job's key for another spec stops the command before anything runs: it is never overwritten). So an
interrupted benchmark continues where it stopped, and a long one can be split over several commands
(`time_budget`: start no new run after that many seconds; the tables are then written from the runs
that exist, the missing ones listed; `report_only`: start none, a report of the finished runs).

Resumable jobs (`Job.resumable`: the model-seed benchmarks and the allocation sweep) also continue a run
that was stopped half way: their runner gets `checkpoint=out_dir/runs/<key>.ckpt` (a directory of step
checkpoints, see `hybridlm.experiments.train`) and `should_stop`. SIGTERM or SIGINT (once; a second one more than
2 s later raises KeyboardInterrupt at once) and the end of `time_budget` make every running resumable run save its
checkpoint after its current update and stop (`TrainingInterrupted`); the next call with the same
`out_dir` resumes it from there. The checkpoint is removed once runs/<key>.json is written. A run's checkpoint in
the format of earlier hybridlm versions (runs/<key>.ckpt.json with runs/<key>.ckpt.stepNNNNNNNN.safetensors) cannot
be resumed: `run_jobs` stops before any run starts and names the files to delete.

Runs execute in this process when there is one worker on the CPU (tests), else in spawned worker
processes, `per_device` of them on each device (side by side they share the device). Workers run in a process
group of their own, so that a signal to the command's group (`timeout`, Ctrl-C) reaches only this process, which
stops them through an Event (a signal to the whole group would also kill torch.compile's compiler subprocesses
mid-compilation).
Each run logs to `out_dir/runs/<key>.log`.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import os
import re
import shlex
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hybridlm.fileio import FileLock, diff_nested, write_atomic
from hybridlm.training.rng import deterministic_kernels
from hybridlm.training.stop import StopRequest

RUNS = "runs"
EXIT_INCOMPLETE = 75  # sysexits' EX_TEMPFAIL: runs stopped or not started; run the same command again


@dataclass(frozen=True)
class Job:
    key: str  # file-name-safe identity, e.g. "fw-3A_seed0"
    runner: str  # "module:function" called as function(spec, device=..., log_fn=..., **context) -> result dict
    spec: dict  # everything that determines the result (compared when reusing a stored run)
    context: dict = field(default_factory=dict)  # where things are (paths): passed on, never compared
    resumable: bool = False  # the runner also takes checkpoint= and should_stop= (see the module docstring)


def safe_key(*parts: object) -> str:
    text = "_".join(str(p) for p in parts)
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in text)


def _run_path(out_dir: Path, key: str) -> Path:
    return out_dir / RUNS / f"{key}.json"


class JobResults(dict):
    """`run_jobs`' answer: key -> result of every run that exists at the end, and what became of the others."""

    def __init__(self) -> None:
        super().__init__()
        self.failed: list[str] = []  # raised (see runs/<key>.log), their worker died, or busy in another command
        self.stopped: list[str] = []  # stopped with a checkpoint: the same command continues them
        self.not_started: list[str] = []  # the time budget or a stop came first

    def missing(self, keys: Sequence[str]) -> list[str]:
        """`keys` without a result, failed ones marked (the reports list them)."""
        return [f"{k} (failed: see runs/{k}.log)" if k in self.failed else k for k in keys if k not in self]

    def exit_status(self) -> int:
        """The command's exit status: 0 every run done, 1 some failed, EXIT_INCOMPLETE some stopped or not
        started (the same command continues them)."""
        if self.failed:
            return 1
        return EXIT_INCOMPLETE if self.stopped or self.not_started else 0


class RunBusy(RuntimeError):
    """Another command holds the run's lock (two commands share an out_dir)."""


@contextlib.contextmanager
def _run_lock(out_dir: Path, key: str):
    """An exclusive lock on runs/<key>.lock while the run trains, so two commands sharing an out_dir never train
    (and checkpoint) the same run at once; the file is removed when the run ends."""
    lock = FileLock(out_dir / RUNS / f"{key}.lock")
    if not lock.acquire():
        raise RunBusy(f"run {key} is being trained by another command on {out_dir}: run this one again when that "
                      "one ends")
    try:
        yield
    finally:
        lock.release(remove=True)


def checkpoint_path(out_dir: str | Path, key: str) -> Path:
    """The checkpoint directory of a resumable run (its step directories: `hybridlm.experiments.train`)."""
    return Path(out_dir) / RUNS / f"{key}.ckpt"


def old_format_checkpoint(out_dir: str | Path, key: str) -> list[Path]:
    """The files of a run's checkpoint in the format of earlier hybridlm versions (runs/<key>.ckpt.json, its
    runs/<key>.ckpt.stepNNNNNNNN.safetensors and their temporaries), which this version cannot resume."""
    runs = Path(out_dir) / RUNS
    if not runs.is_dir():
        return []
    pattern = re.compile(re.escape(key) + r"\.ckpt(\.json|\.step\d+\.safetensors)(\.tmp-\d+)?")
    return sorted(p for p in runs.iterdir() if pattern.fullmatch(p.name))


class OldCheckpointFormat(ValueError):
    """A run to train has an in-progress checkpoint in the format of earlier hybridlm versions."""


def load_run(out_dir: Path, job: Job) -> dict | None:
    """The stored result of `job` when its spec matches, else None."""
    path = _run_path(out_dir, job.key)
    if not path.is_file():
        return None
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):  # unreadable: the run trains again and rewrites it
        return None
    if not isinstance(stored, dict) or not isinstance(stored.get("result"), dict):
        return None
    return stored["result"] if stored.get("spec") == job.spec else None


class RunConflict(ValueError):
    """A finished run of another spec (another recipe in the same --out) is stored under a job's key: running would
    overwrite it. A usage error: another --out (or moving the file away) is the way out."""


def check_out_dir(out_dir: str | Path, jobs: Sequence[Job]) -> None:
    """What stops a command before any run starts (`run_jobs` checks it; a caller that writes in out_dir before
    `run_jobs`, e.g. a corpus, checks first). Writes nothing. `RunConflict` when a job's key holds a finished run of
    another spec; `OldCheckpointFormat` when a resumable run still to train has a checkpoint of an earlier
    hybridlm version."""
    out_dir = Path(out_dir)
    for job in jobs:
        _refuse_another_specs_run(out_dir, job)
    old = [path for job in jobs if job.resumable and load_run(out_dir, job) is None
           for path in old_format_checkpoint(out_dir, job.key)]
    if old:
        raise OldCheckpointFormat(
            f"{', '.join(map(str, old))}: in-progress checkpoint(s) in the format of an earlier hybridlm version, "
            "which this version cannot resume; delete these files to train those runs from their start (or finish "
            "them with the version that saved them)")


def _refuse_another_specs_run(out_dir: Path, job: Job) -> None:
    """A finished run stored under the job's key for another spec (another recipe in the same --out) is never
    overwritten: running would lose it."""
    path = _run_path(out_dir, job.key)
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):  # none, or unreadable (the run trains again and rewrites it)
        return
    spec = stored.get("spec") if isinstance(stored, dict) else None
    if isinstance(spec, dict) and spec != job.spec:
        changed = [d.key for d in diff_nested(spec, job.spec)]
        raise RunConflict(
            f"{path} holds a finished run of another recipe (differs in {', '.join(changed)}); write this one to "
            "another --out, or move that file away to replace it"
        )


def _call(job: Job, device: str, out_dir: Path, should_stop: Callable[[], bool] | None = None, *,
          deterministic: bool = False) -> dict:
    """Run `job` (under `deterministic_kernels` when `deterministic`), write runs/<key>.json, remove its
    checkpoint. A resumable job stopped by `should_stop` raises `TrainingInterrupted` (its checkpoint saved)."""
    module, function = job.runner.split(":")
    fn: Callable = getattr(importlib.import_module(module), function)
    log_path = out_dir / RUNS / f"{job.key}.log"
    extra = {}
    if job.resumable:
        extra = {"checkpoint": str(checkpoint_path(out_dir, job.key)), "should_stop": should_stop}
    with _run_lock(out_dir, job.key), open(log_path, "a", encoding="utf-8") as log:
        def log_fn(line: str) -> None:
            log.write(f"{time.strftime('%H:%M:%S')} {line}\n")
            log.flush()

        log_fn(f"start {job.key} on {device}" + (" (deterministic kernels)" if deterministic else ""))
        start = time.perf_counter()
        try:
            with deterministic_kernels(deterministic):
                result = fn(job.spec, device=device, log_fn=log_fn, **job.context, **extra)
        except Exception as err:
            if _is_interrupted(err):
                log_fn(f"{err}; run the same command again to continue")
            else:
                log_fn("failed:\n" + traceback.format_exc())
            raise
        result["seconds"] = time.perf_counter() - start  # this call's (a resumed run's training time: train.seconds)
        result["device"] = device
        result["deterministic"] = deterministic
        log_fn(f"done in {result['seconds']:.1f}s")
        write_atomic(_run_path(out_dir, job.key), json.dumps({"spec": job.spec, "result": result}, indent=1).encode())
        if job.resumable:
            _remove_checkpoint(out_dir, job.key)
    return result


def _failed_last_time(out_dir: Path, key: str) -> bool:
    """Whether the run's log ends with a failure: its last attempt raised (`_call` logs "start <key> on", then
    "failed:")."""
    log = out_dir / RUNS / f"{key}.log"
    if not log.is_file():
        return False
    attempts = log.read_text(encoding="utf-8", errors="replace").split(f" start {key} on ")
    return " failed:\n" in attempts[-1]


def _is_interrupted(err: BaseException) -> bool:
    from hybridlm.experiments.train import TrainingInterrupted

    return isinstance(err, TrainingInterrupted)


def _remove_checkpoint(out_dir: Path, key: str) -> None:
    from hybridlm.experiments.train import remove_checkpoint

    remove_checkpoint(checkpoint_path(out_dir, key))


def _leftover_checkpoint(out_dir: Path, job: Job, echo: Callable[[str], None]) -> None:
    """A finished run reused: its own checkpoint (left by a kill between the result's write and the checkpoint's
    removal) goes; one saved for another spec under the same key (another recipe's half-done run) stays, as do
    the files of an earlier version's checkpoint (named, to delete)."""
    from hybridlm.experiments.train import saved_fingerprint
    from hybridlm.training.checkpoint import list_checkpoints

    directory = checkpoint_path(out_dir, job.key)
    if list_checkpoints(directory) and saved_fingerprint(directory) != job.spec:
        echo(f"kept {directory}: a checkpoint saved for another spec under the same run name")
    else:  # its own, or only the temporaries of an interrupted first save
        _remove_checkpoint(out_dir, job.key)
    if old := old_format_checkpoint(out_dir, job.key):
        echo(f"kept {', '.join(map(str, old))}: left by an earlier hybridlm version; delete them")


_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


@contextlib.contextmanager
def _signals_blocked():
    """SIGTERM / SIGINT held back (delivered on leaving) while worker processes are spawned: they inherit the
    mask, so a signal to the command's process group cannot kill one before it has left the group."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _kill_workers(pool: ProcessPoolExecutor) -> None:
    """Kill the pool's worker processes (the runs are abandoned: stopping at once). They are in their own process
    groups, so nothing else would reach them. `_processes` is the executor's own record of them."""
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        with contextlib.suppress(Exception):
            process.kill()


_worker_device: str | None = None
_worker_stop = StopRequest()
_worker_event = None  # the parent's multiprocessing Event: set on a signal or at the time budget
_worker_parent: int | None = None


def _init_worker(queue, threads: int, stop_event=None) -> None:
    import torch

    global _worker_device, _worker_event, _worker_parent
    # A process group of its own: `timeout` and Ctrl-C signal the whole foreground group, which would
    # also kill torch.compile's compiler subprocesses and leave a compiling run waiting for them forever.
    # The parent alone gets the signal and relays it through `stop_event`.
    # The parent spawned this process with SIGTERM / SIGINT blocked (`_signals_blocked`), so a signal to the
    # command's group before this point could not kill it (the parent relays it through `stop_event`). Out of the
    # group, the pending ones are discarded (ignored while unblocked) and the defaults come back: an idle, orphaned
    # worker dies on SIGTERM; during a run `_worker_call` turns them into a stop.
    with contextlib.suppress(OSError, AttributeError):
        os.setpgrp()
    for sig in _STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _worker_parent = os.getppid()
    _worker_device = queue.get()
    _worker_event = stop_event
    torch.set_num_threads(threads)  # the workers share the cores: no oversubscription
    if _worker_device.startswith("cuda"):
        torch.cuda.set_device(torch.device(_worker_device))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _worker_should_stop() -> bool:
    """A signal, the parent's stop (signal or time budget), or the parent is gone (killed)."""
    return (bool(_worker_stop) or (_worker_event is not None and _worker_event.is_set())
            or os.getppid() != _worker_parent)


def _worker_call(job: Job, out_dir: str, deterministic: bool) -> tuple[str, dict | None, str, bool]:
    """(key, result or None, error text, interrupted). A signal sent to this process during the run stops it as
    the parent's stop does (saving its checkpoint)."""
    try:
        with _worker_stop.handle_signals():
            return job.key, _call(job, _worker_device, Path(out_dir), _worker_should_stop,
                                  deterministic=deterministic), "", False
    except Exception as err:  # noqa: BLE001  (reported by the parent; the other runs go on)
        if _is_interrupted(err):
            return job.key, None, str(err), True
        return job.key, None, traceback.format_exc(), False


def run_jobs(
    jobs: Sequence[Job],
    out_dir: str | Path,
    *,
    devices: Sequence[str] = ("cpu",),
    per_device: int = 1,
    time_budget: float | None = None,
    deterministic: bool = False,
    report_only: bool = False,
    echo: Callable[[str], None] = print,
) -> JobResults:
    """Run (or reuse) every job; returns key -> result for the runs that exist at the end (with the keys of the
    failed, stopped and not started ones: `JobResults`). `deterministic`: each run under
    `hybridlm.training.rng.deterministic_kernels` (not part of the spec: a reused run is reused as it is; its
    result says "deterministic"). `report_only`: reuse the finished runs and start none (the others are "not
    started"), e.g. to write the tables on a machine other than the one that trained.

    SIGTERM / SIGINT (handled while this runs) and the end of `time_budget` start no further run and stop
    the resumable runs in progress at their next update, saving their checkpoints."""
    out_dir = Path(out_dir)
    if len({j.key for j in jobs}) != len(jobs):
        raise ValueError("job keys must be unique")
    check_out_dir(out_dir, jobs)
    (out_dir / RUNS).mkdir(parents=True, exist_ok=True)
    results = JobResults()
    todo: list[Job] = []
    for job in jobs:
        stored = load_run(out_dir, job)
        if stored is not None:
            results[job.key] = stored
            if job.resumable:  # a run killed between writing its result and removing its checkpoint
                _leftover_checkpoint(out_dir, job, echo)
        else:
            todo.append(job)
    if results:
        echo(f"reusing {len(results)} finished run(s) from {out_dir / RUNS}")
        plain = [key for key, result in results.items() if not result.get("deterministic")]
        if deterministic and plain:
            echo(f"  {len(plain)} of them trained without deterministic kernels ({', '.join(plain)}): move their "
                 f"runs/<key>.json away to train them again deterministically")
    if report_only:
        failed = [j.key for j in todo if _failed_last_time(out_dir, j.key)]
        results.failed, results.stopped = failed, []
        results.not_started = [j.key for j in todo if j.key not in failed]
        if failed:
            echo(f"report only: {len(failed)} run(s) failed ({', '.join(failed)}: see runs/<key>.log)")
        if results.not_started:
            echo(f"report only: {len(results.not_started)} run(s) not started ({', '.join(results.not_started)})")
        return results
    start = time.monotonic()
    stop = StopRequest()

    def over_budget() -> bool:
        return time_budget is not None and time.monotonic() - start > time_budget

    def should_stop() -> bool:
        if over_budget():
            stop.request("time budget reached")
        return bool(stop)

    workers = len(devices) * per_device
    failures: list[str] = []
    stopped: list[str] = []

    def report(key: str, result: dict | None, error: str, interrupted: bool, where: str) -> None:
        if interrupted:
            stopped.append(key)
            stop.request(f"run {key} was stopped")  # e.g. its worker got the signal: start nothing more
            echo(f"  stopped {key}: {error}")
        elif result is None:
            failures.append(key)
            echo(f"  FAILED {key}:\n{error}")
        else:
            results[key] = result
            echo(f"  done {key} in {result['seconds']:.1f}s{where}")

    with stop.handle_signals():
        # in this process only on the CPU: GPU runs go to worker processes (see `_init_worker`)
        if (workers <= 1 or len(todo) <= 1) and all(d == "cpu" for d in devices):
            for job in todo:
                if should_stop():
                    break
                echo(f"run {job.key} on {devices[0]}")
                try:
                    result = _call(job, devices[0], out_dir, should_stop, deterministic=deterministic)
                except Exception as err:  # noqa: BLE001  (e.g. a diverged run: report it, go on with the others)
                    interrupted = _is_interrupted(err)
                    report(job.key, None, str(err) if interrupted else traceback.format_exc(), interrupted, "")
                    continue
                report(job.key, result, "", False, "")
        elif todo:
            import multiprocessing as mp

            context = mp.get_context("spawn")
            queue = context.Queue()
            stop_event = context.Event()
            for device in devices:
                for _ in range(per_device):
                    queue.put(device)
            pending = list(reversed(todo))
            pool = ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=_init_worker,
                                       initargs=(queue, max(1, (os.cpu_count() or 1) // workers), stop_event))
            running: dict = {}  # future -> its job's key
            try:
                while pending or running:
                    while pending and len(running) < workers and not should_stop():
                        job = pending.pop()
                        with _signals_blocked():  # submit spawns the workers
                            running[pool.submit(_worker_call, job, str(out_dir), deterministic)] = job.key
                        echo(f"run {job.key}")
                    if not running:
                        break
                    done, _ = wait(running, timeout=1.0, return_when=FIRST_COMPLETED)
                    if should_stop() and not stop_event.is_set():
                        stop_event.set()  # the workers' runs save and return at their next update
                        echo(f"stopping: {stop.reason}")
                    for future in done:
                        key = running.pop(future)
                        try:
                            key, result, error, interrupted = future.result()
                        except BrokenProcessPool:
                            # A worker was killed (out of memory, a signal) or crashed: the executor ends them all.
                            stop.request("a worker process died")
                            report(key, None, "its worker process died (killed, out of memory or crashed); runs "
                                   "continue from their last checkpoint when the same command runs again", False, "")
                            continue
                        report(key, result, error, interrupted, f" on {result['device']}" if result else "")
            except BaseException:  # a second signal (KeyboardInterrupt): stop at once, leaving no worker behind
                _kill_workers(pool)
                pool.shutdown(wait=False, cancel_futures=True)
                raise
            pool.shutdown(wait=True)
    skipped = [j.key for j in todo if j.key not in results and j.key not in failures and j.key not in stopped]
    results.failed, results.stopped, results.not_started = failures, stopped, skipped
    if stopped:
        echo(f"{len(stopped)} run(s) stopped with a checkpoint ({', '.join(stopped)}); "
             "run the same command again to continue them")
    if skipped:
        echo(f"{stop.reason or 'stopped'}: {len(skipped)} run(s) not started ({', '.join(skipped)}); "
             "run the same command again to continue")
    if failures:
        echo(f"{len(failures)} run(s) failed: {', '.join(failures)}")
    return results


def bench_model_seeds(
    task: str,
    runner: str,
    models: Sequence[str],
    seeds: Sequence[int],
    recipe: dict | None,
    out_dir: str | Path,
    report: Callable[[dict[str, list[dict]], Path, list[str]], dict],
    *,
    parts: dict[str, dict] | None = None,
    merge: Callable[[list[dict]], dict] | None = None,
    echo: Callable[[str], None] = print,
    **kwargs,
) -> dict:
    """One job per (model, seed) with spec {"task", "model", "seed", "recipe"}; `run_jobs` them, then
    `report(model -> its finished runs in seed order, out_dir, keys of the missing runs)`. Jobs start seed by
    seed (every model's seed 0 first), so a run cut short by its time budget has one seed of every model to show.

    With `parts` (name -> recipe, replacing `recipe`; e.g. one recall task each), one job per (model, seed, part),
    keyed "model_part_seedN", and `merge(the finished parts' runs)` makes the model's run of that seed."""
    recipes = parts if parts is not None else {"": recipe}
    if len(recipes) > 1 and merge is None:
        raise ValueError("several parts per model and seed need a merge function")
    jobs = [Job(safe_key(m, *([part] if part else []), f"seed{s}"), runner,
                {"task": task, "model": m, "seed": s, "recipe": r}, resumable=True)
            for s in seeds for m in models for part, r in recipes.items()]
    runs = run_jobs(jobs, out_dir, echo=echo, **kwargs)
    by_model = {}
    for m in models:
        by_model[m] = []
        for s in seeds:
            done = [runs[j.key] for j in jobs if j.spec["model"] == m and j.spec["seed"] == s and j.key in runs]
            if done:
                by_model[m].append(merge(done) if merge is not None else done[0])
    result = report(by_model, Path(out_dir), runs.missing([j.key for j in jobs]))
    echo(wrote_files(result["files"]))
    return {**result, "exit_status": runs.exit_status()}


# --- numbers and tables ----------------------------------------------------------------------------

def mean_std(values: Sequence[float]) -> dict[str, float]:
    """{"mean", "std" (sample std, 0 for one value), "n"} over the finite values."""
    finite = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return {"mean": math.nan, "std": math.nan, "n": 0}
    std = float(np.std(finite, ddof=1)) if len(finite) > 1 else 0.0
    return {"mean": float(np.mean(finite)), "std": std, "n": len(finite)}


def pm(stat: dict[str, float], *, scale: float = 100.0, digits: int = 1) -> str:
    """"99.8 ± 0.1" (the ± part only with two or more values); "–" when nothing was measured."""
    if stat["n"] == 0:
        return "–"
    text = f"{stat['mean'] * scale:.{digits}f}"
    return text + (f" ± {stat['std'] * scale:.{digits}f}" if stat["n"] > 1 else "")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def human_count(count: float) -> str:
    for unit, scale in (("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.2f}{unit}"
    return str(int(count))


def write_json(path: Path, obj: dict) -> None:
    write_atomic(path, json.dumps(obj, indent=1, allow_nan=True).encode())


def wrote_files(paths: Sequence[str]) -> str:
    """The closing line of a bench: the report's paths, comma-separated (not a Python list's repr)."""
    return f"wrote {', '.join(map(str, paths))}"


def write_outputs(out_dir: Path, *, lines: list[str], payload: dict, missing: Sequence[str], png: str,
                  plot: Callable[[Path], None]) -> list[str]:
    """results.md (`lines`, plus the missing runs), results.json (`payload` + command + missing) and the PNG
    drawn by `plot(path)` (which writes it atomically: `hybridlm.fileio.save_figure_atomic`); returns the three
    paths."""
    if missing:
        lines = [*lines, f"Missing runs (run the same command to continue; read a failed run's log first): "
                         f"{', '.join(missing)}", ""]
    out_dir.mkdir(parents=True, exist_ok=True)
    md, js, image = out_dir / "results.md", out_dir / "results.json", out_dir / png
    write_atomic(md, "\n".join(lines).encode("utf-8"))
    write_json(js, {**payload, "command": command_line(), "missing": list(missing)})
    plot(image)
    return [str(md), str(js), str(image)]


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_percent_with_std(ax, x, mean, std, *, label: str, **line_options) -> None:
    """A mean curve in % with a +-1 std band over seeds, the band clipped to 0..100 (an accuracy cannot leave it)."""
    (line,) = ax.plot(x, mean, label=label, **line_options)
    ax.fill_between(x, np.clip(mean - std, 0, 100), np.clip(mean + std, 0, 100), color=line.get_color(), alpha=0.15,
                    linewidth=0)


def command_line() -> str:
    """The `hybridlm ...` command being run, or a note when called from Python."""
    if sys.argv and Path(sys.argv[0]).name in ("hybridlm", "cli.py"):
        return shlex.join(["hybridlm", *sys.argv[1:]])
    return "(called from Python)"
