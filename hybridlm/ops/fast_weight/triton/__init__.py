"""Triton (GPU) kernels of the Falcon fast-weight rules. Importing this package never needs triton (the kernel and
launcher modules, which do, are imported on the first call).

Entry points:
- `fast_weight_triton(q, k, v, beta, lam, options, *, initial_state, offsets, seq_idx, final_state)`: the same
  contract as `chunk.fast_weight_chunk` for the calls of `supports(...)` (rules 1A, 3A, 3 (window <= 64), and 1, 2A
  and 2 with window 1), i.e. what `fast_weight_attention(..., backend="triton")` runs (`backend.py`); without
  `final_state` it returns None in the final state's place and skips assembling it.
- `fast_weight_{1a,1,3,2a,2}_triton(q, x, y, eta, log_gamma, S0, *, read_after, chunk_size)`: one rule's scan on
  prepared writes (chunk.py's pipeline after its step 3), forward and backward in Triton, as `torch.library` custom
  ops (`hybridlm::fast_weight_{1a,1,3,2a,2}_{fwd,bwd}`, `custom_ops.py`, registered on the first call), so that
  `torch.compile` traces them; rule 3 takes `slots` (write events per step) too.
- `is_available()`: triton importable and a CUDA device present; `supports(...)`, `auto_takes(...)` (what
  `backend="auto"` sends here), `slow_path_reason(...)` (why it does not), `step_takes(...)` (the decoding steps
  that run as one kernel, `step.py`) and the limits: `limits.py`.

Layout. Shared building blocks, named for the stage they compute: `decays.py` (chunk-local cumulative log decays),
`chunk_state.py` (each chunk's contribution to the state and the sequential pass over chunks), `chunk_output.py`
(outputs and their value gradient), `wy.py` (the WY factors: (I + A)^-1, U, W), `prepare.py` (the fused write
preparation of rules 1A and 1), `window_prepare.py` (rule 3A's, with its delayed-write coefficients), `band.py` (rule
3A's band), `chunking.py` (the chunk grid and plan they share).
Per rule family: `inner_product.py` / `inner_product_kernels.py` (rules 1A, 2A; 3A on 1A's) and `regression.py` /
`regression_kernels.py` (rules 1, 3, 2): launchers and their family's kernels. `step.py`: one decoding step of
the window-1 rules in one kernel (inference); `mixer_step.py`: the fast-weight mixer's whole decoding step between
its projections (conv, QK norm, gains, step, gated norm) in one kernel (inference).

The kernels also run on CPU tensors under Triton's interpreter (`TRITON_INTERPRET=1` set before triton is
imported): that is how the tests check them without a GPU (`HYBRIDLM_TRITON_INTERPRET=1`).
"""

from __future__ import annotations

from hybridlm.ops.fast_weight.triton.limits import (
    DTYPES,
    MAX_DELTA_CHUNK,
    MAX_HEAD_DIM,
    MAX_RULE_3_WINDOW,
    STEP_RULES,
    SUPPORTED_RULES,
    auto_takes,
    slow_path_reason,
    step_takes,
    supports,
)
from hybridlm.ops.utils import triton_available as is_available


def fast_weight_1a_triton(q, x, y, eta, log_gamma, S0, *, read_after: bool, chunk_size: int = 64):
    """Rule 1A on prepared writes; see `custom_ops.fast_weight_1a_triton`."""
    from hybridlm.ops.fast_weight.triton.custom_ops import fast_weight_1a_triton as run

    return run(q, x, y, eta, log_gamma, S0, read_after=read_after, chunk_size=chunk_size)


def fast_weight_1_triton(q, x, y, eta, log_gamma, S0, *, read_after: bool, chunk_size: int = 64):
    """Rule 1 (window 1) on prepared writes; see `custom_ops.fast_weight_1_triton`."""
    from hybridlm.ops.fast_weight.triton.custom_ops import fast_weight_1_triton as run

    return run(q, x, y, eta, log_gamma, S0, read_after=read_after, chunk_size=chunk_size)


def fast_weight_3_triton(q, x, y, eta, log_gamma, S0, *, read_after: bool, chunk_size: int = 64, slots: int):
    """Rule 3 as rule 1 over write events, `slots` per step; see `custom_ops.fast_weight_3_triton`."""
    from hybridlm.ops.fast_weight.triton.custom_ops import fast_weight_3_triton as run

    return run(q, x, y, eta, log_gamma, S0, read_after=read_after, chunk_size=chunk_size, slots=slots)


def fast_weight_2a_triton(q, x, y, eta, log_gamma, S0, *, read_after: bool, chunk_size: int = 16):
    """Rule 2A (eta, log_gamma per value column) on prepared writes; see `custom_ops.fast_weight_2a_triton`."""
    from hybridlm.ops.fast_weight.triton.custom_ops import fast_weight_2a_triton as run

    return run(q, x, y, eta, log_gamma, S0, read_after=read_after, chunk_size=chunk_size)


def fast_weight_2_triton(q, x, y, eta, log_gamma, S0, *, read_after: bool, chunk_size: int = 16):
    """Rule 2 (regression, eta and log_gamma per value column) on prepared writes; see
    `custom_ops.fast_weight_2_triton`."""
    from hybridlm.ops.fast_weight.triton.custom_ops import fast_weight_2_triton as run

    return run(q, x, y, eta, log_gamma, S0, read_after=read_after, chunk_size=chunk_size)


def fast_weight_triton(q, k, v, beta, lam, options, **call):
    """The op's backend contract (as `chunk.fast_weight_chunk`) on the Triton kernels; see `backend.py`."""
    from hybridlm.ops.fast_weight.triton.backend import fast_weight_triton as run

    return run(q, k, v, beta, lam, options, **call)


__all__ = ["DTYPES", "MAX_DELTA_CHUNK", "MAX_HEAD_DIM", "MAX_RULE_3_WINDOW", "STEP_RULES", "SUPPORTED_RULES",
           "auto_takes", "fast_weight_1_triton", "fast_weight_1a_triton", "fast_weight_2_triton",
           "fast_weight_2a_triton", "fast_weight_3_triton", "fast_weight_triton", "is_available", "slow_path_reason",
           "step_takes", "supports"]
