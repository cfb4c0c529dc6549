"""Triton kernels of the chunked Mamba-2 SSD scan, forward and backward.

Imported only by `scan.py` (of this folder), which is itself imported lazily: this file needs triton at import
time. The math (README.md of this folder, equation numbers (F1)-(F4), (B1)-(B6)), per (b, h) and per chunk of BT
steps, with i, j steps inside the chunk, l_t = dt_t A_h (<= 0), c_i = l_0 + ... + l_i (chunk-local, inclusive),
M[i, j] = [j <= i], u_j = dt_j x_j, h_in / h_out the state entering / leaving the chunk ([P, N]):

    forward                                               backward (dy, dS = dL/dh_out)
    W = sum_j exp(c_last - c_j) u_j B_j^T          (F2)   V = sum_i exp(c_i) dy_i C_i^T                 (B1)
    h_out = exp(c_last) h_in + W                   (F3)   dh_in = exp(c_last) dS + V                    (B2)
    y_i = sum_j M exp(c_i - c_j) (C_i . B_j) u_j   (F4)   dx, ddt, dl per chunk (all of P)              (B3-B5)
          + exp(c_i) h_in C_i + D x_i                     dB, dC per chunk, group, block of N           (B6)

Tensors are contiguous: x, y, dy [b, T, H, P]; B, C [b, T, G, N] (head h reads group h // (H // G)); dt [b, T, H]
float32; A, D [H] float32; the chunk-local cumulative decays cum [b * H, T_pad] float32 (T_pad = n_chunks * BT;
padded steps carry l = 0, so they repeat the last value); per-chunk states [b * H, n_chunks, P, N] float32. Steps
t >= T are masked on load (zeros: no write, no read, no decay). Matmul operands are in the inputs' dtype (fp32
with PREC = "ieee", or bf16/fp16) with fp32 accumulation; masked decay entries are set to -inf before the
exponential, so every exponent is <= 0 and nothing overflows.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from hybridlm.ops.triton_utils import autotune, load_rows, load_steps, state_offsets, store_rows

_autotune = functools.partial(autotune, fixed_warps=4)


_KEY = ["P", "N", "BT"]
_SIZES = ["T", "T_pad", "n_chunks"]  # runtime sizes: no recompilation per sequence length


# --------------------------------------------------------------------------------------------------- helpers


@triton.jit
def _chunk_cum(cum_ptr, i_bh, i_c, T_pad, BT: tl.constexpr):
    """The chunk's c_i [BT] and c_last (a scalar)."""
    base = cum_ptr + i_bh.to(tl.int64) * T_pad + i_c * BT
    return tl.load(base + tl.arange(0, BT)), tl.load(base + BT - 1)


@triton.jit
def _segsum_decay(c, BT: tl.constexpr):
    """[BT, BT] exp(c_i - c_j) for j <= i, else 0: the mask is applied before the exp (exponents <= 0)."""
    i = tl.arange(0, BT)
    return tl.exp(tl.where(i[:, None] >= i[None, :], c[:, None] - c[None, :], float("-inf")))


# --------------------------------------------------------------------------------------------------- forward


