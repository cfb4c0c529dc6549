"""Ring attention: exact causal softmax attention over a sequence split into contiguous chunks over a group.

    out = ring_attention(q, k, v, group)   # q [B, Q, Hq, D], k [B, Q, Hkv, D], v [B, Q, Hkv, Dv] -> [B, Q, Hq, Dv]

Rank j of the J ranks of `group` holds the queries, keys and values of positions [j Q, (j + 1) Q) (what
`shard_sequence` hands out). Its queries need the keys/values of ranks 0..j, which it never holds all at once:

Forward (J - 1 rotations of the ring j -> j + 1):
    at step s rank j holds the K/V block of rank o = (j - s) mod J. If o < j it attends to the whole block,
    if o == j (step 0) causally inside it, if o > j (a block that wrapped around: future positions) it skips
    the compute but still passes the block on. The next block is already in flight while a block is being
    computed. Each block gives a partial output and its log-sum-exp per query (`block_attention`); partials are
    merged exactly by the online-softmax rule out = sum_b exp(lse_b - lse) out_b with lse = logaddexp_b lse_b.
Backward (the same rotations, exact):
    each K/V block travels with its dK/dV accumulator. At step s rank j adds its queries' contribution to the
    block it holds (`block_attention_backward`, from the final output and log-sum-exp saved by the forward)
    and to its own dQ. After J - 1 rotations the accumulator of block o sits on rank o - 1 (mod J) holding every
    contribution; one more rotation of dK/dV alone brings it home.

Memory per rank: the forward saves q, k, v, the output (float32) and the log-sum-exp [B, Hq, Q] only, O(Q),
never the other ranks' keys (an all-gather would hold O(J Q)). Live during a step: two K/V blocks (the one
being used and the one arriving); in backward two (K, V, dK, dV) blocks plus dQ. The price is recomputing
the block scores in backward and sending every K/V block around the ring twice (forward and backward) plus
the dK/dV accumulators once (float32).

Causal load balance is not addressed: rank j computes j + 1 blocks, so rank J-1 does J times rank 0's work
(a zigzag/striped assignment of positions to ranks would even it out; not done). The ring also passes the
wrapped blocks nobody needs, so that every step is the same send-to-next / receive-from-previous exchange on
every rank (the pattern NCCL batches without deadlock).

Block math runs in explicit float32 (float64 stays float64) matmuls + logsumexp so that it works on the CPU.
On CUDA a flash kernel with log-sum-exp output slots into `block_attention`:
`torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)` returns
(out, logsumexp, ...), and `torch.ops.aten._scaled_dot_product_flash_attention_backward`, given the FINAL
(merged) output and log-sum-exp instead of the block's own, returns exactly this block's dQ/dK/dV
contributions (dS = P (dP - rowsum(dO * O)) with P = exp(S - lse)), i.e. `block_attention_backward`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from hybridlm.ops.utils import compute_dtype


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's queries to the keys/values of ranks 0..j of `group` (see module doc).

    Args:
        q: `[B, Q, Hq, D]` this rank's queries (after RoPE; positions j Q .. j Q + Q - 1).
        k: `[B, Q, Hkv, D]` this rank's keys; Hq must be a multiple of Hkv (grouped-query attention: query
            head h reads key head h // (Hq / Hkv), as `scaled_dot_product_attention(enable_gqa=True)`).
        v: `[B, Q, Hkv, Dv]` this rank's values.
        group: the context-parallel group; every rank must call with the same shapes.
        scale: the score scale; 1 / sqrt(D) when None.

    Returns:
        `[B, Q, Hq, Dv]` in q's dtype; differentiable in q, k and v (exact backward, see module doc).
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"ring_attention: q, k, v must be [B, T, H, D], got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    if k.shape[:3] != v.shape[:3] or q.shape[:2] != k.shape[:2] or k.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"ring_attention: q [B, T, Hq, D], k [B, T, Hkv, D], v [B, T, Hkv, Dv] must agree, got "
            f"{list(q.shape)}, {list(k.shape)}, {list(v.shape)}"
        )
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"ring_attention: {q.shape[2]} query heads are not a multiple of {k.shape[2]} key/value heads")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _RingAttention.apply(q, k, v, group, scale)


def block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block: q [B, Hkv, G, Q, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv] (compute dtype) ->
    (out [B, Hkv, G, Q, Dv] normalized within the block, lse [B, Hkv, G, Q]). `causal` masks key i > query i
    (the diagonal block, S == Q). The flash kernel's slot (module doc)."""
    scores = _scores(q, k, scale=scale, causal=causal)  # [B, Hkv, G, Q, S]
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hkv, G, Q]; finite: every query sees at least one key
    probs = torch.exp(scores - lse.unsqueeze(-1))
    return probs @ v.unsqueeze(2), lse


