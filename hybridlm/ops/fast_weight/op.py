"""The front door of the Falcon fast-weight rules: argument checks, dtype policy, backend choice."""

from __future__ import annotations

import torch

from hybridlm.ops.fast_weight.chunk import fast_weight_chunk
from hybridlm.ops.fast_weight.naive import fast_weight_naive
from hybridlm.ops.fast_weight.options import FastWeightOptions, restarts_in_place
from hybridlm.ops.fast_weight.recurrent import fast_weight_recurrent
from hybridlm.ops.fast_weight.state import FastWeightState
from hybridlm.ops.fast_weight.triton import auto_takes as triton_auto_takes
from hybridlm.ops.fast_weight.triton import fast_weight_triton
from hybridlm.ops.fast_weight.triton import slow_path_reason as triton_slow_path_reason
from hybridlm.ops.fast_weight.triton import step_takes as triton_step_takes
from hybridlm.ops.utils import (
    check_cu_seqlens,
    compute_dtype,
    call_in_row_groups,
    needs_grad,
    resolve_backend,
    triton_available,
    triton_runs_on,
    warn_slow_path,
)

BACKENDS = ("naive", "recurrent", "chunk", "triton")
_NO_TRITON = ("triton is not installed: backend='auto' runs the fast-weight op on CUDA through the torch chunk path "
              "(slower, more memory); install triton for its Triton kernels")


