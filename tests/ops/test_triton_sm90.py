"""Every fast-weight Triton kernel compiles to PTX for sm_90 within an H200's shared memory, module by module (bf16 at
a model's sizes, fp32 at small or odd ones; the flags and blocks as the launchers use them). The interpreter never
runs the compiled path (its typing of 3-D tensors, reductions, register allocation), so these builds, which need
triton with its CUDA backend but no GPU, are the CPU's check of it (`triton_modes.compile_for_sm90`).
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from tests.ops.triton_modes import (
    H200_SHARED_BYTES,
    compile_for_sm90,
    needs_cuda_backend,
    uniform_reads_before_writes,
)

PACKAGE = "hybridlm.ops.fast_weight.triton"

DECAYS = """
from hybridlm.ops.fast_weight.triton import decays as k

build(k.chunk_cumsum_kernel, dict(BT=64), warps=8)
build(k.chunk_cumsum_columns_kernel, dict(V=128, BT=16, BV=64))
"""

CHUNK_STATE = """
import itertools
from hybridlm.ops.fast_weight.triton import chunk_state as k

IO = ("q_ptr", "x_ptr", "y_ptr", "a_ptr", "b_ptr", "do_ptr", "o_ptr", "dq_ptr", "dx_ptr", "dy_ptr")
for io, prec, s in (("*bf16", "tf32", dict(K=128, V=128, BT=64)), ("*fp32", "ieee", dict(K=100, V=40, BT=16))):
    b = functools.partial(build, io=io, io_names=IO, warps=8)
    blocks = dict(s, BK=64, BV=64 if s["V"] > 32 else 32)
    sequential = dict(s, BK=64, BV=32, INTERPRET=False)
    for flags in (dict(READ_AFTER=True, GRAD=False), dict(READ_AFTER=False, GRAD=True)):
        b(k.chunk_outer_kernel, dict(blocks, **flags, PREC=prec))
        for has_init in (True, False):
            b(k.state_scan_kernel, dict(sequential, **flags, HAS_INIT=has_init, REVERSE=flags["GRAD"], PREC=prec),
              warps=4)
    if io == "*fp32":
        continue
    # Rule 1A stores its per-chunk states (h) in the inputs' dtype; rule 1 reads float32 ones (above).
    b = functools.partial(build, io=io, io_names=IO + ("h_ptr",), warps=4)
    for grad, (BK, BV) in itertools.product((False, True), ((64, 32), (32, 32), (16, 32), (32, 16), (16, 16))):
        scan = dict(sequential, BK=BK, BV=BV)  # inner_product.scan_blocks's blocks, fixed and narrowed
        b(k.state_scan_kernel, dict(scan, READ_AFTER=True, GRAD=grad, HAS_INIT=grad, REVERSE=grad, PREC=prec))
# Per value column (rules 2A, 2).
build(k.state_pass_columns_kernel, dict(K=128, V=128, BT=16, BK=64, BV=32, HAS_INIT=True, REVERSE=True,
                                        INTERPRET=False))
for io, prec, s in (("*bf16", "tf32", dict(K=128, V=128, BT=16)), ("*fp32", "ieee", dict(K=16, V=8, BT=16))):
    blocks = dict(s, BK=min(64, s["K"]), BV=min(64, max(16, s["V"])), READ_AFTER=False, PREC=prec)
    build(k.chunk_outer_columns_kernel, dict(blocks, GRAD=True), io=io, io_names=IO)
"""

CHUNK_OUTPUT = """
from hybridlm.ops.fast_weight.triton import chunk_output as k

IO = ("q_ptr", "x_ptr", "y_ptr", "do_ptr", "o_ptr", "dy_ptr")
for io, prec, s in (("*bf16", "tf32", dict(K=128, V=128, BT=64)), ("*fp32", "ieee", dict(K=100, V=40, BT=16))):
    blocks = dict(s, BK=64, BV=64 if s["V"] > 32 else 32)
    for io_names in ((IO, IO + ("h_ptr", "dh_ptr")) if io == "*bf16" else (IO,)):  # rule 1A's 16-bit states too
        b = functools.partial(build, io=io, io_names=io_names, warps=8)
        b(k.output_kernel, dict(blocks, READ_AFTER=True, PREC=prec))
        b(k.grad_y_kernel, dict(blocks, READ_AFTER=True, HAS_DH=True, PREC=prec))
