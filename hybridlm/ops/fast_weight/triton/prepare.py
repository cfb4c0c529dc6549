"""The fused write preparation of the window-1 scalar-step rules (1A and 1): chunk.py's `prepare_writes` steps 1-3
(pairs, |x|^2, NLMS or direct step sizes, ridge, clamped log decays; packed rows padded on the fly, or documents
restarted in place from a document index per step) in one pass per (n, block of steps, h), and its backward: the
kernels, and their launchers, the implementations of the custom ops `hybridlm::fast_weight_prepare_fwd` / `_bwd`
(`custom_ops.py`).

Per step t of row n
and head h (src = the flat input row of step t: offsets[n] + t packed, n * T + t otherwise):

    exists_t = [t < len_n] and (same-step, or t >= 1, or a carried last key)
    x_t = exists_t * (k[src - 1] shifted (the carried last key at t = 0) | k[src] same-step)      (k's dtype)
    y_t = exists_t * v[src]
    E_t = |x_t|^2 (float32)         ridge_t = lam_t * E_t (ridge scaling, E detached) | lam_t
    eta_t = exists_t * beta_t / (E_t + ridge_t + eps)  (NLMS) | exists_t * beta_t  (direct)
    a_t = eta_t ridge_t     alpha_t = min(a_t, 1 - eps_gamma)     lg_t = log1p(-alpha_t)

Backward (dx, dy, d eta, d lg given; the forward is recomputed from its own output x, which holds every pair's key,
and beta, lam, so neither k nor v is kept for it; torch's clamp(max=m) passes the gradient where a <= m, equality
included, and stops it where a > m):

    g_alpha = -dlg / (1 - alpha)          g_a = [a <= m] g_alpha
    g_eta = exists (d eta + g_a ridge)    g_ridge = g_a eta
    NLMS:   d beta = g_eta / denom,  g_denom = -g_eta beta / denom^2 (exists only),  g_E = g_denom,  g_ridge += g_denom
    direct: d beta = g_eta,          g_E = 0
    d lam = g_ridge E (ridge scaling) | g_ridge
    d x_src = exists (dx + 2 g_E x)  -> dk[src - 1] (shifted; the carried last key at t = 0) | dk[src]
    d v[src] = exists dy

With a document index per step (SEQ: seq_idx [N, T], the rows' layout, never with offsets) a document starts at
every t >= 1 whose id differs from step t-1's: there no shifted pair exists (k[src - 1] is another document's), and
lg_t = RESTART_LOG_DECAY (-100: exp(-100) ~ 4e-44, below float32's normal range) so that nothing written before
reaches the state after it; its gradient is dropped (a constant; step t's own decay multiplies a state that is
zero within its document). Every later exponent the scan kernels take is a difference of chunk-local sums that
holds -100 either on both sides (the same document) or on one (another: ~0).

Outputs are padded rows [N, T_pad, H, *] (T_pad = the longest sequence); padded steps hold zeros (eta = 0, lg = 0).
y is written only for packed rows (PACKED), which it pads: on rows it would be v itself but where no pair exists,
and there eta = 0, so no write of the scan reads y_t (every term it enters carries eta_t) and its gradient dy_t is
exactly 0. The caller hands v to the scan in y's place (`custom_ops.fast_weight_prepare_triton`), v's gradient is
the scan's dy, and neither the copy nor its backward runs.
Divisions are IEEE (`div_rn`; Triton's `/` compiles to the approximate div.full.f32 on NVIDIA GPUs), as torch's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridlm.ops.fast_weight import chunk
from hybridlm.ops.utils import MAX_GRID_YZ, cdiv, next_power_of_2

_SIZES = ["T_pad"]  # runtime: no recompilation per sequence length
RESTART_LOG_DECAY = tl.constexpr(chunk.RESTART_LOG_DECAY)  # a document restart's log decay (SEQ)
# Steps per program and warps: at K = V = 128 (bf16, sm_90, checked with ptxas) 16 steps on 8 warps compile without
# spills in every variant (the backward peaks at 172 registers); 32 steps, or 4 warps, spill in the backward.
BT, NUM_WARPS = 16, 8


@triton.jit
def log1p_small(u):
    """log(1 + u) to a few ulp for small |u| (the interpreter has no libdevice.log1p): Goldberg's
    log(w) * u / (w - 1) with w = 1 + u rounded, and u itself where w rounds to 1."""
    w = 1.0 + u
    tiny = w == 1.0
    return tl.where(tiny, u, tl.log(w) * tl.math.div_rn(u, tl.where(tiny, 1.0, w - 1.0)))


@triton.jit
def step_sizes(E, beta, lam, exists, eps, one_minus_eps_gamma, NLMS: tl.constexpr, SCALED: tl.constexpr):
    """ridge, denom (1 for direct steps and where no pair exists), eta, a = eta ridge and alpha of steps [BT] from
    their statistic E (also the windowed rule 3A's, `window_prepare.py`)."""
    if SCALED:
        ridge = lam * E
    else:
        ridge = lam
    if NLMS:
        denom = tl.where(exists, E + ridge + eps, 1.0)
        eta = tl.math.div_rn(beta, denom)
    else:
        denom = tl.full(E.shape, 1.0, tl.float32)
        eta = beta
    eta = tl.where(exists, eta, 0.0)
    a = eta * ridge
    alpha = tl.minimum(a, one_minus_eps_gamma, propagate_nan=tl.PropagateNan.ALL)  # NaN stays NaN, as torch's clamp
    return ridge, denom, eta, a, alpha


@triton.jit
def step_size_grads(deta, dlg, E, beta, ridge, denom, eta, a, alpha, exists, one_minus_eps_gamma,
                     NLMS: tl.constexpr, SCALED: tl.constexpr):
    """d beta, d lam and g_E (dL/dE) of steps [BT] from the gradients of their eta and lg (the backward of
    `step_sizes` and lg = log1p(-alpha))."""
    g_alpha = -tl.math.div_rn(dlg, 1.0 - alpha)                          # d log1p(-alpha) / d alpha = -1 / (1 - alpha)
    g_a = tl.where(a <= one_minus_eps_gamma, g_alpha, 0.0)               # torch.clamp(max=m): passes at a == m
    g_ridge = g_a * eta
    g_eta = tl.where(exists, deta + g_a * ridge, 0.0)
    if NLMS:
        g_beta = tl.math.div_rn(g_eta, denom)
        g_denom = tl.where(exists, tl.math.div_rn(-(g_eta * beta), denom * denom), 0.0)
        g_E = g_denom
        g_ridge = g_ridge + g_denom
    else:
        g_beta = g_eta
        g_E = tl.zeros(E.shape, tl.float32)
    if SCALED:
        g_lam = g_ridge * E                                              # E detached: no path to x through ridge
    else:
        g_lam = g_ridge
    return g_beta, g_lam, g_E


@triton.jit
def _steps(k_ptr, v_ptr, beta_ptr, lam_ptr, last_ptr, offsets_ptr, seq_ptr, T_pad, H, eps, one_minus_eps_gamma,
           K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
           SHIFTED: tl.constexpr, HAS_LAST: tl.constexpr, PACKED: tl.constexpr, NLMS: tl.constexpr,
           SCALED: tl.constexpr, SEQ: tl.constexpr, PREPARED: tl.constexpr):
    """The forward quantities of this program's BT steps (shared by both kernels). PREPARED: k_ptr points at the
    forward's output x [N, T_pad, H, K] (the backward's input), whose rows hold the pairs' keys already (zeros where no
    pair exists), instead of at k."""
    i_t, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    t = i_t * BT + tl.arange(0, BT)
    if PACKED:
        start = tl.load(offsets_ptr + i_n).to(tl.int64)
        length = tl.load(offsets_ptr + i_n + 1).to(tl.int64) - start
    else:
        start = i_n.to(tl.int64) * T_pad
        length = T_pad
    valid = t < length
    src = start + t                                                                     # flat input rows [BT]
    if SEQ:  # a document starts at t >= 1 where the id changes (t = 0 continues the carried state)
        here = tl.load(seq_ptr + src, mask=valid, other=0)
        before = tl.load(seq_ptr + src - 1, mask=valid & (t >= 1), other=0)
        restart = valid & (t >= 1) & (here != before)
    else:
        restart = t < 0
    ck = tl.arange(0, BK)
    kmask = ck < K
    if SHIFTED:
        if HAS_LAST:
            exists = valid & ~restart
        else:
            exists = valid & (t >= 1) & ~restart
    else:
        exists = valid
    if PREPARED:
        rows = (i_n.to(tl.int64) * T_pad + t) * H + i_h                                 # padded rows [BT]
        x = tl.load(k_ptr + rows[:, None] * K + ck[None, :], mask=exists[:, None] & kmask[None, :], other=0.0)
    elif SHIFTED:
        prev = (src - 1) * H + i_h
        x = tl.load(k_ptr + prev[:, None] * K + ck[None, :], mask=(valid & (t >= 1))[:, None] & kmask[None, :],
                    other=0.0)
        if HAS_LAST:
            first = tl.load(last_ptr + (i_n * H + i_h).to(tl.int64) * K + ck, mask=kmask, other=0.0)
            x = tl.where((t == 0)[:, None], first[None, :], x)
    else:
        x = tl.load(k_ptr + (src * H + i_h)[:, None] * K + ck[None, :], mask=valid[:, None] & kmask[None, :],
                    other=0.0)
    x = tl.where(exists[:, None], x, 0.0).to(k_ptr.dtype.element_ty)                  # x_t, k's dtype [BT, BK]
    xf = x.to(tl.float32)
    E = tl.sum(xf * xf, axis=1)                                                         # |x_t|^2 [BT]
    beta = tl.load(beta_ptr + src * H + i_h, mask=valid, other=0.0)
    lam = tl.load(lam_ptr + src * H + i_h, mask=valid, other=0.0)
    ridge, denom, eta, a, alpha = step_sizes(E, beta, lam, exists, eps, one_minus_eps_gamma, NLMS, SCALED)
    lg = tl.where(restart, RESTART_LOG_DECAY, log1p_small(-alpha))
    return i_n, i_h, t, valid, exists, restart, src, ck, kmask, x, xf, E, beta, lam, ridge, denom, eta, a, alpha, lg


@triton.jit(do_not_specialize=_SIZES)
def prepare_fwd_kernel(k_ptr, v_ptr, beta_ptr, lam_ptr, last_ptr, offsets_ptr, seq_ptr, x_ptr, y_ptr, eta_ptr,
                       lg_ptr, T_pad, H, eps, one_minus_eps_gamma, K: tl.constexpr, V: tl.constexpr,
                       BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SHIFTED: tl.constexpr,
                       HAS_LAST: tl.constexpr, PACKED: tl.constexpr, NLMS: tl.constexpr, SCALED: tl.constexpr,
                       SEQ: tl.constexpr):
    """x [N, T_pad, H, K], y [N, T_pad, H, V] (k's / v's dtype; PACKED only), eta and lg [N, T_pad, H] float32.
    Grid (cdiv(T_pad, BT), N * H)."""
    i_n, i_h, t, _, exists, _, src, ck, kmask, x, _, _, _, _, _, _, eta, _, _, lg = _steps(
        k_ptr, v_ptr, beta_ptr, lam_ptr, last_ptr, offsets_ptr, seq_ptr, T_pad, H, eps, one_minus_eps_gamma, K, V,
        BT, BK, BV, SHIFTED, HAS_LAST, PACKED, NLMS, SCALED, SEQ, False)
    rows = (i_n.to(tl.int64) * T_pad + t) * H + i_h                                     # padded output rows [BT]
    inside = t < T_pad
    tl.store(x_ptr + rows[:, None] * K + ck[None, :], x, mask=inside[:, None] & kmask[None, :])
    if PACKED:  # y is written (`value_rows`)
        cv = tl.arange(0, BV)
        vmask = cv < V
        y = tl.load(v_ptr + (src * H + i_h)[:, None] * V + cv[None, :], mask=exists[:, None] & vmask[None, :],
                    other=0.0)
        tl.store(y_ptr + rows[:, None] * V + cv[None, :], y, mask=inside[:, None] & vmask[None, :])
    tl.store(eta_ptr + rows, eta, mask=inside)
    tl.store(lg_ptr + rows, lg, mask=inside)


@triton.jit(do_not_specialize=_SIZES)
def prepare_bwd_kernel(x_ptr, beta_ptr, lam_ptr, offsets_ptr, seq_ptr, dx_ptr, dy_ptr, deta_ptr, dlg_ptr, dk_ptr,
                       dv_ptr, dbeta_ptr, dlam_ptr, dlast_ptr, T_pad, H, eps, one_minus_eps_gamma, K: tl.constexpr,
                       V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SHIFTED: tl.constexpr,
                       HAS_LAST: tl.constexpr, PACKED: tl.constexpr, NLMS: tl.constexpr, SCALED: tl.constexpr,
                       SEQ: tl.constexpr):
    """dk, dv (x's / dy's dtype, laid out as k, v; dv with PACKED only), d beta, d lam (float32, as beta, lam) and
    d last_k [N, H, K] for the gradients of x, y, eta, lg (padded rows), from the forward's x (its keys: k itself is
    not kept) and beta, lam. Every row of every output is written (shifted: a sequence's last key feeds no write
    here, so its dk row gets zeros). Grid (cdiv(T_pad, BT), N * H)."""
    i_n, i_h, t, valid, exists, restart, src, ck, kmask, _, xf, E, beta, _, ridge, denom, eta, a, alpha, _ = _steps(
        x_ptr, x_ptr, beta_ptr, lam_ptr, x_ptr, offsets_ptr, seq_ptr, T_pad, H, eps, one_minus_eps_gamma, K, V,
        BT, BK, BV, SHIFTED, HAS_LAST, PACKED, NLMS, SCALED, SEQ, True)
    rows = (i_n.to(tl.int64) * T_pad + t) * H + i_h
    dlg = tl.load(dlg_ptr + rows, mask=valid & ~restart, other=0.0).to(tl.float32)  # a restart's lg is a constant
    deta = tl.load(deta_ptr + rows, mask=valid, other=0.0).to(tl.float32)
    g_beta, g_lam, g_E = step_size_grads(deta, dlg, E, beta, ridge, denom, eta, a, alpha, exists, one_minus_eps_gamma,
                                          NLMS, SCALED)
    tl.store(dbeta_ptr + src * H + i_h, g_beta, mask=valid)
    tl.store(dlam_ptr + src * H + i_h, g_lam, mask=valid)

    dx = tl.load(dx_ptr + rows[:, None] * K + ck[None, :], mask=valid[:, None] & kmask[None, :], other=0.0)
    g_x = dx.to(tl.float32) + 2.0 * g_E[:, None] * xf
    g_x = tl.where(exists[:, None], g_x, 0.0).to(dk_ptr.dtype.element_ty)
    if SHIFTED:
        prev = (src - 1) * H + i_h
        tl.store(dk_ptr + prev[:, None] * K + ck[None, :], g_x, mask=(valid & (t >= 1))[:, None] & kmask[None, :])
        if PACKED:
            last_row = t == tl.load(offsets_ptr + i_n + 1) - tl.load(offsets_ptr + i_n) - 1
        else:
            last_row = t == T_pad - 1
        tl.store(dk_ptr + (src * H + i_h)[:, None] * K + ck[None, :], tl.zeros_like(g_x),
                 mask=last_row[:, None] & kmask[None, :])
        if HAS_LAST:
            head = (i_n * H + i_h).to(tl.int64) * K
            tl.store(dlast_ptr + head + ck[None, :] + 0 * t[:, None], g_x, mask=(t == 0)[:, None] & kmask[None, :])
    else:
        tl.store(dk_ptr + (src * H + i_h)[:, None] * K + ck[None, :], g_x, mask=valid[:, None] & kmask[None, :])

    if PACKED:  # y is written (`value_rows`)
        cv = tl.arange(0, BV)
        vmask = cv < V
        dy = tl.load(dy_ptr + rows[:, None] * V + cv[None, :], mask=valid[:, None] & vmask[None, :], other=0.0)
        dy = tl.where(exists[:, None], dy, 0.0).to(dv_ptr.dtype.element_ty)
        tl.store(dv_ptr + (src * H + i_h)[:, None] * V + cv[None, :], dy, mask=valid[:, None] & vmask[None, :])


def _launch(k, v, offsets, max_len):
    N = k.shape[0] if offsets is None else offsets.shape[0] - 1
    H, K, V = k.shape[2], k.shape[3], v.shape[3]
    if N * H > MAX_GRID_YZ:
        raise ValueError(f"the preparation kernels put the rows x heads ({N * H}) on a launch-grid axis limited to "
                         f"{MAX_GRID_YZ}: call fast_weight_attention (it splits the batch)")
    sizes = {"K": K, "V": V, "BT": BT, "BK": max(16, next_power_of_2(K)),
             "BV": max(16, next_power_of_2(V))}
    return N, H, K, V, (cdiv(max_len, BT), N * H), sizes


def _flags(last_k, offsets, seq_idx, shifted, nlms, ridge_scaling):
    return {"SHIFTED": shifted, "HAS_LAST": shifted and last_k is not None, "PACKED": offsets is not None,
            "NLMS": nlms, "SCALED": ridge_scaling, "SEQ": seq_idx is not None}


def value_rows(offsets, max_len: int) -> int:
    """The rows of y the forward writes: max_len for packed rows, none on rows (y is v there: module docstring)."""
    return 0 if offsets is None else max_len


def value_grad(y: torch.Tensor, beta: torch.Tensor, offsets) -> torch.Tensor:
    """The backward's dv buffer: v's rows (as beta's) for packed rows; none on rows (v's gradient is the scan's)."""
    N, _, H, V = y.shape
    return y.new_empty(*beta.shape, V) if offsets is not None else y.new_empty(N, 0, H, V)


def _pointers(k, last_k, offsets, seq_idx):
    """The optional inputs' pointers (k where absent: never read)."""
    return tuple(k if t is None else t for t in (last_k, offsets, seq_idx))


def forward(k, v, beta, lam, last_k, offsets, seq_idx, max_len: int, shifted: bool, nlms: bool, ridge_scaling: bool,
            eps: float, eps_gamma: float):
    """x [N, max_len, H, K] (k's dtype), y [N, value_rows, H, V] (v's dtype; no rows without offsets: v takes its
    place), eta, log_gamma [N, max_len, H] float32 on contiguous inputs: k [B, T, H, K], v [B, T, H, V], beta, lam
    [B, T, H] float32, last_k [N, H, K] (k's dtype) or None, offsets [N + 1] int64 on k's device or None (then N = B
    and max_len = T), seq_idx [B, T] integers (a document index per step; without offsets) or None."""
    N, H, K, V, grid, sizes = _launch(k, v, offsets, max_len)
    x = k.new_empty(N, max_len, H, K)
    y = v.new_empty(N, value_rows(offsets, max_len), H, V)
    eta = torch.empty(N, max_len, H, dtype=torch.float32, device=k.device)
    lg = torch.empty_like(eta)
    prepare_fwd_kernel[grid](
        k, v, beta, lam, *_pointers(k, last_k, offsets, seq_idx), x, y, eta, lg, max_len, H, eps, 1.0 - eps_gamma,
        **sizes, **_flags(last_k, offsets, seq_idx, shifted, nlms, ridge_scaling), num_warps=NUM_WARPS)
    return x, y, eta, lg


def backward(dx, dy, deta, dlg, x, y, beta, lam, last_k, offsets, seq_idx, max_len: int, shifted: bool, nlms: bool,
             ridge_scaling: bool, eps: float, eps_gamma: float):
    """dk, dv ([B, T, H, K] / [B, T, H, V] as beta's rows, in x's / y's dtype; dv without rows when y has none: v's
    gradient is then the scan's), d beta, d lam (float32) and d last_k ([N, H, K], zeros when last_k is None) for the
    gradients of the forward's four outputs (contiguous, their shapes), from the forward's outputs x and y (y for its
    shape and dtype only) and its inputs beta, lam, last_k: k and v are not needed, so the autograd formula keeps
    neither (x holds every key a pair reads)."""
    N, H, K, _, grid, sizes = _launch(x, y, offsets, max_len)
    # Every input row is some step's (t < its length), which writes its dk, dv, d beta, d lam (zeros where no pair).
    dk = x.new_empty(*beta.shape, K)
    dv = value_grad(y, beta, offsets)
    dbeta = torch.empty_like(beta)
    dlam = torch.empty_like(lam)
    dlast = x.new_zeros(N, H, K)
    _, offsets_ptr, seq_ptr = _pointers(x, last_k, offsets, seq_idx)
    prepare_bwd_kernel[grid](
        x, beta, lam, offsets_ptr, seq_ptr, dx, dy, deta, dlg, dk, dv, dbeta, dlam, dlast, max_len, H, eps,
        1.0 - eps_gamma, **sizes, **_flags(last_k, offsets, seq_idx, shifted, nlms, ridge_scaling),
        num_warps=NUM_WARPS)
    return dk, dv, dbeta, dlam, dlast