def fast_weight_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    lam: torch.Tensor | None = None,
    *,
    rule: str,
    window: int = 1,
    pairing: str = "shifted",
    read: str = "after",
    step_size: str = "nlms",
    ridge_scaling: bool = False,
    eps: float = 1e-6,
    eps_gamma: float = 1e-6,
    initial_state: FastWeightState | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    chunk_size: int = 64,
    backend: str = "auto",
    check_lam: bool = True,
    check_beta: bool = True,
) -> tuple[torch.Tensor, FastWeightState | None]:
    """Falcon fast-weight attention: o_t = S_t^T q_t with S written by one of the six Falcon rules.

    Args:
        q, k: `[B, T, H, K]` query and key features (already feature-mapped; the op does the key shift).
        v: `[B, T, H, V]` values, in q's and k's dtype (mixed dtypes raise: cast them to one first).
        beta: `[B, T, H]` NLMS gains in [0, 2] (0 writes nothing; above 2 the write diverges), or with
            `step_size="direct"` the step sizes themselves (finite, >= 0); rules "2"/"2A" take one gain per value
            column, `[B, T, H, V]`. Any float dtype, as lam.
        lam: `[B, T, H]` ridge >= 0 (decay through gamma = 1 - min(eta * lam, 1 - eps_gamma)); None = 0.
        rule: "1" | "2" | "3" | "1A" | "2A" | "3A" (regression / inner product; scalar, per-column, sliding).
        window: the sliding window B of rules "3"/"3A" (1 for the other rules).
        pairing: "shifted" writes (k_{t-1}, v_t) (Falcon); "same_step" writes (k_t, v_t) (DeltaNet, Mamba-2).
        read: "after" reads S_t (read after write); "before" reads S_{t-1}.
        step_size: "nlms" (eta = beta / (E_t + lam + eps)) or "direct" (eta = beta).
        ridge_scaling: the actual ridge is lam * E_t with E_t the rule's statistic (detached).
        eps: the NLMS stabilizer (> 0). eps_gamma: the decay fraction is clamped at 1 - eps_gamma.
        initial_state: the state to continue from (one row per batch row, or per packed sequence).
        output_final_state: return the final `FastWeightState` (else None).
        cu_seqlens: `[N + 1]` int offsets of packed sequences (B == 1); each starts fresh or from its row
            of `initial_state`, and nothing crosses a sequence boundary.
        seq_idx: `[B, T]` integer document index of every step, the alternative to `cu_seqlens` for compiled
            training on packed documents: a document starts wherever the index changes from one step to the
            next, from a zero state (no `initial_state` or `output_final_state` with it). The chunk and Triton
            backends restart documents in place for a read "after" (the regression rules with shifted pairing):
            the rows keep their shapes and nothing is read on the host (`seq_idx_in_place`). Elsewhere it becomes
            `cu_seqlens` (a host read, shapes per document).
        chunk_size: the chunk length of the chunk-parallel backend (rules "2"/"2A" use at most 16: their
            per-column decays cost O(C^2 V) exponentials per chunk instead of matmuls).
        backend: "auto" | "naive" | "recurrent" | "chunk" | "triton". "recurrent" is the step loop vectorized
            over rows (no cu_seqlens). "auto" takes it for T == 1 (decoding; naive with cu_seqlens; on CUDA
            the Triton step kernel for rules 1A, 1, 2A, 2 when no gradient is recorded), the
            Triton kernels on CUDA when triton is installed (every rule; rule 3 with window <= 64, on rule 1's
            kernels over write events; K, V <= 128; float32/bf16/fp16: each faster than the chunk path,
            benchmarks/RESULTS.md), and the chunk path otherwise. Where "auto" leaves a CUDA call of T > 1 on the
            chunk path it warns once per reason and process (a `SlowPathWarning` naming it: triton missing, heads
            over 128, rule 3's window or the dtype), except for float64 inputs, whose exact path is the caller's
            choice.

        check_lam: check that lam >= 0 (a negative or NaN entry raises; on CUDA a device-side assert, three small
            kernels per call, that stops the process). False: the caller guarantees it, as the fast-weight mixer
            does (its lam is a scaled sigmoid): a NaN lam then reaches the output and the loss, where the trainer's
            guard skips the update.
        check_beta: check that beta is in the range above (as check_lam does for lam, at the same cost). False:
            the caller guarantees it, as the fast-weight mixer does (its beta is a scaled sigmoid).

    Returns:
        o `[B, T, H, V]` in q's dtype, and the final state (float32; float64 for float64 inputs) or None.

    Example:
        >>> q = k = torch.randn(2, 16, 4, 8); v = torch.randn(2, 16, 4, 8); beta = torch.rand(2, 16, 4)
        >>> o, state = fast_weight_attention(q, k, v, beta, rule="1A", output_final_state=True)
    """
    options = FastWeightOptions(rule=rule, window=window, pairing=pairing, read=read, step_size=step_size,
                                ridge_scaling=ridge_scaling, eps=eps, eps_gamma=eps_gamma, chunk_size=chunk_size)
    offsets = _check_inputs(q, k, v, beta, lam, options, cu_seqlens=cu_seqlens, check_lam=check_lam,
                            check_beta=check_beta)
    B, T, H, K = q.shape
    V = v.shape[-1]
    if seq_idx is not None:
        _check_seq_idx(seq_idx, B=B, T=T, device=q.device, cu_seqlens=cu_seqlens, initial_state=initial_state,
                       output_final_state=output_final_state)
        if not seq_idx_in_place(q, v, rule=rule, window=window, pairing=pairing, read=read, backend=backend):
            packed = [t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, beta)]
            o, _ = fast_weight_attention(
                *packed, None if lam is None else lam.reshape(1, B * T, H), rule=rule, window=window,
                pairing=pairing, read=read, step_size=step_size, ridge_scaling=ridge_scaling, eps=eps,
                eps_gamma=eps_gamma, cu_seqlens=document_offsets(seq_idx), chunk_size=chunk_size, backend=backend,
                check_lam=False, check_beta=False)  # checked above
            return o.reshape(B, T, H, V), None
    n_rows = B if offsets is None else len(offsets) - 1
    dtype = compute_dtype(q.dtype)
    state = _prepare_state(initial_state, n_rows=n_rows, H=H, K=K, V=V, window=window, pairing=pairing,
                           dtype=dtype, device=q.device)
    out_dtype = q.dtype
    if lam is None:
        lam = q.new_zeros(B, T, H)
    inference = not needs_grad(q, k, v, beta, lam, state.S, state.last_k)
    name = _backend(q, v, rule=rule, window=window, packed=offsets is not None, backend=backend,
                    inference=inference)
    if name == "triton":  # q, k, v keep their dtype (bf16 tensor cores); step sizes and decays run in float32
        if not triton_runs_on(q):
            raise ValueError("backend='triton' needs triton installed and the tensors on a CUDA device; "
                             "use backend='chunk' (or 'auto') here")
        with torch.autocast(q.device.type, enabled=False):
            o, final = _triton_in_row_groups(q, k, v, beta, lam, options, state=state, offsets=offsets,
                                             seq_idx=seq_idx, final_state=output_final_state)
        return o.to(out_dtype), (final if output_final_state else None)
    q, k, v, beta, lam = (t.to(dtype) for t in (q, k, v, beta, lam))
    # The recurrence stays in `dtype` under a caller's bf16 autocast (its matmuls would otherwise run in bf16).
    with torch.autocast(q.device.type, enabled=False):
        if name == "naive":
            o, final = fast_weight_naive(q, k, v, beta, lam, options, initial_state=state, offsets=offsets)
        elif name == "recurrent":
            o, final = fast_weight_recurrent(q, k, v, beta, lam, options, initial_state=state, offsets=offsets)
        else:
            o, final = fast_weight_chunk(q, k, v, beta, lam, options, initial_state=state, offsets=offsets,
                                         seq_idx=seq_idx)
    return o.to(out_dtype), (final if output_final_state else None)