# Per value column (rules 2A, 2).
for io, prec, s in (("*bf16", "tf32", dict(K=128, V=128, BT=16)), ("*fp32", "ieee", dict(K=16, V=8, BT=16))):
    blocks3 = dict(s, BK=min(64, s["K"]), BV=min(32, max(16, s["V"])), READ_AFTER=False, PREC=prec)
    build(k.output_columns_kernel, blocks3, io=io, io_names=IO, warps=8)
"""

WHOLE_STATE = """
from hybridlm.ops.fast_weight.triton import whole_state as k

IO = ("q_ptr", "x_ptr", "y_ptr", "o_ptr")
# Rule 1A's forward walk: bf16 at a model's head sizes at the launch's 8 warps (float32 at chunks of 16, as the tests
# call it; the op takes it for 16-bit inputs only)
for io, prec, s in (("*bf16", "tf32", dict(K=128, V=128, BT=64, BK=128, BV=128)),
                    ("*fp32", "ieee", dict(K=100, V=40, BT=16, BK=128, BV=64))):
    for read_after, has_init in ((True, True), (False, False)):
        flags = dict(s, READ_AFTER=read_after, HAS_INIT=has_init, PREC=prec, INTERPRET=False)
        build(k.output_walk_kernel, flags, io=io, io_names=IO, warps=8)
"""

INNER_PRODUCT = """
import itertools
from hybridlm.ops.fast_weight.triton import inner_product_kernels as k
from hybridlm.ops.fast_weight.triton.inner_product import grad_qxy_blocks

IO = ("q_ptr", "x_ptr", "y_ptr", "do_ptr", "dq_ptr", "dx_ptr", "dy_ptr")
# The launcher's blocks under its fixed launch (4 warps, 3 stages) and the autotuner's widest (8 warps).
launches = (dict(warps=4, stages=3), dict(warps=8, stages=3))
for io, prec, s in (("*bf16", "tf32", dict(K=128, V=128, BT=64)), ("*fp32", "ieee", dict(K=100, V=40, BT=16)),
                    ("*fp32", "ieee", dict(K=128, V=128, BT=64))):
    BK, BV = grad_qxy_blocks(s["K"], s["V"])
    for io_names in ((IO, IO + ("h_ptr", "dh_ptr")) if io == "*bf16" else (IO,)):  # rule 1A's 16-bit states too
        for read_after, launch in itertools.product((False, True), launches):
            build(k.grad_qxy_kernel, dict(s, BK=BK, BV=BV, READ_AFTER=read_after, PREC=prec), io=io,
                  io_names=io_names, **launch)
# The launcher's blocks at small head sizes and every chunk (ptxas 12.8 miscompiles some of them: `grad_qxy_blocks`).
for io in ("*bf16", "*fp16"):
    for (K, V), BT in itertools.product(((20, 12), (32, 16), (16, 16), (64, 16), (100, 64), (128, 32)), (16, 32, 64)):
        BK, BV = grad_qxy_blocks(K, V)
        build(k.grad_qxy_kernel, dict(K=K, V=V, BT=BT, BK=BK, BV=BV, READ_AFTER=False, PREC="tf32"), io=io,
              io_names=IO + ("h_ptr", "dh_ptr"), warps=4, stages=3)
for io, prec, s in (("*bf16", "tf32", dict(K=128, V=128, BT=16)), ("*fp32", "ieee", dict(K=16, V=8, BT=16))):
    blocks3 = dict(s, BK=min(64, s["K"]), BV=min(32, max(16, s["V"])), READ_AFTER=False, PREC=prec)
    for kernel in (k.grad_v_2a_kernel, k.grad_qx_2a_kernel):
        build(kernel, blocks3, io=io, io_names=IO, warps=8)
"""

WY = """
from hybridlm.ops.fast_weight.triton import wy as k

