"""The op's backend contract on the Triton kernels: raw (q, k, v, beta, lam) -> prepared writes -> kernels.

Same contract as `chunk.fast_weight_chunk` (inputs validated by the front door), for the rules and options of
`limits.supports(...)`: rules 1A and 1 (window 1), 2A and 2 (decays and step sizes per value column, chunks of 16),
rule 3A on 1A's kernels plus a band kernel and rule 3 as 1 over write events. Unlike the torch backends it keeps
q, k, v in their dtype (bf16/fp16 run on tensor cores); the statistic E_t, the step sizes and the log decays are in
float32.

Rule 3A (window W > 1) as delayed writes (README.md, "Rule 3A as delayed writes"; `_delayed_window`): one 1A scan
in which each pair enters the state once, with the sum of all its W writes, plus a band kernel for the W-1 pairs
still being written when a step reads.

Rule 3 over write events: step t's W writes laid out in time as (t, slot 0), ..., (t, slot W-1), the step's decay
on slot 0, its read on the last slot (read "after") or the first (read "before"), through rule 1's kernels. Every
event of step t writes w_(t,j) x_j (y_j - S_{t-1}^T x_j)^T against the state before the step's decay, so the events
of one step must not see each other's writes: rule 1's kernels take the number of slots per step and mask same-step
pairs out of the residuals' triangular system (`regression_kernels.py`, SLOTS). And no step may straddle a chunk
boundary (the next chunk's entry state would hold part of a step's writes), so each step is laid out on P = the next
power of two >= W slots, slots W..P-1 events that write nothing (zero features and weights), with chunks of at least
P events (powers of two: they hold whole steps). The cost is P times rule 1's.

The preparation (pairs, windows, statistic, step sizes, decays) is chunk.py's `prepare_writes`, except for rules 1A
and 1 (window 1, one step size per head): there one fused Triton kernel computes the same write events, forward and
backward (`prepare.py`, the custom op `hybridlm::fast_weight_prepare_fwd`), and for rule 3A on rows (no packed
sequences, no documents in place, windows up to `limits.MAX_PREPARED_WINDOW`): there three kernels compute the
tail-extended pairs, the log decays and the delayed writes' coefficients, forward and backward (`window_prepare.py`,
`hybridlm::fast_weight_window_prepare_fwd`). `fused_preparation=False` asks for prepare_writes in both cases (the
tests compare the two; benchmarks/gpu_fast_weight_triton.py times them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridlm.ops.fast_weight.chunk import PreparedWrites, prepare_writes
from hybridlm.ops.fast_weight.options import FastWeightOptions
from hybridlm.ops.fast_weight.state import FastWeightState
from hybridlm.ops.fast_weight.triton.custom_ops import (
    fast_weight_1_triton,
    fast_weight_1a_triton,
    fast_weight_2_triton,
    fast_weight_2a_triton,
    fast_weight_3_triton,
    fast_weight_delayed_triton,
    fast_weight_prepare_triton,
    fast_weight_step_triton,
    fast_weight_window_prepare_triton,
)
from hybridlm.ops.fast_weight.triton.limits import (
    MAX_DELTA_CHUNK,
    MAX_PREPARED_WINDOW,
    PER_COLUMN_CHUNK,
    step_takes,
    supports,
)
from hybridlm.ops.utils import (
    compute_dtype,
    host_to_device,
    needs_grad,
    packed_to_padded,
    padded_to_packed,
    triton_chunk_size,
)

FUSED_RULES = ("1A", "1")  # window 1, scalar step per head (2A's steps are per value column; 3A has a window)


def fast_weight_triton(
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
    fused_preparation: bool = True,
    final_state: bool = True,
) -> tuple[torch.Tensor, FastWeightState | None]:
    """Rules 1A / 3A / 1 / 3 / 2A / 2 through the Triton kernels. `options.chunk_size` is rounded to a power of two
    in [16, 128] (rules 2A and 2: 16, whatever is asked; their intra-chunk work is O(C^2 V) exponentials per chunk, as
    in chunk.py); for rule 3 it counts events (at least one step's slots).
    Rules 1A and 1, and rule 3A on rows with a window up to MAX_PREPARED_WINDOW, take their write events from the
    fused preparation kernels (`fused_preparation`; False: from chunk.py's prepare_writes, the same events computed
    in torch).
    `seq_idx` ([B, T], a document index per step; only where `options.restarts_in_place`) restarts documents in
    place: the preparation (fused, or prepare_writes) puts no pair across a document start, keeps each window inside
    its document, and puts a log decay of -100 on the start (exp(-100) ~ 4e-44), so the scan's state holds nothing of
    the documents before; each exponent the kernels take is a difference of chunk-local sums that holds that -100
    on both sides (one document: exact up to float32 rounding at magnitude 100 x the restarts so far in the chunk;
    README.md, "Packed documents in place") or on one (another document: ~0).

    A single step (T = 1) of rules 1A, 1, 2A, 2 without packed sequences and without a gradient to record (a
    decoding step) runs as one kernel (`step.py`) instead.

    `final_state=False` (a training step, which discards it): the final state is not assembled, and None is
    returned in its place. The scans' kernels produce S either way; what is skipped is the torch work around them:
    rule 3A's last band folded into S, the carried tail and key.

    Returns o `[B, T, H, V]` in q's dtype and the final state (S float32), or None."""
    rule, window, chunk_size, read_after = options.rule, options.window, options.chunk_size, options.read_after
    K, V = q.shape[-1], v.shape[-1]
    if not supports(rule=rule, window=window, K=K, V=V, dtype=q.dtype):
        raise ValueError(f"the Triton backend runs rules 1A, 1, 2A and 2 (window 1), 3A and 3 (window <= 64) "
                         f"with K, V <= 128 in float32/bfloat16/float16; got rule {rule!r}, window {window}, "
                         f"K = {K}, V = {V}, {q.dtype} (use backend='chunk')")
    if seq_idx is not None and (offsets is not None or not options.restarts_in_place):
        raise ValueError(f"seq_idx (documents restarted in place) takes a read after the write, shifted pairing for "
                         f"the regression rules, and no cu_seqlens; got rule {rule!r}, {options.pairing} pairing, "
                         f"read {options.read!r} (use cu_seqlens)")
    if (q.shape[1] == 1 and offsets is None and seq_idx is None and step_takes(rule=rule, window=window, K=K, V=V,
                                                                                dtype=q.dtype)
            and not needs_grad(q, k, v, beta, lam, initial_state.S, initial_state.last_k)):
        o, final = decoding_step(q, k, v, beta, lam, options, initial_state)
        return o, final if final_state else None
    if fused_preparation and rule in FUSED_RULES and window == 1:
        return _window_1(q, k, v, beta, lam, options, initial_state=initial_state, offsets=offsets, seq_idx=seq_idx,
                         final_state=final_state)
    if (fused_preparation and rule == "3A" and 1 < window <= MAX_PREPARED_WINDOW and offsets is None
            and seq_idx is None):
        return _window_prepared(q, k, v, beta, lam, options, initial_state=initial_state, final_state=final_state)
    p = prepare_writes(q, k, v, beta, lam, options, initial_state=initial_state, offsets=offsets, seq_idx=seq_idx)
    N, T, H, _ = p.q.shape
    W = window
    if rule in ("2A", "2"):  # one write per step, eta, log gamma per value column: X [N, T, H, 1, K] -> [N, T, H, K]
        scan = fast_weight_2a_triton if rule == "2A" else fast_weight_2_triton
        o, S = scan(
            p.q, p.X[:, :, :, 0].to(q.dtype), p.Y[:, :, :, 0].to(q.dtype), p.weights[:, :, :, 0], p.log_gamma,
            initial_state.S.float(), read_after=read_after, chunk_size=PER_COLUMN_CHUNK)
        if offsets is not None:
            o = padded_to_packed(o, offsets)
        p.final.S = S
        return o, p.final if final_state else None

    if rule == "3A" and window > 1:
        o, S = _delayed_window(p, initial_state.S.float(), read_after=read_after,
                               chunk_size=triton_chunk_size(chunk_size, cap=128), final_state=final_state)
        if offsets is not None:
            o = padded_to_packed(o, offsets)
        p.final.S = S
        return o, p.final if final_state else None

    # The 1A / 1 scan over the T * P events (the events of step t are (t, 0), ..., (t, P - 1)): P = 1 for window 1;
    # rule 3's steps are padded to P = a power of two >= W with events that write nothing.
    P = 1 << (W - 1).bit_length() if rule == "3" else W
    X, Y, weights = p.X, p.Y, p.weights[..., 0]                                            # [N, T, H, W, *]
    if P > W:
        X, Y, weights = F.pad(X, (0, 0, 0, P - W)), F.pad(Y, (0, 0, 0, P - W)), F.pad(weights, (0, P - W))
    X = X.permute(0, 1, 3, 2, 4)                                                           # [N, T, P, H, K]
    Y = Y.permute(0, 1, 3, 2, 4)                                                           # [N, T, P, H, V]
    weights = weights.permute(0, 1, 3, 2)                                                  # [N, T, P, H]
    log_gamma = p.log_gamma[..., 0]                                                        # [N, T, H]
    slot = P - 1 if read_after else 0                                                      # where step t reads
    events = (torch.arange(P, device=q.device) == slot)[None, None, :, None, None]         # [1, 1, P, 1, 1]
    q_e = torch.where(events, p.q[:, :, None], 0.0) if P > 1 else p.q[:, :, None]
    lg_e = torch.cat([log_gamma[:, :, None], log_gamma.new_zeros(N, T, P - 1, H)], dim=2)  # decay on slot 0
    inputs = (q_e.reshape(N, T * P, H, K), X.reshape(N, T * P, H, K).to(q.dtype),
              Y.reshape(N, T * P, H, V).to(q.dtype), weights.reshape(N, T * P, H), lg_e.reshape(N, T * P, H),
              initial_state.S.float())
    if rule == "3":  # chunks of whole steps (P <= 128: supports)
        chunk = max(triton_chunk_size(chunk_size, cap=MAX_DELTA_CHUNK), P)
        o, S = fast_weight_3_triton(*inputs, read_after=read_after, chunk_size=chunk, slots=P)
    elif rule == "1":  # window 1 (supports)
        o, S = fast_weight_1_triton(*inputs, read_after=read_after,
                                    chunk_size=triton_chunk_size(chunk_size, cap=MAX_DELTA_CHUNK))
    else:
        o, S = fast_weight_1a_triton(*inputs, read_after=read_after, chunk_size=triton_chunk_size(chunk_size, cap=128))
    o = o.view(N, T, P, H, V)[:, :, slot]                                                  # [N, T, H, V]
    if offsets is not None:
        o = padded_to_packed(o, offsets)
    p.final.S = S
    return o, p.final if final_state else None


def _delayed_window(p: PreparedWrites, S0: torch.Tensor, *, read_after: bool, chunk_size: int,
                    final_state: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Rule 3A (window W > 1) on prepare_writes' windows as 1A over delayed writes plus the band of the W-1 pairs
    still being written (README.md, "Rule 3A as delayed writes"). p.x_ext / p.y_ext [N, W-1+T, H, *] are the pairs
    with the carried tail in front (ext row e = pair e-W+1, so slot j of step t is ext row t + j; p.X / p.Y are their
    windows), p.weights [N, T, H, W, 1] the weight w_(t,j) of slot j at step t. Returns o [N, T, H, V] in q's dtype
    and the final state [N, H, K, V] float32 (at the padded end of every row: padded steps write nothing and do not
    decay)."""
    lg = p.log_gamma[..., 0]                                                               # [N, T, H]
    C = window_coefficients(p.weights[..., 0], lg)
    return _delayed_scan(p.q, p.x_ext, p.y_ext, C, lg, S0, read_after=read_after, chunk_size=chunk_size,
                         final_state=final_state)


def window_coefficients(w: torch.Tensor, lg: torch.Tensor) -> torch.Tensor:
    """C [N, T, H, W] from the window weights w [N, T, H, W] and log decays lg [N, T, H]:
    C_t[j] = sum_m exp(lg_(t-m+1) + ... + lg_t) w_(t-m)[j+m], the pair in slot j of step t over its writes so far."""
    T, W = w.shape[1], w.shape[3]
    C, span = w, torch.zeros_like(lg)
    for m in range(1, min(W, T)):
        span = span + F.pad(lg[:, : T - m + 1], (0, 0, m - 1, 0))                         # sum of the last m lg
        C = C + span.exp()[..., None] * F.pad(w[:, : T - m, :, m:], (0, m, 0, 0, m, 0))
    return C


def _delayed_scan(q, x_ext, y_ext, C, lg, S0, *, read_after: bool, chunk_size: int, final_state: bool = True):
    """The 1A scan over the delayed writes (x_ext, y_ext [N, W-1+T, H, *], C [N, T, H, W], lg [N, T, H]; README.md,
    "Rule 3A as delayed writes") plus the band -> o [N, T, H, V] in q's dtype and the final state float32 (the
    scan's alone, without the last step's band, where `final_state` is False: the caller discards it)."""
    T = q.shape[1]
    x_q, y_q = x_ext.to(q.dtype), y_ext.to(q.dtype)  # (already in q's dtype: the op keeps k and v's)
    band = C[..., 1:]                                                                      # [N, T, H, W-1]
    if not read_after:  # S_(t-1)'s band: step t-1's coefficients in row t (S_0's partial writes are in S_0)
        band = F.pad(band[:, :-1], (0, 0, 0, 0, 1, 0))
    # The delayed writes are the first T ext rows, which the scan reads in place.
    o, S = fast_weight_delayed_triton(q, x_q, y_q, C[..., 0].contiguous(), lg.contiguous(),
                                      band.float().contiguous(), S0, read_after=read_after, chunk_size=chunk_size)
    if not final_state:
        return o, S
    # The last step's band (ext rows T .. T+W-2) enters the final state.
    S = S + torch.einsum("nhj,njhk,njhv->nhkv", C[:, -1, :, 1:], x_ext[:, T:].float(), y_ext[:, T:].float())
    return o, S


def _window_prepared(q, k, v, beta, lam, options: FastWeightOptions, *, initial_state: FastWeightState,
                     final_state: bool = True) -> tuple[torch.Tensor, FastWeightState | None]:
    """Rule 3A (window W > 1) on rows with the fused preparation: the pairs, log decays and delayed-write coefficients
    of prepare_writes and `window_coefficients` from window_prepare.py's kernels, then `_delayed_scan`."""
    shifted, W, T = options.shifted, options.window, q.shape[1]
    state = initial_state
    x_ext, y_ext, C, lg = fast_weight_window_prepare_triton(
        k, v, beta, lam, state.last_k if shifted else None, state.tail_x, state.tail_v, state.tail_len, window=W,
        pairing=options.pairing, step_size=options.step_size, ridge_scaling=options.ridge_scaling, eps=options.eps,
        eps_gamma=options.eps_gamma)
    o, S = _delayed_scan(q, x_ext, y_ext, C, lg, state.S.float(), read_after=options.read_after,
                         chunk_size=triton_chunk_size(options.chunk_size, cap=128), final_state=final_state)
    if not final_state:
        return o, None
    stat = compute_dtype(k.dtype)
    # The final tail is ext rows T .. T+W-2: each of its pairs exists but a fresh shifted row's pair 0, and where
    # T < W-1 it keeps the carried tail's slots T .. W-2, whose last tail_len hold pairs.
    pairs = min(T, W - 1) - int(shifted and state.last_k is None and T <= W - 1)
    tail_len = torch.full((q.shape[0],), pairs, dtype=torch.int64, device=q.device)
    if state.tail_len is not None and T < W - 1:
        tail_len = tail_len + state.tail_len.clamp(max=W - 1 - T)
    final = FastWeightState(S=S, last_k=k[:, -1].to(stat) if shifted else None,
                            tail_x=x_ext[:, T:].transpose(1, 2).to(stat), tail_v=y_ext[:, T:].transpose(1, 2).to(stat),
                            tail_len=tail_len)
    return o, final


def decoding_step(q, k, v, beta, lam, options: FastWeightOptions, state: FastWeightState, *,
                  state_in_place: bool = False, **preparation):
    """One step [B, 1, H, *] through the step kernel -> o [B, 1, H, V], the state after it. `preparation`: the
    mixer's QK norm and gains for the kernel to take (`fast_weight_step_triton`'s gates, qk_norm, qk_eps; beta and
    lam are then the gains' logits). `state_in_place`: the state after the step written over `state`'s tensors and
    returned in them, where they can take it (S float32 and contiguous; shifted pairing: a float32 contiguous carried
    key); else new tensors."""
    shifted = options.shifted
    k, v = k.to(q.dtype), v.to(q.dtype)  # one dtype, as the scans take them
    S = state.S.float()
    last_k = state.last_k if shifted else None
    in_place = (state_in_place and S is state.S and S.is_contiguous()
                and (not shifted or (last_k is not None and last_k.dtype == torch.float32 and last_k.is_contiguous())))
    o, S, last_k = fast_weight_step_triton(
        q[:, 0], k[:, 0], v[:, 0], beta[:, 0], lam[:, 0], S, last_k,
        rule=options.rule, pairing=options.pairing, read_after=options.read_after, step_size=options.step_size,
        ridge_scaling=options.ridge_scaling, eps=options.eps, eps_gamma=options.eps_gamma, in_place=in_place,
        **preparation)
    return o[:, None], FastWeightState(S=S, last_k=last_k if shifted else None)


def _window_1(q, k, v, beta, lam, options: FastWeightOptions, *, initial_state, offsets, seq_idx=None,
              final_state: bool = True) -> tuple[torch.Tensor, FastWeightState | None]:
    """Rules 1A / 1 with the fused preparation: the write events of prepare_writes (window 1) from one kernel."""
    shifted = options.shifted
    if offsets is not None:
        ends = offsets[1:] - 1                                                             # each sequence's last step
        max_len = int((offsets[1:] - offsets[:-1]).max())
        q_rows = packed_to_padded(q, offsets)
        last = k[0, host_to_device(ends, k.device)] if shifted and final_state else None   # [N, H, K]
        device_offsets = host_to_device(offsets.to(torch.int64), q.device)
    else:
        max_len = q.shape[1]
        q_rows = q
        last = k[:, -1] if shifted and final_state else None
        device_offsets = None
    x, y, eta, log_gamma = fast_weight_prepare_triton(
        k, v, beta, lam, initial_state.last_k if shifted else None, device_offsets, max_len=max_len,
        pairing=options.pairing, step_size=options.step_size, ridge_scaling=options.ridge_scaling, eps=options.eps,
        eps_gamma=options.eps_gamma, seq_idx=seq_idx)
    regression = options.rule == "1"
    scan = fast_weight_1_triton if regression else fast_weight_1a_triton
    chunk = triton_chunk_size(options.chunk_size, cap=MAX_DELTA_CHUNK if regression else 128)
    o, S = scan(q_rows, x.to(q.dtype), y.to(q.dtype), eta, log_gamma, initial_state.S.float(),
                read_after=options.read_after, chunk_size=chunk)
    if offsets is not None:
        o = padded_to_packed(o, offsets)
    if not final_state:
        return o, None
    return o, FastWeightState(S=S, last_k=None if last is None else last.to(compute_dtype(k.dtype)))

