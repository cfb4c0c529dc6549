"""The trainer on 4 gloo processes with tensor, context and mixer parallelism, and checkpoints that move between
meshes: every stage's losses, gradient norms and held-out losses equal one process on the same global batch.

One spawn of 4 processes runs three trainers in a chain, each resuming the previous one's checkpoint:

    updates 1-2   tp=2 x dp_shard=2            (SSM heads split: mamba_n_groups=2; activation checkpointing)
    updates 3-4   cp=2 x dp_shard=2            (loads the head-split run's sharded checkpoint, saves a full one)
    updates 5-6   tp=2 x dp_shard=2, mixer_parallel="on"   (each rank holds one mixer per layer)
    updates 7-8   one process                  (loads the mixer-parallel sharded checkpoint)

against one uninterrupted process (micro-batches of 2 rows, 2 accumulated: the global batch of 2 data-parallel
ranks x 2 rows). A wrong row permutation, a mixer missing from a checkpoint, AdamW moments in the wrong layout,
a loss normalized per cp chunk or a gradient norm that double counts tp / cp copies all break these equalities.
Under torchrun the checkpoints are sharded (dcp) by default, except the cp stage's (train.checkpoint_format=full), so
both formats move between meshes. The checkpoints of each mesh hold the keys and shapes of a single-process
checkpoint, and their tensors equal the single-process run's at the same update. Every update is followed by an evaluation (no_grad forward; that
the trainer reshards FSDP2's root after it is not something these equalities can see: a run's first forward is
always a training step). Float32, tolerance 1e-5.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors import safe_open

from hybridlm.training.config import ConfigError, load_config
from hybridlm.training.plan import resolve_parallel
from hybridlm.training.trainer import Trainer
from tests.helpers import free_port
from tests.training.toys import small_config

TOL = 1e-5
STEPS = 8
# tp=2 splits the tiny preset's 2 attention heads, 2 KV heads, 4 SSM heads in 2 B/C groups, 320 MLP channels;
# cp=2 needs rows without document restarts (packed documents cannot be split over cp ranks).
# optim.eps=1e-4: AdamW's first updates are ~lr g / (|g| + eps), so with eps=1e-8 a gradient entry that is
# float32 round-off (~1e-10: rarely seen embedding rows) becomes a weight difference of up to ~lr / 10 between
# two correct runs (measured: 3.6e-4 in the embedding after 2 updates, while the moments agreed to 4e-8 and
# the losses to 1e-5); 1e-4 keeps the weights' comparison meaningful at 1e-5.
MODEL = ("model.overrides.num_key_value_heads=2", "model.overrides.mamba_n_groups=2", "data.document_boundaries=false",
         "optim.eps=1e-4")
STAGES = (  # (name, overrides, last update)
    ("tp2_dp2_ac", ("parallel.tp=2", "parallel.activation_checkpointing=true"), 2),
    ("cp2_dp2", ("parallel.cp=2", "train.checkpoint_format=full"), 4),
    ("mixer_tp2_dp2", ("parallel.tp=2", "parallel.mixer_parallel=on"), 6),
)


def _config(demo_dir: Path, out: Path, *overrides: str):
    return small_config(demo_dir, out, f"train.steps={STEPS}", "train.eval_every=1", "train.eval_batches=1",
                        "train.save_every=2", "train.keep_last=8", *MODEL, *overrides)


def _record(trainer: Trainer) -> dict:
    return {"losses": [r["loss"] for r in trainer.history], "grad_norms": [r["grad_norm"] for r in trainer.history]}


def _chain_worker(rank: int, world: int, port: int, demo_dir: str, out: str, result_file: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)  # the trainers reuse it (one mesh each)
    results = {}
    try:
        for index, (name, overrides, last) in enumerate(STAGES):
            def stop(trainer, record, last=last):
                if record["step"] == last:
                    trainer.request_stop("test")

            trainer = Trainer(_config(Path(demo_dir), Path(out), "batch.micro_batch=2", *overrides),
                              resume=index > 0, callbacks=[stop])
            assert trainer.train().status == "interrupted" and trainer.step == last
            results[name] = _record(trainer)
        if rank == 0:
            Path(result_file).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def reference(demo_dir, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("single") / "run"
    trainer = Trainer(_config(demo_dir, out, "batch.micro_batch=2", "batch.grad_accum=2"))
    trainer.train()
    return {**_record(trainer), "out": out, "evals": _evals(out)}


def _evals(out: Path) -> list[float]:
    return [json.loads(line)["eval_loss"] for line in (out / "eval.jsonl").read_text().splitlines()]


def _diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) for x, y in zip(a, b))


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118 (not a dict)


def _canonical(path: Path) -> tuple[dict[str, torch.Tensor], list[list[str]]]:
    """A checkpoint's model and AdamW tensors under the sharded format's keys ("model.<name>", "optim.<name>.<slot>")
    and its groups' parameter names, whichever format it has."""
    from hybridlm.training.checkpoint import OPTIMIZER_JSON, OPTIMIZER_TENSORS, _read_tree, checkpoint_format

    if checkpoint_format(path) == "dcp":
        from hybridlm.training.export import iter_sharded_tensors
        from hybridlm.training.sharded_checkpoint import GROUPS_FILE

        groups = json.loads((path / GROUPS_FILE).read_text())["param_groups"]
        return dict(iter_sharded_tensors(path)), [g["param_names"] for g in groups]
    out = {f"model.{key}": value for key, value in _tensors(path / "model.safetensors").items()}
    optimizer = _read_tree(path, OPTIMIZER_TENSORS, OPTIMIZER_JSON)
    names = [n for g in optimizer["param_groups"] for n in g["param_names"]]
    for index, slots in optimizer["state"].items():
        out.update({f"optim.{names[int(index)]}.{slot}": value for slot, value in slots.items()})
    return out, [g["param_names"] for g in optimizer["param_groups"]]


