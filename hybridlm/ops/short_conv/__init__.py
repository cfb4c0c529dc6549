"""The mixers' short causal depthwise convolution as a pure function, with documents restarting inside a row:

    y_t[c] = act(bias[c] + sum_{k=0}^{K-1} w[c, k] x_{t-K+1+k}[c] [same document as t])

- `short_conv_naive(...)`: the float64 reference, one tap at a time (`naive.py`);
- `short_conv_triton(...)`: Triton kernels for training on a GPU, one launch forward and two backward
  (`kernels.py`; imported on the first call, so importing this package never needs triton);
- `short_conv_step_triton(x, state, weight, bias, *, silu, in_place)`: one decoding step with its carried state in
  one kernel, the new state written over the old one with `in_place` (`step.py`; inference only).

`short_conv_naive` and `short_conv_triton` take no state: carried states (prefill into a cache) and packed rows by
`cu_seqlens` stay with `hybridlm.modules.causal_conv1d`, which also sends a decoding step to the step kernel.
"""

from __future__ import annotations

from hybridlm.ops.short_conv.naive import short_conv_naive


def short_conv_triton(x, weight, bias=None, *, seq_idx=None, activation=None):
    """The conv on the Triton kernels; see `kernels.short_conv_triton`."""
    from hybridlm.ops.short_conv.kernels import short_conv_triton as run

    return run(x, weight, bias, seq_idx=seq_idx, activation=activation)


def short_conv_step_triton(x, state, weight, bias=None, *, silu=False, in_place=False):
    """One decoding step on its Triton kernel; see `step.short_conv_step_triton`."""
    from hybridlm.ops.short_conv.step import short_conv_step_triton as run

    return run(x, state, weight, bias, silu=silu, in_place=in_place)


__all__ = ["short_conv_naive", "short_conv_step_triton", "short_conv_triton"]
