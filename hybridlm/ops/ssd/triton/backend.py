"""The `ssd` backend contract on the Triton kernels: checked raw inputs -> prepared inputs -> the custom op.

Same contract as `chunk.chunk_ssd` (inputs validated by the front door `hybridlm.ops.ssd.ssd`), except for dtypes:
x, B and C keep their (promoted) dtype, so bf16/fp16 matmuls run on tensor cores, while dt, A, D, the decays and
the state run in float32; float64 is refused (the torch backends run it). Packed sequences (`offsets`) are
right-padded into a batch exactly as the torch chunk path does (`packed_to_padded`, dt = 0 on the padding: padded
steps are exact no-ops, so each row's state after its padding is its sequence's final state), then y is packed back.
"""

from __future__ import annotations

import torch

from hybridlm.ops.ssd.triton.custom_ops import ssd_chunk_triton, ssd_step_triton
from hybridlm.ops.ssd.triton.limits import DTYPES, MAX_CHUNK, MAX_D_STATE, MAX_HEAD_DIM, supports
from hybridlm.ops.utils import needs_grad, packed_to_padded, padded_to_packed, triton_chunk_size, triton_runs_on


def ssd_triton(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    D: torch.Tensor | None,
    chunk_size: int,
    initial_state: torch.Tensor | None,
    offsets: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(y [b, T, H, P] in x's dtype, final_state [b or N_seq, H, P, N] float32)`. `chunk_size` is rounded to a
    power of two in [16, 64] (`limits.MAX_CHUNK`: the op's default 256 would spill registers); initial_state None
    means zeros. A single step (T = 1) without packed sequences and without a gradient to record (a decoding step)
    runs as one kernel (`step.py`)."""
    if not triton_runs_on(x):
        raise ValueError("backend='triton' needs triton installed and the tensors on a CUDA device; "
                         "use backend='chunk' (or set TRITON_INTERPRET=1 to run the kernels on CPU tensors)")
    dtype = torch.promote_types(torch.promote_types(x.dtype, B.dtype), C.dtype)
    P, N = x.shape[-1], B.shape[-1]
    if not supports(P=P, N=N, dtype=dtype):
        raise ValueError(f"the Triton backend takes x, B, C in {DTYPES} with P <= {MAX_HEAD_DIM} and "
                         f"N <= {MAX_D_STATE}; got {dtype}, P = {P}, N = {N} (use backend='chunk')")
    f32 = lambda t: None if t is None else t.to(device=x.device, dtype=torch.float32)
    if x.shape[1] == 1 and offsets is None and not needs_grad(x, dt, A, B, C, D, initial_state):
        b, _, H, _ = x.shape
        h0 = f32(initial_state) if initial_state is not None else x.new_zeros(b, H, P, N, dtype=torch.float32)
        y, final = ssd_step_triton(x[:, 0].to(dtype), dt[:, 0], A, B[:, 0].to(dtype), C[:, 0].to(dtype), D, h0)
        return y[:, None].to(x.dtype), final
    x_, B_, C_, dt_, A_, D_, h0 = x.to(dtype), B.to(dtype), C.to(dtype), f32(dt), f32(A), f32(D), f32(initial_state)
    if offsets is not None:  # [1, total, ...] -> [N_seq, max_len, ...], dt = 0 on the padding
        x_, dt_, B_, C_ = (packed_to_padded(t, offsets) for t in (x_, dt_, B_, C_))
    b, T, H, _ = x_.shape
    if T == 0:  # nothing to scan: the state passes through
        final = h0.clone() if h0 is not None else x.new_zeros(b, H, P, N, dtype=torch.float32)
        return x.new_zeros(x.shape), final
    y, final = ssd_chunk_triton(x_, dt_, A_, B_, C_, D_, h0, chunk_size=triton_chunk_size(chunk_size, cap=MAX_CHUNK))
    if offsets is not None:
        y = padded_to_packed(y, offsets)
    return y.to(x.dtype), final

