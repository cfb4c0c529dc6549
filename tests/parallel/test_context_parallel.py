"""cp=2 on 2 gloo processes: the sequence split in two matches one process (float32, tol 1e-5) for the
Mamba-2 mixer and the fast-weight mixer (rule 3A with a window of 3, rule 1), and attention's K/V gather
is exact in backward too (attention-only model: parameter gradients summed over the cp ranks)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from hybridlm.parallel import (
    ParallelConfig,
    build_mesh,
    context_parallel,
    gather_sequence,
    shard_sequence,
)
from tests.parallel.harness import run_ranks, tiny_model

TOL = 1e-5
LENGTH = 26  # 13 tokens per rank: not a multiple of the chunk size 8, and longer than the conv tail


def _ids() -> torch.Tensor:
    torch.manual_seed(2)
    return torch.randint(0, 128, (2, LENGTH))


def _forward(rank: int, world: int, overrides: dict) -> dict:
    mesh = build_mesh(ParallelConfig(dp_shard=1, cp=world))
    group = mesh["cp"].get_group()
    model = tiny_model(**overrides).eval()
    ids = _ids()
    with torch.no_grad():
        want = model(ids).logits
        local, positions = shard_sequence(ids, group)
        with context_parallel(model, group):
            got = gather_sequence(model(local, position_ids=positions).logits, group)
        # without the state passing / K/V gather the second half must differ (the test can fail)
        alone = gather_sequence(model(local, position_ids=positions).logits, group)
    half = LENGTH // 2
    return {
        "diff": float((got - want).abs().max()),
        "second_half_alone": float((alone - want)[:, half:].abs().max()),
    }


@pytest.mark.parametrize(
    "overrides",
    [
        {"ssm_mixer": "mamba2"},
        {"ssm_mixer": "fast_weight", "fw_rule": "3A", "fw_window": 3},
        {"ssm_mixer": "fast_weight", "fw_rule": "1"},
    ],
    ids=["mamba2", "fast_weight-3A-window3", "fast_weight-1"],
)
def test_cp2_forward_matches_one_process(overrides):
    got = run_ranks(_forward, overrides=overrides)
    assert got["diff"] < TOL, got
    assert got["second_half_alone"] > 1e-3, got


def _attention_backward(rank: int, world: int) -> dict:
    mesh = build_mesh(ParallelConfig(dp_shard=1, cp=world))
    group = mesh["cp"].get_group()
    model = tiny_model(ssm_mixer="none")
    reference = copy.deepcopy(model)
    ids = _ids()
    torch.manual_seed(3)
    weights = torch.randn(2, LENGTH, 128)  # a loss that reads every logit
    (reference(ids).logits * weights).sum().backward()
    local, positions = shard_sequence(ids, group)
    local_weights, _ = shard_sequence(weights, group)
    with context_parallel(model, group):
        (model(local, position_ids=positions).logits * local_weights).sum().backward()
    worst = 0.0
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad, group=group)  # the cp ranks' contributions, as data parallelism would sum them
        worst = max(worst, float((grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-12)))
    return {"relative_grad_diff": worst}


def test_cp2_attention_gradients_match_one_process():
    got = run_ranks(_attention_backward)
    assert got["relative_grad_diff"] < TOL, got


def _grad_guard(rank: int, world: int) -> dict:
    mesh = build_mesh(ParallelConfig(dp_shard=1, cp=world))
    group = mesh["cp"].get_group()
    model = tiny_model()
    local, positions = shard_sequence(_ids(), group)
    with context_parallel(model, group):
        try:  # every rank raises in the first SSM mixer's hook, before any communication
            model(local, position_ids=positions)
        except RuntimeError as error:
            return {"error": str(error)}
    return {"error": None}


def test_cp_refuses_gradients_through_ssm_states():
    got = run_ranks(_grad_guard)
    assert got["error"] is not None and "forward-only" in got["error"], got
