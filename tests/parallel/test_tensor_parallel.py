"""tp=2 (and dp_shard=2 with activation checkpointing, and tp=2 x dp_shard=2) on gloo processes match one
process: forward logits, cached decoding (tp=2), every gradient of one backward, and the losses of a few
AdamW steps, float32, tol 1e-5. Each rank also computes the single-process reference itself (a deep copy of
the same seeded model, before parallelizing). The SSM mixers are head-split: each rank's in_proj, conv and per-head tensors are
checked to be 1/tp of the full ones, so a replicated mixer fails the test.

(AdamW is nearly invariant to a uniform scale of the gradients, so equal losses alone would not catch a
gradient multiplied by the group size: the gradients are compared directly too.)"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hybridlm.parallel import ParallelConfig, build_mesh, parallelize
from tests.parallel.harness import (
    STEPS,
    TOL,
    decode_diff,
    gradient_diff,
    run_ranks,
    tiny_model,
    token_batch,
    train_adamw,
)

# The models of the head-split test: B/C groups = 2 so that tp=2 splits them (the tiny preset has 1).
MODELS = {
    "mamba2-only-grouped-norm": {"use_attention": False, "mamba_n_groups": 2, "mamba_rms_norm": True},
    "fast-weight-rule-1": {"ssm_mixer": "fast_weight", "fw_rule": "1"},
    "fast-weight-3A-window-3": {"ssm_mixer": "fast_weight", "fw_rule": "3A", "fw_window": 3},
    "fast-weight-2A-per-column": {"ssm_mixer": "fast_weight", "fw_rule": "2A"},
    "hybrid-default": {"mamba_n_groups": 2},
}


def _head_split(rank: int, world: int, models: dict) -> dict:
    config = ParallelConfig(tp=2)
    mesh = build_mesh(config)
    ids = token_batch()
    results = {}
    for label, overrides in models.items():
        model = tiny_model(**overrides)
        reference = copy.deepcopy(model)
        full_rows = {n: p.shape[0] for n, p in reference.model.layers[0].ssm.named_parameters()}
        with torch.no_grad():
            want = reference(ids).logits
        parallelize(model, mesh, config)
        ssm = model.model.layers[0].ssm
        local_rows = {n: p.to_local().shape[0] for n, p in ssm.named_parameters() if isinstance(p, DTensor)}
        with torch.no_grad():
            got = model(ids).logits
        decoded = decode_diff(model, ids, want)
        model(ids, labels=ids).loss.backward()
        reference(ids, labels=ids).loss.backward()
        grad_diff = gradient_diff(model, reference)
        model.zero_grad()
        reference.zero_grad()
        attn = model.model.layers[0].attn
        results[label] = {
            "logit_diff": float((got - want).abs().max()),
            "decode_diff": decoded,
            "grad_diff": grad_diff,
            "full_rows": full_rows,
            "local_rows": local_rows,
            "local_heads": ssm.num_heads,
            "attn_local_heads": None if attn is None else [attn.num_heads, attn.num_kv_heads],
            "losses": train_adamw(model, ids, STEPS),
            "reference": train_adamw(reference, ids, STEPS),
        }
    return results


def test_tp2_head_split_matches_one_process():
    results = run_ranks(_head_split, models=MODELS)
    for label, got in results.items():
        full, local = got["full_rows"], got["local_rows"]
        # Really split: every SSM parameter but out_proj (rowwise: Shard(1)) holds 1/2 of the rows.
        split = {name for name in full if not name.startswith("out_proj")}
        assert set(local) >= split, (label, sorted(local))
        assert all(local[name] * 2 == full[name] for name in split), (label, local, full)
        assert got["local_heads"] == 2, label  # 4 SSM heads, 2 per rank
        if got["attn_local_heads"] is not None:
            assert got["attn_local_heads"] == [1, 1], label
        assert got["logit_diff"] < TOL, (label, got["logit_diff"])
        assert got["decode_diff"] < TOL, (label, got["decode_diff"])
        assert got["grad_diff"] < TOL, (label, got["grad_diff"])
        losses, reference = got["losses"], got["reference"]
        assert max(abs(a - b) for a, b in zip(losses, reference)) < TOL, (label, losses, reference)
        assert reference[-1] < reference[0] - 0.1, label  # it trained, so equal losses mean equal updates


def _fsdp_with_checkpointing(rank: int, world: int) -> dict:
    config = ParallelConfig(dp_shard=-1, activation_checkpointing=True)
    mesh = build_mesh(config)
    model = tiny_model()
    reference = copy.deepcopy(model)
    ids = token_batch()
    parallelize(model, mesh, config)
    local = ids.chunk(world)[rank]  # each rank takes half the rows: the global batch is the same
    return {
        "losses": train_adamw(model, local, STEPS, reduce_group=None if world == 1 else dist.group.WORLD),
        "reference": train_adamw(reference, ids, STEPS),
    }


def test_fsdp_and_activation_checkpointing_match_one_process():
    got = run_ranks(_fsdp_with_checkpointing)
    losses, reference = got["losses"], got["reference"]
    assert max(abs(a - b) for a, b in zip(losses, reference)) < TOL, (losses, reference)
    assert reference[-1] < reference[0] - 0.1


def _tp_times_fsdp(rank: int, world: int) -> dict:
    """4 ranks: dp_shard=2 x tp=2 (FSDP2 over the head-split DTensors), then the same mesh with interleaved
    mixer parallelism inside each tp pair (FSDP2 over ranks that hold one mixer per layer)."""
    mesh = build_mesh(ParallelConfig(dp_shard=-1, tp=2))
    ids = token_batch()
    results = {}
    for mixer_parallel in ("off", "interleaved"):
        config = ParallelConfig(dp_shard=-1, tp=2, mixer_parallel=mixer_parallel)
        model = tiny_model(mamba_n_groups=2)  # the tiny preset, its B/C groups split over tp
        reference = copy.deepcopy(model)
        parallelize(model, mesh, config)
        dp_rank = mesh["dp_shard"].get_local_rank()
        local = ids.chunk(mesh["dp_shard"].size())[dp_rank]
        with torch.no_grad():
            logit_diff = float((model(local).logits - reference(local).logits).abs().max())
        # FSDP2 keeps the root's parameters unsharded after a forward (for the backward that usually follows);
        # after a no_grad forward they must be resharded by hand, or the next training step's root gradients
        # are never reduce-scattered.
        model.reshard()
        ssm = model.model.layers[0].ssm
        in_proj = None if ssm is None else ssm.in_proj.weight
        results[mixer_parallel] = {
            "logit_diff": logit_diff,
            "in_proj_placements": None if in_proj is None else [str(p) for p in in_proj.placements],
            "in_proj_local_rows": None if in_proj is None else in_proj.to_local().shape[0],
            "in_proj_rows": reference.model.layers[0].ssm.in_proj.weight.shape[0],
            "losses": train_adamw(model, local, STEPS, reduce_group=mesh["dp_shard"].get_group()),
            "reference": train_adamw(reference, ids, STEPS),
        }
    return results


def test_tp2_x_fsdp2_on_four_processes_matches_one_process():
    results = run_ranks(_tp_times_fsdp, world=4)
    got = results["off"]
    assert len(got["in_proj_placements"]) == 2  # (dp_shard, tp): FSDP2 over the head-split DTensor
    assert got["in_proj_local_rows"] * 4 == got["in_proj_rows"]  # 1/2 by tp, 1/2 by FSDP
    assert results["interleaved"]["in_proj_placements"] is None  # rank 0 runs layer 0's attention only
    for label, got in results.items():
        assert got["logit_diff"] < TOL, (label, got["logit_diff"])
        losses, reference = got["losses"], got["reference"]
        assert max(abs(a - b) for a, b in zip(losses, reference)) < TOL, (label, losses, reference)
        assert reference[-1] < reference[0] - 0.1, label
