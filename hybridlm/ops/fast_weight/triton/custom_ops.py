"""The Triton scans as `torch.library` custom ops, so that `torch.compile` traces them as single graph nodes
(fake implementations give the output shapes; autograd is registered on the forward op and calls the backward op).

    hybridlm::fast_weight_1a_fwd(q, x, y, eta, log_gamma, S0?, read_after, chunk_size) -> (o, S_final)
    hybridlm::fast_weight_1a_bwd(do, dS_final?, q, x, y, eta, log_gamma, S0?, read_after, chunk_size)
        -> (dq, dx, dy, deta, dlog_gamma, dS0)
    hybridlm::fast_weight_1_fwd / hybridlm::fast_weight_1_bwd: the same for rule 1.
    hybridlm::fast_weight_3_fwd / hybridlm::fast_weight_3_bwd: rule 3 as rule 1 over write events, with one more
        argument after chunk_size, int slots (events per step).
    hybridlm::fast_weight_2a_fwd / hybridlm::fast_weight_2a_bwd: the same for rule 2A (eta, log_gamma per value
        column: [N, T, H, V]).
    hybridlm::fast_weight_2_fwd / hybridlm::fast_weight_2_bwd: the same for rule 2 (regression, eta and log_gamma
        per value column).
    hybridlm::fast_weight_prepare_fwd(k, v, beta, lam, last_k?, offsets?, seq_idx?, max_len, shifted, nlms,
        ridge_scaling, eps, eps_gamma) -> (x, y, eta, log_gamma): the fused write preparation of rules 1A / 1
        (`prepare.py`);
    hybridlm::fast_weight_prepare_bwd(dx, dy, deta, dlog_gamma, <the forward's inputs>) -> (dk, dv, dbeta, dlam,
        dlast_k).
    hybridlm::fast_weight_window_prepare_fwd(k, v, beta, lam, last_k?, tail_x?, tail_v?, tail_len?, window, shifted,
        nlms, ridge_scaling, eps, eps_gamma) -> (x_ext, y_ext, C, log_gamma, E): the fused write preparation of rule
        3A on rows (`window_prepare.py`); E (the window statistic) is kept for the backward;
    hybridlm::fast_weight_window_prepare_bwd(dx_ext, dy_ext, dC, dlog_gamma, x_ext, y_ext, C, log_gamma, E,
        <the forward's inputs after v>) -> (dk, dv, dbeta, dlam, dlast_k, dtail_x, dtail_v).

    hybridlm::fast_weight_step(q, k, v, beta, lam, S, last_k?, rule, shifted, read_after, nlms, ridge_scaling, eps,
        eps_gamma, beta_bias?, lam_bias?, beta_scale, lam_scale, qk_norm, qk_eps, qk_scale) -> (o, S', last_k'): one
        decoding step of the window-1 rules (`step.py`), inference only; with the biases, beta and lam are the gains'
        logits, and qk_norm 1 (rms) / 2 (l2) normalizes q and k first.
    hybridlm::fast_weight_step_(<the same arguments>, S!, last_k!?) -> o: the same step writing S' over S and k over
        last_k (a fixed-address cache that a replayed CUDA graph reads).

    hybridlm::fast_weight_mixer_step(p, conv_weight, conv_bias?, conv_state, S, last_k?, beta_bias, lam_bias,
        norm_weight, heads, rule, shifted, read_after, nlms, ridge_scaling, eps, eps_gamma, beta_scale, lam_scale,
        qk_norm, qk_eps, qk_scale, norm_eps) -> (y, conv_state', S', last_k'): the fast-weight mixer's whole decoding
        step between its projections (`mixer_step.py`), inference only; hybridlm::fast_weight_mixer_step_(<the same>,
        conv_state!, S!, last_k!?) -> y writes the new states over the old.

    hybridlm::fast_weight_delayed_fwd(q, x_ext, y_ext, eta, log_gamma, c, S0?, read_after, chunk_size) -> (o, S_final):
        rule 3A as the 1A scan over the first T rows of x_ext, y_ext plus the band of the pairs still being written
        (`band.py`, coefficients c);
    hybridlm::fast_weight_delayed_bwd(do, dS_final?, q, x_ext, y_ext, eta, log_gamma, c, S0?, read_after, chunk_size)
        -> (dq, dx_ext, dy_ext, deta, dlog_gamma, dc, dS0).

Rule 3A runs as rule 1A over delayed writes plus the band (`backend.py`): one delayed op (on rows, after its
preparation op); rule 3's events differ from rule 1's rows (the events of one step do not see each other's writes),
hence its own ops on rule 1's kernels. The implementations (`inner_product.py`, `regression.py`, `prepare.py`,
`window_prepare.py`, `band.py`, which need triton) are imported on the first call; this file imports only torch.
dS0 is always computed (the backward pass ends on it); the autograd formula drops it when S0 is None.
The scans' forward launches are `kept_kernel`s: a region recomputed in the backward
(`hybridlm.ops.recompute`, the fast-weight mixer's) keeps their outputs and recomputes only what feeds them.
"""

import math

import torch

from hybridlm.ops.fast_weight.triton.limits import (
    DTYPES,
    MAX_DELTA_CHUNK,
    MAX_HEAD_DIM,
    MAX_MIXER_STATE,
    MAX_PREPARED_WINDOW,
    MAX_RULE_2_CHUNK,
)
from hybridlm.ops.recompute import keep_in_compiled_regions, kept_kernel, on_contiguous
from hybridlm.ops.utils import contiguous_rows, on_tensor_device, triton_interpreting, unit_last_stride

# The scans' options (after S0), passed through to the implementations' forward/backward; rule 3 adds `slots`.
_OPTIONS = "bool read_after, int chunk_size"
_FWD_SCHEMA = "(Tensor q, Tensor x, Tensor y, Tensor eta, Tensor log_gamma, Tensor? S0, {options}) -> (Tensor, Tensor)"
_BWD_SCHEMA = "(Tensor do, Tensor? dS_final, Tensor q, Tensor x, Tensor y, Tensor eta, Tensor log_gamma, " \
              "Tensor? S0, {options}) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"


def fast_weight_1a_triton(q, x, y, eta, log_gamma, S0, *, read_after: bool, chunk_size: int = 64):
    """Rule 1A on prepared quantities (chunk.py's pipeline after its step 3), differentiable in every input.

    Args:
        q: `[N, T, H, K]` queries. x: `[N, T, H, K]` write features (already shifted and masked).
        y: `[N, T, H, V]` values (same dtype as q and x: float32, bfloat16 or float16).
        eta: `[N, T, H]` step sizes (0 where nothing is written). log_gamma: `[N, T, H]` log decays (<= 0).
        S0: `[N, H, K, V]` the entry state (float32), or None for zeros.
        read_after: o_t reads S_t (True) or S_{t-1} (False).
        chunk_size: a power of two in [16, 128].

    Returns:
        o `[N, T, H, V]` in q's dtype and the final state `[N, H, K, V]` float32.
    """
    _check(q, x, y, eta, log_gamma, S0, chunk_size)
    return torch.ops.hybridlm.fast_weight_1a_fwd(q, x, y, eta, log_gamma, S0, bool(read_after), int(chunk_size))