def _checkpoint_diff(got: Path, want: Path) -> float:
    """Max abs difference over the model and optimizer tensors of two checkpoints (either format), after asserting
    that they hold the same keys and shapes and the same optimizer groups (parameter names)."""
    (a, groups_a), (b, groups_b) = _canonical(got), _canonical(want)
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))[:5]
    worst = 0.0
    for key in a:
        assert a[key].shape == b[key].shape and a[key].dtype == b[key].dtype, key
        worst = max(worst, float((a[key].double() - b[key].double()).abs().max()) if a[key].numel() else 0.0)
    assert groups_a == groups_b  # canonical names, in the groups' order
    return worst


@pytest.fixture(scope="module")
def chain(demo_dir, tmp_path_factory) -> tuple[Path, dict]:
    """The run through the chain of meshes (4 gloo processes): its output folder and each stage's record."""
    root = tmp_path_factory.mktemp("chain")
    out, result_file = root / "chain", root / "chain.json"
    mp.spawn(_chain_worker, args=(4, free_port(), str(demo_dir), str(out), str(result_file)), nprocs=4, join=True)
    return out, json.loads(result_file.read_text())


def test_mesh_chain_matches_one_process(demo_dir, reference, chain):
    out, stages = chain
    stages = dict(stages)
    last = Trainer(_config(demo_dir, out, "batch.micro_batch=2", "batch.grad_accum=2"), resume=True)
    assert last.train().status == "completed" and last.step == STEPS
    stages["single"] = _record(last)

    losses = [x for name in stages for x in stages[name]["losses"]]
    norms = [x for name in stages for x in stages[name]["grad_norms"]]
    report = {name: _diff(stages[name]["losses"], reference["losses"][2 * i: 2 * i + 2])
              for i, name in enumerate(stages)}
    print("loss diffs per stage:", report)
    assert _diff(losses, reference["losses"]) < TOL, (losses, reference["losses"])
    assert _diff(norms, reference["grad_norms"]) < TOL * max(reference["grad_norms"]), (norms, reference["grad_norms"])
    assert _diff(_evals(out), reference["evals"]) < TOL  # one held-out loss per update, under each mesh
    assert reference["losses"][-1] < reference["losses"][0] - 0.5  # it trained

    # each mesh's checkpoint: the single-process layout, and the single-process values of that update
    ref_dir, got_dir = reference["out"] / "checkpoints", out / "checkpoints"
    diffs = {step: _checkpoint_diff(got_dir / f"step_{step:08d}", ref_dir / f"step_{step:08d}") for step in (2, 4, 6, 8)}
    print("checkpoint max abs diffs:", diffs)
    assert max(diffs.values()) < TOL, diffs  # weights and AdamW moments, float32