@triton.jit(do_not_specialize=_SIZES)
def chunk_cumsum_kernel(dt_ptr, A_ptr, cum_ptr, T, T_pad, H, BT: tl.constexpr):
    """(F1) cum[bh, c * BT + i] = sum_{r <= i} dt[b, c * BT + r, h] * A[h]. Grid (n_chunks, b * H)."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    t = i_c * BT + tl.arange(0, BT)
    l = load_steps(dt_ptr, i_b, i_h, t, T, H) * tl.load(A_ptr + i_h)
    tl.store(cum_ptr + i_bh.to(tl.int64) * T_pad + t, tl.cumsum(l, axis=0))


@_autotune(_KEY)
@triton.jit(do_not_specialize=_SIZES)
def chunk_state_kernel(a_ptr, w_ptr, dt_ptr, cum_ptr, out_ptr, T, T_pad, n_chunks, H, G,
                       P: tl.constexpr, N: tl.constexpr, BT: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                       GRAD: tl.constexpr, PREC: tl.constexpr):
    """out[bh, c] = sum_t coef_t a_t w_t^T, one [BP, BN] block; a is [b, T, H, P], w [b, T, G, N].
    (F2) a = x, w = B, coef_t = exp(c_last - c_t) dt_t: what the chunk writes, decayed to its end.
    (B1) GRAD: a = dy, w = C, coef_t = exp(c_t): the chunk's reads, as a gradient of its entry state.
    Grid (nP * nN, n_chunks, b * H)."""
    i_pn, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_p, i_n = i_pn // tl.cdiv(N, BN), i_pn % tl.cdiv(N, BN)
    i_b, i_h = i_bh // H, i_bh % H
    i_g = i_h // (H // G)
    t = i_c * BT + tl.arange(0, BT)
    rp, rn = i_p * BP + tl.arange(0, BP), i_n * BN + tl.arange(0, BN)
    a = load_rows(a_ptr, i_b, i_h, t, T, H, P, rp)                                          # [BT, BP]
    w = load_rows(w_ptr, i_b, i_g, t, T, G, N, rn)                                          # [BT, BN]
    c, c_last = _chunk_cum(cum_ptr, i_bh, i_c, T_pad, BT)
    if GRAD:
        coef = tl.exp(c)
    else:
        coef = tl.exp(c_last - c) * load_steps(dt_ptr, i_b, i_h, t, T, H)                   # [BT]
    out = tl.dot(tl.trans((a * coef[:, None]).to(a.dtype)), w, input_precision=PREC)        # [BP, BN] fp32
    offs, mask = state_offsets(i_bh, i_c, n_chunks, P, N, rp, rn)
    tl.store(out_ptr + offs, out, mask=mask)


@triton.jit
def _pass_chunk(h_ptr, cum_ptr, k, i_bh, T_pad, n_chunks, P: tl.constexpr, N: tl.constexpr, BT: tl.constexpr,
                rp, rn, mask, REVERSE: tl.constexpr):
    """The k-th chunk of the walk (the last first when REVERSE): its offsets in h, its term h[c] and its decay
    exp(c_last); past the walk's end the term and decay are masked off (zeros, read by nothing)."""
    if REVERSE:
        i_c = n_chunks - 1 - k
    else:
        i_c = k
    live = k < n_chunks
    offs, _ = state_offsets(i_bh, i_c, n_chunks, P, N, rp, rn)
    term = tl.load(h_ptr + offs, mask=mask & live, other=0.0)
    decay = tl.exp(tl.load(cum_ptr + i_bh.to(tl.int64) * T_pad + i_c * BT + BT - 1, mask=live, other=0.0))
    return offs, term, decay


@triton.jit
def _pass_step(h_ptr, cum_ptr, S, k, offs, term, decay, offs1, term1, decay1, i_bh, T_pad, n_chunks,
               P: tl.constexpr, N: tl.constexpr, BT: tl.constexpr, rp, rn, mask, REVERSE: tl.constexpr):
    """Step k of the walk, chunk k's (offs, term, decay) and chunk k + 1's loaded: load chunk k + 2's, swap h[c] for
    the carried S, return exp(c_last) S + term and the two loaded chunks moved up by one."""
    offs2, term2, decay2 = _pass_chunk(h_ptr, cum_ptr, k + 2, i_bh, T_pad, n_chunks, P, N, BT, rp, rn, mask, REVERSE)
    tl.store(h_ptr + offs, S, mask=mask)
    return decay * S + term, offs1, term1, decay1, offs2, term2, decay2