def fast_weight_1_triton(q, x, y, eta, log_gamma, S0, *, read_after: bool, chunk_size: int = 64):
    """Rule 1 (regression, S_t = exp(lg_t) S_{t-1} + eta_t x_t (y_t - S_{t-1}^T x_t)^T) on prepared quantities; the
    same contract as `fast_weight_1a_triton`, with chunk_size at most `limits.MAX_DELTA_CHUNK` (64)."""
    _check(q, x, y, eta, log_gamma, S0, chunk_size)
    _check_delta_chunk(chunk_size)
    return torch.ops.hybridlm.fast_weight_1_fwd(q, x, y, eta, log_gamma, S0, bool(read_after), int(chunk_size))


def fast_weight_3_triton(q, x, y, eta, log_gamma, S0, *, read_after: bool, chunk_size: int = 64, slots: int):
    """Rule 3 (sliding-window regression) as rule 1 over its write events: the rows are events, `slots` per step
    (a power of two dividing T and chunk_size). Event e decays the state by exp(log_gamma_e) and writes
    eta_e x_e (y_e - S_{s-1}^T x_e)^T, where S_{s-1} is the state before the first event of e's step s (before its
    decay): the events of one step do not see each other's writes. Otherwise the contract of `fast_weight_1_triton`
    (`backend.py` lays the windows out, the step's decay on its first slot)."""
    _check(q, x, y, eta, log_gamma, S0, chunk_size)
    _check_delta_chunk(chunk_size)
    T = q.shape[1]
    if not (isinstance(slots, int) and slots >= 1 and slots & (slots - 1) == 0 and chunk_size % slots == 0
            and T % slots == 0):
        raise ValueError(f"slots must be a power of two dividing chunk_size ({chunk_size}) and T ({T}); got {slots}")
    return torch.ops.hybridlm.fast_weight_3_fwd(q, x, y, eta, log_gamma, S0, bool(read_after), int(chunk_size),
                                                int(slots))


def fast_weight_2a_triton(q, x, y, eta, log_gamma, S0, *, read_after: bool, chunk_size: int = 16):
    """Rule 2A (S_t = S_{t-1} Diag(exp(log_gamma_t)) + x_t (eta_t * y_t)^T, decays and step sizes per value column)
    on prepared quantities; the contract of `fast_weight_1a_triton` except that eta and log_gamma are `[N, T, H, V]`
    (float32). The intra-chunk work is O(C^2 V) exponentials per chunk: the backend uses chunk_size 16."""
    _check(q, x, y, eta, log_gamma, S0, chunk_size, per_column=True)
    return torch.ops.hybridlm.fast_weight_2a_fwd(q, x, y, eta, log_gamma, S0, bool(read_after), int(chunk_size))


def fast_weight_2_triton(q, x, y, eta, log_gamma, S0, *, read_after: bool, chunk_size: int = 16):
    """Rule 2 (regression with eta and log_gamma per value column: S_t = S_{t-1} Diag(exp(log_gamma_t))
    + x_t (eta_t * (y_t - S_{t-1}^T x_t))^T) on prepared quantities; the contract of `fast_weight_2a_triton`
    (eta, log_gamma `[N, T, H, V]`; the intra-chunk work is O(C^2 V) per chunk: the backend uses chunk_size 16;
    chunks of 16 and 32 are the ones built and tested)."""
    _check(q, x, y, eta, log_gamma, S0, chunk_size, per_column=True)
    if chunk_size > MAX_RULE_2_CHUNK:
        raise ValueError(f"rule 2's kernels take chunks of 16 or 32 (their [C, C, BV] float32 work grows with C^2); "
                         f"got chunk_size {chunk_size}")
    return torch.ops.hybridlm.fast_weight_2_fwd(q, x, y, eta, log_gamma, S0, bool(read_after), int(chunk_size))


def fast_weight_prepare_triton(k, v, beta, lam, last_k, offsets, *, max_len: int, pairing: str, step_size: str,
                               ridge_scaling: bool, eps: float, eps_gamma: float, seq_idx=None):
    """chunk.py's `prepare_writes` for window 1 and a scalar step per head (rules 1A, 1), fused, differentiable in
    k, v, beta, lam and last_k.

    Args:
        k: `[B, T, H, K]`, v: `[B, T, H, V]` (one dtype), beta, lam: `[B, T, H]` (cast to float32 here).
        last_k: `[N, H, K]` the carried last key (shifted pairing) or None (cast to k's dtype, as prepare_writes).
        offsets: `[N + 1]` int64 packed-sequence offsets on k's device (B = 1), or None (N = B, max_len = T).
        max_len: the longest sequence (T without offsets).
        seq_idx: `[B, T]` integer document index per step (without offsets) or None: a document starts where it
            changes, with no shifted pair there and a log decay of `prepare.RESTART_LOG_DECAY` (-100) that
            ends every earlier write's share of the state (exp(-100) ~ 4e-44); that decay carries no gradient.

    Returns:
        x `[N, max_len, H, K]` (k's dtype), y `[N, max_len, H, V]`, eta and log_gamma `[N, max_len, H]` float32: the
        window-1 `p.X[..., 0, :]`, `p.Y[..., 0, :]`, `p.weights[..., 0, 0]`, `p.log_gamma[..., 0]`; but without offsets
        y is v itself (made contiguous), not `p.Y`, which has zeros where no pair exists: eta is 0 there, so the scans
        read neither (`prepare.py`).
    """
    shifted = pairing == "shifted"
    last_k = last_k.to(k.dtype) if shifted and last_k is not None else None
    x, y, eta, log_gamma = torch.ops.hybridlm.fast_weight_prepare_fwd(
        k, v, beta.to(torch.float32), lam.to(torch.float32), last_k, offsets, seq_idx, int(max_len), shifted,
        step_size == "nlms", bool(ridge_scaling), float(eps), float(eps_gamma))
    return x, (y if offsets is not None else v.contiguous()), eta, log_gamma


