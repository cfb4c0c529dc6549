"""Two gloo processes on the CPU train like one process with the same global batch (replicas and FSDP2), and
checkpoints move between world sizes. The tiny preset, float32, seeded. (The meshes with tp, cp and mixer
parallelism: tests/training/test_distributed_mesh.py.)

Each multi-process run is `torch.multiprocessing.spawn` of `_worker` below (the environment torchrun
would set: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR / MASTER_PORT); rank 0 writes its per-update losses.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from hybridlm.training.checkpoint import latest_checkpoint
from hybridlm.training.config import load_config
from hybridlm.training.trainer import Trainer
from tests.helpers import free_port
from tests.training.toys import small_config

STEPS = 6
TOL = 1e-5


def _config(demo_dir: Path, out: Path, *overrides: str):
    return small_config(demo_dir, out, f"train.steps={STEPS}", "train.eval_every=3", "train.eval_batches=2",
                        *overrides)


def _worker(rank: int, world: int, port: int, demo_dir: str, out: str, overrides: list, stop_at: int | None,
            resume: bool, result_file: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)

    def stop(trainer, record):
        if stop_at is not None and record["step"] == stop_at:
            trainer.request_stop("test")

    trainer = Trainer(_config(Path(demo_dir), Path(out), *overrides), resume=resume, callbacks=[stop])
    try:
        result = trainer.train()
        evals = [json.loads(line)["eval_loss"] for line in (Path(out) / "eval.jsonl").read_text().splitlines()]
        if rank == 0:
            Path(result_file).write_text(json.dumps({
                "losses": [r["loss"] for r in trainer.history], "status": result.status, "evals": evals,
                "grad_norms": [r["grad_norm"] for r in trainer.history],
                "step": trainer.step, "tokens": trainer.tokens,
            }))
    finally:
        trainer.close()


def run_two_ranks(demo_dir: Path, out: Path, *overrides: str, stop_at=None, resume=False) -> dict:
    result_file = out.parent / f"{out.name}_result.json"
    mp.spawn(_worker, args=(2, free_port(), str(demo_dir), str(out), list(overrides), stop_at, resume,
                            str(result_file)), nprocs=2, join=True)
    return json.loads(result_file.read_text())


@pytest.fixture(scope="module")
def reference(demo_dir, tmp_path_factory) -> dict:
    """One process, micro-batches of 2 rows, 2 accumulated: the global batch of 2 ranks x 2 rows."""
    out = tmp_path_factory.mktemp("single") / "run"
    trainer = Trainer(_config(demo_dir, out, "batch.micro_batch=2", "batch.grad_accum=2"))
    trainer.train()
    evals = [json.loads(line)["eval_loss"] for line in (out / "eval.jsonl").read_text().splitlines()]
    return {"losses": [r["loss"] for r in trainer.history], "evals": evals, "tokens": trainer.tokens,
            "grad_norms": [r["grad_norm"] for r in trainer.history]}


def _close(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) for x, y in zip(a, b))


def test_replicas_two_ranks_match_one_process(demo_dir, reference, tmp_path):
    """dp_replicate=2 (HSDP with a shard group of 1: DDP-like replicas)."""
    got = run_two_ranks(demo_dir, tmp_path / "ddp", "batch.micro_batch=2", "parallel.dp_replicate=-1",
                        "parallel.dp_shard=1")
    assert got["status"] == "completed" and got["tokens"] == reference["tokens"]
    assert _close(got["losses"], reference["losses"]) < TOL, (got["losses"], reference["losses"])
    assert _close(got["evals"], reference["evals"]) < TOL
    # the gradient itself (before clipping), not only its direction: Adam would hide a wrong scale
    assert _close(got["grad_norms"], reference["grad_norms"]) < TOL * max(reference["grad_norms"])
    assert reference["losses"][-1] < reference["losses"][0] - 1.0  # it trained (so equality means something)


def test_checkpoints_move_between_one_process_and_fsdp(demo_dir, reference, tmp_path):
    """Updates 1-2 in one process, 3-4 on 2 FSDP2 ranks (resumed from its checkpoint), 5-6 in one process
    again (resumed from the FSDP checkpoint): the same losses as one uninterrupted process."""
    out = tmp_path / "chain"
    single = ("batch.micro_batch=2", "batch.grad_accum=2")
    first = Trainer(_config(demo_dir, out, *single), callbacks=[lambda t, r: t.request_stop() if r["step"] == 2 else None])
    assert first.train().status == "interrupted"
    middle = run_two_ranks(demo_dir, out, "batch.micro_batch=2", "parallel.dp_shard=-1", stop_at=4, resume=True)
    assert middle["status"] == "interrupted" and latest_checkpoint(out / "checkpoints").name == "step_00000004"
    last = Trainer(_config(demo_dir, out, *single), resume=True)
    assert last.train().status == "completed" and last.tokens == reference["tokens"]
    chained = [r["loss"] for r in first.history] + middle["losses"] + [r["loss"] for r in last.history]
    assert _close(chained, reference["losses"]) < TOL, (chained, reference["losses"])
    evals = [json.loads(line)["eval_loss"] for line in (out / "eval.jsonl").read_text().splitlines()]
    assert _close(evals, reference["evals"]) < TOL  # step 3 evaluated under FSDP, step 6 in one process


def _leaves_a_group_it_found(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from hybridlm.training.distributed import destroy_distributed, init_distributed

    ctx = init_distributed(load_config(None, []), device="cpu")  # the harness's group: reused, not owned
    destroy_distributed(ctx)
    return {"owned": ctx.owns_group, "still_initialized": dist.is_initialized()}


def test_close_leaves_a_process_group_it_did_not_create():
    """A trainer inside a harness that set up the process group (a test, a notebook) must not tear it down."""
    from tests.parallel.harness import run_ranks

    assert run_ranks(_leaves_a_group_it_found) == {"owned": False, "still_initialized": True}


def _one_rank_signalled(rank: int, world: int, demo_dir: str, out: str) -> dict:
    import torch.distributed as dist

    def signal_rank_1(trainer, record):
        if rank == 1 and record["step"] == 2:
            trainer._stop.request("SIGTERM")  # what the signal handler sets, here on rank 1 only

    with Trainer(_config(Path(demo_dir), Path(out)), callbacks=[signal_rank_1]) as trainer:
        status = trainer.train().status
        reasons = [None] * world
        dist.all_gather_object(reasons, trainer.stop_reason)
        return {"status": status, "step": trainer.step, "reasons": reasons}


def test_a_signal_to_one_rank_stops_every_rank_with_its_name(demo_dir, tmp_path):
    """SIGTERM reaches rank 1 only: both ranks stop after the same update and both name the signal (so each exits
    with 128 + its number), not only the rank that got it."""
    from tests.parallel.harness import run_ranks

    got = run_ranks(_one_rank_signalled, demo_dir=str(demo_dir), out=str(tmp_path / "run"))
    assert got == {"status": "interrupted", "step": 2, "reasons": ["SIGTERM", "SIGTERM"]}


def _demo_too_small(rank: int, world: int, root: str) -> list:
    import torch.distributed as dist

    from hybridlm.training.config import ConfigError

    config = small_config(Path(root) / "demo", Path(root) / "run", "data.demo_max_bytes=1000")
    try:
        Trainer(config)
        problem = None
    except ConfigError as err:
        problem = str(err)
    problems = [None] * world
    dist.all_gather_object(problems, problem)
    return problems


def test_a_demo_corpus_rank_0_cannot_prepare_is_every_ranks_config_error(tmp_path):
    """Rank 0 prepares the demo corpus; a size too small for it is a ConfigError on every rank (not rank 0's alone,
    with the others failing on a closed connection)."""
    from tests.parallel.harness import run_ranks

    problems = run_ranks(_demo_too_small, root=str(tmp_path))
    assert len(set(problems)) == 1 and problems[0].startswith("data.demo_max_bytes: "), problems
