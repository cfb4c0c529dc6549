"""The one 4-process spawn that test_context_parallel and test_ring_attention share (spawning 4 processes
dominates their time on 2 cores), and the ring-attention inputs both use.

    four_process_results()["train"]          cp=2 x dp_shard=2 training against one process
    four_process_results()["rings"]          ring_attention over 4 ranks and over two rings of 2, per tile

Ring attention is checked with grouped-query attention (6 query heads on 2 key/value heads), an odd head dim (5)
and a value dim that differs (7), 13 tokens per rank, untiled and in query tiles of 4 rows (4 does not divide 13).
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridlm.parallel import (
    ParallelConfig,
    build_mesh,
    context_parallel,
    parallelize,
    reduce_context_parallel_grads,
    ring_attention,
    shard_sequence,
)
from tests.parallel.harness import (
    CP_LENGTH,
    STEPS,
    cp_tokens,
    max_relative,
    next_token_labels,
    run_ranks,
    summed_loss,
    tiny_model,
)

BATCH, CHUNK, Q_HEADS, KV_HEADS, DIM, VALUE_DIM = 2, 13, 6, 2, 5, 7
RING_TILES = {"untiled": None, "tile4": 4}  # 4 does not divide CHUNK


def reference_attention(q, k, v, *, causal: bool = True) -> torch.Tensor:
    """Plain (causal) GQA attention, [B, T, H, D] layouts."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, enable_gqa=True
    )
    return out.transpose(1, 2)


def attention_inputs(length: int, keys: int | None = None, *, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q [B, T, Hq, D], k [B, S, Hkv, D], v [B, S, Hkv, Dv] (S = T unless given) and loss weights [B, T, Hq, Dv]."""
    keys = length if keys is None else keys
    torch.manual_seed(seed)
    q = torch.randn(BATCH, length, Q_HEADS, DIM, requires_grad=True)
    k = torch.randn(BATCH, keys, KV_HEADS, DIM, requires_grad=True)
    v = torch.randn(BATCH, keys, KV_HEADS, VALUE_DIM, requires_grad=True)
    weights = torch.randn(BATCH, length, Q_HEADS, VALUE_DIM)  # a loss that reads every output
    return q, k, v, weights


def _ring(group, rank: int, world: int) -> dict:
    """ring_attention over `group` (`world` ranks, this one `rank` in it) against the whole sequence, for each
    of RING_TILES; the tiled run also against the untiled one."""
    q, k, v, weights = attention_inputs(CHUNK * world)
    want = reference_attention(q, k, v)
    (want * weights).sum().backward()
    local_weights = shard_sequence(weights, group)[0]

    results, untiled = {}, None
    for name, tile in RING_TILES.items():
        local = [shard_sequence(t.detach(), group)[0].requires_grad_(True) for t in (q, k, v)]
        got = ring_attention(*local, group, tile=tile)
        (got * local_weights).sum().backward()
        alone = reference_attention(*(t.detach() for t in local))  # this chunk without the earlier ranks' keys
        results[name] = {
            "out": max_relative(got, shard_sequence(want, group)[0]),
            "dq": max_relative(local[0].grad, shard_sequence(q.grad, group)[0]),
            "dk": max_relative(local[1].grad, shard_sequence(k.grad, group)[0]),
            "dv": max_relative(local[2].grad, shard_sequence(v.grad, group)[0]),
            "last_rank_alone": float((alone - got.detach()).abs().max()) if rank == world - 1 else 0.0,
        }
        if untiled is None:
            untiled = [got, *(t.grad for t in local)]
        else:
            results[name]["vs_untiled"] = max(max_relative(a, b) for a, b in zip([got, *(t.grad for t in local)], untiled))
    return results


def _rings(rank: int, world: int) -> dict:
    """On 4 processes: one ring over all 4 (cp=4) and two rings of 2 ({0, 1}, {2, 3}: cp=2), each untiled and
    tiled; the worst rank's errors of each, keyed "cp4/tile4" etc."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    results = {"cp4": _ring(dist.group.WORLD, rank, world), "cp2": _ring(pairs[rank // 2], rank % 2, 2)}
    worst = {}
    for cp, by_tile in results.items():
        for tile, result in by_tile.items():
            values = torch.tensor(list(result.values()), dtype=torch.float64)
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
            worst[f"{cp}/{tile}"] = dict(zip(result, values.tolist()))
    return worst


def _train_cp_dp(rank: int, world: int) -> dict:
    """cp=2 x dp_shard=2: FSDP2 over dp_shard, parameters replicated over cp and their gradients summed over it;
    the losses of STEPS AdamW updates and those of one process on the same global batch."""
    config = ParallelConfig(dp_shard=2, cp=2)
    mesh = build_mesh(config)
    cp_group = mesh["cp"].get_group()
    model = tiny_model()
    reference = copy.deepcopy(model)
    ids = cp_tokens(rows=4)
    labels = next_token_labels(ids)
    dp_rank = mesh["dp_shard"].get_local_rank()
    rows = ids.chunk(2)[dp_rank]  # this dp rank's half of the global batch
    local, positions = shard_sequence(rows, cp_group)
    local_labels, _ = shard_sequence(labels.chunk(2)[dp_rank], cp_group)
    count = rows.shape[0] * (CP_LENGTH - 1)  # the targets of this dp rank's rows (over all cp ranks)

    parallelize(model, mesh, config)  # FSDP2 over dp_shard; replicated over cp
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(STEPS):
        with context_parallel(model, cp_group):
            logits = model(local, position_ids=positions).logits  # [B/2, T/2, V]
        # this rank's share: summed over cp it is the mean over the dp rank's rows; FSDP averages over dp
        loss = summed_loss(logits, local_labels, count)
        loss.backward()
        reduce_context_parallel_grads(model, cp_group)
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        dist.all_reduce(value)  # sum over cp and dp ...
        losses.append(float(value) / 2)  # ... / dp = the global mean

    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    want = []
    for _ in range(STEPS):
        logits = reference(ids).logits
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        want.append(float(loss.detach()))
    return {"losses": losses, "reference": want}


def _four_processes(rank: int, world: int) -> dict:
    return {"train": _train_cp_dp(rank, world), "rings": _rings(rank, world)}


@functools.cache
def four_process_results() -> dict:
    """What rank 0 returned from the shared 4-process spawn (spawned once per pytest process)."""
    return run_ranks(_four_processes, world=4)