@triton.jit(do_not_specialize=_SIZES)
def state_pass_kernel(h_ptr, init_ptr, final_ptr, cum_ptr, T_pad, n_chunks,
                      P: tl.constexpr, N: tl.constexpr, BT: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                      HAS_INIT: tl.constexpr, REVERSE: tl.constexpr, INTERPRET: tl.constexpr):
    """(F3) / (B2): the sequential pass over chunks, in place, float32. h[c] holds chunk c's term (W of (F2) or V of
    (B1)) on entry and the value carried into chunk c on exit. Forward: S <- exp(c_last) S + W[c] from S = h0, so
    h[c] ends as h_in of chunk c and `final` is the final state. REVERSE: from the last chunk down, from S = dL/dh_T,
    so h[c] ends as dS (= dL/dh_out) of chunk c and `final` is dL/dh0. Grid (nP * nN, b * H).

    The terms and decays are loaded two chunks ahead of the step that adds them: no step waits on a load issued in
    it, so the walk's time is not one memory round trip per chunk (nothing else in a step hides it).
    INTERPRET: a while loop (Triton's CPU interpreter cannot `range` over a runtime int with numpy >= 2.4)."""
    i_pn, i_bh = tl.program_id(0), tl.program_id(1)
    i_p, i_n = i_pn // tl.cdiv(N, BN), i_pn % tl.cdiv(N, BN)
    rp, rn = i_p * BP + tl.arange(0, BP), i_n * BN + tl.arange(0, BN)
    offs0, mask = state_offsets(i_bh, 0, 1, P, N, rp, rn)                                  # [P, N] of row bh
    if HAS_INIT:
        S = tl.load(init_ptr + offs0, mask=mask, other=0.0).to(tl.float32)
    else:
        S = tl.zeros([BP, BN], dtype=tl.float32)
    offs, term, decay = _pass_chunk(h_ptr, cum_ptr, 0, i_bh, T_pad, n_chunks, P, N, BT, rp, rn, mask, REVERSE)
    offs1, term1, decay1 = _pass_chunk(h_ptr, cum_ptr, 1, i_bh, T_pad, n_chunks, P, N, BT, rp, rn, mask, REVERSE)
    if INTERPRET:
        k = 0
        while k < n_chunks:
            S, offs, term, decay, offs1, term1, decay1 = _pass_step(
                h_ptr, cum_ptr, S, k, offs, term, decay, offs1, term1, decay1, i_bh, T_pad, n_chunks, P, N, BT, rp,
                rn, mask, REVERSE)
            k += 1
    else:
        for k in range(n_chunks):
            S, offs, term, decay, offs1, term1, decay1 = _pass_step(
                h_ptr, cum_ptr, S, k, offs, term, decay, offs1, term1, decay1, i_bh, T_pad, n_chunks, P, N, BT, rp,
                rn, mask, REVERSE)
    tl.store(final_ptr + offs0, S, mask=mask)


@_autotune(_KEY)
@triton.jit(do_not_specialize=_SIZES)
def output_kernel(x_ptr, B_ptr, C_ptr, dt_ptr, D_ptr, cum_ptr, h_ptr, y_ptr, T, T_pad, n_chunks, H, G,
                  P: tl.constexpr, N: tl.constexpr, BT: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                  HAS_D: tl.constexpr, PREC: tl.constexpr):
    """(F4) y_i = sum_j M[i, j] exp(c_i - c_j) (C_i . B_j) dt_j x_j + exp(c_i) h_in C_i (+ D x_i), a [BT, BP]
    block; loops over blocks of N. Grid (nP, n_chunks, b * H)."""
    i_p, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    i_g = i_h // (H // G)
    t = i_c * BT + tl.arange(0, BT)
    rp = i_p * BP + tl.arange(0, BP)
    CB = tl.zeros([BT, BT], dtype=tl.float32)                                               # C_i . B_j
    y_inter = tl.zeros([BT, BP], dtype=tl.float32)                                          # h_in C_i
    for i_n in range(tl.cdiv(N, BN)):
        rn = i_n * BN + tl.arange(0, BN)
        Cb = load_rows(C_ptr, i_b, i_g, t, T, G, N, rn)                                    # [BT, BN]
        Bb = load_rows(B_ptr, i_b, i_g, t, T, G, N, rn)
        offs, mask = state_offsets(i_bh, i_c, n_chunks, P, N, rp, rn)
        S = tl.load(h_ptr + offs, mask=mask, other=0.0)                                     # [BP, BN] fp32
        CB += tl.dot(Cb, tl.trans(Bb), input_precision=PREC)
        y_inter += tl.dot(Cb, tl.trans(S).to(Cb.dtype), input_precision=PREC)
    c, _ = _chunk_cum(cum_ptr, i_bh, i_c, T_pad, BT)
    dt = load_steps(dt_ptr, i_b, i_h, t, T, H)
    x = load_rows(x_ptr, i_b, i_h, t, T, H, P, rp)                                          # [BT, BP]
    scores = CB * _segsum_decay(c, BT) * dt[None, :]                                        # [BT(i), BT(j)]
    y = y_inter * tl.exp(c)[:, None] + tl.dot(scores.to(x.dtype), x, input_precision=PREC)
    if HAS_D:
        y += tl.load(D_ptr + i_h) * x.to(tl.float32)
    store_rows(y_ptr, y, i_b, i_h, t, T, H, P, rp)