def fast_weight_window_prepare_triton(k, v, beta, lam, last_k, tail_x, tail_v, tail_len, *, window: int,
                                      pairing: str, step_size: str, ridge_scaling: bool, eps: float,
                                      eps_gamma: float):
    """chunk.py's `prepare_writes` for rule 3A (window W > 1) on rows, followed by the delayed-write coefficients of
    `backend._delayed_window`, fused (`window_prepare.py`), differentiable in k, v, beta, lam, last_k, tail_x and
    tail_v.

    Args:
        k: `[N, T, H, K]`, v: `[N, T, H, V]`, beta, lam: `[N, T, H]` (cast to float32 here).
        last_k: `[N, H, K]` the carried last key (shifted pairing) or None (cast to k's dtype, as prepare_writes).
        tail_x, tail_v, tail_len: the carried tail `[N, H, W-1, K]`, `[N, H, W-1, V]`, `[N]` (integers; the last
            tail_len slots hold pairs), or all None.
        window: W in [2, `limits.MAX_PREPARED_WINDOW`].

    Returns:
        x_ext `[N, W-1+T, H, K]` (k's dtype), y_ext `[N, W-1+T, H, V]` (v's dtype): the pairs with the carried tail
        in front (prepare_writes' `p.x_ext`, `p.y_ext`); C `[N, T, H, W]` (C_t[j]: the coefficient of the pair in slot
        j of step t over its writes so far) and log_gamma `[N, T, H]`, float32.
    """
    if not 2 <= window <= MAX_PREPARED_WINDOW:
        raise ValueError(f"the window preparation takes windows 2 .. {MAX_PREPARED_WINDOW}; got {window}")
    if k.shape[-1] > MAX_HEAD_DIM or v.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"the Triton kernels take K, V <= {MAX_HEAD_DIM}; got {k.shape[-1]}, {v.shape[-1]}")
    _check_device(k)
    shifted = pairing == "shifted"
    last_k = last_k.to(k.dtype) if shifted and last_k is not None else None
    tail_len = None if tail_len is None else tail_len.to(torch.int64)
    x_ext, y_ext, C, log_gamma, _ = torch.ops.hybridlm.fast_weight_window_prepare_fwd(
        k, v, beta.to(torch.float32), lam.to(torch.float32), last_k, tail_x, tail_v, tail_len, int(window), shifted,
        step_size == "nlms", bool(ridge_scaling), float(eps), float(eps_gamma))
    return x_ext, y_ext, C, log_gamma


def fast_weight_delayed_triton(q, x_ext, y_ext, eta, log_gamma, c, S0, *, read_after: bool, chunk_size: int = 64):
    """Rule 3A as delayed writes (`band.py`; README.md, "Rule 3A as delayed writes"): rule 1A's scan over the first T
    rows of x_ext, y_ext (step sizes eta, log decays log_gamma), plus the band of the W - 1 pairs still being written,

        o_t = o_t(1A) + sum_{j=1..W-1} c_(t,j) (q_t . x_e) y_e,    e = t + j (read after) or t + j - 1 (read before:
                                                                  the caller puts step t-1's coefficients in row t),

    differentiable in every input.

    Args:
        q: `[N, T, H, K]`. x_ext: `[N, W-1+T, H, K]`, y_ext: `[N, W-1+T, H, V]` the pairs with the carried tail in
            front (q's dtype). eta, log_gamma: `[N, T, H]`. c: `[N, T, H, W-1]` float32. S0: `[N, H, K, V]` float32
            or None. read_after, chunk_size: as `fast_weight_1a_triton`'s.

    Returns:
        o `[N, T, H, V]` in q's dtype and the scan's final state `[N, H, K, V]` float32 (the last step's band, the
        pairs still being written, is not in it).
    """
    if q.dim() == 4 and (c.dim() != 4 or tuple(c.shape[:3]) != tuple(q.shape[:3]) or c.shape[3] < 1
                         or x_ext.shape[1] != q.shape[1] + c.shape[3]):
        raise ValueError(f"c must be [N, T, H, W-1] with x_ext, y_ext of W-1+T rows; got c {list(c.shape)}, x_ext "
                         f"{list(x_ext.shape)} for q {list(q.shape)}")
    if c.dtype != torch.float32:
        raise ValueError(f"c must be float32; got {c.dtype}")
    _check(q, x_ext, y_ext, eta, log_gamma, S0, chunk_size, more_rows=True)
    return torch.ops.hybridlm.fast_weight_delayed_fwd(q, x_ext, y_ext, eta, log_gamma, c, S0, bool(read_after),
                                                      int(chunk_size))


_QK_NORMS = {"none": 0, "rms": 1, "l2": 2}  # the step kernel's QK_NORM


def fast_weight_step_triton(q, k, v, beta, lam, S, last_k, *, rule: str, pairing: str, read_after: bool,
                            step_size: str, ridge_scaling: bool, eps: float, eps_gamma: float,
                            gates: tuple | None = None, qk_norm: str = "none", qk_eps: float = 0.0,
                            in_place: bool = False):
    """One decoding step of rule 1A, 1, 2A or 2 (window 1) in one kernel (`step.py`), without autograd.

    Args:
        q, k: `[N, H, K]`, v: `[N, H, V]` (one dtype among the kernels'). beta: `[N, H]` (2A, 2: `[N, H, V]`), lam:
            `[N, H]` (cast to float32 here). S: `[N, H, K, V]` float32 S_{t-1}. last_k: `[N, H, K]` the carried key
            (shifted pairing; None: a fresh row, which writes nothing this step).
        gates: None, or `(beta_bias, lam_bias, beta_scale, lam_scale)`: beta and lam are then the gains' logits
            (any float dtype, read at their row strides) and the kernel takes beta = beta_scale sigmoid(beta +
            beta_bias), lam = lam_scale sigmoid(lam + lam_bias) (biases `[H]`, 2A / 2's beta_bias `[H V]`, any float
            dtype, read as float32: a bf16 model's biases take no cast kernel of their own).
        qk_norm: "none", or "rms" / "l2" (eps `qk_eps`): q and k normalized over K in the kernel first, as the
            fast-weight mixer's `_normalize` (l2: rms with eps / K, times 1 / sqrt(K)), rounded to q's dtype; the
            carried key is the normalized k.
        in_place: write S_t over S and the new carried key over last_k (both float32 and contiguous), and return
            them; the third output is then last_k as given (None with same-step pairing, which carries no key; a
            shifted row needs one).

    Returns:
        o `[N, H, V]` in q's dtype, S_t `[N, H, K, V]` float32 and k as float32 `[N, H, K]` (the next carried key).
    """
    N, H, K = q.shape if q.dim() == 3 else (None,) * 3
    V = v.shape[-1]
    per_column = rule in ("2A", "2")
    want_beta = (N, H, V) if per_column else (N, H)
    if (q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[:2] != (N, H) or tuple(beta.shape) != want_beta
            or tuple(lam.shape) != (N, H) or tuple(S.shape) != (N, H, K, V)
            or (last_k is not None and last_k.shape != q.shape)):
        raise ValueError(f"the step takes q, k [N, H, K], v [N, H, V], beta {list(want_beta)}, lam [N, H], "
                         f"S [N, H, K, V], last_k [N, H, K]; got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}, "
                         f"{list(beta.shape)}, {list(lam.shape)}, {list(S.shape)}, "
                         f"{None if last_k is None else list(last_k.shape)}")
    if rule not in ("1A", "1", "2A", "2"):
        raise ValueError(f"the step kernel runs rules 1A, 1, 2A and 2 (window 1); got rule {rule!r}")
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype or S.dtype != torch.float32:
        raise ValueError(f"q, k, v must share one dtype among {DTYPES} and S be float32; got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}, {S.dtype}")
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise ValueError(f"the Triton kernels take K, V <= {MAX_HEAD_DIM}; got K = {K}, V = {V}")
    if qk_norm not in _QK_NORMS:
        raise ValueError(f"qk_norm must be one of {list(_QK_NORMS)}; got {qk_norm!r}")
    beta_bias = lam_bias = None
    beta_scale = lam_scale = 1.0
    if gates is not None:
        beta_bias, lam_bias, beta_scale, lam_scale = gates
        width = math.prod(want_beta[1:])
        if tuple(beta_bias.shape) != (width,) or tuple(lam_bias.shape) != (H,):
            raise ValueError(f"the gains' biases must be [{width}] (beta) and [{H}] (lam); got "
                             f"{list(beta_bias.shape)}, {list(lam_bias.shape)}")
    _check_device(q)
    if gates is None:
        beta, lam = beta.to(torch.float32), lam.to(torch.float32)
    l2 = qk_norm == "l2"
    options = (rule, pairing == "shifted", bool(read_after), step_size == "nlms", bool(ridge_scaling), float(eps),
               float(eps_gamma), beta_bias, lam_bias, float(beta_scale), float(lam_scale), _QK_NORMS[qk_norm],
               float(qk_eps) / (K if l2 else 1), K ** -0.5 if l2 else 1.0)
    if in_place:
        if pairing == "shifted" and last_k is None:
            raise ValueError("fast_weight_step_triton: a shifted row updated in place needs its carried key (a fresh "
                             "row's new key has nowhere to go: step it without in_place)")
        if (not S.is_contiguous() or (last_k is not None and (last_k.dtype != torch.float32
                                                              or not last_k.is_contiguous()))):
            raise ValueError("fast_weight_step_triton: a state updated in place must be contiguous, its carried key "
                             "float32")
        o = torch.ops.hybridlm.fast_weight_step_(q, k, v, beta, lam, S, last_k, *options)
        return o, S, last_k
    return torch.ops.hybridlm.fast_weight_step(q, k, v, beta, lam, S,
                                               None if last_k is None else last_k.to(torch.float32), *options)


