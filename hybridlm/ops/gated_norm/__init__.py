"""The mixers' grouped, gated RMSNorm (the Mamba-2 and fast-weight mixers' output norm) as a pure function:

    y = w * u / sqrt(mean_group(u^2) + eps) [* SiLU(z)],   u = x (norm before the gate) or x * SiLU(z)

- `gated_norm_naive(...)`: the float64 reference (`naive.py`);
- `gated_norm_triton(...)`: Triton kernels for a GPU, one launch forward and one backward (`kernels.py`; imported on
  the first call, so importing this package never needs triton).

`hybridlm.modules.gated_rms_norm` is the mixers' entry point: these kernels for CUDA tensors outside torch.compile
(`backend="auto"`), else its torch form (float32 math, several kernels each way).
"""

from __future__ import annotations

from hybridlm.ops.gated_norm.limits import MAX_GROUP
from hybridlm.ops.gated_norm.naive import gated_norm_naive


def gated_norm_triton(x, weight, gate=None, *, groups=1, eps=1e-6, norm_before_gate=True):
    """The norm on the Triton kernels; see `kernels.gated_norm_triton`."""
    from hybridlm.ops.gated_norm.kernels import gated_norm_triton as run

    return run(x, weight, gate, groups=groups, eps=eps, norm_before_gate=norm_before_gate)


__all__ = ["MAX_GROUP", "gated_norm_naive", "gated_norm_triton"]