IO = ("x_ptr", "y_ptr")
# The largest chunk (MAX_DELTA_CHUNK = 64) at three head sizes, rule 1 (one slot) and rule 3 (four).
for K in (128, 64, 16):
    for slots in (1, 4):
        build(k.tinv_kernel, dict(K=K, BT=64, BK=min(64, K), SLOTS=slots, PREC="tf32", PREC32="tf32"), io="*bf16",
              io_names=IO, warps=4)
        build(k.wu_kernel, dict(K=K, V=K, BT=64, BD=min(64, max(16, K)), SLOTS=slots, PREC32="tf32"), io="*bf16",
              io_names=IO, warps=8)
"""

REGRESSION = """
import itertools
from hybridlm.ops.fast_weight.triton import regression_kernels as k
from hybridlm.ops.fast_weight.triton.regression import pass_launches
from hybridlm.ops.triton_utils import block

IO = ("x_ptr", "y_ptr", "q_ptr", "do_ptr", "dx_ptr", "dq_ptr", "dy_ptr")
b = functools.partial(build, io="*bf16", io_names=IO)
# Rules 1 and 3's two sequential passes as regression.py launches them: 16-bit inputs (TF32 products of float32
# factors) and float32 inputs (exact products).
PASS_INPUTS = (("*bf16", "tf32"), ("*fp32", "ieee"))


def launch(settings):
    return {"warps": settings["num_warps"], "stages": settings["num_stages"]}


# The passes' launches at K = V: [(value block, regression.PassLaunch)].
def launches(K):
    return [(block(K, p.block_v), p) for p in pass_launches(K, K)]