def _check_device(t: torch.Tensor) -> None:
    if t.device.type != "cuda" and not triton_interpreting():
        raise ValueError(f"the Triton kernels need CUDA tensors (got {t.device}; on a CPU set TRITON_INTERPRET=1 "
                         "before triton is imported to run them under the interpreter)")


def _output_grad(do, q, y) -> torch.Tensor:
    """dL/do in q's dtype for a scan's backward: zeros where only the final state was used (the scans' autograd does
    not materialize unused gradients, so an unused final state costs no zero-filled [N, H, K, V] tensor)."""
    if do is None:
        return q.new_zeros(*q.shape[:-1], y.shape[-1])
    return do.to(q.dtype)


def _contiguous_grad_inputs(dS_final, S0, *tensors) -> tuple:
    """A scan backward op's inputs as its kernels read them: dS_final float32 and S0 (each or None), then the other
    tensors, all contiguous."""
    return (None if dS_final is None else dS_final.float().contiguous(), None if S0 is None else S0.contiguous(),
            *(t.contiguous() for t in tensors))


def _check_delta_chunk(chunk_size) -> None:
    if chunk_size > MAX_DELTA_CHUNK:
        raise ValueError(f"rule 1's (and rule 3's) kernels take chunks of at most {MAX_DELTA_CHUNK} (at 128 they need "
                         f"more shared memory than a GPU block has); got chunk_size {chunk_size}")