def fast_weight_step_fuses(q: torch.Tensor, v: torch.Tensor, *, rule: str, window: int = 1,
                             backend: str = "auto") -> bool:
    """Whether a decoding step of q [B, 1, H, K], v [B, 1, H, V] without a gradient to record runs the step kernel
    (as `fast_weight_attention` would), so that a mixer can hand the kernel its QK normalization and gains as well
    (`fast_weight_decoding_step`). Metadata only."""
    K, V = q.shape[-1], v.shape[-1]
    return (q.dim() == 4 and q.shape[1] == 1 and triton_step_takes(rule=rule, window=window, K=K, V=V, dtype=q.dtype)
            and _backend(q, v, rule=rule, window=window, packed=False, backend=backend, inference=True) == "triton"
            and triton_runs_on(q))


def fast_weight_decoding_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta_logits: torch.Tensor,
    lam_logits: torch.Tensor,
    *,
    gates: tuple[torch.Tensor, torch.Tensor, float, float],
    qk_norm: str,
    qk_eps: float,
    rule: str,
    pairing: str = "shifted",
    read: str = "after",
    step_size: str = "nlms",
    ridge_scaling: bool = False,
    eps: float = 1e-6,
    eps_gamma: float = 1e-6,
    initial_state: FastWeightState | None = None,
    state_in_place: bool = False,
) -> tuple[torch.Tensor, FastWeightState]:
    """One decoding step of a fast-weight mixer from its raw pieces, in one kernel: q and k normalized, the gains
    taken from their logits, then the step of `fast_weight_attention` (window 1, inference only, where
    `fast_weight_step_fuses`). The same values as normalizing, taking the gains and calling the op:

        q, k <- qk_norm(q), qk_norm(k)  ("rms": u / sqrt(mean u^2 + qk_eps); "l2": rms with qk_eps / K, times
                                         1 / sqrt(K); "none"), rounded to q's dtype
        beta = beta_scale sigmoid(beta_logits + beta_bias),  lam = lam_scale sigmoid(lam_logits + lam_bias)

    Args:
        q, k: `[B, 1, H, K]`, v: `[B, 1, H, V]` (one dtype; row slices are read in place). beta_logits: `[B, 1, H]`
            (rules 2A, 2: `[B, 1, H, V]`), lam_logits: `[B, 1, H]`, any float dtype. gates: `(beta_bias, lam_bias,
            beta_scale, lam_scale)`, biases `[H]` (2A, 2's beta_bias `[H V]`). initial_state: the state after the
            steps so far (None: zeros).
        state_in_place: write the state after the step over `initial_state`'s tensors and return them in it (a
            fixed-address cache that a replayed CUDA graph reads, `hybridlm.layers.cache.LayerCache.states_in_place`);
            only where they can take it (S float32 and contiguous; shifted pairing: a float32 contiguous carried key),
            else the state comes back in new tensors.

    Returns:
        o `[B, 1, H, V]` in q's dtype and the state after the step (float32; the carried key is the normalized k).
    """
    from hybridlm.ops.fast_weight.triton.backend import decoding_step

    options = FastWeightOptions(rule=rule, pairing=pairing, read=read, step_size=step_size,
                                ridge_scaling=ridge_scaling, eps=eps, eps_gamma=eps_gamma)
    if q.dim() != 4 or q.shape[1] != 1:
        raise ValueError(f"fast_weight_decoding_step takes one step, q [B, 1, H, K]; got {list(q.shape)}")
    B, _, H, K = q.shape
    V = v.shape[-1]
    state = _prepare_state(initial_state, n_rows=B, H=H, K=K, V=V, window=1, pairing=pairing, dtype=torch.float32,
                           device=q.device)
    with torch.autocast(q.device.type, enabled=False):
        return decoding_step(q, k, v, beta_logits, lam_logits, options, state, gates=gates, qk_norm=qk_norm,
                             qk_eps=qk_eps, state_in_place=state_in_place)


