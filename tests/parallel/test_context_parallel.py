"""Context parallelism equals one process:

- cp=2 on 2 gloo processes, for an attention-only model (grouped-query: 2 query heads on 1 key/value head),
  Mamba-2 only, fast-weight rule 3A with a window of 3, fast-weight rule 1, the default hybrid (attention +
  Mamba-2) with ring attention and with the K/V all-gather: the logits, the parameter gradients (after the
  cp reduction) and the gradient of the input embeddings; float32 (tol 1e-5 relative) and float64 (every
  parameter's gradient to 1e-10: exact, not just close). One spawn runs every variant (spawning dominates the
  time on 2 cores); each variant is its own test.
- cp=2 x dp_shard=2 on 4 processes (FSDP2 over dp_shard, parameters replicated over cp and their gradients
  summed over it by `reduce_context_parallel_grads`): the losses of 3 AdamW steps of the tiny hybrid equal one
  process on the same global batch (`four_process.py`: the spawn test_ring_attention shares).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper,
)

from hybridlm.parallel import (
    ParallelConfig,
    build_mesh,
    context_parallel,
    gather_sequence,
    reduce_context_parallel_grads,
    shard_sequence,
)
from tests.helpers import rel_err
from tests.parallel.four_process import four_process_results
from tests.parallel.harness import CP_LENGTH, TOL, cp_tokens, max_relative, run_ranks, tiny_model

# name -> (tiny_model overrides, context_parallel attention mode)
VARIANTS = {
    "attention-gqa": ({"ssm_mixer": "none", "num_key_value_heads": 1}, "ring"),
    "mamba2": ({"ssm_mixer": "mamba2", "use_attention": False}, "ring"),
    "fast_weight-3A-window3": ({"ssm_mixer": "fast_weight", "fw_rule": "3A", "fw_window": 3, "use_attention": False}, "ring"),
    "fast_weight-1": ({"ssm_mixer": "fast_weight", "fw_rule": "1", "use_attention": False}, "ring"),
    "hybrid-ring": ({}, "ring"),
    "hybrid-allgather": ({}, "allgather"),
}


def _compare(group, overrides: dict, attention: str, dtype: torch.dtype, length: int = CP_LENGTH) -> dict:
    """One variant in one dtype: forward + backward under cp against the same model in one process."""
    model = tiny_model(**overrides).to(dtype)
    reference = copy.deepcopy(model)
    ids = cp_tokens(length=length)
    torch.manual_seed(3)
    weights = torch.randn(2, length, 128, dtype=dtype)  # a loss that reads every logit
    # [B, T, D]: what the model makes of ids (inputs_embeds are not scaled by embedding_multiplier)
    embeds = (reference.model.embed_tokens(ids) * reference.model.embedding_multiplier).detach().requires_grad_(True)
    want = reference(inputs_embeds=embeds).logits
    (want * weights).sum().backward()
    want = want.detach()

    local, positions = shard_sequence(embeds.detach(), group)
    local.requires_grad_(True)
    with context_parallel(model, group, attention=attention):
        logits = model(inputs_embeds=local, position_ids=positions).logits  # [B, T/2, V]
    (logits * shard_sequence(weights, group)[0]).sum().backward()  # after the hooks are gone: still exact
    reduce_context_parallel_grads(model, group)

    with torch.no_grad():  # without the state passing / ring the second half must differ (the test can fail)
        alone = gather_sequence(model(inputs_embeds=local.detach(), position_ids=positions).logits, group)
    got = gather_sequence(logits.detach(), group)
    # the embedding table gets no gradient here: the embeddings are the input
    pairs = [(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()) if q.grad is not None]
    half = length // 2
    return {
        "logits": max_relative(got, want),
        "embed_grads": max_relative(gather_sequence(local.grad, group), embeds.grad),
        # float32: the worst entry of any gradient against the largest gradient entry; float64: each parameter
        # on its own (float32 rounding alone moves A_log's small, cancelling gradient by ~1e-5 of itself)
        "all_param_grads": max(float((a - b).abs().max()) for a, b in pairs) / max(float(b.abs().max()) for _, b in pairs),
        "each_param_grad": max(rel_err(a, b) for a, b in pairs),
        "second_half_alone": float((alone - want)[:, half:].abs().max()),
    }


def _all_variants(rank: int, world: int) -> dict:
    group = build_mesh(ParallelConfig(dp_shard=1, cp=world))["cp"].get_group()
    results = {
        name: {str(dtype): _compare(group, overrides, attention, dtype) for dtype in (torch.float32, torch.float64)}
        for name, (overrides, attention) in VARIANTS.items()
    }
    # one token per rank: the first rank's chunk makes no shifted write, so its gates get no gradient there
    results["one-token-chunks"] = _compare(group, {"ssm_mixer": "fast_weight", "fw_rule": "1A", "use_attention": False},
                                           "ring", torch.float64, length=world)
    return results


@pytest.fixture(scope="module")
def cp2_results() -> dict:
    return run_ranks(_all_variants)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cp2_forward_and_gradients_match_one_process(cp2_results, variant):
    single, double = cp2_results[variant]["torch.float32"], cp2_results[variant]["torch.float64"]
    for name in ("logits", "embed_grads", "all_param_grads"):
        assert single[name] < TOL, single
    assert double["each_param_grad"] < 1e-10, double  # exact: every parameter's gradient, float64
    assert double["logits"] < 1e-12 and double["embed_grads"] < 1e-10, double
    assert single["second_half_alone"] > 1e-3, single


def test_cp2_with_one_token_per_rank_reduces_gradients_only_some_ranks_have(cp2_results):
    double = cp2_results["one-token-chunks"]
    assert double["each_param_grad"] < 1e-10 and double["logits"] < 1e-12, double


def test_cp2_x_dp_shard2_training_matches_one_process():
    got = four_process_results()["train"]
    losses, reference = got["losses"], got["reference"]
    assert max(abs(a - b) for a, b in zip(losses, reference)) < TOL, (losses, reference)
    assert reference[-1] < reference[0] - 0.1  # it trained, so equal losses mean equal updates


def test_context_parallel_refuses_unknown_attention_and_checkpointing():
    """Checked before any communication (no process group needed)."""
    model = tiny_model()
    with pytest.raises(ValueError, match="attention must be one of"), context_parallel(model, attention="flash"):
        pass
    model.model.layers[0] = checkpoint_wrapper(model.model.layers[0])
    with pytest.raises(ValueError, match="activation checkpointing is not supported"), context_parallel(model):
        pass
