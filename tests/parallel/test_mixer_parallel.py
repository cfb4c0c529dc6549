"""Mixer parallelism ("on" and "interleaved") on gloo processes matches one process: forward logits, cached
decoding, every gradient of one backward (so a sum whose backward multiplied the gradient by the group size
would fail, which AdamW's scale-invariant losses alone would not show), and the losses of 3 AdamW steps,
float32, tol 1e-5. 2 processes: tp=2, one rank attention, one rank SSM. 4 processes: tp=4, attention TP=2 on one half
and SSM TP=2 (head split) on the other. Each rank is checked to hold exactly one mixer per layer, the one
its half owns in that mode."""

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

MODES = ("on", "interleaved")


def _mixer_parallel(rank: int, world: int, models: dict) -> dict:
    mesh = build_mesh(ParallelConfig(tp=world))  # the whole world is one tp group
    ids = token_batch()
    results = {}
    for label, overrides in models.items():
        for mode in MODES:
            config = ParallelConfig(tp=world, mixer_parallel=mode)
            model = tiny_model(**overrides)
            reference = copy.deepcopy(model)
            with torch.no_grad():
                want = reference(ids).logits
            parallelize(model, mesh, config)
            roles = [
                "attention" if block.attn is not None and block.ssm is None
                else "ssm" if block.ssm is not None and block.attn is None else "both"
                for block in model.model.layers
            ]
            split = [  # is the owned mixer tensor-parallel within its half?
                any(isinstance(p, DTensor) for p in (block.attn or block.ssm).parameters())
                for block in model.model.layers
            ]
            every_roles, every_split = [None] * world, [None] * world
            dist.all_gather_object(every_roles, roles)
            dist.all_gather_object(every_split, split)
            with torch.no_grad():
                got = model(ids).logits
            decoded = decode_diff(model, ids, want)  # each rank caches its own mixer's state only
            model(ids, labels=ids).loss.backward()
            reference(ids, labels=ids).loss.backward()
            grad_diff = gradient_diff(model, reference)
            model.zero_grad()
            reference.zero_grad()
            results[f"{label}/{mode}"] = {
                "roles": every_roles,
                "split": every_split,
                "params": sum(p.numel() for p in model.parameters()),
                "reference_params": sum(p.numel() for p in reference.parameters()),
                "logit_diff": float((got - want).abs().max()),
                "decode_diff": decoded,
                "grad_diff": grad_diff,
                "losses": train_adamw(model, ids, STEPS),
                "reference": train_adamw(reference, ids, STEPS),
            }
    return results


def _check(results: dict, *, expected_roles: dict, inner_tp: bool) -> None:
    for key, got in results.items():
        mode = key.rsplit("/", 1)[1]
        assert got["roles"] == expected_roles[mode], (key, got["roles"])
        assert all(all(flags) == inner_tp for flags in got["split"]), (key, got["split"])
        assert got["params"] < got["reference_params"]  # the other mixer's weights are not held
        assert got["logit_diff"] < TOL, (key, got["logit_diff"])
        assert got["decode_diff"] < TOL, (key, got["decode_diff"])
        assert got["grad_diff"] < TOL, (key, got["grad_diff"])
        losses, reference = got["losses"], got["reference"]
        assert max(abs(a - b) for a, b in zip(losses, reference)) < TOL, (key, losses, reference)
        assert reference[-1] < reference[0] - 0.1, key


def test_mixer_parallel_two_processes_matches_one_process():
    results = run_ranks(
        _mixer_parallel, world=2,
        models={
            "mamba2": {},
            "fast-weight-3A": {"ssm_mixer": "fast_weight", "fw_rule": "3A", "fw_window": 3},
            "mamba2-SAM": {"block_arrangement": "SAM"},  # the MLP reads the mixers' input too
        },
    )
    a, s = "attention", "ssm"
    expected = {"on": [[a, a], [s, s]], "interleaved": [[a, s], [s, a]]}  # per rank, per layer
    _check(results, expected_roles=expected, inner_tp=False)


def test_mixer_parallel_four_processes_with_tp_inside_each_half():
    results = run_ranks(_mixer_parallel, world=4, models={"mamba2": {"mamba_n_groups": 2, "mamba_rms_norm": True}})
    a, s = "attention", "ssm"
    expected = {"on": [[a, a], [a, a], [s, s], [s, s]], "interleaved": [[a, s], [a, s], [s, a], [s, a]]}
    _check(results, expected_roles=expected, inner_tp=True)
