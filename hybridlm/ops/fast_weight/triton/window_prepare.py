"""The fused write preparation of rule 3A (window W > 1) on rows (no packed sequences, no documents in place):
chunk.py's `prepare_writes` steps 1-3 for a sliding window and the delayed-write coefficients of
`backend._delayed_window` in three kernels, their backward in three: the kernels, and their launchers, the
implementations of the custom ops `hybridlm::fast_weight_window_prepare_fwd` / `_bwd` (`custom_ops.py`).

Per row n and head h, over the ext rows e = 0 .. T+W-2 (the carried tail's W-1 slots, then pair p = e-(W-1); slot j
of step t's window is ext row t + j):

    m_e = [e >= W-1-tail_len]  (tail slot; no tail: False)  |  same-step, or p >= 1, or a carried last key  (pair)
    x_e = m_e (tail_x[e] | k_(p-1) shifted (the carried last key at p = 0) | k_p same-step)        (k's dtype)
    y_e = m_e (tail_v[e] | v_p)                                                                    (v's dtype)
    energy_e = |x_e|^2 (float32)

Per step t (its window: ext rows t .. t+W-1; active_t = m_(t+W-1), its own pair exists):

    count_t = max(sum_j m_(t+j), 1)        E_t = sum_j energy_(t+j) / count_t
    ridge_t = lam_t E_t (ridge scaling, E detached) | lam_t
    eta_t = active_t beta_t / (E_t + ridge_t + eps)  (NLMS) | active_t beta_t  (direct)
    alpha_t = min(eta_t ridge_t, 1 - eps_gamma)        lg_t = log1p(-alpha_t)        a_t = eta_t / count_t

and the coefficient of the pair in slot j of step t over the writes it has had (README.md, "Rule 3A as delayed
writes"), with span(t, m) = lg_t + ... + lg_(t-m+1) (span(t, 0) = 0) and term(t, m) = [t >= m] exp(span(t, m)) a_(t-m):

    C_t[j] = m_(t+j) sum_(m = 0 .. W-1-j) term(t, m)                 (so C_t[W-1] = a_t: a pair's first write)

Backward (d x_ext, d y_ext, dC, d lg given; the forward's x_ext, C, lg and E are kept, k and v are not: x_ext holds
every key a pair reads). With u_t[j] = dC_t[j] m_(t+j) and U_t(m) = sum_(j <= W-1-m) u_t[j] (dC_t[j] reaches
term(t, m) for every j <= W-1-m):

    d a_s = sum_m [s + m < T] U_(s+m)(m) exp(span(s+m, m))
    d lg_r += sum_(i = 1 .. W-1) [r + i - 1 < T] sum_(m >= i) term(r+i-1, m) U_(r+i-1)(m)    (lg_r is in span(t, m)
              exactly where t - m < r <= t: t = r + i - 1 and m >= i)
    g_alpha = -d lg / (1 - alpha)        g_a = [eta ridge <= 1 - eps_gamma] g_alpha   (torch.clamp(max=): passes at ==)
    g_eta = active (d a / count + g_a ridge)        g_ridge = g_a eta
    NLMS:   d beta = g_eta / denom,  g_denom = -active g_eta beta / denom^2,  g_E = g_denom,  g_ridge += g_denom
    direct: d beta = g_eta,          g_E = 0
    d lam = g_ridge E (ridge scaling) | g_ridge
    d energy_e = sum_j [0 <= e - j < T] g_E_(e-j) / count_(e-j)
    d x_e = m_e (d x_ext_e + 2 d energy_e x_e)  -> d tail_x[e] | dk_(p-1) (shifted; d last_k at p = 0) | dk_p
    d y_e = m_e d y_ext_e                       -> d tail_v[e] | dv_p

The kernels, one program per (block of ext rows or of steps, n h). A step's window and its history (the steps whose
writes it still decays) are gathers of W <= 64 values along time at [BT, WP] indices (WP = the next power of two
>= W), the sums over m cumulative sums along that axis; the backward gathers forward in time where the forward
gathered backward, so nothing is scattered (no atomics):

    rows_fwd_kernel          x_ext, y_ext and energy (a float32 [N H, W-1+T] buffer)
    steps_fwd_kernel         E (kept for the backward), lg and a (into C_t[W-1])
    coefficients_fwd_kernel  C_t[0 .. W-2] from the gathered lg and a
    coefficients_bwd_kernel  per step t and m: U_t(m) exp(span(t, m)) and sum_(m' >= m) term(t, m') U_t(m')
                             (two float32 [N H, T, W] buffers)
    steps_bwd_kernel         d a, d lg (gathering those from the W steps that hold them), d beta, d lam and
                             g_E / count (a float32 [N H, T] buffer)
    rows_bwd_kernel          d energy (gathering g_E / count from the W steps whose windows hold the row), dk, dv,
                             d last_k, d tail_x, d tail_v

Divisions are IEEE (`div_rn`; Triton's `/` compiles to the approximate div.full.f32 on NVIDIA GPUs), as torch's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridlm.ops.fast_weight.triton.band import program_rows, row_offsets
from hybridlm.ops.fast_weight.triton.prepare import log1p_small, step_size_grads, step_sizes
from hybridlm.ops.utils import MAX_GRID_YZ, cdiv, next_power_of_2

_SIZES = ["T"]  # runtime: no recompilation per sequence length
# Ext rows per program of the row kernels, and warps of every kernel: at K = V = 128 (bf16, sm_90, checked with
# ptxas) every kernel compiles without spills at windows 3 and 64, the row kernels at <= 104 registers with 8 warps
# (up to 219 with 4).
ROWS, NUM_WARPS = 16, 8
# Elements of a step kernel's [BT, WP] tiles: BT = STEP_TILE / WP steps per program, within [16, 256].
STEP_TILE = 2048


@triton.jit
def _exists(e, n, T, tail_len_ptr, W: tl.constexpr, SHIFTED: tl.constexpr, HAS_LAST: tl.constexpr,
            HAS_TAIL: tl.constexpr):
    """m_e for ext rows e (any shape): False outside 0 .. T+W-2."""
    if HAS_TAIL:
        tail = e >= W - 1 - tl.load(tail_len_ptr + n)
    else:
        tail = e < 0
    first_pair = W - 1                   # the first ext row that holds a pair
    if SHIFTED and not HAS_LAST:
        first_pair = W                   # pair 0 of a fresh shifted row has no key
    inside = (e >= 0) & (e < T + W - 1)
    return inside & tl.where(e < W - 1, tail, e >= first_pair)


@triton.jit
def _window(n, t, valid, T, tail_len_ptr, W: tl.constexpr, WP: tl.constexpr, SHIFTED: tl.constexpr,
            HAS_LAST: tl.constexpr, HAS_TAIL: tl.constexpr):
    """The window rows e = t + j [BT, WP] of steps t, whether each is in the window (j < W), count_t and active_t."""
    j = tl.arange(0, WP)
    e = t[:, None] + j[None, :]
    in_window = valid[:, None] & (j[None, :] < W)
    m = _exists(e, n, T, tail_len_ptr, W, SHIFTED, HAS_LAST, HAS_TAIL) & in_window
    count = tl.maximum(tl.sum(m.to(tl.float32), axis=1), 1.0)
    active = valid & _exists(t + W - 1, n, T, tail_len_ptr, W, SHIFTED, HAS_LAST, HAS_TAIL)
    return e, in_window, count, active


@triton.jit
def _history(lg_ptr, C_ptr, n, h, t, valid, T, H, W: tl.constexpr, WP: tl.constexpr):
    """For steps t [BT] and m = 0 .. WP-1 [BT, WP]: span(t, m), a_(t-m) (= C_(t-m)[W-1]) and whether term(t, m)
    exists (m < W, t >= m)."""
    m = tl.arange(0, WP)[None, :]
    s = t[:, None] - m                                                               # the writing step
    held = valid[:, None] & (m < W) & (s >= 0)
    step_rows = (n.to(tl.int64) * T + s) * H + h                                     # rows of [N, T, H] [BT, WP]
    lg = tl.load(lg_ptr + step_rows + H, mask=held & (m >= 1), other=0.0)           # lg_(t-m+1), 0 at m = 0
    a = tl.load(C_ptr + step_rows * W + W - 1, mask=held, other=0.0)
    return tl.cumsum(lg, axis=1), a, held


@triton.jit
def _sources(n, h, e, T, H, W: tl.constexpr, LAG: tl.constexpr, D: tl.constexpr, BD: tl.constexpr):
    """Where ext rows e [BR] come from, as offsets [BR, BD] and masks (columns < D): tail slot e of a [N, H, W-1, D]
    tail, input row r = p - LAG of a [N, T, H, D] tensor (LAG = 1: shifted keys), or the carried key [N, H, D] where
    r = -1 (shifted keys' pair 0)."""
    cols = tl.arange(0, BD)[None, :]
    in_cols = cols < D
    nh = n.to(tl.int64) * H + h
    r = e - (W - 1) - LAG
    tail_offsets = (nh * (W - 1) + e)[:, None] * D + cols
    input_offsets = ((n.to(tl.int64) * T + r) * H + h)[:, None] * D + cols
    last_offsets = nh * D + cols + 0 * e[:, None]
    is_tail = (e < W - 1)[:, None] & in_cols
    is_row = ((r >= 0) & (r < T))[:, None] & in_cols
    is_last = ((r == -1) & (e >= W - 1))[:, None] & in_cols
    return tail_offsets, input_offsets, last_offsets, is_tail, is_row, is_last


@triton.jit
def _gather_pairs(src_ptr, last_ptr, tail_ptr, n, h, e, m, T, H, W: tl.constexpr, LAG: tl.constexpr,
                  D: tl.constexpr, BD: tl.constexpr, HAS_LAST: tl.constexpr, HAS_TAIL: tl.constexpr):
    """x_ext (src k, LAG 1 shifted / 0 same-step) or y_ext (src v, LAG 0) at ext rows e [BR, BD] in src's dtype,
    zeros where m_e is False (the tail cast to src's dtype, as prepare_writes)."""
    tail_offsets, input_offsets, last_offsets, is_tail, is_row, is_last = _sources(n, h, e, T, H, W, LAG, D, BD)
    keep = m[:, None]
    out = tl.load(src_ptr + input_offsets, mask=keep & is_row, other=0.0)
    if HAS_TAIL:
        tail = tl.load(tail_ptr + tail_offsets, mask=keep & is_tail, other=0.0)
        out = tl.where(is_tail, tail.to(src_ptr.dtype.element_ty), out)
    if HAS_LAST:
        out = tl.where(is_last, tl.load(last_ptr + last_offsets, mask=keep & is_last, other=0.0), out)
    return out


@triton.jit
def _scatter_pairs(g, dst_ptr, last_ptr, tail_ptr, n, h, e, inside, T, H, W: tl.constexpr, LAG: tl.constexpr,
                   D: tl.constexpr, BD: tl.constexpr, HAS_LAST: tl.constexpr, HAS_TAIL: tl.constexpr):
    """Store the gradients g [BR, BD] of ext rows e where `_gather_pairs` read them (each source row is one ext row's,
    so these are plain stores)."""
    tail_offsets, input_offsets, last_offsets, is_tail, is_row, is_last = _sources(n, h, e, T, H, W, LAG, D, BD)
    keep = inside[:, None]
    tl.store(dst_ptr + input_offsets, g.to(dst_ptr.dtype.element_ty), mask=keep & is_row)
    if HAS_TAIL:
        tl.store(tail_ptr + tail_offsets, g.to(tail_ptr.dtype.element_ty), mask=keep & is_tail)
    if HAS_LAST:
        tl.store(last_ptr + last_offsets, g.to(last_ptr.dtype.element_ty), mask=keep & is_last)


@triton.jit(do_not_specialize=_SIZES)
def rows_fwd_kernel(k_ptr, v_ptr, last_ptr, tail_x_ptr, tail_v_ptr, tail_len_ptr, x_ptr, y_ptr, energy_ptr, T, H,
                    W: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
                    BV: tl.constexpr, SHIFTED: tl.constexpr, HAS_LAST: tl.constexpr, HAS_TAIL: tl.constexpr):
    """x_ext [N, W-1+T, H, K], y_ext [N, W-1+T, H, V] (k's / v's dtype) and energy [N H, W-1+T] float32.
    Grid (cdiv(W-1+T, BR), N H)."""
    n, h, e, inside = program_rows(T + W - 1, H, BR)
    m = _exists(e, n, T, tail_len_ptr, W, SHIFTED, HAS_LAST, HAS_TAIL)
    x = _gather_pairs(k_ptr, last_ptr, tail_x_ptr, n, h, e, m, T, H, W, 1 if SHIFTED else 0, K, BK, HAS_LAST,
                      HAS_TAIL)                                                      # [BR, BK]
    y = _gather_pairs(v_ptr, v_ptr, tail_v_ptr, n, h, e, m, T, H, W, 0, V, BV, False, HAS_TAIL)  # [BR, BV]
    x_offsets, x_mask = row_offsets(n, h, e, inside, T + W - 1, H, K, BK)
    y_offsets, y_mask = row_offsets(n, h, e, inside, T + W - 1, H, V, BV)
    tl.store(x_ptr + x_offsets, x, mask=x_mask)
    tl.store(y_ptr + y_offsets, y, mask=y_mask)
    xf = x.to(tl.float32)
    tl.store(energy_ptr + (n.to(tl.int64) * H + h) * (T + W - 1) + e, tl.sum(xf * xf, axis=1), mask=inside)


@triton.jit(do_not_specialize=_SIZES)
def steps_fwd_kernel(energy_ptr, beta_ptr, lam_ptr, tail_len_ptr, E_ptr, lg_ptr, C_ptr, T, H, eps,
                     one_minus_eps_gamma, W: tl.constexpr, WP: tl.constexpr, BT: tl.constexpr, SHIFTED: tl.constexpr,
                     HAS_LAST: tl.constexpr, HAS_TAIL: tl.constexpr, NLMS: tl.constexpr, SCALED: tl.constexpr):
    """E [N, H, T], lg [N, T, H] and a_t into C [N, T, H, W] at C_t[W-1] (float32). Grid (cdiv(T, BT), N H)."""
    n, h, t, valid = program_rows(T, H, BT)
    e, in_window, count, active = _window(n, t, valid, T, tail_len_ptr, W, WP, SHIFTED, HAS_LAST, HAS_TAIL)
    nh = n.to(tl.int64) * H + h
    energy = tl.load(energy_ptr + nh * (T + W - 1) + e, mask=in_window, other=0.0)   # [BT, WP]
    E = tl.math.div_rn(tl.sum(energy, axis=1), count)
    step_rows = (n.to(tl.int64) * T + t) * H + h
    beta = tl.load(beta_ptr + step_rows, mask=valid, other=0.0)
    lam = tl.load(lam_ptr + step_rows, mask=valid, other=0.0)
    _, _, eta, _, alpha = step_sizes(E, beta, lam, active, eps, one_minus_eps_gamma, NLMS, SCALED)
    tl.store(E_ptr + nh * T + t, E, mask=valid)
    tl.store(lg_ptr + step_rows, log1p_small(-alpha), mask=valid)
    tl.store(C_ptr + step_rows * W + W - 1, tl.math.div_rn(eta, count), mask=valid)


@triton.jit(do_not_specialize=_SIZES)
def coefficients_fwd_kernel(lg_ptr, tail_len_ptr, C_ptr, T, H, W: tl.constexpr, WP: tl.constexpr, BT: tl.constexpr,
                            SHIFTED: tl.constexpr, HAS_LAST: tl.constexpr, HAS_TAIL: tl.constexpr):
    """C_t[0 .. W-2] of C [N, T, H, W] from lg and C_t[W-1] = a_t (steps_fwd_kernel's). Grid (cdiv(T, BT), N H)."""
    n, h, t, valid = program_rows(T, H, BT)
    span, a, held = _history(lg_ptr, C_ptr, n, h, t, valid, T, H, W, WP)
    partial = tl.cumsum(tl.where(held, tl.exp(span) * a, 0.0), axis=1)   # sum_(m' <= m) term(t, m') [BT, WP]
    # Column m of `partial` is C_t[j] with j = W-1-m (before the mask m_(t+j)); j = W-1 is a_t, already stored.
    j = W - 1 - tl.arange(0, WP)[None, :]
    m = _exists(t[:, None] + j, n, T, tail_len_ptr, W, SHIFTED, HAS_LAST, HAS_TAIL)
    C = tl.where(m, partial, 0.0)
    step_rows = (n.to(tl.int64) * T + t) * H + h
    tl.store(C_ptr + step_rows[:, None] * W + j, C, mask=valid[:, None] & (j >= 0) & (j < W - 1))


@triton.jit(do_not_specialize=_SIZES)
def coefficients_bwd_kernel(dC_ptr, lg_ptr, C_ptr, tail_len_ptr, ga_ptr, glg_ptr, T, H, W: tl.constexpr,
                            WP: tl.constexpr, BT: tl.constexpr, SHIFTED: tl.constexpr, HAS_LAST: tl.constexpr,
                            HAS_TAIL: tl.constexpr):
    """For steps t and m < W, into [N H, T, W] float32 buffers: ga = U_t(m) exp(span(t, m)) (step t's part of
    d a_(t-m)) and glg = sum_(m' >= m) term(t, m') U_t(m') (its part of d lg_(t-m+1), m >= 1). Grid (cdiv(T, BT),
    N H)."""
    n, h, t, valid = program_rows(T, H, BT)
    span, a, held = _history(lg_ptr, C_ptr, n, h, t, valid, T, H, W, WP)
    i = tl.arange(0, WP)[None, :]
    j = W - 1 - i                                                                    # dC_t[W-1-i] in column i
    m = _exists(t[:, None] + j, n, T, tail_len_ptr, W, SHIFTED, HAS_LAST, HAS_TAIL) & valid[:, None] & (j >= 0)
    step_rows = (n.to(tl.int64) * T + t) * H + h
    u = tl.load(dC_ptr + step_rows[:, None] * W + j, mask=m, other=0.0)
    U = tl.cumsum(u, axis=1, reverse=True)                        # U_t(m) = sum_(i >= m) u_t[W-1-i]  [BT, WP]
    ga = tl.where(held, U * tl.exp(span), 0.0)
    glg = tl.cumsum(ga * a, axis=1, reverse=True)
    buffer = ((n.to(tl.int64) * H + h) * T + t)[:, None] * W + i
    in_window = valid[:, None] & (i < W)
    tl.store(ga_ptr + buffer, ga, mask=in_window)
    tl.store(glg_ptr + buffer, glg, mask=in_window)


@triton.jit(do_not_specialize=_SIZES)
def steps_bwd_kernel(ga_ptr, glg_ptr, dlg_ptr, E_ptr, beta_ptr, lam_ptr, tail_len_ptr, dbeta_ptr, dlam_ptr, gE_ptr,
                     T, H, eps, one_minus_eps_gamma, W: tl.constexpr, WP: tl.constexpr, BT: tl.constexpr,
                     SHIFTED: tl.constexpr, HAS_LAST: tl.constexpr, HAS_TAIL: tl.constexpr, NLMS: tl.constexpr,
                     SCALED: tl.constexpr):
    """d beta, d lam [N, T, H] (as beta, lam) and g_E / count [N H, T] (float32) from d lg [N, T, H] and
    coefficients_bwd_kernel's buffers. Grid (cdiv(T, BT), N H)."""
    n, h, t, valid = program_rows(T, H, BT)
    _, _, count, active = _window(n, t, valid, T, tail_len_ptr, W, WP, SHIFTED, HAS_LAST, HAS_TAIL)
    nh = n.to(tl.int64) * H + h
    i = tl.arange(0, WP)[None, :]
    later = t[:, None] + i                                        # d a_t: step t + m's column m
    da = tl.sum(tl.load(ga_ptr + (nh * T + later) * W + i, mask=valid[:, None] & (i < W) & (later < T), other=0.0),
                axis=1)
    spans = later - 1                                             # d lg_t: step t + i - 1's column i, i >= 1
    inside = valid[:, None] & (i >= 1) & (i < W) & (spans < T)
    step_rows = (n.to(tl.int64) * T + t) * H + h
    dlg = tl.load(dlg_ptr + step_rows, mask=valid, other=0.0).to(tl.float32)
    dlg += tl.sum(tl.load(glg_ptr + (nh * T + spans) * W + i, mask=inside, other=0.0), axis=1)
    E = tl.load(E_ptr + nh * T + t, mask=valid, other=0.0)
    beta = tl.load(beta_ptr + step_rows, mask=valid, other=0.0)
    lam = tl.load(lam_ptr + step_rows, mask=valid, other=0.0)
    ridge, denom, eta, a, alpha = step_sizes(E, beta, lam, active, eps, one_minus_eps_gamma, NLMS, SCALED)
    g_beta, g_lam, g_E = step_size_grads(tl.math.div_rn(da, count), dlg, E, beta, ridge, denom, eta, a, alpha, active,
                                          one_minus_eps_gamma, NLMS, SCALED)               # d eta = d a / count
    tl.store(dbeta_ptr + step_rows, g_beta, mask=valid)
    tl.store(dlam_ptr + step_rows, g_lam, mask=valid)
    tl.store(gE_ptr + nh * T + t, tl.math.div_rn(g_E, count), mask=valid)


@triton.jit(do_not_specialize=_SIZES)
def rows_bwd_kernel(x_ptr, dx_ptr, dy_ptr, gE_ptr, tail_len_ptr, dk_ptr, dv_ptr, dlast_ptr, dtail_x_ptr, dtail_v_ptr,
                    T, H, W: tl.constexpr, WP: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BR: tl.constexpr,
                    BK: tl.constexpr, BV: tl.constexpr, SHIFTED: tl.constexpr, HAS_LAST: tl.constexpr,
                    HAS_TAIL: tl.constexpr, NLMS: tl.constexpr):
    """dk, dv (laid out as k, v), d last_k [N, H, K] and d tail_x, d tail_v [N, H, W-1, *] for the gradients of
    x_ext and y_ext plus steps_bwd_kernel's g_E / count. Shifted pairing writes dk's rows but the last (no pair holds
    its key here). Grid (cdiv(W-1+T, BR), N H)."""
    n, h, e, inside = program_rows(T + W - 1, H, BR)
    m = _exists(e, n, T, tail_len_ptr, W, SHIFTED, HAS_LAST, HAS_TAIL)
    x_offsets, x_mask = row_offsets(n, h, e, inside, T + W - 1, H, K, BK)
    dx = tl.load(dx_ptr + x_offsets, mask=x_mask, other=0.0).to(tl.float32)            # [BR, BK]
    if NLMS:  # E_t = sum_j energy_(t+j) / count_t: row e is in the windows of steps e - j
        j = tl.arange(0, WP)[None, :]
        s = e[:, None] - j
        held = inside[:, None] & (j < W) & (s >= 0) & (s < T)
        denergy = tl.sum(tl.load(gE_ptr + (n.to(tl.int64) * H + h) * T + s, mask=held, other=0.0), axis=1)
        x = tl.load(x_ptr + x_offsets, mask=x_mask, other=0.0).to(tl.float32)
        dx += 2.0 * denergy[:, None] * x
    dx = tl.where(m[:, None], dx, 0.0)
    _scatter_pairs(dx, dk_ptr, dlast_ptr, dtail_x_ptr, n, h, e, inside, T, H, W, 1 if SHIFTED else 0, K, BK,
                   HAS_LAST, HAS_TAIL)
    y_offsets, y_mask = row_offsets(n, h, e, inside, T + W - 1, H, V, BV)
    dy = tl.where(m[:, None], tl.load(dy_ptr + y_offsets, mask=y_mask, other=0.0), 0.0)
    _scatter_pairs(dy, dv_ptr, dv_ptr, dtail_v_ptr, n, h, e, inside, T, H, W, 0, V, BV, False, HAS_TAIL)


def _launch(N: int, T: int, H: int, K: int, V: int, W: int):
    """The row kernels' and the step kernels' sizes and grids."""
    if N * H > MAX_GRID_YZ:
        raise ValueError(f"the window preparation kernels put the rows x heads ({N * H}) on a launch-grid axis "
                         f"limited to {MAX_GRID_YZ}: call fast_weight_attention (it splits the batch)")
    WP = next_power_of_2(W)
    BT = min(256, max(16, STEP_TILE // WP))
    rows = {"W": W, "K": K, "V": V, "BR": ROWS, "BK": max(16, next_power_of_2(K)), "BV": max(16, next_power_of_2(V))}
    steps = {"W": W, "WP": WP, "BT": BT}
    return rows, (cdiv(T + W - 1, ROWS), N * H), steps, (cdiv(T, BT), N * H)


def _flags(last_k, tail_x, shifted: bool) -> dict:
    return {"SHIFTED": shifted, "HAS_LAST": shifted and last_k is not None, "HAS_TAIL": tail_x is not None}


def forward(k, v, beta, lam, last_k, tail_x, tail_v, tail_len, window: int, shifted: bool, nlms: bool,
            ridge_scaling: bool, eps: float, eps_gamma: float):
    """x_ext [N, W-1+T, H, K] (k's dtype), y_ext [N, W-1+T, H, V] (v's dtype), C [N, T, H, W], lg [N, T, H] and
    E [N, H, T] (float32) on contiguous inputs: k [N, T, H, K], v [N, T, H, V], beta, lam [N, T, H] float32, last_k
    [N, H, K] (k's dtype) or None, tail_x [N, H, W-1, K], tail_v [N, H, W-1, V] (any float dtype) and tail_len [N]
    (int64), all three or none."""
    W = window
    N, T, H, K = k.shape
    rows, row_grid, steps, step_grid = _launch(N, T, H, K, v.shape[3], W)
    flags = _flags(last_k, tail_x, shifted)
    x_ext = k.new_empty(N, W - 1 + T, H, K)
    y_ext = v.new_empty(N, W - 1 + T, H, v.shape[3])
    energy = torch.empty(N * H, W - 1 + T, dtype=torch.float32, device=k.device)
    E = torch.empty(N, H, T, dtype=torch.float32, device=k.device)
    lg = torch.empty(N, T, H, dtype=torch.float32, device=k.device)
    C = torch.empty(N, T, H, W, dtype=torch.float32, device=k.device)
    last_ptr, tail_x_ptr, tail_v_ptr, tail_len_ptr = (k if t is None else t for t in (last_k, tail_x, tail_v, tail_len))
    rows_fwd_kernel[row_grid](k, v, last_ptr, tail_x_ptr, tail_v_ptr, tail_len_ptr, x_ext, y_ext, energy, T, H,
                              **rows, **flags, num_warps=NUM_WARPS)
    steps_fwd_kernel[step_grid](energy, beta, lam, tail_len_ptr, E, lg, C, T, H, eps, 1.0 - eps_gamma, **steps,
                                **flags, NLMS=nlms, SCALED=ridge_scaling, num_warps=NUM_WARPS)
    coefficients_fwd_kernel[step_grid](lg, tail_len_ptr, C, T, H, **steps, **flags, num_warps=NUM_WARPS)
    return x_ext, y_ext, C, lg, E


def backward(dx_ext, dy_ext, dC, dlg, x_ext, y_ext, C, lg, E, beta, lam, last_k, tail_x, tail_v, tail_len,
             window: int, shifted: bool, nlms: bool, ridge_scaling: bool, eps: float, eps_gamma: float):
    """dk, dv ([N, T, H, *] in x_ext's / y_ext's dtype), d beta, d lam (float32), d last_k ([N, H, K]; zeros without
    one) and d tail_x, d tail_v ([N, H, W-1, *] in the tail's dtype; float32 zeros without one) for the gradients of
    x_ext, y_ext, C, lg (contiguous, their shapes), from the forward's outputs x_ext, C, lg, E (y_ext for its shape
    and dtype) and its inputs beta, lam, last_k, tail_x, tail_v, tail_len (last_k and the tail for their presence)."""
    W = window
    N, T, H = beta.shape
    K, V = x_ext.shape[3], y_ext.shape[3]
    rows, row_grid, steps, step_grid = _launch(N, T, H, K, V, W)
    flags = _flags(last_k, tail_x, shifted)
    f32 = {"dtype": torch.float32, "device": x_ext.device}
    ga, glg = torch.empty(N * H, T, W, **f32), torch.empty(N * H, T, W, **f32)
    gE = torch.empty(N * H, T, **f32)
    dbeta, dlam = torch.empty_like(beta), torch.empty_like(lam)
    dk = x_ext.new_empty(N, T, H, K)
    if shifted:
        dk[:, T - 1] = 0.0  # the last key feeds no pair here (the final state's last_k is taken outside)
    dv = y_ext.new_empty(N, T, H, V)
    dlast = torch.empty_like(last_k) if flags["HAS_LAST"] else x_ext.new_zeros(N, H, K)
    dtail_x, dtail_v = ((torch.zeros(N, H, W - 1, D, **f32) if tail is None else torch.empty_like(tail))
                        for tail, D in ((tail_x, K), (tail_v, V)))
    tail_len_ptr = x_ext if tail_len is None else tail_len
    coefficients_bwd_kernel[step_grid](dC, lg, C, tail_len_ptr, ga, glg, T, H, **steps, **flags, num_warps=NUM_WARPS)
    steps_bwd_kernel[step_grid](ga, glg, dlg, E, beta, lam, tail_len_ptr, dbeta, dlam, gE, T, H, eps, 1.0 - eps_gamma,
                                **steps, **flags, NLMS=nlms, SCALED=ridge_scaling, num_warps=NUM_WARPS)
    rows_bwd_kernel[row_grid](x_ext, dx_ext, dy_ext, gE, tail_len_ptr, dk, dv, dlast, dtail_x, dtail_v, T, H,
                              **rows, WP=steps["WP"], **flags, NLMS=nlms, num_warps=NUM_WARPS)
    return dk, dv, dbeta, dlam, dlast, dtail_x, dtail_v