# -------------------------------------------------------------------------------------------------- backward


@_autotune(_KEY)
@triton.jit(do_not_specialize=_SIZES)
def grad_x_kernel(x_ptr, B_ptr, C_ptr, dt_ptr, A_ptr, D_ptr, cum_ptr, h_ptr, dh_ptr, dy_ptr,
                  dx_ptr, ddt_ptr, dl_ptr, dD_ptr, T, T_pad, n_chunks, H, G,
                  P: tl.constexpr, N: tl.constexpr, BT: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                  HAS_D: tl.constexpr, PREC: tl.constexpr):
    """(B3)-(B5) per chunk, BP covering all of P (the per-step sums run over P), looping over blocks of N; with
    K[i, j] = M[i, j] exp(c_i - c_j) (C_i . B_j), h_in = h[c], dS = dh[c]:

        du_j  = sum_i K[i, j] dy_i + exp(c_last - c_j) dS B_j           (B3)  dL/du_j, u_j = dt_j x_j
        dx_j  = dt_j du_j + D dy_j,   ddt_j = x_j . du_j + A dl_j,   dD partial = sum_j dy_j . x_j
        dc_k  = sum_j T[k, j] + dy_k . (exp(c_k) h_in C_k) - u_k . du_k  (B4)  T[i, j] = K[i, j] dt_j (dy_i . x_j)
        dl_r  = sum_{k >= r} dc_k + <dS, h_out>                          (B5)  h_out = exp(c_last) h_in + W

    dl (the gradient of the step's log decay l_r = dt_r A) is written for dA = sum dt dl (summed outside).
    Grid (n_chunks, b * H)."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    i_g = i_h // (H // G)
    t = i_c * BT + tl.arange(0, BT)
    rp = tl.arange(0, BP)
    CB = tl.zeros([BT, BT], dtype=tl.float32)                                               # C_i . B_j
    y_inter = tl.zeros([BT, BP], dtype=tl.float32)                                          # h_in C_i
    dSB = tl.zeros([BT, BP], dtype=tl.float32)                                              # dS B_j
    s_dot = 0.0                                                                             # <dS, h_in>
    for i_n in range(tl.cdiv(N, BN)):
        rn = i_n * BN + tl.arange(0, BN)
        Cb = load_rows(C_ptr, i_b, i_g, t, T, G, N, rn)                                    # [BT, BN]
        Bb = load_rows(B_ptr, i_b, i_g, t, T, G, N, rn)
        offs, mask = state_offsets(i_bh, i_c, n_chunks, P, N, rp, rn)
        S = tl.load(h_ptr + offs, mask=mask, other=0.0)                                     # [BP, BN] fp32
        dS = tl.load(dh_ptr + offs, mask=mask, other=0.0)
        CB += tl.dot(Cb, tl.trans(Bb), input_precision=PREC)
        y_inter += tl.dot(Cb, tl.trans(S).to(Cb.dtype), input_precision=PREC)
        dSB += tl.dot(Bb, tl.trans(dS).to(Bb.dtype), input_precision=PREC)
        s_dot += tl.sum(tl.sum(S * dS, axis=1), axis=0)
    c, c_last = _chunk_cum(cum_ptr, i_bh, i_c, T_pad, BT)
    dt = load_steps(dt_ptr, i_b, i_h, t, T, H)
    x = load_rows(x_ptr, i_b, i_h, t, T, H, P, rp)                                          # [BT, BP]
    dy = load_rows(dy_ptr, i_b, i_h, t, T, H, P, rp)
    xf, dyf = x.to(tl.float32), dy.to(tl.float32)
    K = CB * _segsum_decay(c, BT)                                                           # [BT(i), BT(j)]
    to_end = tl.exp(c_last - c)                                                             # [BT]
    # (B3) du_j = sum_i K[i, j] dy_i + exp(c_last - c_j) dS B_j
    du = tl.dot(tl.trans(K).to(dy.dtype), dy, input_precision=PREC) + dSB * to_end[:, None]
    dx = du * dt[:, None]
    if HAS_D:
        dx += tl.load(D_ptr + i_h) * dyf
    x_du = tl.sum(xf * du, axis=1)                                                          # [BT]
    # (B4) the decay c_k enters as exp(+c_k) in its reads and exp(-c_k) in its writes
    dyx = tl.dot(dy, tl.trans(x), input_precision=PREC)                                     # dy_i . x_j
    reads = tl.sum(K * dyx * dt[None, :], axis=1) + tl.sum(dyf * y_inter * tl.exp(c)[:, None], axis=1)
    dc = reads - dt * x_du
    # (B5) <dS, h_out> = exp(c_last) <dS, h_in> + sum_j exp(c_last - c_j) dt_j x_j . (dS B_j)
    exit_term = tl.exp(c_last) * s_dot + tl.sum(to_end * dt * tl.sum(xf * dSB, axis=1), axis=0)
    dl = tl.cumsum(dc, axis=0, reverse=True) + exit_term
    ddt = x_du + tl.load(A_ptr + i_h) * dl
    store_rows(dx_ptr, dx, i_b, i_h, t, T, H, P, rp)
    step_offs = (i_b.to(tl.int64) * T + t) * H + i_h
    tl.store(ddt_ptr + step_offs, ddt, mask=t < T)
    tl.store(dl_ptr + step_offs, dl, mask=t < T)
    tl.store(dD_ptr + i_bh.to(tl.int64) * n_chunks + i_c, tl.sum(tl.sum(xf * dyf, axis=1), axis=0))


@_autotune(_KEY)
@triton.jit(do_not_specialize=_SIZES)
def grad_bc_kernel(x_ptr, B_ptr, C_ptr, dt_ptr, cum_ptr, h_ptr, dh_ptr, dy_ptr, dB_ptr, dC_ptr,
                   T, T_pad, n_chunks, H, G,
                   P: tl.constexpr, N: tl.constexpr, BT: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                   R: tl.constexpr, PREC: tl.constexpr):
    """(B6) per chunk, group and block of N, BP covering all of P; summed over the R = H / G heads h of the group,
    with Gm[i, j] = M[i, j] exp(c_i - c_j) dt_j (dy_i . x_j) (all of head h):

        dC_i = sum_h [ exp(c_i) h_in^T dy_i + sum_j Gm[i, j] B_j ]
        dB_j = sum_h [ sum_i Gm[i, j] C_i + exp(c_last - c_j) dt_j dS^T x_j ]

    Grid (nN, n_chunks, b * G)."""
    i_n, i_c, i_bg = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_g = i_bg // G, i_bg % G
    t = i_c * BT + tl.arange(0, BT)
    rp, rn = tl.arange(0, BP), i_n * BN + tl.arange(0, BN)
    Cb = load_rows(C_ptr, i_b, i_g, t, T, G, N, rn)                                        # [BT, BN]
    Bb = load_rows(B_ptr, i_b, i_g, t, T, G, N, rn)
    dC = tl.zeros([BT, BN], dtype=tl.float32)
    dB = tl.zeros([BT, BN], dtype=tl.float32)
    for r in range(R):  # the heads of the group (R is a compile-time constant)
        i_h = i_g * R + r
        i_bh = i_b * H + i_h
        x = load_rows(x_ptr, i_b, i_h, t, T, H, P, rp)                                      # [BT, BP]
        dy = load_rows(dy_ptr, i_b, i_h, t, T, H, P, rp)
        offs, mask = state_offsets(i_bh, i_c, n_chunks, P, N, rp, rn)
        S = tl.load(h_ptr + offs, mask=mask, other=0.0)                                     # [BP, BN] fp32
        dS = tl.load(dh_ptr + offs, mask=mask, other=0.0)
        c, c_last = _chunk_cum(cum_ptr, i_bh, i_c, T_pad, BT)
        dt = load_steps(dt_ptr, i_b, i_h, t, T, H)
        Gm = tl.dot(dy, tl.trans(x), input_precision=PREC) * _segsum_decay(c, BT) * dt[None, :]  # [BT(i), BT(j)]
        dC += tl.dot(dy, S.to(dy.dtype), input_precision=PREC) * tl.exp(c)[:, None] \
            + tl.dot(Gm.to(Bb.dtype), Bb, input_precision=PREC)
        dB += tl.dot(tl.trans(Gm).to(Cb.dtype), Cb, input_precision=PREC) \
            + tl.dot(x, dS.to(x.dtype), input_precision=PREC) * (tl.exp(c_last - c) * dt)[:, None]
    store_rows(dC_ptr, dC, i_b, i_g, t, T, G, N, rn)
    store_rows(dB_ptr, dB, i_b, i_g, t, T, G, N, rn)