# The largest chunk (MAX_DELTA_CHUNK = 64) at three head sizes, rule 1 and rule 3.
for K, BT in ((128, 64), (64, 64), (16, 64)):
    for slots in (1, 4):
        sizes = dict(K=K, V=K, BT=BT, BK=K, PREC="tf32", PREC32="tf32", SLOTS=slots)
        for (io, prec), (BV, passes) in itertools.product(PASS_INPUTS, launches(K)):
            b(k.delta_grad_pass_kernel, dict(sizes, BV=BV, HAS_INIT=True, INTERPRET=False, PREC32=prec), io=io,
              **launch(passes.kwargs(reverse=True)))
        b(k.delta_grad_state_kernel, dict(sizes, BK=min(64, K), BV=min(64, K)), warps=8)
        for read_after in (True, False):
            b(k.delta_grad_kernel, dict(sizes, BK=min(64, K), BV=min(64, K), READ_AFTER=read_after,
                                        N_PARTS=-(-K // 64), STORE_DY=True), warps=8)
    # The kernels that do not take SLOTS, as regression.py launches them.
    plain = dict(K=K, V=K, BT=BT, BK=K, PREC32="tf32")
    for (io, prec), (BV, passes) in itertools.product(PASS_INPUTS, launches(K)):
        # The forward stores the entry states (h) in the inputs' dtype, the backward's recomputation in float32.
        for io_names in (IO, IO + ("h_ptr",)):
            b(k.delta_pass_kernel, dict(plain, BV=BV, HAS_INIT=True, INTERPRET=False, PREC32=prec), io=io,
              io_names=io_names, **launch(passes.kwargs()))
    for read_after in (True, False):
        b(k.delta_grad_q_kernel, dict(plain, BV=32 if K > 64 else min(64, max(16, K)), READ_AFTER=read_after),
          warps=8)

# Rule 2 (per value column), chunks of 16 and 32.
CASES = [("*bf16", "tf32", dict(K=128, V=128, BT=BT), read_after) for BT in (16, 32) for read_after in (False, True)]
for io, prec, s, read_after in CASES + [("*fp32", "ieee", dict(K=16, V=8, BT=16), False)]:
    b = functools.partial(build, io=io, io_names=IO)
    common = dict(s, READ_AFTER=read_after, PREC=prec, PREC32=prec, INTERPRET=False)
    tile = 16 if s["BT"] > 16 else 32  # ChunkPlan.column_tile: the [BT, BT, BV] tiles shrink as the chunk grows
    passes = dict(common, BK=s["K"], BV=16 if s["K"] > 64 else 32, HAS_INIT=True)
    b(k.delta2_pass_kernel, passes, warps=4)
    b(k.delta2_grad_pass_kernel, passes, warps=8)  # as launched
    blocks3 = dict(common, BK=min(64, s["K"]), BV=min(tile, max(16, s["V"])))
    for kernel in (k.grad_v_2_kernel, k.grad_qx_2_kernel):
        for warps in (4, 8):  # the autotuned configurations
            b(kernel, blocks3, warps=warps)
"""

BAND = """
from hybridlm.ops.fast_weight.triton import band as k

IO = ("q_ptr", "x_ptr", "y_ptr", "dq_ptr", "dx_ptr", "dy_ptr", "base_ptr", "o_ptr", "do_ptr")
for io, K, V, W in (("*bf16", 128, 128, 3), ("*fp32", 20, 12, 5)):
    for shift in (0, 1):
        consts = dict(SHIFT=shift, W=W, K=K, V=V, BT=k.BT, BK=max(16, triton.next_power_of_2(K)),
                      BV=max(16, triton.next_power_of_2(V)))
        for kernel in (k.band_fwd_kernel, k.band_bwd_q_kernel, k.band_bwd_xy_kernel):
            build(kernel, consts, io=io, io_names=IO, warps=k.NUM_WARPS)
"""

PREPARE = """
from hybridlm.ops.fast_weight.triton import prepare as k

HALF = ("k_ptr", "v_ptr", "last_ptr", "x_ptr", "y_ptr", "dx_ptr", "dy_ptr", "dk_ptr", "dv_ptr", "dlast_ptr")
TYPES = {"offsets_ptr": "*i64", "seq_ptr": "*i64", "eps": "fp32", "one_minus_eps_gamma": "fp32"}
for io, K, V in (("*bf16", 128, 128), ("*fp32", 20, 12)):
    for on, seq in ((True, False), (False, False), (True, True)):
        consts = dict(K=K, V=V, BT=k.BT, BK=max(16, triton.next_power_of_2(K)), BV=max(16, triton.next_power_of_2(V)),
                      SHIFTED=on, HAS_LAST=on, PACKED=on and not seq, NLMS=on, SCALED=on, SEQ=seq)
        for kernel in (k.prepare_fwd_kernel, k.prepare_bwd_kernel):
            build(kernel, consts, io=io, io_names=HALF, types=TYPES, warps=k.NUM_WARPS)
"""

WINDOW_PREPARE = """
from hybridlm.ops.fast_weight.triton import window_prepare as k

HALF = ("k_ptr", "v_ptr", "last_ptr", "x_ptr", "y_ptr", "dx_ptr", "dy_ptr", "dk_ptr", "dv_ptr", "dlast_ptr")
TYPES = {"tail_len_ptr": "*i64", "eps": "fp32", "one_minus_eps_gamma": "fp32"}
KERNELS = (k.rows_fwd_kernel, k.steps_fwd_kernel, k.coefficients_fwd_kernel, k.coefficients_bwd_kernel,
           k.steps_bwd_kernel, k.rows_bwd_kernel)
# A model's heads in bf16 at the smallest and the largest window (the step kernels' tiles: [256, 4] and [32, 64]),
# odd float32 sizes; a shifted row with its carried key and tail, NLMS, ridge scaling, and a fresh same-step one.
for io, K, V, W in (("*bf16", 128, 128, 3), ("*bf16", 128, 128, 64), ("*fp32", 20, 12, 5)):
    rows, _, steps, _ = k._launch(2, 100, 2, K, V, W)
    for on in (True, False):
        flags = dict(SHIFTED=on, HAS_LAST=on, HAS_TAIL=on, NLMS=on, SCALED=on)
        for kernel in KERNELS:
            build(kernel, dict(rows, **steps, **flags), io=io, io_names=HALF, types=TYPES, warps=k.NUM_WARPS)
"""

STEP = """
from hybridlm.ops.fast_weight.triton import step as k

IO = ("q_ptr", "k_ptr", "v_ptr", "o_ptr")
TYPES = {name: "fp32" for name in ("eps", "one_minus_eps_gamma", "qk_eps", "qk_scale", "beta_scale", "lam_scale")}
# The decoding step as step.forward blocks it: a model's heads in bf16, the largest heads (MAX_HEAD_DIM), odd float32
# sizes; the mixer's preparation in the kernel (QK norm rms / l2, the gains from their logits) on the bf16 heads; the
# writing steps in place (a graphed decoder's), the others into new tensors.
for io, K, V in (("*bf16", 64, 64), ("*bf16", 128, 128), ("*fp32", 20, 12)):
    BK = max(16, triton.next_power_of_2(K))
    BV = min(max(16, triton.next_power_of_2(V)), max(16, k.STATE_BLOCK // BK))
    for i, (rule, shifted) in enumerate((("1A", True), ("1", True), ("2A", False), ("2", True))):
        for writes in (True, False):
            prepared = io == "*bf16" and writes
            flags = dict(WRITES=writes, SHIFTED=shifted, REGRESSION=rule in ("1", "2"),
                         PER_COLUMN=rule in ("2A", "2"), NLMS=rule != "2A", SCALED=rule == "1", READ_AFTER=rule != "2",
                         QK_NORM=1 + i % 2 if prepared else 0, GATES=prepared, IN_PLACE=writes)
            build(k.step_kernel, dict(K=K, V=V, BK=BK, BV=BV, **flags), io=io, io_names=IO, types=TYPES,
                  warps=k.NUM_WARPS)
"""

MIXER_STEP = """
from hybridlm.ops.fast_weight.triton import mixer_step as k
from hybridlm.ops.fast_weight.triton.step import STATE_BLOCK

IO = ("p_ptr", "cs_ptr", "cs_out_ptr", "y_ptr")
TYPES = {name: "fp32" for name in ("eps", "one_minus_eps_gamma", "qk_eps", "qk_scale", "beta_scale", "lam_scale",
                                   "norm_eps")}
# The mixer's whole step as mixer_step.forward blocks it: a model's heads in bf16 (one value block at 64, four at
# 128), odd float32 sizes (a partial value block); in place and not, a fresh shifted row (no write).
for io, K, V in (("*bf16", 64, 64), ("*bf16", 128, 128), ("*fp32", 20, 12)):
    BK = max(16, triton.next_power_of_2(K))
    BV = min(max(16, triton.next_power_of_2(V)), max(16, STATE_BLOCK // BK))
    for i, (rule, shifted) in enumerate((("1A", True), ("1", True), ("2A", False), ("2", True))):
        for writes in (True, False):
            flags = dict(WRITES=writes, SHIFTED=shifted, REGRESSION=rule in ("1", "2"),
                         PER_COLUMN=rule in ("2A", "2"), NLMS=rule != "2A", SCALED=rule == "1", READ_AFTER=rule != "2",
                         QK_NORM=i % 3, IN_PLACE=writes, CONV_BIAS=i % 2 == 1, KC=4 - i % 2, KCP=4)
            build(k.mixer_step_kernel, dict(K=K, V=V, BK=BK, BV=BV, **flags), io=io, io_names=IO, types=TYPES,
                  warps=k.NUM_WARPS)
"""

BUILDS = {  # module: its builds
    "decays": DECAYS, "chunk_state": CHUNK_STATE, "chunk_output": CHUNK_OUTPUT, "whole_state": WHOLE_STATE,
    "inner_product_kernels": INNER_PRODUCT,
    "wy": WY, "regression_kernels": REGRESSION, "band": BAND, "prepare": PREPARE,
    "window_prepare": WINDOW_PREPARE, "step": STEP, "mixer_step": MIXER_STEP,
}


@needs_cuda_backend
@pytest.mark.parametrize("module", list(BUILDS))
def test_kernels_compile_for_sm90(module):
    """Every `*_kernel` of the module builds, each within an H200 block's shared memory."""
    report = compile_for_sm90(BUILDS[module], modules=(f"{PACKAGE}.{module}",))
    assert set(report["built"]) == report["defined"], report  # every kernel of the module
    assert max(report["built"].values()) <= H200_SHARED_BYTES, report["built"]


# The SASS of a kernel that ptxas 12.8 built for grad_qxy_kernel at K = 20, V = 12, chunks of 64 and blocks (32, 16):
# the wgmma descriptor's register pair UR14:UR15 comes from UR9, which nothing sets.
UNSET_DESCRIPTOR = """
        /*06a0*/                   UMOV UR8, 0x400 ;                                            /* 0x0000040000087882 */
        /*0a10*/                   S2UR UR4, SR_CgaCtaId ;                                      /* 0x00000000000479c3 */
        /*0a90*/                   ULEA UR8, UR4, UR8, 0x18 ;                                   /* 0x0000000804087291 */
        /*0ab0*/                   USHF.R.U32.HI UR6, URZ, 0x4, UR8 ;                           /* 0x0000000804067899 */
        /*0f10*/                   UIMAD.WIDE.U32 UR10, UR6, 0x4, URZ ;                         /* 0x00000004060a78a5 */
        /*0f20*/                   UIADD3 UR12, UR11, 0x1, URZ ;                                /* 0x000000010b0c7890 */
        /*0f40*/                   ULOP3.LUT UP1, UR30, UR4, 0x6, URZ, 0xc0, !UPT ;              /* 0x00000006041e7892 */
        /*0f50*/                   UISETP.NE.U32.AND UP2, UPT, UR30, URZ, UPT ;                 /* 0x0000003f1e00728c */
        /*4a10*/                   UIADD3 UR14, UP0, UR9, 0x1, URZ ;                            /* 0x0000000109 */
        /*4a60*/                   UIADD3.X UR15, UR9, -0x3ffffff0, URZ, UP0, !UPT ;            /* 0xc000001009 */
        /*6560*/                   HGMMA.64x8x16.F32 R28, gdesc[UR12].tnspB, RZ, !UPT ;         /* 0x400000000c */
        /*6570*/                   HGMMA.64x8x16.F32 R28, gdesc[UR36].tnspB, RZ, !UPT ;         /* 0x4000000024 */
        /*65d0*/                   STS.128 [R131+UR8+0x2000], R28 ;                             /* 0x0020001c83 */
        /*65e0*/                   STS.128 [R131+UR40+0x2800], R36 ;                            /* 0x0028002483 */
"""


def test_uniform_register_check_flags_what_nothing_set():
    """`uniform_reads_before_writes`, which every sm_90 build above passes through: reads of UR9 (never set), the
    descriptor group at UR36 (never set) and the store's UR40 are flagged; UR4, UR6, UR8, UR11 (set as the high half
    of a WIDE product), UR30 (set by a LOP3 that also sets a predicate) and the group at UR12 are not."""
    unset = uniform_reads_before_writes(UNSET_DESCRIPTOR)
    assert [line.split()[0] for line in unset] == ["4a10", "4a60", "65e0", "6570"], unset
    assert uniform_reads_before_writes(UNSET_DESCRIPTOR.replace("UR9", "UR6").replace("UR36", "UR12")
                                       .replace("UR40", "UR8")) == []


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_launch_sweep_specializes_as_a_cuda_launch():
    """`sm90_launch_sweep` records a launch as the JIT would build it on a GPU: tensors as typed pointers, 16-byte
    aligned or not; ints equal to 1 as constexprs and ints divisible by 16 with that attribute, unless the kernel
    does not specialize them; None as a constexpr; the INTERPRET flag off; the launch's warps and stages."""
    import triton.language as tl

    from tests.ops.sm90_launch_sweep import _specialization

    def kernel(a_ptr, b_ptr, one, n, T, maybe_ptr, K: tl.constexpr, INTERPRET: tl.constexpr):
        """The shape of a kernel's parameters; never run."""

    launched = SimpleNamespace(kwargs={"do_not_specialize": ["T"]})  # the interpreter's view: the jit's options
    args = (torch.zeros(8, dtype=torch.bfloat16), torch.zeros(9)[1:], 1, 32, 48, None, 20, True)
    spec = _specialization(launched, kernel, args, {"num_warps": 8, "num_stages": 2})
    assert spec["signature"] == {"a_ptr": "*bf16", "b_ptr": "*fp32", "one": "constexpr", "n": "i32", "T": "i32",
                                 "maybe_ptr": "constexpr", "K": "constexpr", "INTERPRET": "constexpr"}
    assert spec["constexprs"] == {"one": 1, "maybe_ptr": None, "K": 20, "INTERPRET": False}
    assert spec["attrs"] == {"0": [["tt.divisibility", 16]], "3": [["tt.divisibility", 16]]}
    assert (spec["warps"], spec["stages"], spec["kernel"]) == (8, 2, "kernel")