def fast_weight_mixer_step_fuses(q: torch.Tensor, v: torch.Tensor, *, rule: str, window: int = 1,
                                   backend: str = "auto") -> bool:
    """Whether a decoding step of q [B, 1, H, K], v [B, 1, H, V] runs the step kernel (`fast_weight_step_fuses`) and
    its heads fit the fast-weight mixer's whole-step kernel (`fast_weight_mixer_decoding_step`). Metadata only."""
    from hybridlm.ops.fast_weight.triton.limits import MAX_MIXER_STATE

    return (fast_weight_step_fuses(q, v, rule=rule, window=window, backend=backend)
            and q.shape[-1] * v.shape[-1] <= MAX_MIXER_STATE)


def fast_weight_mixer_decoding_step(
    proj: torch.Tensor,
    *,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_eps: float,
    gates: tuple[torch.Tensor, torch.Tensor, float, float],
    qk_norm: str,
    qk_eps: float,
    rule: str,
    pairing: str = "shifted",
    read: str = "after",
    step_size: str = "nlms",
    ridge_scaling: bool = False,
    eps: float = 1e-6,
    eps_gamma: float = 1e-6,
    initial_state: FastWeightState,
    state_in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, FastWeightState]:
    """The fast-weight mixer's decoding step between its two projections in one kernel (where
    `fast_weight_mixer_step_fuses`): the short conv's step with its state and SiLU, then `fast_weight_decoding_step`
    (QK norm, gains, the rule's step), then the gated RMSNorm (groups of V channels, the norm before the gate), with
    the same roundings as those steps run apart.

    Args:
        proj: `[B, 1, width]` the input projection's output, [q | k | v | z | beta logits | lam logits] (q, k `[H K]`,
            v, z `[H V]`, beta logits `[H]` or `[H V]` for 2A, 2, lam logits `[H]`).
        conv_weight: `[H (2K + V), taps]`, conv_bias: its bias or None, conv_state: `[B, taps - 1, H (2K + V)]` (cast
            to proj's dtype). norm_weight: `[H V]`, norm_eps: the gated norm's. gates, qk_norm, qk_eps and the rule's
            options: `fast_weight_decoding_step`'s.
        initial_state: the state after the steps so far (its S `[B, H, K, V]` gives K and V).
        state_in_place: write the new conv state and fast-weight state over `conv_state` and `initial_state`'s tensors
            and return them (a fixed-address cache that a replayed CUDA graph reads); only where they can take it (S
            float32 and contiguous, the carried key of a shifted row float32 and contiguous, the conv state in proj's
            dtype with a unit stride along its channels), else new tensors.

    Returns:
        y `[B, 1, H V]` in proj's dtype (the output projection's input), the new conv state, the new state.
    """
    from hybridlm.ops.fast_weight.triton.custom_ops import fast_weight_mixer_step_triton

    if proj.dim() != 3 or proj.shape[1] != 1:
        raise ValueError(f"fast_weight_mixer_decoding_step takes one step, proj [B, 1, width]; got {list(proj.shape)}")
    B = proj.shape[0]
    if initial_state is None or initial_state.S.dim() != 4:
        raise ValueError("fast_weight_mixer_decoding_step continues a state: initial_state with S [B, H, K, V]")
    _, H, K, V = initial_state.S.shape
    state = _prepare_state(initial_state, n_rows=B, H=H, K=K, V=V, window=1, pairing=pairing, dtype=torch.float32,
                           device=proj.device)
    shifted = pairing == "shifted"
    last_k = state.last_k if shifted else None
    in_place = (state_in_place and state.S is initial_state.S and state.S.is_contiguous()
                and conv_state.dtype == proj.dtype and conv_state.stride(-1) == 1
                and (not shifted or (last_k is not None and last_k is initial_state.last_k
                                     and last_k.is_contiguous())))
    with torch.autocast(proj.device.type, enabled=False):
        y, conv, S, last = fast_weight_mixer_step_triton(
            proj[:, 0], conv_weight, conv_bias, conv_state.to(proj.dtype), state.S, last_k, gates=gates,
            norm_weight=norm_weight, norm_eps=norm_eps, rule=rule, pairing=pairing, read_after=read == "after",
            step_size=step_size, ridge_scaling=ridge_scaling, eps=eps, eps_gamma=eps_gamma, qk_norm=qk_norm,
            qk_eps=qk_eps, in_place=in_place)
    return y[:, None], conv, FastWeightState(S=S, last_k=last if shifted else None)


