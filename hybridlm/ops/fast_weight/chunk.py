"""Chunk-parallel Falcon fast-weight rules in plain PyTorch (all six rules, differentiable by autograd).

One engine covers the rule table (README.md in this folder derives it). Every rule is a sum of *write
events* e = (s, j): at step s the state decays by gamma_s and receives w_e x_j r_e^T, where j runs over the
step's window (one pair for rules 1/2/1A/2A, the last `window` pairs for 3/3A) and
    w_e = eta_s * [pair j exists] / B_s                      (per value column for rules 2/2A)
    r_e = y_j                        (inner-product rules 1A/2A/3A)
    r_e = y_j - S_{s-1}^T x_j        (regression rules 1/2/3: the residual against the pre-step state)
Inside a chunk with entry state S_0 and chunk-local log decays L_s = sum_{r<=s} log gamma_r:
    S_t = exp(L_t) S_0 + sum_{e: s_e <= t} exp(L_t - L_{s_e}) w_e x_e r_e^T
so the regression residuals solve one unit lower-triangular system (the WY/UT transform, paper Alg. 1/8;
for rule 3 the unknowns are the C x window (step, slot) residuals, the same system on events):
    r_e + sum_{e': s_e' < s_e} exp(L_{s_e - 1} - L_{s_e'}) w_e' (x_e . x_e') r_e' = y_e - exp(L_{s_e - 1}) S_0^T x_e
and the outputs are masked attention over events (paper Alg. 4 for 3A). Decays only ever enter as
exp(L_a - L_b) with a >= b inside one chunk, so nothing overflows (C.6, chunk-local renormalization).
Per-column rules carry a decay per value column: the Gram x_e . x_e' is shared, the systems are per column.

Cost per head: O(T * C * W * (K + V) + T * (C W)^2 V / C) -- linear in T for a fixed chunk and window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridlm.ops.fast_weight.options import FastWeightOptions
from hybridlm.ops.fast_weight.state import FastWeightState
from hybridlm.ops.utils import compute_dtype, host_to_device, packed_to_padded, padded_to_packed, seq_idx_segments

# A document's first step under `seq_idx` (documents restarted in place): this log decay ends every earlier write's
# share of the state (exp(-100) ~ 4e-44, below float32's normal range), while each exponent the chunk forms take,
# exp(L_a - L_b) with a >= b, holds it on both sides (one document: it cancels) or on one (another document: ~0).
RESTART_LOG_DECAY = -100.0
# Per-column decays (rules 2/2A) make every intra-chunk coefficient a [C, C, V] tensor of exponentials rather
# than a matmul, so their chunks are kept short: the work per step grows with C, the chunk loop shrinks.
PER_COLUMN_MAX_CHUNK = 16


@dataclass
class PreparedWrites:
    """The rule-independent form of a call (steps 1-3 below), shared by the chunk and Triton backends.

    Every step t carries its window of write pairs and their weights w = eta_t [pair exists] / B_t; rules without a
    window have one slot. Packed inputs are right-padded into rows (padded steps have no pair: eta = 0, gamma = 1).
    """

    q: torch.Tensor           # [N, T, H, K]
    X: torch.Tensor           # [N, T, H, W, K] write features of the step's window (zeros where no pair; with
                              # seq_idx, another document's pairs stay: their weights are 0)
    Y: torch.Tensor           # [N, T, H, W, V]
    weights: torch.Tensor     # [N, T, H, W, Dv] (Dv = V for rules 2/2A, else 1), in the statistics dtype
    log_gamma: torch.Tensor   # [N, T, H, Dv]
    final: FastWeightState    # the carried last key and sliding tail at each row's end (S is left to the scan)
    # The pairs with the carried tail in front, [N, W-1+T, H, K] / [N, W-1+T, H, V] (X and Y are windows of these
    # views); None for window 1.
    x_ext: torch.Tensor | None = None
    y_ext: torch.Tensor | None = None


def prepare_writes(q, k, v, beta, lam, options: FastWeightOptions, *, initial_state: FastWeightState,
                   offsets: torch.Tensor | None, seq_idx: torch.Tensor | None = None) -> PreparedWrites:
    """Steps 1-3 of the chunk form: write pairs, windows, the statistic E_t, step sizes and log decays.

    q, k, v keep their dtype (the Triton backend runs bf16 operands); the statistic, step sizes, decays and the
    carried pairs are computed in `compute_dtype` (float32, or float64 for float64 inputs).

    seq_idx ([B, T] integers, without offsets) restarts documents in place, wherever it changes from one step to the
    next (the first document continues the carried state): no shifted pair crosses a document start, a window holds
    only its own document's pairs (statistic and weights), and the start's log decay is RESTART_LOG_DECAY (a
    constant: no gradient). Right for a read after the write and, for the regression rules, shifted pairing
    (`options.restarts_in_place`): elsewhere a document's first step would read or fit the last document's state."""
    rule, eps = options.rule, options.eps
    stat = compute_dtype(k.dtype)
    beta, lam = beta.to(stat), lam.to(stat)
    if offsets is not None:
        # Packed sequences run as a right-padded batch: padded steps have no pair (eta = 0, gamma = 1),
        # so they leave the state untouched and the final state is the state at each sequence's end.
        q, k, v, beta, lam = (packed_to_padded(t, offsets) for t in (q, k, v, beta, lam))
        lengths = host_to_device(offsets[1:] - offsets[:-1], q.device)
    else:
        lengths = torch.full((q.shape[0],), q.shape[1], dtype=torch.int64, device=q.device)
    N, T, H, K = k.shape
    V = v.shape[-1]
    W = options.window
    valid = torch.arange(T, device=q.device)[None, :] < lengths[:, None]                # [N, T]
    if seq_idx is not None:  # each step's document, numbered from 0 (the carried state's) in each row
        segment = seq_idx_segments(seq_idx, (N, T))                                        # [N, T]
        restart = F.pad(segment[:, 1:] != segment[:, :-1], (1, 0))                          # [N, T]

    # 1. Write pairs (x_t, y_t) and whether each exists (C.5: a fresh shifted sequence has none at t = 1).
    if options.shifted:
        first = initial_state.last_k if initial_state.last_k is not None else k.new_zeros(N, H, K)
        x = torch.cat([first[:, None].to(k.dtype), k[:, :-1]], dim=1)                      # [N, T, H, K]
        exists = valid.clone()
        if initial_state.last_k is None:
            exists[:, 0] = False
        if seq_idx is not None:
            exists = exists & ~restart
    else:
        x, exists = k, valid
    x = x * exists[:, :, None, None].to(x.dtype)
    y = v * exists[:, :, None, None].to(v.dtype)

    # 2. Each step's window of pairs, reaching into the carried tail (C.7).
    if W > 1:
        tail_x, tail_v, tail_m = _tail(initial_state, N, H, K, V, W, x)
        x_ext = torch.cat([tail_x.to(x.dtype), x], dim=1)                                  # [N, W-1+T, H, K]
        y_ext = torch.cat([tail_v.to(y.dtype), y], dim=1)
        m_ext = torch.cat([tail_m, exists], dim=1)                                         # [N, W-1+T]
        Xw = x_ext.unfold(1, W, 1).movedim(-1, 3)                                          # [N, T, H, W, K]
        Yw = y_ext.unfold(1, W, 1).movedim(-1, 3)                                          # [N, T, H, W, V]
        Mw = m_ext.unfold(1, W, 1)                                                         # [N, T, W]
        if seq_idx is not None:  # the window's pairs of the step's own document (the tail's is document 0)
            segment_ext = F.pad(segment, (W - 1, 0))                                        # [N, W-1+T]
            Mw = Mw & (segment_ext.unfold(1, W, 1) == segment[:, :, None])
    else:
        Xw, Yw, Mw = x[:, :, :, None], y[:, :, :, None], exists[:, :, None]
    Mw = Mw.to(stat)
    count = Mw.sum(-1).clamp(min=1.0)                                                      # B_t  [N, T]

    # 3. The rule's statistic E_t, step sizes eta_t and log decays log gamma_t.
    if rule == "3":
        Xs = Xw.to(stat)
        if seq_idx is not None and W > 1:
            Xs = Xs * Mw[:, :, None, :, None]
        E = _top_eigenvalue(Xs @ Xs.transpose(-1, -2)) / count[:, :, None]                 # mu_t  [N, T, H]
    elif rule == "3A":  # the window's sum of per-pair energies (never a float copy of the [N, T, H, W, K] windows)
        energy = (x_ext if W > 1 else x).to(stat).square().sum(-1)                         # [N, W-1+T, H]
        if W > 1:
            windows = energy.unfold(1, W, 1)                                               # [N, T, H, W]
            if seq_idx is not None:
                windows = windows * Mw[:, :, None, :]
            energy = windows.sum(-1)
        E = energy / count[:, :, None]                                                     # Ebar_t
    else:
        E = x.to(stat).square().sum(-1)                                                    # |x_t|^2
    ridge = lam * E.detach() if options.ridge_scaling else lam                             # [N, T, H]
    active = exists[:, :, None]                                                            # [N, T, 1]
    if options.step_size == "nlms":
        denom = torch.where(active, E + ridge + eps, 1.0)                                  # [N, T, H]
        eta = beta / (denom[..., None] if options.per_column else denom)
    else:
        eta = beta
    if options.per_column:                                                                 # eta [N, T, H, V]
        ridge, active = ridge[..., None], active[..., None]
    eta = torch.where(active, eta, 0.0)
    log_gamma = torch.log1p(-torch.clamp(eta * ridge, max=1.0 - options.eps_gamma))        # log gamma_t
    if not options.per_column:
        eta, log_gamma = eta[..., None], log_gamma[..., None]                              # [N, T, H, Dv]
    if seq_idx is not None:
        log_gamma = torch.where(restart[:, :, None, None], RESTART_LOG_DECAY, log_gamma)
    weights = eta[:, :, :, None, :] * (Mw / count[..., None])[:, :, None, :, None]         # [N, T, H, W, Dv]

    rows = torch.arange(N, device=q.device)
    final = FastWeightState(S=initial_state.S,
                            last_k=k[rows, lengths - 1].to(stat) if options.shifted else None)
    if W > 1:
        index = lengths[:, None] + torch.arange(W - 1, device=q.device)[None, :]           # ext slots [N, W-1]
        final.tail_x = x_ext[rows[:, None], index].transpose(1, 2).to(stat)                # [N, H, W-1, K]
        final.tail_v = y_ext[rows[:, None], index].transpose(1, 2).to(stat)
        final.tail_len = m_ext[rows[:, None], index].sum(-1).to(torch.int64)
    return PreparedWrites(q=q, X=Xw, Y=Yw, weights=weights, log_gamma=log_gamma, final=final,
                          x_ext=x_ext if W > 1 else None, y_ext=y_ext if W > 1 else None)


def fast_weight_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    lam: torch.Tensor,
    options: FastWeightOptions,
    *,
    initial_state: FastWeightState,
    offsets: torch.Tensor | None,
    seq_idx: torch.Tensor | None = None,
) -> tuple[torch.Tensor, FastWeightState]:
    """Same contract as `naive.fast_weight_naive` (inputs validated and cast by the front door); `seq_idx`
    restarts documents in place (`prepare_writes`)."""
    p = prepare_writes(q, k, v, beta, lam, options, initial_state=initial_state, offsets=offsets, seq_idx=seq_idx)
    # 4. The chunk scan, head-major.
    chunk_size = options.chunk_size
    if options.per_column:
        chunk_size = min(chunk_size, PER_COLUMN_MAX_CHUNK)
    o, S = _chunk_scan(
        p.q.transpose(1, 2), p.X.transpose(1, 2), p.Y.transpose(1, 2), p.weights.transpose(1, 2),
        p.log_gamma.transpose(1, 2), initial_state.S,
        regression=options.regression, read_after=options.read_after, chunk_size=chunk_size,
        wide_exponents=seq_idx is not None,
    )
    o = o.transpose(1, 2)                                                                  # [N, T, H, V]
    if offsets is not None:
        o = padded_to_packed(o, offsets)
    p.final.S = S
    return o, p.final


def _tail(state: FastWeightState, N, H, K, V, W, like):
    """The carried tail as time-major prefixes [N, W-1, H, *] and its existence mask [N, W-1]."""
    if state.tail_x is None:
        return like.new_zeros(N, W - 1, H, K), like.new_zeros(N, W - 1, H, V), torch.zeros(
            N, W - 1, dtype=torch.bool, device=like.device
        )
    slots = torch.arange(W - 1, device=like.device)[None, :]
    mask = slots >= (W - 1 - state.tail_len.to(like.device))[:, None]
    tail_x = state.tail_x.transpose(1, 2) * mask[:, :, None, None]
    tail_v = state.tail_v.transpose(1, 2) * mask[:, :, None, None]
    return tail_x, tail_v, mask


def _pad_steps(t: torch.Tensor, pad: int, dims_after: int) -> torch.Tensor:
    """`pad` zero steps at the end of the time dim, which `dims_after` dims follow; `t` itself when pad is 0 (under
    dynamic shapes a traced zero pad of a transposed tensor was taken as contiguous and viewed: a runtime error)."""
    return F.pad(t, (0, 0) * dims_after + (0, pad)) if pad else t


def _chunk_scan(q, X, Y, w, log_gamma, S, *, regression, read_after, chunk_size, wide_exponents=False):
    """The event scan. q [N, H, T, K]; X [N, H, T, W, K]; Y [N, H, T, W, V]; w [N, H, T, W, Dv];
    log_gamma [N, H, T, Dv]; S [N, H, K, V] the entry state. Returns o [N, H, T, V] and the final state.
    `wide_exponents`: the chunk-local log decays and their differences in float64 (documents restarted in place
    put -100 per restart into them, which float32 would round at that magnitude); the exponentials come back in
    the scan's dtype.

    Three phases: everything that does not depend on the carried state is computed for all chunks at once
    (decays, Gram and attention matrices, and for scalar-decay regression the WY factors U, W with
    r = U - W S_in); only the state passing S_in -> S_out runs as a loop over chunks; the outputs are then
    computed for all chunks at once from the recorded entry states.
    """
    N, H, T, W, K = X.shape
    V = Y.shape[-1]
    Dv = w.shape[-1]
    C = min(chunk_size, T)
    n_chunks = -(-T // C)
    pad = n_chunks * C - T  # padded steps write nothing (w = 0) and do not decay (log gamma = 0)
    n = C * W                                                                              # events per chunk
    Qc = _pad_steps(q, pad, 1).reshape(N, H, n_chunks, C, K)
    Xc = _pad_steps(X, pad, 2).reshape(N, H, n_chunks, n, K)                                # [N, H, c, n, K]
    Yc = _pad_steps(Y, pad, 2).reshape(N, H, n_chunks, n, V)
    wc = _pad_steps(w, pad, 2).reshape(N, H, n_chunks, n, Dv)
    lg = _pad_steps(log_gamma, pad, 1).reshape(N, H, n_chunks, C, Dv)
    dtype = lg.dtype
    if wide_exponents:
        lg = lg.to(torch.float64)
    L = torch.cumsum(lg, dim=3)                                                            # log c_t (chunk-local)
    L_prev = L - lg                                                                        # log c_{t-1}
    step = torch.arange(C, device=q.device).repeat_interleave(W)                           # s_e  [n]
    L_event = L[:, :, :, step]                                                             # [N, H, c, n, Dv]
    carry = torch.exp(L[:, :, :, -1]).to(dtype)                                            # chunk decay [N, H, c, Dv]
    coef = torch.exp(L[:, :, :, -1:] - L_event).to(dtype) * wc                             # to the chunk end

    # Phase 1: the regression residuals' triangular systems (r + A r = y - exp(L_{s-1}) X S_in).
    if regression:
        L_event_prev = L_prev[:, :, :, step]
        earlier = (step[:, None] > step[None, :])[:, :, None]                              # s_e' < s_e  [n, n, 1]
        decay = _masked_exp(L_event_prev[..., :, None, :] - L_event[..., None, :, :], earlier).to(dtype)
        A = (decay * wc[..., None, :, :] * (Xc @ Xc.transpose(-1, -2))[..., None]).movedim(-1, 3)  # [N,H,c,Dv,n,n]
        start = torch.exp(L_event_prev).to(dtype)                                          # [N, H, c, n, Dv]
        if Dv == 1:  # WY form: r = U - W S_in with U = (I + A)^-1 Y, W = (I + A)^-1 diag(start) X
            U = _solve_unit_lower(A, Yc)
            W_wy = _solve_unit_lower(A, start * Xc)

    # Phase 2: pass the state through the chunks.
    entry_states, residuals = [], []
    for c in range(n_chunks):
        entry_states.append(S)
        if not regression:
            R = Yc[:, :, c]
        elif Dv == 1:
            R = U[:, :, c] - W_wy[:, :, c] @ S
        else:  # per-column systems: one solve per chunk with this chunk's entry state
            R = _solve_unit_lower(A[:, :, c], Yc[:, :, c] - start[:, :, c] * (Xc[:, :, c] @ S))
        residuals.append(R)
        S = carry[:, :, c, None, :] * S + Xc[:, :, c].transpose(-1, -2) @ (coef[:, :, c] * R)
    S_in = torch.stack(entry_states, dim=2)                                                # [N, H, c, K, V]
    R = torch.stack(residuals, dim=2) if regression else Yc                                # [N, H, c, n, V]

    # Phase 3: outputs, o_t = exp(L_t) S_in^T q_t + sum_{e: s_e <= t} exp(L_t - L_{s_e}) w_e (q_t . x_e) r_e.
    L_read = L if read_after else L_prev
    t_idx = torch.arange(C, device=q.device)
    seen = (step[None, :] <= t_idx[:, None]) if read_after else (step[None, :] < t_idx[:, None])
    D = _masked_exp(L_read[..., :, None, :] - L_event[..., None, :, :], seen[:, :, None]).to(dtype)
    D = D * wc[..., None, :, :]
    P = Qc @ Xc.transpose(-1, -2)                                                          # q_t . x_e  [N,H,c,C,n]
    o = torch.exp(L_read).to(dtype) * (Qc @ S_in)
    if Dv == 1:
        o = o + (P * D[..., 0]) @ R
    else:
        o = o + torch.einsum("...te,...tev,...ev->...tv", P, D, R)
    return o.reshape(N, H, n_chunks * C, V)[:, :, :T], S


def _top_eigenvalue(gram: torch.Tensor, slice_size: int = 1 << 15) -> torch.Tensor:
    """lambda_max of a batch of small symmetric matrices [..., W, W] -> [...].

    cuSOLVER's batched eigensolver fails on very large batches, so the batch runs in slices."""
    flat = gram.reshape(-1, *gram.shape[-2:])
    top = [torch.linalg.eigvalsh(part)[:, -1] for part in flat.split(slice_size)]
    return torch.cat(top).reshape(gram.shape[:-2])


def _masked_exp(exponent: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """exp(exponent) where mask, else 0; the masked entries are never exponentiated (they may be positive)."""
    return torch.exp(torch.where(mask, exponent, float("-inf")))


def _solve_unit_lower(A: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """Solve (I + A) R = rhs for strictly lower-triangular A [..., Dv, n, n]; rhs and R are [..., n, M].

    Dv == 1: one system with M right-hand sides. Dv == M: one system per column."""
    if A.shape[-3] == 1:
        return torch.linalg.solve_triangular(A[..., 0, :, :], rhs, upper=False, unitriangular=True)
    solved = torch.linalg.solve_triangular(A, rhs.transpose(-1, -2)[..., None], upper=False, unitriangular=True)
    return solved[..., 0].transpose(-1, -2)
