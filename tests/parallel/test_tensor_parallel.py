"""tp=2 (and dp_shard=2 with activation checkpointing) on 2 gloo processes match one process: forward
logits and the losses of a few AdamW steps, float32, tol 1e-5. Each rank also computes the single-process
reference itself (a deep copy of the same seeded model, before parallelizing)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hybridlm.parallel import ParallelConfig, build_mesh, parallelize
from tests.parallel.harness import run_ranks, tiny_model

TOL = 1e-5
STEPS = 3


def _batch(rows: int = 4, length: int = 20) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randint(0, 128, (rows, length))


def _train(model, ids: torch.Tensor, steps: int, *, reduce_group=None) -> list[float]:
    """AdamW steps on the next-token loss; with `reduce_group` the reported loss is the mean over its ranks."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        if reduce_group is not None:
            dist.all_reduce(value, group=reduce_group)
            value /= dist.get_world_size(reduce_group)
        losses.append(float(value))
    return losses


def _tensor_parallel(rank: int, world: int, ssm_mixer: str) -> dict:
    config = ParallelConfig(tp=2)
    mesh = build_mesh(config)
    model = tiny_model(ssm_mixer=ssm_mixer)
    reference = copy.deepcopy(model)
    ids = _batch()
    with torch.no_grad():
        want = reference(ids).logits
    parallelize(model, mesh, config)
    attn = model.model.layers[0].attn
    with torch.no_grad():
        got = model(ids).logits
    return {
        "logit_diff": float((got - want).abs().max()),
        "local_heads": [attn.num_heads, attn.num_kv_heads],
        "q_is_dtensor": isinstance(attn.q_proj.weight, DTensor),
        "local_q_rows": attn.q_proj.weight.to_local().shape[0],
        "losses": _train(model, ids, STEPS),
        "reference": _train(reference, ids, STEPS),
    }


@pytest.mark.parametrize("ssm_mixer", ["mamba2", "fast_weight"])
def test_tp2_matches_one_process(ssm_mixer):
    got = run_ranks(_tensor_parallel, ssm_mixer=ssm_mixer)
    assert got["q_is_dtensor"] and got["local_heads"] == [1, 1] and got["local_q_rows"] == 64  # really split
    assert got["logit_diff"] < TOL, got["logit_diff"]
    losses, reference = got["losses"], got["reference"]
    assert max(abs(a - b) for a, b in zip(losses, reference)) < TOL, (losses, reference)
    assert reference[-1] < reference[0] - 0.1  # it trained, so equal losses mean equal updates


def _fsdp_with_checkpointing(rank: int, world: int) -> dict:
    config = ParallelConfig(dp_shard=-1, activation_checkpointing=True)
    mesh = build_mesh(config)
    model = tiny_model()
    reference = copy.deepcopy(model)
    ids = _batch()
    parallelize(model, mesh, config)
    local = ids.chunk(world)[rank]  # each rank takes half the rows: the global batch is the same
    return {
        "losses": _train(model, local, STEPS, reduce_group=None if world == 1 else dist.group.WORLD),
        "reference": _train(reference, ids, STEPS),
    }


def test_fsdp_and_activation_checkpointing_match_one_process():
    got = run_ranks(_fsdp_with_checkpointing)
    losses, reference = got["losses"], got["reference"]
    assert max(abs(a - b) for a, b in zip(losses, reference)) < TOL, (losses, reference)
    assert reference[-1] < reference[0] - 0.1


def _tp_times_fsdp(rank: int, world: int) -> dict:
    config = ParallelConfig(dp_shard=-1, tp=2)  # 4 ranks: dp_shard=2 x tp=2 (FSDP2 over DTensor TP weights)
    mesh = build_mesh(config)
    model = tiny_model()
    reference = copy.deepcopy(model)
    ids = _batch()
    parallelize(model, mesh, config)
    dp_rank = mesh["dp_shard"].get_local_rank()
    local = ids.chunk(mesh["dp_shard"].size())[dp_rank]
    return {
        "losses": _train(model, local, STEPS, reduce_group=mesh["dp_shard"].get_group()),
        "reference": _train(reference, ids, STEPS),
    }


def test_tp2_x_fsdp2_on_four_processes_matches_one_process():
    got = run_ranks(_tp_times_fsdp, world=4)
    losses, reference = got["losses"], got["reference"]
    assert max(abs(a - b) for a, b in zip(losses, reference)) < TOL, (losses, reference)
    assert reference[-1] < reference[0] - 0.1
