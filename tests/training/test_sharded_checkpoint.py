"""Sharded (dcp) checkpoints through the trainer: each rank writes its own shards, and a run resumes from them on the
same mesh bit for bit and on another world size (1 and 4 gloo processes) within the parallel tests' tolerance; the
write is atomic (a crash before the rename, or during an asynchronous save, leaves the previous checkpoint the newest);
a missing or corrupt shard is refused naming the file; `hybridlm checkpoint export` equals the run's own final/.

One spawn of 2 processes runs three trainers: an uninterrupted run, a run stopped at update 2, and its resume (with
asynchronous saves every 2 updates), so the resumed losses can be compared exactly with the uninterrupted ones. The
reference of the other world sizes is one process with the same global batch (2 rows x 2 accumulated). The tiny
preset, float32. (Meshes with tp, cp and mixer parallelism resume sharded checkpoints in
tests/training/test_distributed_mesh.py.)
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridlm.training import checkpoint as checkpoint_module
from hybridlm.training.checkpoint import CheckpointError, checkpoint_format, latest_checkpoint, list_checkpoints
from hybridlm.training.trainer import Trainer
from tests.helpers import free_port
from tests.training.toys import small_config

STEPS = 6
TOL = 1e-5
SINGLE = ("batch.micro_batch=2", "batch.grad_accum=2")  # one process: the global batch of 2 ranks x 2 rows


def _config(demo_dir: Path, out: Path, *overrides: str):
    return small_config(demo_dir, out, f"train.steps={STEPS}", *overrides)


def _losses(trainer: Trainer) -> list[float]:
    return [r["loss"] for r in trainer.history]


def _stop_at(step: int):
    return lambda trainer, record: trainer.request_stop("test") if record["step"] == step else None


def _copy_checkpoint(run: Path, step: int, out: Path) -> Path:
    """A new run directory `out` holding only the checkpoint of `step` of `run` (to resume elsewhere)."""
    name = f"step_{step:08d}"
    shutil.copytree(run / "checkpoints" / name, out / "checkpoints" / name)
    return out


def _stages(rank: int, world: int, port: int, demo_dir: str, root: str, stages: list, result_file: str) -> None:
    """Trainers one after another on `world` gloo processes: (name, out, overrides, stop_at, resume) each; after a
    stage named "first", rank 0 keeps a copy of its checkpoint of update 2 in <root>/from2."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    try:
        for name, out, overrides, stop_at, resume in stages:
            callbacks = [_stop_at(stop_at)] if stop_at else []
            with Trainer(_config(Path(demo_dir), Path(out), *overrides), resume=resume, callbacks=callbacks) as t:
                status = t.train().status
                results[name] = {"losses": _losses(t), "status": status, "format": t.checkpoint_format}
            if name == "first" and rank == 0:
                _copy_checkpoint(Path(out), 2, Path(root) / "from2")
            dist.barrier()
        if rank == 0:
            Path(result_file).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def _spawn(world: int, demo_dir: Path, root: Path, stages: list) -> dict:
    result_file = root / f"result_{world}.json"
    mp.spawn(_stages, args=(world, free_port(), str(demo_dir), str(root), stages, str(result_file)), nprocs=world,
             join=True)
    return json.loads(result_file.read_text())


@pytest.fixture(scope="module")
def reference(demo_dir, tmp_path_factory) -> list[float]:
    with Trainer(_config(demo_dir, tmp_path_factory.mktemp("single") / "run", *SINGLE)) as trainer:
        trainer.train()
        return _losses(trainer)


@pytest.fixture(scope="module")
def two_ranks(demo_dir, tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("two")
    stages = [
        ("whole", str(root / "whole"), [], None, False),
        ("first", str(root / "run"), [], 2, False),
        ("resumed", str(root / "run"), ["train.checkpoint_async=true", "train.save_every=2"], None, True),
    ]
    return root, _spawn(2, demo_dir, root, stages)


def _diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) for x, y in zip(a, b))


