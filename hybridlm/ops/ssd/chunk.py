"""Mamba-2 SSD, chunked: the state-space dual form in plain torch (no loop over time steps).

Time is cut into chunks of L steps. Inside a chunk the recurrence is unrolled into a masked,
decayed attention-like product (quadratic in L); across chunks only the [P, N] state is carried,
by a short loop over chunks. With the per-step log decay l_t = dt_t * A (<= 0) and its inclusive
cumulative sum c_i inside the chunk (c_{-1} = 0), for steps i, j of one chunk and its entering
state h_in:

    y_i = sum_{j <= i} exp(c_i - c_j) (C_i . B_j) dt_j x_j   +   exp(c_i) h_in C_i   (+ D x_i)
    h_out = exp(c_{L-1}) h_in + sum_j exp(c_{L-1} - c_j) dt_j x_j B_j^T

Every exponent is <= 0 (the non-causal entries are set to -inf before the exp), so nothing
overflows and the gradients stay finite. The math with shapes: README.md beside this file.
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return `(y [b, T, H, P], final_state [b or N_seq, H, P, N])`, both in the inputs' dtype.

    With `offsets` (checked `cu_seqlens`, b == 1) the packed sequences are right-padded into a batch:
    padded steps have dt = 0, so they are exact no-ops (decay 1, no write) and each row's state after
    the padding is the sequence's final state.
    """
    if offsets is None:
        return _chunk_scan(x, dt, A, B, C, D, chunk_size, initial_state)
    pad = lambda t: packed_to_padded(t, offsets)  # noqa: E731  [1, total, ...] -> [N_seq, max_len, ...]
    y, final_state = _chunk_scan(pad(x), pad(dt), A, pad(B), pad(C), D, chunk_size, initial_state)
    return padded_to_packed(y, offsets), final_state


def _chunk_scan(x, dt, A, B, C, D, L, h0):
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

    # 1. Log decays and their cumulative sums inside each chunk: c_i = sum_{k <= i} dt_k A.
    cum = torch.cumsum(dtc * A.view(G, R, 1), dim=-1)  # [b, c, G, R, L]

    # 2. Intra-chunk (diagonal blocks): y_i += sum_{j <= i} exp(c_i - c_j) (C_i . B_j) dt_j x_j.
    causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
    segsum = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf"))  # [b, c, G, R, L, L]
    CB = torch.einsum("bcign,bcjgn->bcgij", Cc, Bc)  # [b, c, G, L, L]
    scores = CB[:, :, :, None] * torch.exp(segsum) * dtc[..., None, :]  # [b, c, G, R, L, L]
    y = torch.einsum("bcgrij,bcjgrp->bcigrp", scores, xc)  # [b, c, L, G, R, P]

    # 3. Chunk states (what each chunk writes, decayed to its end): sum_j exp(c_{L-1} - c_j) dt_j x_j B_j^T.
    to_end = torch.exp(cum[..., -1:] - cum) * dtc  # [b, c, G, R, L]
    writes = torch.einsum("bcgrj,bcjgrp,bcjgn->bcgrpn", to_end, xc, Bc)  # [b, c, G, R, P, N]

    # 4. Inter-chunk recurrence: h_in[c + 1] = exp(c_{L-1}) h_in[c] + writes[c], from h_in[0] = h0.
    chunk_decay = torch.exp(cum[..., -1])[..., None, None]  # [b, c, G, R, 1, 1]
    h = h0.reshape(b, G, R, P, N)  # [b, G, R, P, N]
    states_in = []
    for c in range(n_chunks):
        states_in.append(h)
        h = chunk_decay[:, c] * h + writes[:, c]
    h_in = torch.stack(states_in, dim=1) if states_in else writes  # [b, c, G, R, P, N]

    # 5. State to output (off-diagonal blocks): y_i += exp(c_i) h_in C_i.
    y = y + torch.einsum("bcign,bcgrpn,bcgri->bcigrp", Cc, h_in, torch.exp(cum))

    y = y.reshape(b, n_chunks * L, H, P)[:, :T]  # [b, T, H, P]
    if D is not None:
        y = y + D[:, None] * x
    return y, h.reshape(b, H, P, N)