def _triton_in_row_groups(q, k, v, beta, lam, options, *, state, offsets, seq_idx, final_state: bool):
    """`fast_weight_triton` once per group of sequences that keeps its launches within CUDA's grid: one call for the
    usual shapes; more for sequences x heads > 65535 (a synthetic task's 8192 rows x 8 heads, thousands of packed
    documents), whose outputs and final states are joined in order (`call_in_row_groups`). Without `final_state`
    the final state is None."""

    def call(steps, rows, group_offsets):
        *inputs, group_seq_idx = steps
        return fast_weight_triton(*inputs, options, initial_state=rows[0], offsets=group_offsets,
                                  seq_idx=group_seq_idx, final_state=final_state)

    return call_in_row_groups(call, [q, k, v, beta, lam, seq_idx], [state], heads=q.shape[2], offsets=offsets,
                              join_rows=FastWeightState.cat if final_state else lambda states: None)


def _backend(q, v, *, rule, window, packed, backend, inference=False) -> str:
    """The backend a call runs: a single decoding step the step loop (vectorized over rows), or on a GPU the step
    kernel where it takes the call (`inference`: no gradient to record; triton `step_takes`); longer inputs the chunk
    path, or on a GPU the Triton kernels. "auto" on a CUDA tensor that the kernels would take but for its shape, rule,
    window, dtype or a missing triton warns (once per reason) that it runs the chunk path."""
    K, V = q.shape[-1], v.shape[-1]
    takes = triton_auto_takes(rule=rule, window=window, K=K, V=V, dtype=q.dtype)
    step_loop = "naive" if packed else "recurrent"  # decoding: one step, vectorized over rows
    if q.shape[1] == 1:
        default = step_loop
        if (inference and not packed and q.is_cuda and triton_available()
                and triton_step_takes(rule=rule, window=window, K=K, V=V, dtype=q.dtype)):
            default = "triton"
    elif q.is_cuda and takes and triton_available():
        default = "triton"
    else:
        default = "chunk"
        if backend == "auto" and q.is_cuda:  # metadata only: no host sync, constant under torch.compile
            reason = _NO_TRITON if takes else triton_slow_path_reason(rule=rule, window=window, K=K, V=V,
                                                                      dtype=q.dtype)
            if reason is not None:
                warn_slow_path(reason)
    return resolve_backend(backend, available=BACKENDS, default=default)


