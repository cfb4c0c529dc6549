"""The interpreter's bounds check (`triton_modes.check_interpreted_bounds`, on whenever the op tests run under
HYBRIDLM_TRITON_INTERPRET=1): a kernel's active lanes past the tensors it was launched with fail the launch, masked
lanes and in-bounds accesses do not.

    HYBRIDLM_TRITON_INTERPRET=1 python -m pytest -q tests/ops/test_triton_interpreter_bounds.py
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.triton_modes import HAS_TRITON, INTERPRET

pytestmark = pytest.mark.skipif(not (INTERPRET and HAS_TRITON),
                                reason="checks the interpreter (HYBRIDLM_TRITON_INTERPRET=1 with triton installed)")

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def copy_kernel(src_ptr, dst_ptr, n, shift, BLOCK: tl.constexpr):
        """dst[i] = src[i + shift] for i < n."""
        offs = tl.arange(0, BLOCK)
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs + shift, mask=offs < n), mask=offs < n)


def test_in_bounds_and_masked_lanes_pass():
    src, dst = torch.arange(8.0), torch.zeros(8)
    copy_kernel[(1,)](src, dst, 8, 0, BLOCK=16)  # lanes 8..15 masked off
    assert torch.equal(dst, src)
    copy_kernel[(1,)](src, dst[:4], 4, 4, BLOCK=16)  # a view: inside its storage
    assert torch.equal(dst[:4], src[4:])


@pytest.mark.parametrize("n,shift,what", [(9, 0, "load"), (8, 1, "load")])
def test_active_lanes_past_the_tensors_fail(n, shift, what):
    src, dst = torch.arange(8.0), torch.zeros(16)
    with pytest.raises(Exception, match=f"copy_kernel: 1 of {n} active {what} lanes fall outside every tensor"):
        copy_kernel[(1,)](src, dst, n, shift, BLOCK=16)


def test_a_store_past_the_end_fails():
    src, dst = torch.arange(16.0), torch.zeros(8)
    with pytest.raises(Exception, match="copy_kernel: 8 of 16 active store lanes fall outside every tensor"):
        copy_kernel[(1,)](src, dst, 16, 0, BLOCK=16)