def test_same_mesh_resume_is_bit_exact(two_ranks, reference):
    root, got = two_ranks
    assert all(got[name]["format"] == "dcp" for name in got)  # the default under torchrun
    assert got["first"]["status"] == "interrupted" and got["resumed"]["status"] == "completed"
    assert got["first"]["losses"] + got["resumed"]["losses"] == got["whole"]["losses"]  # exactly
    assert _diff(got["whole"]["losses"], reference) < TOL
    assert reference[-1] < reference[0] - 1.0  # it trained
    # keep_last=2 counted complete checkpoints only; the asynchronous saves were completed and renamed
    assert [p.name for p in list_checkpoints(root / "run" / "checkpoints")] == ["step_00000004", "step_00000006"]
    assert not list((root / "run" / "checkpoints").glob("*.tmp"))
    assert checkpoint_format(root / "run" / "checkpoints" / "step_00000004") == "dcp"


def test_two_rank_checkpoints_resume_in_one_process(demo_dir, two_ranks, reference, tmp_path):
    """Update 2 (a synchronous save) -> updates 3-6 in one process; update 4 (written asynchronously while updates
    5 and 6 changed the weights) -> updates 5-6."""
    root, _ = two_ranks
    for step in (2, 4):
        source = root / "from2" if step == 2 else root / "run"
        out = _copy_checkpoint(source, step, tmp_path / f"from{step}")
        with Trainer(_config(demo_dir, out, *SINGLE), resume=True) as trainer:
            assert trainer.step == step
            trainer.train()
            assert _diff(_losses(trainer), reference[step:]) < TOL, (step, _losses(trainer), reference[step:])


def test_a_token_budget_resumed_on_fewer_ranks_ends_at_its_tokens(demo_dir, two_ranks, tmp_path, capsys):
    """The two-rank run's update 2 resumed in one process (half its rows per update) under the token budget of the
    two-rank run's 6 updates: the updates left are planned at one rank (8, not the 10 that a plan from scratch would
    add), the run ends at the budget, the token-unit schedule's total is the budget, and the note names the
    change of ranks."""
    root, _ = two_ranks
    state = json.loads((root / "from2" / "checkpoints" / "step_00000002" / "train_state.json").read_text())
    done = state["train_state"]["tokens"]
    budget = STEPS * done // 2
    out = _copy_checkpoint(root / "from2", 2, tmp_path / "one")
    sets = ("train.steps=null", f"train.tokens={budget}", "schedule.unit=tokens", "schedule.warmup=64")
    with Trainer(_config(demo_dir, out, *sets), resume=True) as trainer:
        assert (trainer.total_steps, trainer.total_tokens, trainer.schedule_total) == (10, budget, budget)
        result = trainer.train()
    assert (result.step, result.tokens) == (10, budget)
    assert "data-parallel ranks: 2 -> 1" in capsys.readouterr().out
    with Trainer(_config(demo_dir, out, *sets), resume=True) as trainer:  # done: nothing more to train
        assert trainer.already_complete


def test_two_rank_checkpoint_resumes_on_four_ranks(demo_dir, two_ranks, reference, tmp_path):
    root, _ = two_ranks
    out = _copy_checkpoint(root / "from2", 2, tmp_path / "four")
    got = _spawn(4, demo_dir, tmp_path, [("four", str(out), ["batch.micro_batch=1"], 4, True)])["four"]
    assert _diff(got["losses"], reference[2:4]) < TOL, (got["losses"], reference[2:4])


@pytest.mark.parametrize("fmt", ["hybridlm", "falcon_h1"])
def test_export_equals_the_runs_final_model(two_ranks, tmp_path, fmt):
    from hybridlm import load_model
    from hybridlm.cli import main

    root, _ = two_ranks
    assert main(["checkpoint", "export", "--run", str(root / "run"), "--out", str(tmp_path / "model"),
                 "--format", fmt]) == 0
    got, want = load_model(tmp_path / "model").state_dict(), load_model(root / "run" / "final").state_dict()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)  # final/ is the gathered model of the same update
    assert (tmp_path / "model" / "tokenizer.json").is_file()
    again = ["checkpoint", "export", "--run", str(root / "run"), "--out", str(tmp_path / "model"), "--format", fmt]
    assert main(again) == 2 and main([*again, "--overwrite"]) == 0  # an earlier export is replaced when asked
    assert all(torch.equal(load_model(tmp_path / "model").state_dict()[k], want[k]) for k in want)