def runs_triton(q, *, rule, window=1, backend="auto") -> bool:
    """Whether `fast_weight_attention(q, k, v, ...)` with V = K on one row layout runs the Triton kernels (metadata
    only)."""
    return _backend(q, q, rule=rule, window=window, packed=False, backend=backend) == "triton"


def seq_idx_in_place(q, v=None, *, rule, window=1, pairing="shifted", read="after", backend="auto") -> bool:
    """Whether `fast_weight_attention(q, k, v, ..., seq_idx=...)` restarts the documents in place, on the rows'
    shapes with nothing read on the host (so it can run inside a compiled graph): the chunk and Triton backends, a
    read after the write, and shifted pairing for the regression rules 1, 2, 3 (`options.restarts_in_place`).
    Otherwise `seq_idx` becomes `cu_seqlens`. v: the values (None: V = K)."""
    name = _backend(q, q if v is None else v, rule=rule, window=window, packed=False, backend=backend)
    return name in ("chunk", "triton") and restarts_in_place(rule=rule, pairing=pairing, read=read)


def document_offsets(seq_idx: torch.Tensor) -> torch.Tensor:
    """seq_idx [B, T] -> the `cu_seqlens` of its documents with the rows laid end to end (a document starts at
    every row's first step and wherever the index changes), int64 on the CPU: reads the tensor on the host."""
    B, T = seq_idx.shape
    starts = torch.ones(B, T, dtype=torch.bool, device=seq_idx.device)
    starts[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    first = starts.reshape(-1).nonzero().flatten().cpu()
    return torch.cat([first, torch.tensor([B * T])]).to(torch.int64)


def _check_seq_idx(seq_idx, *, B, T, device, cu_seqlens, initial_state, output_final_state) -> None:
    if cu_seqlens is not None:
        raise ValueError("pass either cu_seqlens (packed offsets) or seq_idx (a document index per step), not both")
    if tuple(seq_idx.shape) != (B, T) or seq_idx.dtype.is_floating_point or seq_idx.dtype == torch.bool:
        raise ValueError(f"seq_idx must be an integer tensor [B, T] = {[B, T]}, got {seq_idx.dtype} "
                         f"{list(seq_idx.shape)}")
    if seq_idx.device != device:
        raise ValueError(f"seq_idx is on {seq_idx.device} and q on {device}; move seq_idx to q's device")
    if initial_state is not None or output_final_state:
        raise ValueError("with seq_idx every document starts from a zero state and no final state is returned; "
                         "use cu_seqlens (one state per sequence) to carry states")


def _check_inputs(q, k, v, beta, lam, options: FastWeightOptions, *, cu_seqlens,
                  check_lam: bool = True, check_beta: bool = True) -> torch.Tensor | None:
    """Raise a ValueError that says what is wrong with a tensor (the options checked themselves); return the
    packed offsets (or None)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [B, T, H, D]; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape [B, T, H, K]; got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, H, _ = q.shape
    if v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V]; got {tuple(v.shape)}")
    if T < 1:
        raise ValueError("the sequence is empty (T = 0)")
    want_beta = (B, T, H, v.shape[3]) if options.per_column else (B, T, H)
    if tuple(beta.shape) != want_beta:
        what = "one gain per value column, [B, T, H, V]" if options.per_column else "[B, T, H]"
        raise ValueError(f"rule {options.rule!r} takes beta as {what} = {list(want_beta)}; got {list(beta.shape)}")
    if lam is not None:
        if tuple(lam.shape) != (B, T, H):
            raise ValueError(f"lam must be [B, T, H] = {[B, T, H]}; got {list(lam.shape)}")
        message = "lam must be >= 0 (it is a ridge coefficient); got negative or NaN entries"
        if check_lam and not _tracing():
            if lam.is_cuda:  # a device-side assert: a host sync per call would stall the GPU
                torch._assert_async((lam >= 0).all(), message)
            elif not bool((lam >= 0).all()):
                raise ValueError(message)
    for name, t in (("q", q), ("k", k), ("v", v), ("beta", beta), ("lam", lam)):
        if t is not None and not t.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}: put every input on one device")
    if not q.dtype == k.dtype == v.dtype:  # the Triton kernels read them as they are, the torch paths in one dtype
        raise ValueError(f"q, k and v must have one dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype}: cast them to "
                         "one dtype before the call")
    if check_beta and not _tracing():
        if options.step_size == "nlms":  # NaN fails both comparisons
            valid = ((beta >= 0) & (beta <= 2)).all()
            message = ("beta must be in [0, 2] with step_size='nlms' (an NLMS gain; above 2 the write diverges); "
                       "got entries outside it or NaN")
        else:
            valid = ((beta >= 0) & (beta <= torch.finfo(beta.dtype).max)).all()
            message = "beta must be finite and >= 0 with step_size='direct' (a step size); got negative, inf or NaN"
        if beta.is_cuda:  # a device-side assert: a host sync per call would stall the GPU
            torch._assert_async(valid, message)
        elif not bool(valid):
            raise ValueError(message)
    if cu_seqlens is None:
        return None
    return check_cu_seqlens(cu_seqlens, batch_size=B, total_len=T)


def _prepare_state(state, *, n_rows, H, K, V, window, pairing, dtype, device) -> FastWeightState:
    """Check a given initial state against the call, cast it to the compute dtype; a zero state if None."""
    if state is None:
        return FastWeightState(S=torch.zeros(n_rows, H, K, V, dtype=dtype, device=device))
    if not isinstance(state, FastWeightState):
        raise ValueError(f"initial_state must be a FastWeightState, got {type(state).__name__}")
    if tuple(state.S.shape) != (n_rows, H, K, V):
        raise ValueError(f"initial_state.S must be [N, H, K, V] = {[n_rows, H, K, V]} (N = rows or packed "
                         f"sequences); got {list(state.S.shape)}")
    last_k = None
    if pairing == "shifted" and state.last_k is not None:
        if tuple(state.last_k.shape) != (n_rows, H, K):
            raise ValueError(f"initial_state.last_k must be {[n_rows, H, K]}; got {list(state.last_k.shape)}")
        last_k = state.last_k.to(device=device, dtype=dtype)
    tail_x = tail_v = tail_len = None
    if window > 1 and state.tail_x is not None:
        if (tuple(state.tail_x.shape) != (n_rows, H, window - 1, K) or state.tail_v is None
                or tuple(state.tail_v.shape) != (n_rows, H, window - 1, V) or state.tail_len is None
                or tuple(state.tail_len.shape) != (n_rows,)):
            got = [None if t is None else list(t.shape) for t in (state.tail_x, state.tail_v, state.tail_len)]
            raise ValueError(f"initial_state's tail must hold window - 1 = {window - 1} pairs: tail_x "
                             f"{[n_rows, H, window - 1, K]}, tail_v {[n_rows, H, window - 1, V]}, tail_len "
                             f"[{n_rows}]; got {got[0]}, {got[1]}, {got[2]}")
        if state.tail_len.dtype.is_floating_point or state.tail_len.dtype == torch.bool:
            raise ValueError(f"initial_state.tail_len must hold integers, got {state.tail_len.dtype}")
        message = f"initial_state.tail_len must be in [0, window - 1 = {window - 1}] (pairs held in the tail)"
        fits = ((state.tail_len >= 0) & (state.tail_len <= window - 1)).all()
        if state.tail_len.is_cuda and not _tracing():  # a device-side assert: no host sync
            torch._assert_async(fits, message)
        elif not _tracing() and not bool(fits):
            raise ValueError(message)
        tail_x = state.tail_x.to(device=device, dtype=dtype)
        tail_v = state.tail_v.to(device=device, dtype=dtype)
        tail_len = state.tail_len.to(device)
    return FastWeightState(S=state.S.to(device=device, dtype=dtype), last_k=last_k, tail_x=tail_x, tail_v=tail_v,
                           tail_len=tail_len)


def _tracing() -> bool:
    """Inside torch.compile or a CUDA-graph capture, where a value check would synchronize with the host."""
    return torch.compiler.is_compiling() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