def test_head_split_checkpoint_resumes_in_one_process(demo_dir, reference, chain, tmp_path):
    """The tp=2 x dp_shard=2 checkpoint of update 2 (written by the chain) resumed in one process: updates 3-4
    equal the uninterrupted run."""
    out = tmp_path / "from_tp"
    shutil.copytree(chain[0] / "checkpoints" / "step_00000002", out / "checkpoints" / "step_00000002")
    config = _config(demo_dir, out, "batch.micro_batch=2", "batch.grad_accum=2")  # the reference's schedule
    trainer = Trainer(config, resume=True, callbacks=[lambda t, r: t.request_stop() if r["step"] == 4 else None])
    assert trainer.step == 2
    trainer.train()
    got = [r["loss"] for r in trainer.history]
    print("tp=2 x dp_shard=2 -> one process, updates 3-4: loss diff", _diff(got, reference["losses"][2:4]))
    assert _diff(got, reference["losses"][2:4]) < TOL


# ------------------------------------------------------------------------------------------------ config errors
@pytest.mark.parametrize(
    "overrides, world, names",
    [
        (["parallel.tpp=2"], 1, ["unknown key 'parallel.tpp'", "tp", "dp_shard"]),
        (["parallel.tp=3"], 4, ["parallel", "world size 4", "not divisible"]),
        (["parallel.tp=2", "parallel.dp_shard=3"], 4, ["dp_replicate x dp_shard x cp x tp", "= 6", "world size is 4"]),
        (["parallel.dp_replicate=-1"], 4, ["at most one of them can be -1"]),
        (["parallel.cp=2"], 2, ["parallel.cp", "packed documents", "data.document_boundaries=false"]),
        (["parallel.cp=2", "data.document_boundaries=false", "parallel.activation_checkpointing=true"], 2,
         ["parallel.activation_checkpointing", "cp"]),
        (["parallel.cp=3", "data.document_boundaries=false", "batch.seq_len=32"], 3, ["batch.seq_len", "divisible"]),
        (["parallel.cp=2", "data.document_boundaries=false", "model.overrides.attention_window=16"], 2,
         ["model.overrides.attention_window", "parallel.cp"]),
        (["parallel.tp=3", "parallel.mixer_parallel=on"], 3, ["parallel.mixer_parallel", "even"]),
        (["parallel.mixer_parallel=sideways"], 1, ["parallel.mixer_parallel", "interleaved"]),
        (["parallel.tp=2", "parallel.mixer_parallel=on", "train.compile=true"], 2, ["train.compile", "mixer_parallel"]),
        (["distributed.strategy=ddp"], 1, ["distributed.strategy", "removed", "parallel.dp_replicate=-1"]),
        (["train.compile=true", "train.compile_mode=reduce-overhead"], 2,
         ["train.compile_mode: 'reduce-overhead'", "runs in one process", "train.compile_mode=default"]),
        (["parallel.tp=2", "model.overrides.num_key_value_heads=2"], 2,
         ["parallel.tp=2", "mamba_n_groups=1", "parallel.ssm_tensor_parallel=false"]),
        (["parallel.tp=2", "model.overrides.mamba_n_groups=2"], 2, ["parallel.tp=2", "num_key_value_heads"]),
    ],
)
def test_parallel_config_errors_name_the_keys(overrides, world, names):
    with pytest.raises(ConfigError) as info:
        resolve_parallel(load_config(None, overrides), world)
    for name in names:
        assert name in str(info.value), (name, str(info.value))


