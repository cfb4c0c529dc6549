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

Block math, tiled over the queries (`tile` rows; default `default_tile`: one [B, Hq, tile, S] float32 score
tile within `TILE_BYTES` = 256 MiB):
    the grouped queries of one key/value head, [B, Hkv, G, Q, D], are cut into query tiles of t <= tile rows and
    each tile is flattened to [B, Hkv, G t, D], so that the G query heads sharing a key head read K/V with one
    plain batched matmul (K/V are never repeated per query head). Per tile, against the block's S keys:
        forward   s = q_t k^T scale [B, Hkv, G t, S]; m = rowmax s; p = exp(s - m); l = rowsum p;
                  out_t = (p v) / l, lse_t = m + log l   (each query tile sees every key: no merge needed inside
                  a block; blocks merge by the rule above)
        backward  p = exp(s - lse) with the FINAL lse; dv += p^T do_t; dp = do_t v^T;
                  ds = p (dp - delta_t) scale with delta = rowsum(do * out) of the FINAL out;
                  dq_t = ds k; dk += ds^T q_t
    On the diagonal block (o == j, S == Q) query tile [r0, r1) reads only keys [0, r1): the keys after the tile
    are future for every one of its queries and are skipped, the keys [0, r0) are past for all of them and need
    no mask, and only the square [r0, r1) x [r0, r1) is masked (key > query). So the diagonal block costs about
    half the FLOPs of a full one. The score tensor is the only O(S) per-query intermediate: forward keeps one
    tile of it live (exp and the normalisation run in place), backward two (p and dp -> ds in place).
    Accumulation is float32 (float64 stays float64) whatever the input dtype (bf16 inputs are upcast per
    block), so that it also runs on the CPU.

Memory per rank: the forward saves q, k, v, the output (float32) and the log-sum-exp [B, Hq, Q] only, O(Q),
never the other ranks' keys (an all-gather would hold O(J Q)). Live during a step: two K/V blocks (the one
being used and the one arriving), a float32 copy of the block in use, the block's partial output, and one or
two score tiles: O(B Hq tile S) = O(tile x Q) per head instead of the O(Q^2) of an untiled block. In backward
two (K, V, dK, dV) blocks plus dQ. The price is recomputing the block scores in backward and sending every
K/V block around the ring twice (forward and backward) plus the dK/dV accumulators once (float32).

Causal load balance is not addressed: rank j computes j + 1 blocks, so rank J-1 does J times rank 0's work
(a zigzag/striped assignment of positions to ranks would even it out; not done). The ring also passes the
wrapped blocks nobody needs, so that every step is the same send-to-next / receive-from-previous exchange on
every rank (the pattern NCCL batches without deadlock).

A fused CUDA kernel would replace `block_attention` / `block_attention_backward` one block at a time, with the
ring, the merge (`_merge`, float32) and the saved out / lse unchanged. Not implemented: the calls below
follow the op schemas of torch 2.13, and a kernel plugged in must be tested on the GPU against this module's
torch path. Layouts [B, H, T, D]: q_b = this rank's queries [B, Hq, Q, D]
and k_b, v_b = the held block [B, Hkv, S, D] (bf16), do_b = dout [B, Hq, Q, Dv]; causal = (o == j) (the
kernels' top-left causal alignment is right: S == Q on the diagonal); scale as here.
    flash (needs Dv == D, D <= 256, fp16/bf16; takes Hkv < Hq key heads like SDPA's enable_gqa flash path, else
    expand k_b, v_b with repeat_interleave(G, dim=1) and sum dk_b, dv_b over the G copies):
        out_b, lse_b, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q_b, k_b, v_b, 0.0, causal, False, scale=scale)
        -> out_b [B, Hq, Q, D] in q's dtype (merge out_b.float()), lse_b [B, Hq, Q] float32, natural log.
        dq_b, dk_b, dv_b = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            do_b, q_b, k_b, v_b, out, lse, cum_q, cum_k, Q, S, 0.0, causal, seed, offset, scale=scale)
        with out = the FINAL merged output (in q's dtype, [B, Hq, Q, D]) and lse = the FINAL log-sum-exp
        ([B, Hq, Q] float32) saved by the forward, NOT the block's own: the kernel forms P = exp(S - lse) and
        delta = rowsum(do * out) from them, so it returns exactly this block's share, like
        `block_attention_backward`. cum_q / cum_k / seed / offset: empty tensors for a dense batch without
        dropout (or the forward's returns, if kept). Accumulate dq_b, dk_b, dv_b in float32 as here.
    memory-efficient (also for Dv != D; no GQA: expand K/V as above):
        out_b, lse_b, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
            q_b, k_b, v_b, None, True, 0.0, causal, scale=scale)       # compute_log_sumexp=True
        dq_b, dk_b, dv_b, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            do_b, q_b, k_b, v_b, bias, out, lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale)
        lse_b comes padded along the queries (to a multiple of 32 in the CUDA kernel): merge lse_b[..., :Q] and
        pad the final lse the same way for the backward; `bias` is the schema's non-optional attn_bias (no bias:
        an undefined/empty tensor, as autograd passes it).
    Either kernel tiles internally (SRAM tiles, O(Q D) memory per head), which is what `tile` emulates here.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from hybridlm.ops.utils import compute_dtype

