"""Mamba-2 SSD, chunked: the state-space dual form in plain torch (no loop over time steps).

Time is cut into chunks of L steps. Inside a chunk the recurrence is unrolled into a masked,
decayed attention-like product (quadratic in L); across chunks only the [P, N] state is carried,
by a short loop over chunks (under torch.compile its closed form, `inter_chunk`). With the per-step
log decay l_t = dt_t * A (<= 0) and its inclusive cumulative sum c_i inside the chunk (c_{-1} = 0),
for steps i, j of one chunk and its entering state h_in:

    y_i = sum_{j <= i} exp(c_i - c_j) (C_i . B_j) dt_j x_j   +   exp(c_i) h_in C_i   (+ D x_i)
    h_out = exp(c_{L-1}) h_in + sum_j exp(c_{L-1} - c_j) dt_j x_j B_j^T

The in-chunk exponents c_i - c_j are summed as l_{j+1} + ... + l_i (`_segsum`), never as a difference of the
prefix sums, which would lose eps |c_i| to cancellation. Every exponent is <= 0 (the non-causal ones are 0 and their
terms masked through C_i . B_j), so nothing overflows and the gradients stay finite. The math with shapes:
README.md beside this file.
Inputs reach this function already checked and cast to the compute dtype by `hybridlm.ops.ssd.ssd`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridlm.ops.utils import packed_to_padded, padded_to_packed


def chunk_ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    D: torch.Tensor | None,
    chunk_size: int,
    initial_state: torch.Tensor,
    offsets: torch.Tensor | None,
    segments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return `(y [b, T, H, P], final_state [b or N_seq, H, P, N])`, both in the inputs' dtype.

    With `offsets` (checked `cu_seqlens`, b == 1) the packed sequences are right-padded into a batch:
    padded steps have dt = 0, so they are exact no-ops (decay 1, no write) and each row's state after
    the padding is the sequence's final state. With `segments` ([b, T] int64, 0 at the first step, +1 at every
    restart; `hybridlm.ops.ssd.ssd`'s `seq_idx`) the state restarts from zero where the segment changes: the
    decays across a restart are masked to zero, and every shape stays that of the rows.
    """
    if offsets is None:
        return _chunk_scan(x, dt, A, B, C, D, chunk_size, initial_state, segments)
    pad = lambda t: packed_to_padded(t, offsets)  # noqa: E731  [1, total, ...] -> [N_seq, max_len, ...]
    y, final_state = _chunk_scan(pad(x), pad(dt), A, pad(B), pad(C), D, chunk_size, initial_state, None)
    return padded_to_packed(y, offsets), final_state