def block_attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    *,
    scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's share of the gradients, from the FINAL output's log-sum-exp `lse` [B, Hkv, G, Q] and
    `delta` = rowsum(dout * out) [B, Hkv, G, Q]: P = exp(S - lse) is then this block's slice of the global
    softmax, so dS = P (dP - delta) is exact. -> dq [B, Hkv, G, Q, D], dk [B, Hkv, S, D], dv [B, Hkv, S, Dv]
    (dk, dv summed over the G query heads that share a key head)."""
    scores = _scores(q, k, scale=scale, causal=causal)  # [B, Hkv, G, Q, S]
    probs = torch.exp(scores - lse.unsqueeze(-1))  # masked entries: exp(-inf) = 0
    dv = (probs.transpose(-1, -2) @ dout).sum(2)  # [B, Hkv, S, Dv]
    dprobs = dout @ v.unsqueeze(2).transpose(-1, -2)  # [B, Hkv, G, Q, S]
    dscores = probs * (dprobs - delta.unsqueeze(-1)) * scale
    dq = dscores @ k.unsqueeze(2)  # [B, Hkv, G, Q, D]
    dk = (dscores.transpose(-1, -2) @ q).sum(2)  # [B, Hkv, S, D]
    return dq, dk, dv


def _scores(q: torch.Tensor, k: torch.Tensor, *, scale: float, causal: bool) -> torch.Tensor:
    scores = (q @ k.unsqueeze(2).transpose(-1, -2)) * scale  # [B, Hkv, G, Q, S]
    if causal:
        rows, cols = scores.shape[-2:]
        future = torch.ones(rows, cols, dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def _start_rotation(tensors: list[torch.Tensor], group, rank: int, size: int) -> tuple[list[torch.Tensor], list]:
    """Post: send `tensors` to rank + 1, receive the same shapes from rank - 1 (mod size). -> (buffers, works);
    the buffers hold the previous rank's tensors once every work has been waited on."""
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, group=group, group_peer=(rank + 1) % size) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, group=group, group_peer=(rank - 1) % size) for t in received]
    return received, dist.batch_isend_irecv(ops)


def _finish(works: list) -> None:
    for work in works:
        work.wait()


class _RingAttention(torch.autograd.Function):
    """Grouped layouts inside: q [B, Hkv, G, Q, D]; k, v (and dk, dv) [B, Hkv, Q, D] contiguous, so that the
    blocks that travel are dense buffers of one known shape on every rank."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, scale: float) -> torch.Tensor:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        batch, length, q_heads, _ = q.shape
        kv_heads, dtype = k.shape[2], compute_dtype(q.dtype)
        qg = _group_queries(q, kv_heads).to(dtype)  # [B, Hkv, G, Q, D]
        held = [k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()]  # [B, Hkv, Q, D], sent as is
        out = lse = None
        for step in range(size):
            origin = (rank - step) % size
            incoming, works = _start_rotation(held, group, rank, size) if step < size - 1 else (None, [])
            if origin <= rank:  # a block of later positions (origin > rank) is passed on, not used
                block_out, block_lse = block_attention(
                    qg, held[0].to(dtype), held[1].to(dtype), scale=scale, causal=origin == rank
                )
                out, lse = (block_out, block_lse) if out is None else _merge(out, lse, block_out, block_lse)
            _finish(works)
            held = incoming
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale = group, scale
        return _ungroup(out, batch, length, q_heads).to(q.dtype)  # [B, Q, Hq, Dv]

    @staticmethod
    @once_differentiable
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        kv_heads, dtype = k.shape[2], out.dtype
        qg = _group_queries(q, kv_heads).to(dtype)  # [B, Hkv, G, Q, D]
        dout = _group_queries(dout, kv_heads).to(dtype)  # [B, Hkv, G, Q, Dv]
        delta = (dout * out).sum(-1)  # [B, Hkv, G, Q]
        dq = torch.zeros_like(qg)
        kv = [k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()]  # [B, Hkv, Q, D]
        dkv = [torch.zeros_like(kv[0], dtype=dtype), torch.zeros_like(kv[1], dtype=dtype)]  # travel with kv
        for step in range(size):
            origin = (rank - step) % size
            # K/V move on while this step computes; the accumulators only once this step's share is in.
            incoming_kv, works = _start_rotation(kv, group, rank, size) if step < size - 1 else (None, [])
            if origin <= rank:
                dq_b, dk_b, dv_b = block_attention_backward(
                    qg, kv[0].to(dtype), kv[1].to(dtype), dout, lse, delta, scale=scale, causal=origin == rank
                )
                dq += dq_b
                dkv = [dkv[0] + dk_b, dkv[1] + dv_b]
            if size > 1:  # the last rotation brings every accumulator home
                incoming_dkv, dkv_works = _start_rotation(dkv, group, rank, size)
                _finish(works + dkv_works)
                kv, dkv = incoming_kv, incoming_dkv
        batch, length, q_heads, _ = q.shape
        dq = _ungroup(dq, batch, length, q_heads).to(q.dtype)
        return dq, dkv[0].transpose(1, 2).to(k.dtype), dkv[1].transpose(1, 2).to(v.dtype), None, None


def _group_queries(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, T, Hq, D] -> [B, Hkv, G, T, D] (query head h = i G + g reads key head i)."""
    batch, length, heads, dim = x.shape
    return x.reshape(batch, length, kv_heads, heads // kv_heads, dim).permute(0, 2, 3, 1, 4)


def _ungroup(x: torch.Tensor, batch: int, length: int, heads: int) -> torch.Tensor:
    """[B, Hkv, G, T, D] -> [B, T, Hq, D]."""
    return x.permute(0, 3, 1, 2, 4).reshape(batch, length, heads, x.shape[-1])


def _merge(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online softmax: two partial results (each normalized over its keys) -> the one over both key sets."""
    merged = torch.logaddexp(lse, block_lse)  # [B, Hkv, G, Q]
    out = out * torch.exp(lse - merged).unsqueeze(-1) + block_out * torch.exp(block_lse - merged).unsqueeze(-1)
    return out, merged
