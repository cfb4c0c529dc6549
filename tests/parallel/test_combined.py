"""Context parallelism combined with tensor and mixer parallelism equals one process (4 gloo processes, float32).

The mesh is cp=2 x tp=2 (dp 1): ranks (cp, tp) = (0, 0), (0, 1), (1, 0), (1, 1). Every rank holds the tiny
hybrid (attention + Mamba-2, SA_M; 2 KV heads and 2 B/C groups so tp=2 splits them), the same rows, and its cp
chunk of every row (T = 26: 13 tokens per cp rank, not a multiple of the chunk size 8). Scenarios:

- "cp2_tp2": tensor parallelism with the SSM heads split (each rank's in_proj is 1/2 of the rows), the sequence
  over cp: ring attention over the local heads, state passing of the local SSM heads' states;
- "cp2_mixer_on" / "cp2_mixer_interleaved": mixer parallelism over the tp pair (one rank attention, the other
  the SSM, per layer), the sequence over cp: a rank's cp peer has the same tp coordinate and so the same role
  in every layer, so ring attention runs between the attention ranks and state passing between the SSM ranks.

For each: the logits (gathered over cp), every parameter gradient after `reduce_context_parallel_grads`
(DTensors gathered over tp, the SSM rows un-permuted), the global gradient norm of the trainer's
`clip_grad_norm` (which must count the cp and tp copies once), and the losses of 3 AdamW updates
(foreach=False: DTensor and plain parameters mix) with that clipping active, against the same model in one
process on the whole sequence. Tolerance 1e-5. All scenarios share one 4-process spawn (spawning dominates the
time on 2 cores). Also: the training config accepts mixer parallelism with cp.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hybridlm.parallel import (
    ParallelConfig,
    build_mesh,
    context_parallel,
    gather_sequence,
    parallelize,
    reduce_context_parallel_grads,
    shard_sequence,
)
from hybridlm.training.distributed import DistContext, clip_grad_norm
from tests.parallel.harness import (
    CP_LENGTH,
    STEPS,
    TOL,
    cp_tokens,
    gradient_diff,
    next_token_labels,
    run_ranks,
    summed_loss,
    tiny_model,
)

MAX_NORM = 0.5  # below these updates' gradient norms (~1.5-3): clipping is active in every update
MODEL = {"num_key_value_heads": 2, "mamba_n_groups": 2, "mamba_rms_norm": True}  # the grouped norm splits too

SCENARIOS = {  # name -> mixer_parallel
    "cp2_tp2": "off",
    "cp2_mixer_on": "on",
    "cp2_mixer_interleaved": "interleaved",
}


def _names(model) -> list[str]:
    return [name for name, _ in model.named_parameters()]


def _scenario(mixer_parallel: str, *, world: int) -> dict:
    config = ParallelConfig(dp_shard=1, cp=2, tp=2, mixer_parallel=mixer_parallel)
    mesh = build_mesh(config)
    ctx = DistContext(dist.get_rank(), world, backend="gloo", parallel=config.resolved(world), mesh=mesh)
    cp_group = mesh["cp"].get_group()
    model = tiny_model(**MODEL)
    reference = copy.deepcopy(model)
    names = _names(reference)
    parallelize(model, mesh, config)
    roles = [
        "attention" if b.ssm is None else "ssm" if b.attn is None else "both" for b in model.model.layers
    ]
    ssm = next((b.ssm for b in model.model.layers if b.ssm is not None), None)
    in_proj_split = isinstance(ssm.in_proj.weight, DTensor) if ssm is not None else None

    ids = cp_tokens()
    labels = next_token_labels(ids)
    count = ids.shape[0] * (CP_LENGTH - 1)
    local, positions = shard_sequence(ids, cp_group)
    local_labels, _ = shard_sequence(labels, cp_group)

    # one forward + backward: logits, every gradient, the global norm
    with context_parallel(model, cp_group):
        logits = model(local, position_ids=positions).logits  # [B, T/2, V]
    summed_loss(logits, local_labels, count).backward()
    reduce_context_parallel_grads(model, cp_group)
    want = reference(ids).logits
    summed_loss(want, labels, count).backward()
    got = gather_sequence(logits.detach(), cp_group)
    result = {
        "roles": roles,
        "in_proj_split": in_proj_split,
        "logit_diff": float((got - want.detach()).abs().max()),
        "grad_diff": gradient_diff(model, reference),
        "grad_scale": max(float(p.grad.abs().max()) for p in reference.parameters() if p.grad is not None),
        "norm": clip_grad_norm(model, float("inf"), ctx, names=names),
        "reference_norm": float(torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf"))),
    }
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)

    # AdamW updates with the trainer's clipping (active)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4, foreach=False)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-4, foreach=False)
    losses, want_losses = [], []
    for _ in range(STEPS):
        with context_parallel(model, cp_group):
            loss = summed_loss(model(local, position_ids=positions).logits, local_labels, count)
        loss.backward()
        reduce_context_parallel_grads(model, cp_group)
        clip_grad_norm(model, MAX_NORM, ctx, names=names)
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.detach().clone()
        dist.all_reduce(value, group=cp_group)  # the chunks' shares add up to the rows' mean
        losses.append(float(value))

        ref_loss = summed_loss(reference(ids).logits, labels, count)
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        want_losses.append(float(ref_loss.detach()))
    result.update(losses=losses, reference=want_losses)
    return result


def _all_scenarios(rank: int, world: int) -> dict:
    out = {}
    for name, mixer_parallel in SCENARIOS.items():
        result = _scenario(mixer_parallel, world=world)
        every = [None] * world
        dist.all_gather_object(every, {k: result[k] for k in ("roles", "in_proj_split", "logit_diff", "grad_diff")})
        result["ranks"] = every  # each rank's own comparison (gradients of the mixers it holds)
        out[name] = result
    return out


@functools.cache
def combined_results() -> dict:
    return run_ranks(_all_scenarios, world=4)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_cp_with_tp_or_mixer_parallelism_matches_one_process(scenario):
    got = combined_results()[scenario]
    for rank, theirs in enumerate(got["ranks"]):
        assert theirs["logit_diff"] < TOL, (rank, theirs)
        assert theirs["grad_diff"] < TOL * got["grad_scale"], (rank, theirs, got["grad_scale"])
    assert abs(got["norm"] - got["reference_norm"]) < TOL * got["reference_norm"], got
    assert got["reference_norm"] > MAX_NORM  # clipping changes the updates below
    losses, reference = got["losses"], got["reference"]
    assert len(losses) == len(reference) > 0, (losses, reference)
    assert max(abs(a - b) for a, b in zip(losses, reference)) < TOL, (losses, reference)
    assert reference[-1] < reference[0] - 0.1  # it trained: equal losses mean equal updates


def test_each_rank_holds_its_split():
    """cp2_tp2: every rank holds half of the SSM in_proj rows (a DTensor); mixer parallelism: ranks (cp, tp) and
    (cp', tp) have the same role per layer, the two tp ranks different ones."""
    results = combined_results()
    assert all(r["in_proj_split"] and set(r["roles"]) == {"both"} for r in results["cp2_tp2"]["ranks"])
    a, s = "attention", "ssm"
    expected = {"cp2_mixer_on": [[a, a], [s, s], [a, a], [s, s]],
                "cp2_mixer_interleaved": [[a, s], [s, a], [a, s], [s, a]]}  # rank = 2 cp + tp
    for name, roles in expected.items():
        assert [r["roles"] for r in results[name]["ranks"]] == roles, (name, results[name]["ranks"])


def test_training_config_accepts_mixer_parallelism_with_cp():
    """`hybridlm train`'s config: mixer parallelism with cp > 1 passes validation and resolves on 4 ranks."""
    from hybridlm.training.config import load_config
    from hybridlm.training.plan import resolve_parallel

    config = load_config(None, ["parallel.cp=2", "parallel.tp=2", "parallel.mixer_parallel=interleaved",
                                "data.document_boundaries=false", "model.overrides.num_key_value_heads=2",
                                "model.overrides.mamba_n_groups=2"])
    resolved = resolve_parallel(config, 4)
    assert (resolved.dp_shard, resolved.cp, resolved.tp, resolved.mixer_parallel) == (1, 2, 2, "interleaved")
