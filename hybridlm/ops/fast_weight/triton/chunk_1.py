"""Rule 1 (regression / delta rule, scalar decay, window 1) on prepared writes: Triton forward, torch backward.

    S_t = exp(log_gamma_t) S_{t-1} + eta_t x_t (y_t - S_{t-1}^T x_t)^T     o_t = S_t^T q_t (read after) or S_{t-1}^T q_t

Forward (Triton): chunk-local cumulative decays (`kernels.chunk_cumsum_kernel`) -> the WY factors of every chunk,
U = (I + A)^-1 Y and W = (I + A)^-1 diag(exp L_{s-1}) X, all chunks in parallel (`kernels_delta.wy_kernel`) ->
the sequential pass r_c = U_c - W_c S_c, S_{c+1} = exp(L_last) S_c + X_c^T diag(exp(L_last - L_s) eta_s) r_c
(`kernels_delta.delta_pass_kernel`) -> the outputs, which are rule 1A's with y replaced by the residuals r
(`kernels.output_kernel`).

Backward: NOT in Triton yet. It recomputes the forward through the torch chunk path (`chunk._chunk_scan` on the
same prepared inputs, in float32, under autograd) and differentiates that, so it costs what the chunk backend's
forward + backward cost (and its memory), on top of the Triton forward.
"""

from __future__ import annotations

import torch

from hybridlm.ops.fast_weight.chunk import _chunk_scan
from hybridlm.ops.fast_weight.triton import kernels, kernels_delta
from hybridlm.ops.fast_weight.triton.chunk_1a import _block, _check, _interpreting


def fast_weight_1_triton(
    q: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    eta: torch.Tensor,
    log_gamma: torch.Tensor,
    S0: torch.Tensor | None,
    *,
    read_after: bool,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rule 1 on prepared quantities (the same contract as `chunk_1a.fast_weight_1a_triton`), differentiable in
    every input. Returns o `[N, T, H, V]` in q's dtype and the final state `[N, H, K, V]` float32."""
    _check(q, x, y, eta, log_gamma, S0, chunk_size)
    return _FastWeight1.apply(q, x, y, eta, log_gamma, S0, bool(read_after), int(chunk_size))


class _FastWeight1(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, x, y, eta, log_gamma, S0, read_after, chunk_size):
        q, x, y, eta, log_gamma = (t.contiguous() for t in (q, x, y, eta, log_gamma))
        S0 = None if S0 is None else S0.contiguous()
        o, S_final = _forward(q, x, y, eta, log_gamma, S0, read_after, chunk_size)
        ctx.save_for_backward(q, x, y, eta, log_gamma, S0)
        ctx.read_after, ctx.chunk_size = read_after, chunk_size
        ctx.set_materialize_grads(False)
        return o, S_final

    @staticmethod
    def backward(ctx, do, dS_final):
        q, x, y, eta, log_gamma, S0 = ctx.saved_tensors
        N, _, H, K = q.shape
        V = y.shape[-1]
        leaves = [t.detach().float().requires_grad_(True) for t in (q, x, y, eta, log_gamma)]
        S_in = (S0.detach() if S0 is not None else q.new_zeros(N, H, K, V, dtype=torch.float32)).float()
        S_in.requires_grad_(S0 is not None and ctx.needs_input_grad[5])
        with torch.enable_grad():
            qf, xf, yf, etaf, lgf = leaves
            o, S = _chunk_scan(qf.transpose(1, 2), xf.transpose(1, 2)[:, :, :, None], yf.transpose(1, 2)[:, :, :, None],
                               etaf.transpose(1, 2)[..., None, None], lgf.transpose(1, 2)[..., None], S_in,
                               regression=True, read_after=ctx.read_after, chunk_size=ctx.chunk_size)
            outputs, grads_out = [], []
            if do is not None:
                outputs.append(o.transpose(1, 2))
                grads_out.append(do.float())
            if dS_final is not None:
                outputs.append(S)
                grads_out.append(dS_final.float())
            inputs = leaves + ([S_in] if S_in.requires_grad else [])
            if outputs:
                grads = torch.autograd.grad(outputs, inputs, grads_out, allow_unused=True)
            else:
                grads = [None] * len(inputs)
        grads = [None if g is None else g.to(t.dtype) for g, t in zip(grads, (q, x, y, eta, log_gamma, S0))]
        dS0 = grads[5] if len(grads) > 5 else None
        return (*grads[:5], dS0, None, None)


def _forward(q, x, y, eta, log_gamma, S0, read_after, chunk_size):
    N, T, H, K = q.shape
    V = y.shape[-1]
    BT = chunk_size
    n_chunks = -(-T // BT)
    T_pad = n_chunks * BT
    NH = N * H
    device = q.device
    prec = "ieee" if q.dtype == torch.float32 else "tf32"  # products of the 16-bit / fp32 inputs
    prec32 = "ieee" if q.dtype == torch.float32 else "tf32"  # products of the fp32 WY factors and states
    interpreting = _interpreting()
    BK_full = _block(K, 128)

    L = torch.empty(NH, T_pad, dtype=torch.float32, device=device)
    kernels.chunk_cumsum_kernel[(n_chunks, NH)](log_gamma, L, T, T_pad, H, BT=BT)

    U = torch.empty(NH, T_pad, V, dtype=torch.float32, device=device)
    W = torch.empty(NH, T_pad, K, dtype=torch.float32, device=device)
    kernels_delta.wy_kernel[(n_chunks, NH)](x, y, eta, L, U, W, T, T_pad, n_chunks, H, K=K, V=V, BT=BT, BK=BK_full,
                                             BV=_block(V, 64), PREC=prec, PREC32=prec32)

    states = torch.empty(NH, n_chunks, K, V, dtype=torch.float32, device=device)
    R = torch.empty(N, T, H, V, dtype=torch.float32, device=device)
    final = torch.empty(N, H, K, V, dtype=torch.float32, device=device)
    BV_pass = _block(V, 32 if BK_full > 64 else 64)
    kernels_delta.delta_pass_kernel[(-(-V // BV_pass), NH)](
        x, eta, L, U, W, final if S0 is None else S0, states, R, final, T, T_pad, n_chunks, H, K=K, V=V, BT=BT,
        BK=BK_full, BV=BV_pass, HAS_INIT=S0 is not None, INTERPRET=interpreting, PREC32=prec32, num_warps=4)

    # Outputs: rule 1A's output kernel with the (float32) residuals in place of y.
    o = torch.empty(N, T, H, V, dtype=q.dtype, device=device)
    BK, BV = _block(K, 64), _block(V, 64)
    kernels.output_kernel[(-(-V // BV), n_chunks, NH)](
        q, x, R, eta, L, states, o, T, T_pad, n_chunks, H, K=K, V=V, BT=BT, BK=BK, BV=BV, READ_AFTER=read_after, PREC=prec32)
    return o, final