def test_sizes_resolve_against_the_world_size():
    config = load_config(None, ["parallel.tp=2", "model.overrides.num_key_value_heads=2"])
    with pytest.raises(ConfigError, match="mamba_n_groups"):
        resolve_parallel(config, 8)
    replicated_ssm = load_config(None, ["parallel.tp=2", "model.overrides.num_key_value_heads=2",
                                        "parallel.ssm_tensor_parallel=false"])
    assert resolve_parallel(replicated_ssm, 8).shape == (1, 4, 1, 2)
    replicas = load_config(None, ["parallel.dp_replicate=-1", "parallel.dp_shard=1"])
    assert resolve_parallel(replicas, 4).shape == (4, 1, 1, 1)


def test_reduce_overhead_compile_is_fine_in_one_process():
    config = load_config(None, ["train.compile=true", "train.compile_mode=reduce-overhead"])
    assert resolve_parallel(config, 1).shape == (1, 1, 1, 1)


def test_one_process_refuses_a_mesh_larger_than_the_world(demo_dir, tmp_path):
    with pytest.raises(ConfigError, match="world size is 1"):
        Trainer(_config(demo_dir, tmp_path / "tp", "parallel.tp=2", "parallel.dp_shard=1"))
    with pytest.raises(ConfigError, match=r"world size 1 is not divisible .* fewer processes .*--set parallel\.tp=1"):
        Trainer(_config(demo_dir, tmp_path / "tp", "parallel.tp=2"))  # a tp=2 run's config, resumed in one process


def test_clip_grad_norm_equals_torch_in_one_process():
    from hybridlm.training import distributed as D

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    model(torch.randn(4, 5)).square().sum().backward()
    twin = copy.deepcopy(model)
    for p, q in zip(model.parameters(), twin.parameters()):
        q.grad = p.grad.clone()
    want = float(torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.5))
    names = [n for n, _ in model.named_parameters()]
    got = D.clip_grad_norm(model, 0.5, D.DistContext(), names=names)
    assert want > 0.5 and abs(got - want) < 1e-6 * want  # it clips
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-6, atol=0)


# ------------------------------------------------------------------------------------------------ the adapter
def _round_trips(rank: int, world: int) -> dict:
    """2 ranks, tp=2: head split, mixer parallelism "on" and "interleaved". The gathered state dict equals the
    unparallelized model's (keys, shapes, values: exact); a perturbed canonical dict loaded back gathers to itself."""
    from hybridlm.parallel import ParallelConfig, build_mesh, parallelize
    from hybridlm.parallel.checkpoint import (
        full_model_state_dict,
        load_full_model_state_dict,
    )
    from tests.parallel.harness import tiny_model

    results = {}
    for mode in ("off", "on", "interleaved"):
        config = ParallelConfig(tp=2, dp_shard=1, mixer_parallel=mode)
        model = tiny_model(mamba_n_groups=2)
        want = {k: v.clone() for k, v in model.state_dict().items()}
        parallelize(model, build_mesh(config), config)
        got = full_model_state_dict(model)
        shifted = {k: v + torch.arange(v.numel(), dtype=v.dtype).view_as(v) * 1e-3 for k, v in want.items()}
        missing, unexpected = load_full_model_state_dict(model, shifted)
        again = full_model_state_dict(model)
        if rank == 0:
            results[mode] = {
                "keys_equal": sorted(got) == sorted(want) and sorted(again) == sorted(want),
                "diff": max(float((got[k] - want[k]).abs().max()) for k in want),
                "round_trip": max(float((again[k] - shifted[k]).abs().max()) for k in want),
                "missing": missing, "unexpected": unexpected,
            }
    return results


def test_full_state_dict_gathers_every_mixer_in_the_canonical_rows():
    from tests.parallel.harness import run_ranks

    results = run_ranks(_round_trips, world=2)
    for mode, got in results.items():
        assert got["keys_equal"] and got["missing"] == [] and got["unexpected"] == [], (mode, got)
        assert got["diff"] == 0.0 and got["round_trip"] == 0.0, (mode, got)


def test_nccl_on_the_cpu_is_a_config_error_before_any_process_group(monkeypatch):
    import torch.distributed as dist

    from hybridlm.training.distributed import init_distributed

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match="distributed.backend: nccl needs CUDA devices.*distributed.backend=gloo"):
        init_distributed(load_config(None, ["distributed.backend=nccl"]), device="cpu")
    assert not dist.is_initialized()
