"""ring_attention over 2 and over 4 gloo processes (in the 4-process spawn of test_context_parallel) equals plain causal attention on the whole sequence (one process):
the output and the gradients of q, k, v, with grouped-query attention (6 query heads on 2 key/value heads),
an odd head dim (5) and a value dim that differs (7), float32, tol 1e-5 relative to the largest entry."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridlm.parallel import ring_attention, shard_sequence

TOL = 1e-5
BATCH, CHUNK, Q_HEADS, KV_HEADS, DIM, VALUE_DIM = 2, 3, 6, 2, 5, 7


def _reference(q, k, v) -> torch.Tensor:
    """Plain causal GQA attention, [B, T, H, D] layouts."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    )
    return out.transpose(1, 2)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).abs().max() / b.detach().abs().max())


def _ring(group, rank: int, world: int) -> dict:
    """ring_attention over `group` (`world` ranks, this one `rank` in it) against the whole sequence."""
    length = CHUNK * world
    torch.manual_seed(0)
    q = torch.randn(BATCH, length, Q_HEADS, DIM, requires_grad=True)
    k = torch.randn(BATCH, length, KV_HEADS, DIM, requires_grad=True)
    v = torch.randn(BATCH, length, KV_HEADS, VALUE_DIM, requires_grad=True)
    weights = torch.randn(BATCH, length, Q_HEADS, VALUE_DIM)  # a loss that reads every output
    want = _reference(q, k, v)
    (want * weights).sum().backward()

    local = [shard_sequence(t.detach(), group)[0].requires_grad_(True) for t in (q, k, v)]
    got = ring_attention(*local, group)
    (got * shard_sequence(weights, group)[0]).sum().backward()
    alone = _reference(*(t.detach() for t in local))  # this chunk without the earlier ranks' keys
    return {
        "out": _relative(got, shard_sequence(want, group)[0]),
        "dq": _relative(local[0].grad, shard_sequence(q.grad, group)[0]),
        "dk": _relative(local[1].grad, shard_sequence(k.grad, group)[0]),
        "dv": _relative(local[2].grad, shard_sequence(v.grad, group)[0]),
        "last_rank_alone": float((alone - got).abs().max()) if rank == world - 1 else 0.0,
    }


def rings(rank: int, world: int) -> dict:
    """On 4 processes: one ring over all 4 (cp=4) and two rings of 2 ({0, 1}, {2, 3}: cp=2); the worst rank's
    errors of each. Runs inside the 4-process spawn of test_context_parallel (a spawn costs ~10-20 s on 2
    cores, the rings a fraction of a second)."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    results = {"cp4": _ring(dist.group.WORLD, rank, world), "cp2": _ring(pairs[rank // 2], rank % 2, 2)}
    worst = {}
    for name, result in results.items():
        values = torch.tensor(list(result.values()), dtype=torch.float64)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        worst[name] = dict(zip(result, values.tolist()))
    return worst


@pytest.mark.parametrize("cp", ["cp2", "cp4"])
def test_ring_attention_matches_causal_attention(cp):
    # shares the 4-process spawn of test_context_parallel (imported here: that module imports this one)
    from tests.parallel.test_context_parallel import four_process_results

    got = four_process_results()["rings"][cp]
    for name in ("out", "dq", "dk", "dv"):
        assert got[name] < TOL, got
    assert got["last_rank_alone"] > 1e-2, got  # the earlier ranks' keys really matter (the test can fail)
