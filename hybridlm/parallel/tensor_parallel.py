"""Tensor parallelism for the hybrid block with PyTorch's `parallelize_module` (DTensor).

Per block, over the `tp` mesh dimension of size P:

    attention   q_proj, k_proj, v_proj  ColwiseParallel   heads split: each rank holds Hq/P query heads and
                o_proj                  RowwiseParallel   Hkv/P key/value heads; o_proj all-reduces the sum
    MLP         gate_proj, up_proj      ColwiseParallel   intermediate channels split
                down_proj               RowwiseParallel   all-reduce of the sum
    SSM mixer   (Mamba-2 or fast-weight)  REPLICATED      every tp rank runs the whole mixer

Why the SSM mixer is replicated (a choice, the simplest correct one): its fused `in_proj` concatenates
segments of different kinds ((z, x, B, C, dt) for Mamba-2; (q, k, v, z, beta, lam) for fast-weight), so
a plain column split would hand rank 0 all of z and half of x, not whole heads. A head split needs a custom
per-segment layout of `in_proj` (and, for Mamba-2, B/C split by groups), of the conv channels and of the
gated norm; that is left for later (hybridlm/parallel/README.md). Replicated, the mixer sees the same
(replicated) input on every tp rank and computes the same output and the same gradients, so the block is
exact; it just does not save the mixer's compute or memory. Its parameters stay plain tensors (FSDP2 can
still shard them over the data-parallel mesh).

After the split each `Attention` holds local head counts (`num_heads`, `num_kv_heads`), because its
forward reshapes the local projection outputs `[B, T, H_local * D]` by them. Embeddings, norms and the LM
head are not split (the residual stream stays replicated on the tp ranks).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from hybridlm.layers.attention import Attention
from hybridlm.layers.block import HybridBlock
from hybridlm.layers.mlp import GatedMLP


def check_tensor_parallel(model: nn.Module, tp: int) -> None:
    """Raise ValueError (naming the config field) when a head or channel count does not divide by `tp`."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    for block in _blocks(model):
        if block.attn is not None:
            for field, value in (("num_attention_heads", block.attn.num_heads),
                                 ("num_key_value_heads", block.attn.num_kv_heads)):
                if value % tp:
                    raise ValueError(
                        f"tensor parallelism tp={tp} splits attention heads: {field}={value} is not divisible "
                        f"by {tp} (layer {block.layer_idx})"
                    )
        if block.mlp is not None:
            width = block.mlp.gate_proj.out_features
            if width % tp:
                raise ValueError(
                    f"tensor parallelism tp={tp} splits the MLP: intermediate_size={width} is not divisible by "
                    f"{tp} (layer {block.layer_idx})"
                )


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Split every block's attention and MLP over `tp_mesh` (1-D) in place; returns `model`.

    The SSM mixers stay replicated (see the module docstring). A mesh of size 1 leaves the model as it is."""
    tp = tp_mesh.size()
    check_tensor_parallel(model, tp)
    if tp == 1:
        return model
    for block in _blocks(model):
        if block.attn is not None:
            _parallelize_attention(block.attn, tp_mesh)
        if block.mlp is not None:
            _parallelize_mlp(block.mlp, tp_mesh)
    return model


def _parallelize_attention(attn: Attention, tp_mesh: DeviceMesh) -> None:
    plan = {
        "q_proj": ColwiseParallel(),  # [B, T, D] replicated -> local [B, T, Hq/P * hd]
        "k_proj": ColwiseParallel(),
        "v_proj": ColwiseParallel(),
        "o_proj": RowwiseParallel(),  # local [B, T, Hq/P * hd] -> all-reduced [B, T, D]
    }
    parallelize_module(attn, tp_mesh, plan)
    tp = tp_mesh.size()
    attn.num_heads //= tp  # the forward views the local projections by these
    attn.num_kv_heads //= tp


def _parallelize_mlp(mlp: GatedMLP, tp_mesh: DeviceMesh) -> None:
    plan = {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}
    parallelize_module(mlp, tp_mesh, plan)


def _blocks(model: nn.Module) -> list[HybridBlock]:
    return [m for m in model.modules() if isinstance(m, HybridBlock)]