def _check(q, x, y, eta, log_gamma, S0, chunk_size, per_column: bool = False, more_rows: bool = False) -> None:
    """The scans' inputs; `more_rows`: x and y may have T_xy >= T rows (the delayed op's x_ext, y_ext)."""
    bad = q.dim() != 4 or x.dim() != 4 or y.dim() != 4
    if not bad:
        N, T, H, K = q.shape
        T_xy = x.shape[1]
        bad = x.shape != (N, T_xy, H, K) or y.shape[:3] != (N, T_xy, H) or (T_xy < T if more_rows else T_xy != T)
    if bad:
        rows = "T_xy >= T" if more_rows else "T"
        raise ValueError(f"q must be [N, T, H, K], x [N, {rows}, H, K] and y [N, {rows}, H, V]; got q "
                         f"{tuple(q.shape)}, x {tuple(x.shape)}, y {tuple(y.shape)}")
    N, T, H, K = q.shape
    V = y.shape[-1]
    if T < 1:
        raise ValueError("the sequence is empty (T = 0)")
    want, what = ((N, T, H, V), "[N, T, H, V]") if per_column else ((N, T, H), "[N, T, H]")
    for name, t in (("eta", eta), ("log_gamma", log_gamma)):
        if tuple(t.shape) != want or not t.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating-point {what} = {list(want)}; "
                             f"got {list(t.shape)} {t.dtype}")
    if q.dtype not in DTYPES or x.dtype != q.dtype or y.dtype != q.dtype:
        raise ValueError(f"q, x, y must share one dtype among {DTYPES}; got {q.dtype}, {x.dtype}, {y.dtype}")
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise ValueError(f"the Triton kernels take K, V <= {MAX_HEAD_DIM}; got K = {K}, V = {V} "
                         "(use the chunk backend)")
    if not (isinstance(chunk_size, int) and 16 <= chunk_size <= 128 and chunk_size & (chunk_size - 1) == 0):
        raise ValueError(f"chunk_size must be a power of two in [16, 128] for the Triton kernels; got {chunk_size}")
    if S0 is not None and (tuple(S0.shape) != (N, H, K, V) or S0.dtype != torch.float32):
        raise ValueError(f"S0 must be float32 [N, H, K, V] = {[N, H, K, V]}; got {list(S0.shape)} {S0.dtype}")
    devices = {t.device for t in (q, x, y, eta, log_gamma, S0) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device; got {sorted(map(str, devices))}")
    _check_device(q)


def _implementation(rule: str):
    """The launchers (forward, backward) of `rule`'s scan, imported on the first call (they need triton)."""
    if rule in ("1A", "2A"):
        from hybridlm.ops.fast_weight.triton import inner_product as module
    else:
        from hybridlm.ops.fast_weight.triton import regression as module
    suffix = {"1A": "1a", "2A": "2a", "1": "1", "3": "1", "2": "2"}[rule]  # rule 3 runs rule 1's launchers
    return getattr(module, f"forward_{suffix}"), getattr(module, f"backward_{suffix}")


def _register(rule: str, name: str, options: str = _OPTIONS) -> None:
    """Define hybridlm::fast_weight_{name}_fwd / _bwd on the kernels of `rule`, their fake implementations and the
    forward op's autograd formula. `options`: the schema's arguments after S0 (no gradient), passed on in order to
    the implementation's forward and backward."""

    @torch.library.custom_op(f"hybridlm::fast_weight_{name}_fwd", mutates_args=(),
                             schema=_FWD_SCHEMA.format(options=options))
    def fwd(q, x, y, eta, log_gamma, S0, *options):
        with on_tensor_device(q):  # kept, not run again, in a recomputed region (hybridlm.ops.recompute)
            return kept_kernel(on_contiguous(_implementation(rule)[0]), q, x, y, eta, log_gamma, S0, *options)

    @fwd.register_fake
    def _(q, x, y, eta, log_gamma, S0, *options):
        N, T, H, K = q.shape
        V = y.shape[-1]
        return q.new_empty(N, T, H, V), q.new_empty(N, H, K, V, dtype=torch.float32)

    @torch.library.custom_op(f"hybridlm::fast_weight_{name}_bwd", mutates_args=(),
                             schema=_BWD_SCHEMA.format(options=options))
    def bwd(do, dS_final, q, x, y, eta, log_gamma, S0, *options):
        dS_final, S0, do, q, x, y, eta, log_gamma = _contiguous_grad_inputs(dS_final, S0, do, q, x, y, eta, log_gamma)
        with on_tensor_device(q):
            return _implementation(rule)[1](do, dS_final, q, x, y, eta, log_gamma, S0, *options)

    @bwd.register_fake
    def _(do, dS_final, q, x, y, eta, log_gamma, S0, *options):
        N, _, H, K = q.shape
        V = y.shape[-1]
        # Contiguous, as the kernels write them (the inputs are made contiguous first).
        return (q.new_empty(q.shape), x.new_empty(x.shape), y.new_empty(y.shape), eta.new_empty(eta.shape),
                log_gamma.new_empty(log_gamma.shape), q.new_empty(N, H, K, V, dtype=torch.float32))

    def setup_context(ctx, inputs, output):
        q, x, y, eta, log_gamma, S0, *options = inputs
        ctx.save_for_backward(q, x, y, eta, log_gamma, S0)
        ctx.options = options
        ctx.set_materialize_grads(False)  # an unused final state's gradient stays None, not a zero-filled tensor

    def backward(ctx, do, dS_final):
        q, x, y, eta, log_gamma, S0 = ctx.saved_tensors
        do = _output_grad(do, q, y)
        dq, dx, dy, deta, dlg, dS0 = bwd(do, dS_final, q, x, y, eta, log_gamma, S0, *ctx.options)
        return (dq, dx, dy, deta, dlg, None if S0 is None else dS0) + (None,) * len(ctx.options)

    fwd.register_autograd(backward, setup_context=setup_context)
    keep_in_compiled_regions(getattr(torch.ops.hybridlm, f"fast_weight_{name}_fwd").default)


_PREP_OPTIONS = "Tensor beta, Tensor lam, Tensor? last_k, Tensor? offsets, Tensor? seq_idx, int max_len, " \
                "bool shifted, bool nlms, bool ridge_scaling, float eps, float eps_gamma"
_PREP_ARGS = f"Tensor k, Tensor v, {_PREP_OPTIONS}"


def _register_prepare() -> None:
    """hybridlm::fast_weight_prepare_fwd / _bwd (`prepare.py`), their fake implementations and autograd."""

    def rows(k, offsets):
        return k.shape[0] if offsets is None else offsets.shape[0] - 1

    @torch.library.custom_op("hybridlm::fast_weight_prepare_fwd", mutates_args=(),
                             schema=f"({_PREP_ARGS}) -> (Tensor, Tensor, Tensor, Tensor)")
    def fwd(k, v, beta, lam, last_k, offsets, seq_idx, max_len, shifted, nlms, ridge_scaling, eps, eps_gamma):
        from hybridlm.ops.fast_weight.triton import prepare

        k, beta, lam = (t.contiguous() for t in (k, beta, lam))
        v = v.contiguous() if offsets is not None else v  # read for packed rows only (`prepare.value_rows`)
        last_k, seq_idx = (None if t is None else t.contiguous() for t in (last_k, seq_idx))
        with on_tensor_device(k):
            return prepare.forward(k, v, beta, lam, last_k, offsets, seq_idx, max_len, shifted, nlms, ridge_scaling,
                                   eps, eps_gamma)

    @fwd.register_fake
    def _(k, v, beta, lam, last_k, offsets, seq_idx, max_len, shifted, nlms, ridge_scaling, eps, eps_gamma):
        from hybridlm.ops.fast_weight.triton.prepare import value_rows

        N, H = rows(k, offsets), k.shape[2]
        eta = beta.new_empty(N, max_len, H, dtype=torch.float32)
        return (k.new_empty(N, max_len, H, k.shape[3]), v.new_empty(N, value_rows(offsets, max_len), H, v.shape[3]),
                eta, torch.empty_like(eta))

    # The backward takes the forward's outputs x and y in place of k and v (`prepare.backward`): x holds every key a
    # pair reads, y gives dv's shape and dtype. Both stay alive for the scan's own backward, so keeping them costs
    # nothing, where keeping v (a slice of the mixer's conv output) would hold that whole output until the backward.
    # Without offsets y has no rows: the scan reads v (a contiguous copy where v is a slice) and gives dv itself.
    @torch.library.custom_op("hybridlm::fast_weight_prepare_bwd", mutates_args=(),
                             schema="(Tensor dx, Tensor dy, Tensor deta, Tensor dlog_gamma, Tensor x, Tensor y, "
                                    f"{_PREP_OPTIONS}) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
    def bwd(dx, dy, deta, dlog_gamma, x, y, beta, lam, last_k, offsets, seq_idx, max_len, shifted, nlms,
            ridge_scaling, eps, eps_gamma):
        from hybridlm.ops.fast_weight.triton import prepare

        dx, dy, deta, dlog_gamma, x, y, beta, lam = (t.contiguous() for t in (dx, dy, deta, dlog_gamma, x, y, beta,
                                                                                lam))
        last_k, seq_idx = (None if t is None else t.contiguous() for t in (last_k, seq_idx))
        with on_tensor_device(x):
            return prepare.backward(dx.to(x.dtype), dy.to(y.dtype), deta.float(), dlog_gamma.float(), x, y, beta,
                                    lam, last_k, offsets, seq_idx, max_len, shifted, nlms, ridge_scaling, eps,
                                    eps_gamma)

    @bwd.register_fake
    def _(dx, dy, deta, dlog_gamma, x, y, beta, lam, last_k, offsets, seq_idx, max_len, shifted, nlms, ridge_scaling,
          eps, eps_gamma):
        from hybridlm.ops.fast_weight.triton.prepare import value_grad

        K = x.shape[-1]
        return (x.new_empty(*beta.shape, K), value_grad(y, beta, offsets), beta.new_empty(beta.shape),
                lam.new_empty(lam.shape), x.new_empty(x.shape[0], x.shape[2], K))

    def setup_context(ctx, inputs, output):
        beta, lam, last_k, offsets, seq_idx = inputs[2:7]
        x, y = output[:2]
        ctx.save_for_backward(x, y, beta, lam, last_k, offsets, seq_idx)
        ctx.options = inputs[7:]

    def backward(ctx, dx, dy, deta, dlog_gamma):
        x, y, beta, lam, last_k, offsets, seq_idx = ctx.saved_tensors
        dk, dv, dbeta, dlam, dlast = bwd(dx, dy, deta, dlog_gamma, x, y, beta, lam, last_k, offsets, seq_idx,
                                         *ctx.options)
        dv = dv if offsets is not None else None  # on rows y is v (fast_weight_prepare_triton): the scan gives dv
        return (dk, dv, dbeta, dlam, None if last_k is None else dlast) + (None,) * 8  # offsets .. eps_gamma

    fwd.register_autograd(backward, setup_context=setup_context)


_WINDOW_OPTIONS = "Tensor beta, Tensor lam, Tensor? last_k, Tensor? tail_x, Tensor? tail_v, Tensor? tail_len, " \
                  "int window, bool shifted, bool nlms, bool ridge_scaling, float eps, float eps_gamma"


def _register_window_prepare() -> None:
    """hybridlm::fast_weight_window_prepare_fwd / _bwd (`window_prepare.py`), their fake implementations and
    autograd."""

    def optional(*tensors):
        return (None if t is None else t.contiguous() for t in tensors)

    @torch.library.custom_op("hybridlm::fast_weight_window_prepare_fwd", mutates_args=(),
                             schema=f"(Tensor k, Tensor v, {_WINDOW_OPTIONS}) -> (Tensor, Tensor, Tensor, Tensor, "
                                    "Tensor)")
    def fwd(k, v, beta, lam, last_k, tail_x, tail_v, tail_len, *options):
        from hybridlm.ops.fast_weight.triton import window_prepare

        with on_tensor_device(k):
            return window_prepare.forward(*(t.contiguous() for t in (k, v, beta, lam)),
                                          *optional(last_k, tail_x, tail_v, tail_len), *options)

    @fwd.register_fake
    def _(k, v, beta, lam, last_k, tail_x, tail_v, tail_len, window, *options):
        N, T, H, K = k.shape
        C = beta.new_empty(N, T, H, window, dtype=torch.float32)
        return (k.new_empty(N, window - 1 + T, H, K), v.new_empty(N, window - 1 + T, H, v.shape[3]), C,
                C.new_empty(N, T, H), C.new_empty(N, H, T))

    # The backward takes the forward's outputs x_ext (every key a pair reads), C, log_gamma and E in place of k and v
    # (y_ext for dv's shape and dtype): the scan and the band keep x_ext and y_ext anyway.
    @torch.library.custom_op("hybridlm::fast_weight_window_prepare_bwd", mutates_args=(),
                             schema="(Tensor dx_ext, Tensor dy_ext, Tensor dC, Tensor dlog_gamma, Tensor x_ext, "
                                    f"Tensor y_ext, Tensor C, Tensor log_gamma, Tensor E, {_WINDOW_OPTIONS}) -> "
                                    "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
    def bwd(dx_ext, dy_ext, dC, dlog_gamma, x_ext, y_ext, C, log_gamma, E, beta, lam, last_k, tail_x, tail_v,
            tail_len, *options):
        from hybridlm.ops.fast_weight.triton import window_prepare

        with on_tensor_device(x_ext):
            return window_prepare.backward(
                dx_ext.to(x_ext.dtype).contiguous(), dy_ext.to(y_ext.dtype).contiguous(),
                *(t.float().contiguous() for t in (dC, dlog_gamma)),
                *(t.contiguous() for t in (x_ext, y_ext, C, log_gamma, E, beta, lam)),
                *optional(last_k, tail_x, tail_v, tail_len), *options)

    @bwd.register_fake
    def _(dx_ext, dy_ext, dC, dlog_gamma, x_ext, y_ext, C, log_gamma, E, beta, lam, last_k, tail_x, tail_v, tail_len,
          window, shifted, *options):
        N, T, H = beta.shape
        K, V = x_ext.shape[3], y_ext.shape[3]
        dtail_x, dtail_v = (C.new_empty(N, H, window - 1, D) if tail is None else tail.new_empty(tail.shape)
                            for tail, D in ((tail_x, K), (tail_v, V)))
        return (x_ext.new_empty(N, T, H, K), y_ext.new_empty(N, T, H, V), beta.new_empty(beta.shape),
                lam.new_empty(lam.shape), x_ext.new_empty(N, H, K) if last_k is None or not shifted
                else last_k.new_empty(last_k.shape), dtail_x, dtail_v)

    def setup_context(ctx, inputs, output):
        beta, lam, last_k, tail_x, tail_v, tail_len = inputs[2:8]
        x_ext, y_ext, C, log_gamma, E = output
        ctx.save_for_backward(x_ext, y_ext, C, log_gamma, E, beta, lam, last_k, tail_x, tail_v, tail_len)
        ctx.options = inputs[8:]

    def backward(ctx, dx_ext, dy_ext, dC, dlog_gamma, _):
        saved = ctx.saved_tensors
        last_k, tail_x = saved[7], saved[8]
        dk, dv, dbeta, dlam, dlast, dtail_x, dtail_v = bwd(dx_ext, dy_ext, dC, dlog_gamma, *saved, *ctx.options)
        no_tail = tail_x is None
        return (dk, dv, dbeta, dlam, None if last_k is None else dlast, None if no_tail else dtail_x,
                None if no_tail else dtail_v) + (None,) * 7  # tail_len .. eps_gamma

    fwd.register_autograd(backward, setup_context=setup_context)


def _register_delayed() -> None:
    """hybridlm::fast_weight_delayed_fwd / _bwd (`band.py`), their fake implementations and autograd."""
    args = "Tensor q, Tensor x_ext, Tensor y_ext, Tensor eta, Tensor log_gamma, Tensor c, Tensor? S0, " \
           "bool read_after, int chunk_size"

    @torch.library.custom_op("hybridlm::fast_weight_delayed_fwd", mutates_args=(),
                             schema=f"({args}) -> (Tensor, Tensor)")
    def fwd(q, x_ext, y_ext, eta, log_gamma, c, S0, read_after, chunk_size):
        from hybridlm.ops.fast_weight.triton import band

        with on_tensor_device(q):
            return kept_kernel(on_contiguous(band.delayed_forward), q, x_ext, y_ext, eta, log_gamma, c, S0,
                               read_after, chunk_size)

    @fwd.register_fake
    def _(q, x_ext, y_ext, eta, log_gamma, c, S0, read_after, chunk_size):
        N, T, H, K = q.shape
        return q.new_empty(N, T, H, y_ext.shape[-1]), q.new_empty(N, H, K, y_ext.shape[-1], dtype=torch.float32)

    @torch.library.custom_op("hybridlm::fast_weight_delayed_bwd", mutates_args=(),
                             schema=f"(Tensor do, Tensor? dS_final, {args}) -> "
                                    "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
    def bwd(do, dS_final, q, x_ext, y_ext, eta, log_gamma, c, S0, read_after, chunk_size):
        from hybridlm.ops.fast_weight.triton import band

        dS_final, S0, do, q, x_ext, y_ext, eta, log_gamma, c = _contiguous_grad_inputs(
            dS_final, S0, do, q, x_ext, y_ext, eta, log_gamma, c)
        with on_tensor_device(q):
            return band.delayed_backward(do, dS_final, q, x_ext, y_ext, eta, log_gamma, c, S0, read_after, chunk_size)

    @bwd.register_fake
    def _(do, dS_final, q, x_ext, y_ext, eta, log_gamma, c, S0, read_after, chunk_size):
        N, _, H, K = q.shape
        # Contiguous, as the kernels write them (the inputs are made contiguous first).
        return (q.new_empty(q.shape), x_ext.new_empty(x_ext.shape), y_ext.new_empty(y_ext.shape),
                eta.new_empty(eta.shape), log_gamma.new_empty(log_gamma.shape), c.new_empty(c.shape),
                q.new_empty(N, H, K, y_ext.shape[-1], dtype=torch.float32))

    def setup_context(ctx, inputs, output):
        *tensors, read_after, chunk_size = inputs
        ctx.save_for_backward(*tensors)
        ctx.options = (read_after, chunk_size)
        ctx.set_materialize_grads(False)  # an unused final state's gradient stays None, not a zero-filled tensor

    def backward(ctx, do, dS_final):
        q, x_ext, y_ext, eta, log_gamma, c, S0 = ctx.saved_tensors
        do = _output_grad(do, q, y_ext)
        *grads, dS0 = bwd(do, dS_final, q, x_ext, y_ext, eta, log_gamma, c, S0, *ctx.options)
        return (*grads, None if S0 is None else dS0, None, None)

    fwd.register_autograd(backward, setup_context=setup_context)
    keep_in_compiled_regions(torch.ops.hybridlm.fast_weight_delayed_fwd.default)


def _register_step() -> None:
    """hybridlm::fast_weight_step (`step.py`), hybridlm::fast_weight_step_ (the same, writing the state after the step
    over S and last_k) and their fake implementations; no autograd (decoding)."""
    arguments = ("Tensor v, Tensor beta, Tensor lam, {S}, {last_k}, str rule, bool shifted, bool read_after, "
                 "bool nlms, bool ridge_scaling, float eps, float eps_gamma, Tensor? beta_bias, Tensor? lam_bias, "
                 "float beta_scale, float lam_scale, int qk_norm, float qk_eps, float qk_scale")

    @torch.library.custom_op(
        "hybridlm::fast_weight_step", mutates_args=(),
        schema=f"(Tensor q, Tensor k, {arguments.format(S='Tensor S', last_k='Tensor? last_k')}) "
               "-> (Tensor, Tensor, Tensor)")
    def step(q, k, v, beta, lam, S, last_k, *options):
        return _run_step(q, k, v, beta, lam, S.contiguous(), None if last_k is None else last_k.contiguous(),
                         *options, in_place=False)

    @step.register_fake
    def _(q, k, v, beta, lam, S, last_k, *args):
        return (q.new_empty(v.shape), S.new_empty(S.shape), q.new_empty(q.shape, dtype=torch.float32))

    @torch.library.custom_op(
        "hybridlm::fast_weight_step_", mutates_args=("S", "last_k"),
        schema=f"(Tensor q, Tensor k, {arguments.format(S='Tensor(a!) S', last_k='Tensor(b!)? last_k')}) -> Tensor")
    def step_in_place(q, k, v, beta, lam, S, last_k, *options):
        return _run_step(q, k, v, beta, lam, S, last_k, *options, in_place=True)[0]

    @step_in_place.register_fake
    def _(q, k, v, *args):
        return q.new_empty(v.shape)


def _run_step(q, k, v, beta, lam, S, last_k, rule, shifted, read_after, nlms, ridge_scaling, eps, eps_gamma,
              beta_bias, lam_bias, beta_scale, lam_scale, qk_norm, qk_eps, qk_scale, *, in_place: bool):
    """The step kernel's launch (`step.forward`) on the custom ops' arguments; S and last_k contiguous."""
    from hybridlm.ops.fast_weight.triton import step as module

    q, k, v = (unit_last_stride(t) for t in (q, k, v))  # read at their row and head strides
    beta, lam = (contiguous_rows(t) for t in (beta, lam))  # read at their row strides
    beta_bias, lam_bias = (None if t is None else t.contiguous() for t in (beta_bias, lam_bias))
    with on_tensor_device(q):
        return module.forward(q, k, v, beta, lam, S, last_k, rule=rule, shifted=shifted, read_after=read_after,
                              nlms=nlms, ridge_scaling=ridge_scaling, eps=eps, eps_gamma=eps_gamma,
                              beta_bias=beta_bias, lam_bias=lam_bias, beta_scale=beta_scale, lam_scale=lam_scale,
                              qk_norm=qk_norm, qk_eps=qk_eps, qk_scale=qk_scale, in_place=in_place)


def fast_weight_mixer_step_triton(p, conv_weight, conv_bias, conv_state, S, last_k, *, gates: tuple,
                                  norm_weight, norm_eps: float, rule: str, pairing: str, read_after: bool,
                                  step_size: str, ridge_scaling: bool, eps: float, eps_gamma: float, qk_norm: str,
                                  qk_eps: float, in_place: bool = False):
    """The fast-weight mixer's decoding step between its projections in one kernel (`mixer_step.py`), without
    autograd: the conv step, the QK norm, the gains, the step of rule 1A, 1, 2A or 2 (window 1), the gated RMSNorm.

    Args:
        p: `[N, width]` the input projection's rows, [q | k | v | z | beta logits | lam logits] (q, k `[H K]`, v, z
            `[H V]`, beta logits `[H]` or `[H V]` for 2A, 2, lam logits `[H]`); a dtype among the kernels'.
        conv_weight: `[C, KC]` (C = H (2K + V), KC >= 2), conv_bias `[C]` or None; conv_state `[N, KC-1, C]` in p's
            dtype (unit stride along the channels).
        S: `[N, H, K, V]` float32; last_k: `[N, H, K]` float32 (shifted pairing; None: a fresh row, no write).
        gates: `(beta_bias, lam_bias, beta_scale, lam_scale)` as `fast_weight_step_triton`'s. norm_weight: `[H V]`,
            norm_eps: the gated norm's (groups of V channels, the norm before the gate). qk_norm, qk_eps: as there.
        in_place: the new conv state, S and last key written over conv_state, S and last_k (S, last_k contiguous
            float32; last_k given for shifted pairing) and returned.

    Returns:
        y `[N, H V]` in p's dtype (the out projection's input), the new conv state, S_t, the new carried key.
    """
    beta_bias, lam_bias, beta_scale, lam_scale = gates
    N, width = p.shape if p.dim() == 2 else (None, None)
    K, V = (S.shape[2], S.shape[3]) if S.dim() == 4 else (None, None)
    H = lam_bias.shape[0]
    per_column = rule in ("2A", "2")
    C = None if K is None else H * (2 * K + V)
    want_width = None if K is None else C + H * V + (H * V if per_column else H) + H
    if (p.dim() != 2 or S.dim() != 4 or tuple(S.shape) != (N, H, K, V) or width != want_width
            or conv_weight.dim() != 2 or conv_weight.shape[0] != C or conv_weight.shape[1] < 2
            or tuple(conv_state.shape) != (N, conv_weight.shape[1] - 1, C)
            or (conv_bias is not None and tuple(conv_bias.shape) != (C,))
            or (last_k is not None and tuple(last_k.shape) != (N, H, K))
            or tuple(beta_bias.shape) != ((H * V,) if per_column else (H,)) or tuple(norm_weight.shape) != (H * V,)):
        raise ValueError(f"the mixer's step takes p [N, H (3K + 2V) + beta + H], S [N, H, K, V], a conv of >= 2 taps "
                         f"on its H (2K + V) channels and its state [N, taps - 1, C], last_k [N, H, K], biases and a "
                         f"norm weight of the heads' sizes; got p {list(p.shape)}, S {list(S.shape)}, conv "
                         f"{list(conv_weight.shape)}, state {list(conv_state.shape)}, last_k "
                         f"{None if last_k is None else list(last_k.shape)}, beta_bias {list(beta_bias.shape)}, "
                         f"lam_bias {list(lam_bias.shape)}, norm {list(norm_weight.shape)}")
    if rule not in ("1A", "1", "2A", "2"):
        raise ValueError(f"the mixer's step kernel runs rules 1A, 1, 2A and 2 (window 1); got rule {rule!r}")
    if p.dtype not in DTYPES or conv_state.dtype != p.dtype or S.dtype != torch.float32 or (
            last_k is not None and last_k.dtype != torch.float32):
        raise ValueError(f"p must be in one of {DTYPES}, the conv state in p's dtype, S and last_k float32; got "
                         f"{p.dtype}, {conv_state.dtype}, {S.dtype}, {None if last_k is None else last_k.dtype}")
    if K * V > MAX_MIXER_STATE:
        raise ValueError(f"the mixer's step kernel holds a head's state in one program: K V <= {MAX_MIXER_STATE}; got "
                         f"K = {K}, V = {V}")
    if qk_norm not in _QK_NORMS:
        raise ValueError(f"qk_norm must be one of {list(_QK_NORMS)}; got {qk_norm!r}")
    if in_place and ((pairing == "shifted" and last_k is None) or not S.is_contiguous()
                     or conv_state.stride(-1) != 1):
        raise ValueError("fast_weight_mixer_step_triton: states updated in place must be contiguous (the conv state "
                         "along its channels), with the carried key of a shifted row")
    _check_device(p)
    l2 = qk_norm == "l2"
    options = (H, rule, pairing == "shifted", bool(read_after), step_size == "nlms", bool(ridge_scaling), float(eps),
               float(eps_gamma), float(beta_scale), float(lam_scale), _QK_NORMS[qk_norm],
               float(qk_eps) / (K if l2 else 1), K ** -0.5 if l2 else 1.0, float(norm_eps))
    if in_place:
        y = torch.ops.hybridlm.fast_weight_mixer_step_(p, conv_weight, conv_bias, conv_state, S, last_k, beta_bias,
                                                       lam_bias, norm_weight, *options)
        return y, conv_state, S, last_k
    return torch.ops.hybridlm.fast_weight_mixer_step(p, conv_weight, conv_bias, conv_state, S, last_k, beta_bias,
                                                     lam_bias, norm_weight, *options)


def _register_mixer_step() -> None:
    """hybridlm::fast_weight_mixer_step (`mixer_step.py`), hybridlm::fast_weight_mixer_step_ (the same, writing the
    new states over the old) and their fake implementations; no autograd (decoding)."""
    arguments = ("Tensor p, Tensor conv_weight, Tensor? conv_bias, {states}, Tensor beta_bias, Tensor lam_bias, "
                 "Tensor norm_weight, int heads, str rule, bool shifted, bool read_after, bool nlms, "
                 "bool ridge_scaling, float eps, float eps_gamma, float beta_scale, float lam_scale, int qk_norm, "
                 "float qk_eps, float qk_scale, float norm_eps")

    @torch.library.custom_op(
        "hybridlm::fast_weight_mixer_step", mutates_args=(),
        schema=f"({arguments.format(states='Tensor conv_state, Tensor S, Tensor? last_k')}) "
               "-> (Tensor, Tensor, Tensor, Tensor)")
    def step(p, conv_weight, conv_bias, conv_state, S, last_k, *options):
        return _run_mixer_step(p, conv_weight, conv_bias, conv_state, S.contiguous(),
                               None if last_k is None else last_k.contiguous(), *options, in_place=False)

    @step.register_fake
    def _(p, conv_weight, conv_bias, conv_state, S, last_k, beta_bias, lam_bias, norm_weight, heads, *args):
        return (p.new_empty(p.shape[0], norm_weight.shape[0]), conv_state.new_empty(conv_state.shape),
                S.new_empty(S.shape), S.new_empty(S.shape[:3]))

    @torch.library.custom_op(
        "hybridlm::fast_weight_mixer_step_", mutates_args=("conv_state", "S", "last_k"),
        schema=f"({arguments.format(states='Tensor(a!) conv_state, Tensor(b!) S, Tensor(c!)? last_k')}) -> Tensor")
    def step_in_place(p, conv_weight, conv_bias, conv_state, S, last_k, *options):
        return _run_mixer_step(p, conv_weight, conv_bias, conv_state, S, last_k, *options, in_place=True)[0]

    @step_in_place.register_fake
    def _(p, conv_weight, conv_bias, conv_state, S, last_k, beta_bias, lam_bias, norm_weight, *args):
        return p.new_empty(p.shape[0], norm_weight.shape[0])


def _run_mixer_step(p, conv_weight, conv_bias, conv_state, S, last_k, beta_bias, lam_bias, norm_weight, heads, rule,
                    shifted, read_after, nlms, ridge_scaling, eps, eps_gamma, beta_scale, lam_scale, qk_norm, qk_eps,
                    qk_scale, norm_eps, *, in_place: bool):
    """The mixer step kernel's launch (`mixer_step.forward`) on the custom ops' arguments; S and last_k contiguous."""
    from hybridlm.ops.fast_weight.triton import mixer_step

    conv_weight, conv_bias, beta_bias, lam_bias, norm_weight = (
        None if t is None else t.contiguous() for t in (conv_weight, conv_bias, beta_bias, lam_bias, norm_weight))
    with on_tensor_device(p):
        return mixer_step.forward(unit_last_stride(p), conv_weight, conv_bias, unit_last_stride(conv_state), S, last_k,
                                  beta_bias, lam_bias, norm_weight, heads=heads, rule=rule, shifted=shifted,
                                  read_after=read_after, nlms=nlms, ridge_scaling=ridge_scaling, eps=eps,
                                  eps_gamma=eps_gamma, beta_scale=beta_scale, lam_scale=lam_scale, qk_norm=qk_norm,
                                  qk_eps=qk_eps, qk_scale=qk_scale, norm_eps=norm_eps, in_place=in_place)


_register_prepare()
_register_window_prepare()
_register_step()
_register_mixer_step()
_register_delayed()
_register("1A", "1a")
_register("1", "1")
_register("3", "3", options=f"{_OPTIONS}, int slots")
_register("2A", "2a")
_register("2", "2")
