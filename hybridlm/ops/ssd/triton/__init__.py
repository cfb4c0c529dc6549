"""Triton (GPU) kernels of the chunked Mamba-2 SSD scan, forward and backward. Importing this package never needs
triton (`scan.py` and `kernels.py`, which do, are imported on the first call).

- `ssd_chunk_triton(x, dt, A, B, C, D, h0, *, chunk_size)`: the scan on prepared inputs (x, B, C in one dtype; dt,
  A, D, h0 float32), differentiable in every tensor; a `torch.library` custom op (`hybridlm::ssd_fwd` / `_bwd`,
  `custom_ops.py`, registered on the first call), so `torch.compile` traces it.
- `ssd_triton(...)`: the same contract as `chunk.chunk_ssd` (packed sequences included), i.e. what
  `ssd(..., backend="triton")` runs; `backend.py`.
- `ssd_step_triton(x, dt, A, B, C, D, h)`: one decoding step in one kernel (`step.py`, the custom op
  `hybridlm::ssd_step`, or `hybridlm::ssd_step_` writing the new state over h; inference only), what `ssd` runs for
  T == 1 on CUDA without a gradient to record.
- `is_available()`: triton importable and a CUDA device present; `supports(...)`: the shapes and dtypes the kernels
  take (else use the chunk backend), `auto_takes(...)` (what `backend="auto"` sends here) and `slow_path_reason(...)`
  (why it does not): `limits.py`.

The kernels also run on CPU tensors under Triton's interpreter (`TRITON_INTERPRET=1` set before triton is
imported): that is how the tests check them without a GPU (`HYBRIDLM_TRITON_INTERPRET=1`). The math: README.md.
"""

from __future__ import annotations

from hybridlm.ops.ssd.triton.limits import (
    AUTO_DTYPES,
    DTYPES,
    MAX_D_STATE,
    MAX_HEAD_DIM,
    auto_takes,
    slow_path_reason,
    supports,
)
from hybridlm.ops.utils import triton_available as is_available


def ssd_chunk_triton(x, dt, A, B, C, D, h0, *, chunk_size: int = 64):
    """The scan on prepared inputs; see `custom_ops.ssd_chunk_triton`."""
    from hybridlm.ops.ssd.triton.custom_ops import ssd_chunk_triton as run

    return run(x, dt, A, B, C, D, h0, chunk_size=chunk_size)


def ssd_step_triton(x, dt, A, B, C, D, h, *, discretize=None, gate=None, in_place=False):
    """One decoding step; see `custom_ops.ssd_step_triton`."""
    from hybridlm.ops.ssd.triton.custom_ops import ssd_step_triton as run

    return run(x, dt, A, B, C, D, h, discretize=discretize, gate=gate, in_place=in_place)


def ssd_triton(x, dt, A, B, C, **options):
    """The backend contract (as `chunk.chunk_ssd`) on the Triton kernels; see `backend.py`."""
    from hybridlm.ops.ssd.triton.backend import ssd_triton as run

    return run(x, dt, A, B, C, **options)


__all__ = ["AUTO_DTYPES", "DTYPES", "MAX_D_STATE", "MAX_HEAD_DIM", "auto_takes", "is_available", "slow_path_reason",
           "ssd_chunk_triton", "ssd_step_triton", "ssd_triton", "supports"]
