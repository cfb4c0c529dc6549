"""Pure tensor functions (no module state): the fast-weight rules (`fast_weight`), the Mamba-2 SSD scan
(`ssd`: `from hybridlm.ops.ssd import ssd`), the mixers' short causal conv (`short_conv`) and gated output norm
(`gated_norm`), the output-keeping RMS normalization (`rms_norm`), the SiLU gate (`silu_gate`) and the rotation of
queries and keys for inference (`rotary`);
`recompute`: a region recomputed in the backward except its scan kernels. `SlowPathWarning`:
what the two ops, and `hybridlm.modules.causal_conv1d` over the conv's kernels, issue where `backend="auto"` on CUDA
runs a torch path for a call their Triton kernels cannot take."""

from __future__ import annotations

from hybridlm.lazy import lazy_exports

_EXPORTS = {
    "fast_weight_attention": "hybridlm.ops.fast_weight.op",
    "FastWeightState": "hybridlm.ops.fast_weight.state",
    "SlowPathWarning": "hybridlm.ops.utils",
}

__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