def test_export_writes_safetensors_shards_with_their_index(two_ranks, tmp_path):
    from hybridlm import load_model
    from hybridlm.training.export import INDEX_FILE, export_checkpoint

    root, _ = two_ranks
    out = export_checkpoint(root / "run", tmp_path / "model", step=4, shard_bytes=1_000_000)
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and shards[-1].endswith(f"-of-{len(shards):05d}.safetensors")
    assert (out / INDEX_FILE).is_file()
    assert sorted(load_model(out).state_dict()) == sorted(load_model(root / "run" / "final").state_dict())


# ------------------------------------------------------------------------------------------------ one process
@pytest.mark.parametrize("overrides, world, want", [
    ([], 1, "full"), ([], 2, "dcp"), (["train.checkpoint_async=true"], 1, "dcp"),
    (["train.checkpoint_format=full"], 4, "full"), (["train.checkpoint_format=dcp"], 1, "dcp"),
])
def test_checkpoint_format_resolves_against_the_world_size(overrides, world, want):
    from hybridlm.training.config import load_config
    from hybridlm.training.plan import checkpoint_format as resolve

    assert resolve(load_config(None, overrides), world) == want


@pytest.mark.parametrize("overrides, message", [
    (["train.checkpoint_format=sharded"], "train.checkpoint_format: must be one of auto, dcp, full"),
    (["train.checkpoint_format=full", "train.checkpoint_async=true"],
     "train.checkpoint_async: .*checkpoint_format=dcp"),
])
def test_checkpoint_settings_are_validated(overrides, message):
    from hybridlm.training.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def _dcp(demo_dir: Path, out: Path, *overrides: str):
    return _config(demo_dir, out, "train.checkpoint_format=dcp", "train.save_every=2", "train.keep_last=3",
                   *SINGLE, *overrides)


class SimulatedCrash(Exception):
    pass


def test_a_crash_before_the_rename_leaves_the_previous_checkpoint_newest(demo_dir, tmp_path, monkeypatch, reference):
    out = tmp_path / "run"
    publish = checkpoint_module.publish

    def crash_at_step_4(tmp, final):
        if final.name == "step_00000004":
            raise SimulatedCrash("between the write and the rename")
        publish(tmp, final)

    monkeypatch.setattr(checkpoint_module, "publish", crash_at_step_4)
    with Trainer(_dcp(demo_dir, out)) as trainer, pytest.raises(SimulatedCrash):
        trainer.train()
    checkpoints = out / "checkpoints"
    assert latest_checkpoint(checkpoints).name == "step_00000002"
    assert (checkpoints / "step_00000004.tmp" / "dcp" / ".metadata").is_file()  # written, never renamed
    monkeypatch.undo()
    with Trainer(_dcp(demo_dir, out), resume=True) as trainer:
        assert trainer.step == 2
        trainer.train()
        assert _diff(_losses(trainer), reference[2:]) < TOL


def test_a_crash_during_an_async_save_leaves_the_previous_checkpoint_newest(demo_dir, tmp_path):
    out = tmp_path / "run"

    def crash(trainer, record):
        if record["step"] == 5:  # the save of update 4 is still pending (the next save would complete it)
            raise SimulatedCrash("during an asynchronous save")

    with Trainer(_dcp(demo_dir, out, "train.checkpoint_async=true"), callbacks=[crash]) as trainer:
        with pytest.raises(SimulatedCrash):
            trainer.train()
    checkpoints = out / "checkpoints"
    assert latest_checkpoint(checkpoints).name == "step_00000002"  # completed by the save of update 4
    assert (checkpoints / "step_00000004.tmp").is_dir()
    assert not (checkpoints / "step_00000004").exists()


def test_missing_or_corrupt_shards_are_refused_naming_the_file(demo_dir, tmp_path):
    out = tmp_path / "run"
    with Trainer(_dcp(demo_dir, out, "train.steps=2")) as trainer:
        trainer.train()
    shard = out / "checkpoints" / "step_00000002" / "dcp" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp fails its checksum"):
        Trainer(_dcp(demo_dir, out, "train.steps=4"), resume=True)
    shard.unlink()
    with pytest.raises(CheckpointError, match=r"no checkpoint .* is complete"):  # a listed file missing: not complete
        Trainer(_dcp(demo_dir, out, "train.steps=4"), resume=True)
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp is listed in the manifest but missing"):
        checkpoint_module.verify_checkpoint(shard.parent.parent)