TILE_BYTES = 256 * 2**20  # the default tile's budget: one [B, Hq, tile, S] float32 score tile
MIN_TILE = 16  # the default tile never goes below this many rows (tiny tiles would be all overhead)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    scale: float | None = None,
    tile: int | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's queries to the keys/values of ranks 0..j of `group` (see module doc).

    Args:
        q: `[B, Q, Hq, D]` this rank's queries (after RoPE; positions j Q .. j Q + Q - 1).
        k: `[B, Q, Hkv, D]` this rank's keys; Hq must be a multiple of Hkv (grouped-query attention: query
            head h reads key head h // (Hq / Hkv), as `scaled_dot_product_attention(enable_gqa=True)`).
        v: `[B, Q, Hkv, Dv]` this rank's values.
        group: the context-parallel group; every rank must call with the same shapes. None: the default group,
            or, when no process group is initialized, one rank (plain causal attention in this process).
        scale: the score scale; 1 / sqrt(D) when None.
        tile: query rows per tile of the block math (module doc); None: `default_tile` (Q or fewer).

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
    if tile is not None and tile < 1:
        raise ValueError(f"ring_attention: tile must be a positive number of rows, got {tile}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    tile = default_tile(q.shape[0], q.shape[2], q.shape[1]) if tile is None else int(tile)
    return _RingAttention.apply(q, k, v, group, scale, tile)


def default_tile(batch: int, q_heads: int, keys: int, *, budget: int = TILE_BYTES) -> int:
    """Query rows per tile such that one float32 score tile [batch, q_heads, tile, keys] fits in `budget` bytes
    (at least `MIN_TILE` rows). E.g. 16 heads over 16K keys: 256 rows; 8 heads (tp=2) over 16K keys (cp=2):
    512; 16 heads over 4K keys (cp=8): 1024."""
    return max(MIN_TILE, budget // (4 * batch * q_heads * keys))


def block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool, tile: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block: q [B, Hkv, G, Q, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv] (compute dtype) ->
    (out [B, Hkv, G, Q, Dv] normalized within the block, lse [B, Hkv, G, Q]), `tile` query rows at a time (None:
    all Q at once). `causal` masks key i > query i (the diagonal block, S == Q). The flash kernel's slot."""
    batch, kv_heads, group, length, _ = q.shape
    out = q.new_empty(batch, kv_heads, group, length, v.shape[-1])
    lse = q.new_empty(batch, kv_heads, group, length)
    for start, stop, keys in _tiles(length, k.shape[2], tile, causal):
        rows = stop - start
        scores = _tile_scores(q, k, start, stop, keys, scale=scale, causal=causal)  # [B, Hkv, G t, keys]
        peak = scores.amax(-1, keepdim=True)  # finite: every query sees at least one key
        probs = scores.sub_(peak).exp_()  # unnormalized, in place
        total = probs.sum(-1, keepdim=True)
        tile_out = (probs @ v[:, :, :keys]).div_(total)  # [B, Hkv, G t, Dv]
        out[:, :, :, start:stop] = tile_out.view(batch, kv_heads, group, rows, -1)
        lse[:, :, :, start:stop] = (peak + total.log()).view(batch, kv_heads, group, rows)
    return out, lse


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
    tile: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's share of the gradients, from the FINAL output's log-sum-exp `lse` [B, Hkv, G, Q] and
    `delta` = rowsum(dout * out) [B, Hkv, G, Q]: P = exp(S - lse) is then this block's slice of the global
    softmax, so dS = P (dP - delta) is exact. -> dq [B, Hkv, G, Q, D], dk [B, Hkv, S, D], dv [B, Hkv, S, Dv]
    (dk, dv summed over the G query heads that share a key head); `tile` query rows at a time (None: all)."""
    batch, kv_heads, group, length, _ = q.shape
    dq = torch.empty_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for start, stop, keys in _tiles(length, k.shape[2], tile, causal):
        rows = stop - start
        probs = _tile_scores(q, k, start, stop, keys, scale=scale, causal=causal)  # [B, Hkv, G t, keys]
        probs.sub_(_tile_rows(lse, start, stop).unsqueeze(-1)).exp_()  # masked entries: exp(-inf) = 0
        dout_t = _tile_rows(dout, start, stop)  # [B, Hkv, G t, Dv]
        dv[:, :, :keys] += probs.transpose(-1, -2) @ dout_t  # summed over the G t rows
        dscores = dout_t @ v[:, :, :keys].transpose(-1, -2)  # dP [B, Hkv, G t, keys]
        dscores.sub_(_tile_rows(delta, start, stop).unsqueeze(-1)).mul_(probs).mul_(scale)  # dS (scaled)
        del probs
        dq[:, :, :, start:stop] = (dscores @ k[:, :, :keys]).view(batch, kv_heads, group, rows, -1)
        dk[:, :, :keys] += dscores.transpose(-1, -2) @ _tile_rows(q, start, stop)
    return dq, dk, dv


def _tiles(length: int, keys: int, tile: int | None, causal: bool):
    """(start, stop, keys read) of each query tile: on the diagonal block the keys after the tile are skipped."""
    tile = length if tile is None else max(1, min(tile, length))
    for start in range(0, length, tile):
        stop = min(start + tile, length)
        yield start, stop, stop if causal else keys


def _tile_rows(x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Query rows [start, stop) of a grouped [B, Hkv, G, Q, ...] tensor, flattened to [B, Hkv, G t, ...]."""
    return x[:, :, :, start:stop].flatten(2, 3)


def _tile_scores(
    q: torch.Tensor, k: torch.Tensor, start: int, stop: int, keys: int, *, scale: float, causal: bool
) -> torch.Tensor:
    """Scaled scores of query rows [start, stop) against keys [0, keys): [B, Hkv, G t, keys]; with `causal` the
    keys after each query are -inf (only the square [start, stop) x [start, stop) can hold such keys)."""
    scores = (_tile_rows(q, start, stop) @ k[:, :, :keys].transpose(-1, -2)).mul_(scale)
    if causal:
        rows = stop - start
        future = torch.ones(rows, rows, dtype=torch.bool, device=scores.device).triu(1)  # key > query
        square = scores.unflatten(2, (q.shape[2], rows))[..., start:stop]  # [B, Hkv, G, t, t], a view
        square.masked_fill_(future, float("-inf"))
    return scores


def _rank_and_size(group) -> tuple[int, int]:
    """This rank and the ring's size; one rank when no process group exists (group None, nothing initialized)."""
    if group is None and not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


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
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, scale: float, tile: int) -> torch.Tensor:
        rank, size = _rank_and_size(group)
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
                    qg, held[0].to(dtype), held[1].to(dtype), scale=scale, causal=origin == rank, tile=tile
                )
                out, lse = (block_out, block_lse) if out is None else _merge(out, lse, block_out, block_lse)
            _finish(works)
            held = incoming
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale, ctx.tile = group, scale, tile
        return _ungroup(out, batch, length, q_heads).to(q.dtype)  # [B, Q, Hq, Dv]

    @staticmethod
    @once_differentiable
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale, tile = ctx.group, ctx.scale, ctx.tile
        rank, size = _rank_and_size(group)
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
                    qg, kv[0].to(dtype), kv[1].to(dtype), dout, lse, delta, scale=scale, causal=origin == rank,
                    tile=tile,
                )
                dq += dq_b
                dkv = [dkv[0] + dk_b, dkv[1] + dv_b]
            if size > 1:  # the last rotation brings every accumulator home
                incoming_dkv, dkv_works = _start_rotation(dkv, group, rank, size)
                _finish(works + dkv_works)
                kv, dkv = incoming_kv, incoming_dkv
        batch, length, q_heads, _ = q.shape
        dq = _ungroup(dq, batch, length, q_heads).to(q.dtype)
        return dq, dkv[0].transpose(1, 2).to(k.dtype), dkv[1].transpose(1, 2).to(v.dtype), None, None, None


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
