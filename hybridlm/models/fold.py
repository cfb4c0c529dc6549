"""Folding the muP forward multipliers into the weights, for inference: the same function with fewer kernels.

Falcon-H1 scales activations by constant multipliers (its report's Table 7): the embeddings, the logits, each block's
mixer inputs and outputs, attention's keys, the MLP's gate and output, the Mamba-2 projection's five pieces. Each one
that is not 1 is an elementwise kernel per call (`hybridlm.modules.multiplier.scaled`), and a decoding step at a
small batch runs hundreds of small kernels whose count sets its time (benchmarks/RESULTS.md): an official Falcon-H1
checkpoint's step carries some thirteen such kernels per layer. Every multiplier sits next to a linear map, so it
moves into that map's weight:

    m (W x + b) = (m W) x + (m b)       an output multiplier (of a projection's output, or of some of its rows)
    W (m x) + b = (m W) x + b           an input multiplier (of what a projection reads)

and the multiplier becomes 1 (in the modules and in the config, so a folded model saves and reloads as itself):

| multiplier | folded into |
|---|---|
| attention_in_multiplier (m_ai) | q_proj, k_proj, v_proj weights |
| key_multiplier | k_proj weight and bias |
| attention_out_multiplier | o_proj weight and bias |
| ssm_in_multiplier | the SSM mixer's in_proj weight |
| ssm_multiplier_z, _x, _B, _C, _dt | the Mamba-2 in_proj's rows of z, x, B, C, dt (weight and bias) |
| ssm_out_multiplier | the SSM mixer's out_proj weight and bias |
| mlp_multiplier_gate, mlp_multiplier_down | gate_proj, down_proj weights and biases |
| lm_head_multiplier | lm_head's weight (kept when tied to the embeddings) |
| embedding_multiplier | the embedding table (kept when tied to the LM head) |

The function is the same in exact arithmetic; in floating point each folded weight is rounded once more (in its
dtype) where the activations were rounded before, so outputs move by about one rounding of the weights' dtype
(float32: ~1e-7 relative). For inference: muP's per-parameter learning rates assume the multipliers, so train the
model as loaded, not folded. Tensor-parallel (DTensor) weights are refused.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridlm.layers.mamba2 import Mamba2Mixer


@torch.no_grad()
def fold_multipliers(model: nn.Module) -> dict[str, float]:
    """Fold `model`'s (a `HybridForCausalLM` or `HybridModel`) muP multipliers into its weights in place (the module
    docstring); returns the config fields folded, with the values they had (those already 1 are left out, as are the
    embedding and LM-head multipliers of tied embeddings). The config then holds 1 for each."""
    from hybridlm.models.model import HybridForCausalLM, HybridModel

    lm = model if isinstance(model, HybridForCausalLM) else None
    base = model.model if lm is not None else model
    if not isinstance(base, HybridModel):
        raise ValueError(f"fold_multipliers takes a HybridForCausalLM or HybridModel, got {type(model).__name__} "
                         "(an adapter-wrapped model: merge its adapters first, or fold before adding them)")
    if any(hasattr(p, "to_local") for p in model.parameters()):
        raise ValueError("fold_multipliers: the model's weights are sharded (DTensor); fold before parallelizing")
    wrapped = [name for name, m in base.named_modules() if name.endswith("_proj") and not isinstance(m, nn.Linear)]
    if wrapped:
        raise ValueError(f"fold_multipliers: projections wrapped by adapters ({', '.join(wrapped[:3])}...): merge the "
                         "adapters first, or fold before adding them")
    folded: dict[str, float] = {}
    for block in base.layers:
        folded.update(_fold_block(block))
    tied = lm is not None and lm.lm_head.weight is base.embed_tokens.weight
    if lm is not None and not tied and lm.lm_head_multiplier != 1.0:
        folded["lm_head_multiplier"] = float(lm.lm_head_multiplier)
        lm.lm_head.weight.mul_(lm.lm_head_multiplier)
        lm.lm_head_multiplier = 1.0
    if not tied and base.embedding_multiplier != 1.0:
        folded["embedding_multiplier"] = float(base.embedding_multiplier)
        base.embed_tokens.weight.mul_(base.embedding_multiplier)
        base.embedding_multiplier = 1.0
    for name in folded:
        setattr(model.config, name, 1.0)
    return folded


def _fold_block(block: nn.Module) -> dict[str, float]:
    """One `HybridBlock`'s multipliers, and its mixers' and MLP's, into their weights -> the config fields folded
    (those that were not 1), with their values."""
    folded: dict[str, float] = {}

    def fold(field: str, multiplier: float, linear: nn.Linear, *, bias: bool = True, rows: slice = slice(None)):
        if multiplier != 1.0:
            folded[field] = float(multiplier)
            _scale(linear, multiplier, bias=bias, rows=rows)

    if block.attn is not None:
        attn = block.attn
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            fold("attention_in_multiplier", block.attn_in_multiplier, proj, bias=False)
        fold("key_multiplier", attn.key_multiplier, attn.k_proj)
        fold("attention_out_multiplier", block.attn_out_multiplier, attn.o_proj)
        block.attn_in_multiplier = block.attn_out_multiplier = attn.key_multiplier = 1.0
    if block.ssm is not None:
        ssm = block.ssm
        fold("ssm_in_multiplier", block.ssm_in_multiplier, ssm.in_proj, bias=False)
        fold("ssm_out_multiplier", block.ssm_out_multiplier, ssm.out_proj)
        block.ssm_in_multiplier = block.ssm_out_multiplier = 1.0
        if isinstance(ssm, Mamba2Mixer):
            # in_proj's rows: z [d_ssm], x [d_ssm], B, C [G N], dt [H] (the mixer's split)
            bc = ssm.groups * ssm.d_state
            widths = {"z": ssm.d_ssm, "x": ssm.d_ssm, "B": bc, "C": bc, "dt": ssm.num_heads}
            start = 0
            for piece, width in widths.items():
                fold(f"ssm_multiplier_{piece}", ssm.multipliers[piece], ssm.in_proj, rows=slice(start, start + width))
                start += width
            ssm.multipliers = dict.fromkeys(widths, 1.0)
    if block.mlp is not None:
        mlp = block.mlp
        fold("mlp_multiplier_gate", mlp.gate_multiplier, mlp.gate_proj)
        fold("mlp_multiplier_down", mlp.down_multiplier, mlp.down_proj)
        mlp.gate_multiplier = mlp.down_multiplier = 1.0
    return folded


def _scale(linear: nn.Linear, multiplier: float, *, bias: bool, rows: slice) -> None:
    """linear's weight rows `rows` (and its bias's, for an output multiplier) times `multiplier`, in place."""
    linear.weight[rows].mul_(multiplier)
    if bias and linear.bias is not None:
        linear.bias[rows].mul_(multiplier)