def _chunk_scan(x, dt, A, B, C, D, L, h0, segments):
    b, T, H, P = x.shape
    G, N = B.shape[2:]
    R = H // G  # heads per group: head h = g * R + r reads group g
    n_chunks = -(-T // L)
    pad = n_chunks * L - T
    # Right-pad time to whole chunks with dt = 0: the padded steps leave the state unchanged.
    xc = F.pad(x, (0, 0, 0, 0, 0, pad)).view(b, n_chunks, L, G, R, P)  # [b, c, L, G, R, P]
    Bc = F.pad(B, (0, 0, 0, 0, 0, pad)).view(b, n_chunks, L, G, N)  # [b, c, L, G, N]
    Cc = F.pad(C, (0, 0, 0, 0, 0, pad)).view(b, n_chunks, L, G, N)  # [b, c, L, G, N]
    dtc = F.pad(dt, (0, 0, 0, pad)).view(b, n_chunks, L, G, R).permute(0, 1, 3, 4, 2)  # [b, c, G, R, L]

    # 0. Restarts (segments): which pairs of steps share a segment. The padding continues the last segment.
    #    same[i, j]: steps i, j of a chunk in one segment; to_end[j]: j in the segment the chunk ends in;
    #    from_start[i]: i in the segment that entered the chunk; through[c]: chunk c has no restart at all.
    same = to_end_kept = from_start = through = None
    if segments is not None:
        steps = torch.arange(n_chunks * L, device=segments.device)  # (no branch on the padding's size: with a
        seg = torch.where(steps < T, F.pad(segments, (0, pad)), segments[:, -1:])  # dynamic T, a guard per value)
        seg = seg.view(b, n_chunks, L)  # [b, c, L]
        entering = torch.cat([seg[:, :1, 0], seg[:, :-1, -1]], dim=1)  # [b, c]: the step before each chunk
        same = (seg[..., :, None] == seg[..., None, :])[:, :, None]  # [b, c, 1, L, L]
        to_end_kept = (seg == seg[..., -1:])[:, :, None, None]  # [b, c, 1, 1, L]
        from_start = (seg == entering[..., None])[:, :, None, None]  # [b, c, 1, 1, L]
        through = seg[..., -1] == entering  # [b, c]

    # 1. Log decays l_i = dt_i A, their cumulative sums inside each chunk c_i = l_0 + ... + l_i, and the segment sums
    #    S[i, j] = c_i - c_j = l_{j+1} + ... + l_i (j < i) summed as such (`_segsum`): as a difference of prefix sums
    #    it would lose eps |c_i| to cancellation, 1e-3 relative in float32 once strong decays make |c| ~ 1e4.
    log_a = dtc * A.view(G, R, 1)  # [b, c, G, R, L]
    cum = torch.cumsum(log_a, dim=-1)  # [b, c, G, R, L]
    segsum = _segsum(log_a, masked=False)  # [b, c, G, R, L, L]; 0 (not -inf) for j >= i: masked through CB below

    # 2. Intra-chunk (diagonal blocks): y_i += sum_{j <= i} exp(S[i, j]) (C_i . B_j) dt_j x_j. The causal (and
    #    segment) mask zeroes C_i . B_j, R times smaller than exp(S); exp(S) is 1 above the diagonal, never inf.
    keep = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
    if same is not None:
        keep = keep & same  # [b, c, 1, L, L]
    CB = torch.einsum("bcign,bcjgn->bcgij", Cc, Bc).masked_fill(~keep, 0)  # [b, c, G, L, L]
    scores = CB[:, :, :, None] * torch.exp(segsum) * dtc[..., None, :]  # [b, c, G, R, L, L]
    y = torch.einsum("bcgrij,bcjgrp->bcigrp", scores, xc)  # [b, c, L, G, R, P]

    # 3. Chunk states (what each chunk writes, decayed to its end): sum_j exp(S[L-1, j]) dt_j x_j B_j^T.
    to_end = torch.exp(segsum[..., -1, :]) * dtc  # [b, c, G, R, L]
    if to_end_kept is not None:
        to_end = to_end * to_end_kept
    writes = torch.einsum("bcgrj,bcjgrp,bcjgn->bcgrpn", to_end, xc, Bc)  # [b, c, G, R, P, N]

    # 4. Inter-chunk recurrence: h_in[c + 1] = exp(ld_c) h_in[c] + writes[c], from h_in[0] = h0, with ld_c the
    #    chunk's log decay (-inf for a chunk with a restart: nothing passes through it).
    log_decay = cum[..., -1]  # [b, c, G, R]
    if through is not None:
        log_decay = log_decay.masked_fill(~through[..., None, None], float("-inf"))
    states = inter_chunk(log_decay, writes, h0.reshape(b, G, R, P, N), closed_form=torch.compiler.is_compiling())
    h_in, h = states[:, :-1], states[:, -1]  # entering each chunk [b, c, G, R, P, N]; after the last

    # 5. State to output (off-diagonal blocks): y_i += exp(c_i) h_in C_i.
    from_entry = torch.exp(cum)  # [b, c, G, R, L]
    if from_start is not None:
        from_entry = from_entry * from_start
    y = y + torch.einsum("bcign,bcgrpn,bcgri->bcigrp", Cc, h_in, from_entry)

    y = y.reshape(b, n_chunks * L, H, P)[:, :T]  # [b, T, H, P]
    if D is not None:
        y = y + D[:, None] * x
    return y, h.reshape(b, H, P, N)


def inter_chunk(log_decay: torch.Tensor, writes: torch.Tensor, h0: torch.Tensor, *, closed_form: bool) -> torch.Tensor:
    """The states entering every chunk and the final one, [b, c + 1, G, R, P, N], from the chunks' log decays
    [b, c, G, R], their writes [b, c, G, R, P, N] and h0 [b, G, R, P, N].

    Two forms of one recurrence. Eagerly a loop over chunks (linear in their number). Under torch.compile the closed
    form h_in[z] = sum_{k < z} exp(ld_{k+1} + ... + ld_{z-1}) writes[k] + exp(ld_0 + ... + ld_{z-1}) h0: one product
    over pairs of chunks (quadratic in their number, a few GFLOP at T = 16K), whose graph stays short at any length
    where the loop's unrolls into one step per chunk."""
    if not closed_form:
        h, states = h0, [h0]
        for c in range(writes.shape[1]):
            h = torch.exp(log_decay[:, c])[..., None, None] * h + writes[:, c]
            states.append(h)
        return torch.stack(states, dim=1)
    carry = torch.exp(_segsum(F.pad(log_decay.permute(0, 2, 3, 1), (1, 0))))  # [b, G, R, c + 1, c + 1]
    states = torch.cat([h0[:, None], writes], dim=1)  # [b, c + 1, G, R, P, N]
    return torch.einsum("bgrzc,bcgrpn->bzgrpn", carry, states)


def _segsum(v: torch.Tensor, *, masked: bool = True) -> torch.Tensor:
    """v [..., n] -> [..., n, n]: out[z, c] = v[c+1] + ... + v[z] for c <= z (0 on the diagonal); above it -inf,
    or 0 with `masked=False` (for a caller that masks exp(out) itself).
    Summed as masked cumulative sums, never as differences of prefix sums: each entry is a sum of terms of one sign
    (no cancellation, exact to a few eps of itself), and an entry of -inf (a decay of zero) stays -inf in every sum
    it enters and yields no inf - inf. (Computed transposed, out[c, z], so that the sum runs over the contiguous
    last dim; the result is a transposed view.)"""
    n = v.shape[-1]
    after = torch.ones(n, n, dtype=torch.bool, device=v.device).triu(1)  # [c, k]: k > c
    terms = v[..., None, :].expand(*v.shape[:-1], n, n).masked_fill(~after, 0)  # terms[c, k] = v[k] for k > c
    sums = torch.cumsum(terms, dim=-1).transpose(-1, -2)  # sums[z, c] = sum_{c < k <= z} v[k] (0 for z <= c)
    if not masked:
        return sums
    return sums.masked_fill(~after.T.logical_or(torch.eye(n, dtype=torch.bool, device=v.device)), float("-inf"))
