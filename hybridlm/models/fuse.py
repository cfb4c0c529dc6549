"""Fusing the projections that read one input into one GEMM each, for generation: fewer kernels per decoding step.

A decoding step at a small batch runs hundreds of small kernels whose count, not their arithmetic, sets its time
(benchmarks/RESULTS.md). In every block several projections read the same input:

| block | one GEMM for |
|---|---|
| attention | q_proj, k_proj, v_proj |
| "SA_M" and "SAM" (Falcon-H1's parallel blocks) | the SSM mixer's in_proj, q_proj, k_proj, v_proj (all read N(x)) |
| the MLP | up_proj, gate_proj |

`fuse_projections` concatenates each group's weights into one matrix (`hybridlm.modules.FusedLinear`) and makes the
projections' own weights views of it, so nothing is stored twice and the checkpoint layout is unchanged (the fused
matrices are not saved). A block then multiplies once per group and hands each mixer its slice, in the calls of
generation: with a cache, no packed documents, no gradient. Training and every other call run the projections apart
on the same tensors.

Each output element is the same dot product either way; a wider GEMM may run another kernel whose summation order
differs, so outputs may move by a rounding of the activations' dtype. The SSM's in_proj joins q, k, v only where
the mixers' input multipliers are 1 (each would otherwise read N(x) scaled its own way): fold them first
(`fold_multipliers`; `prepare_for_generation` does both, on a CUDA device, and so do the serving engine and the
`generate` and `chat` commands). Fuse after moving the model to its device and dtype: `.to()` gives each weight its own
storage again, and the blocks then notice it and run the projections apart.
"""

from __future__ import annotations

import logging

from torch import nn

from hybridlm.modules.fused_linear import FusedLinear

log = logging.getLogger(__name__)


def prepare_for_generation(model: nn.Module, *, fold: bool = True, fuse: bool = True, concurrent: bool = True) -> None:
    """What the serving engine and the `generate` and `chat` commands do to a model they load, once it is on its
    device and in its dtype: fold its muP multipliers into its weights (`fold_multipliers`), then, on a CUDA device,
    fuse the projections that read one input (`fuse_projections`) and let each parallel block's graphed decoding steps
    run its SSM half on a second stream beside attention (`concurrent_mixers`, `hybridlm.layers.block`); `fold`, `fuse`,
    `concurrent` False leave each out. The same function, fewer kernels per decoding step, and the two halves of a
    block overlapping. A model on the CPU keeps its projections apart: there a GEMM's own time, not its launch, sets a
    step's, and the fused blocks' checks cost about what the joined GEMMs save."""
    from hybridlm.models.fold import fold_multipliers

    if fold:
        folded = fold_multipliers(model)
        if folded:
            log.info("folded %d muP multipliers into the weights (%s)", len(folded), ", ".join(folded))
    if fuse and next(model.parameters()).is_cuda:
        log.info("fused the projections that read one input: %d GEMMs fewer per forward", fuse_projections(model))
    if concurrent and next(model.parameters()).is_cuda:
        blocks = set_concurrent_mixers(model, True)
        if blocks:
            log.info("%d parallel blocks decode their SSM half on a side stream beside attention", blocks)


def set_concurrent_mixers(model: nn.Module, enabled: bool) -> int:
    """Set `concurrent_mixers` on every block of `model` that has both mixers in a parallel arrangement ("SA_M",
    "SAM"); returns how many blocks that is. It acts only in decoding steps on CUDA over a fixed-address cache, the
    steps CUDA graphs replay (`hybridlm.layers.block`)."""
    from hybridlm.layers.block import HybridBlock

    blocks = [m for m in model.modules() if isinstance(m, HybridBlock) and m.ssm is not None
              and m.attn is not None and m.arrangement in ("SA_M", "SAM")]
    for block in blocks:
        block.concurrent_mixers = enabled
    return len(blocks)


def fuse_projections(model: nn.Module) -> int:
    """Fuse the projections of each block of `model` (a `HybridForCausalLM` or `HybridModel`) that read one input
    (the module docstring), in place; returns how many GEMMs fewer a fused forward runs."""
    from hybridlm.models.model import HybridForCausalLM, HybridModel

    base = model.model if isinstance(model, HybridForCausalLM) else model
    if not isinstance(base, HybridModel):
        raise ValueError(f"fuse_projections takes a HybridForCausalLM or HybridModel, got {type(model).__name__} "
                         "(an adapter-wrapped model: merge its adapters first, or fuse before adding them)")
    saved = 0
    for index, block in enumerate(base.layers):
        paths = []
        if block.attn is not None:
            if (block.arrangement in ("SA_M", "SAM") and block.ssm is not None
                    and (block.ssm_in_multiplier, block.attn_in_multiplier) == (1.0, 1.0)):
                paths.append("ssm.in_proj")  # both mixers read N(x) itself
            paths += ["attn.q_proj", "attn.k_proj", "attn.v_proj"]
        block.fused_input = _fuse(block, paths, index)
        block.fused_mlp = _fuse(block, ["mlp.up_proj", "mlp.gate_proj"] if block.mlp is not None else [], index)
        saved += sum(len(fused.names) - 1 for fused in (block.fused_input, block.fused_mlp) if fused is not None)
    return saved


def _fuse(block: nn.Module, paths: list[str], index: int) -> FusedLinear | None:
    if not paths:
        return None
    try:
        return FusedLinear({path: block.get_submodule(path) for path in paths})
    except ValueError as error:
        raise ValueError(f"fuse_projections: layer {index}: {error}") from None
