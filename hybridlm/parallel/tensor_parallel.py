"""Tensor parallelism for the hybrid block with PyTorch's `parallelize_module` (DTensor).

Per block, over the `tp` mesh dimension of size P:

    attention   q_proj, k_proj, v_proj  ColwiseParallel          heads split: each rank holds Hq/P query heads
                o_proj                  RowwiseParallel          and Hkv/P key/value heads; all-reduce of the sum
    MLP         gate_proj, up_proj      ColwiseParallel          intermediate channels split
                down_proj               RowwiseParallel          all-reduce of the sum
    SSM mixer   in_proj                 SegmentColwiseParallel   heads split per segment (below)
    (Mamba-2 or conv, norm, per-head    ShardRows                Shard(0) DTensors, used through local views
     fast-weight) parameters
                out_proj                RowwiseParallel          all-reduce of the sum

The SSM mixer's head split. Its fused `in_proj` stacks segments of different kinds: (z, x, B, C, dt) for
Mamba-2 ([d_ssm, d_ssm, G N, G N, H] rows), (q, k, v, z, beta, lam) for the fast-weight mixer
([H K, H K, H V, H V, H or H V, H] rows). A plain Shard(0) of that weight would hand rank 0 all of z and half
of x, not whole heads. `SegmentColwiseParallel` permutes the rows before sharding,
so that the contiguous Shard(0) block of rank r is [z_r, x_r, B_r, C_r, dt_r] (rank r's slice of every
segment, in the original order); the layer's own `split` by its *local* sizes then cuts the local output
exactly as the single-process forward cuts the full one. Chosen over one Linear per segment because
the mixer's forward and its state-dict keys stay as they are, the projection stays one GEMM, and the style
is torch's own ColwiseParallel (one input all-reduce in backward) plus a row permutation. The price: the
global view of a TP-sharded `in_proj.weight` (and `conv.weight`) is the permuted matrix, so a checkpoint
taken from DTensor full tensors needs `segment_permutation(...).argsort()` to go back to the fused layout.

What the head split needs, and why it is exact:
- heads are contiguous in every per-head tensor (x, z, y, the norm scale, A_log, D, dt_bias, the fast-weight
  biases; the per-column beta of rules "2"/"2A" is head-major [H, V]), so a contiguous Shard(0) is a head split;
- Mamba-2's B and C are per group, head h reading group h // (H / G): with G % P == 0 and H % P == 0, rank
  r's heads read exactly rank r's groups, and the local head -> group map is the same formula with H/P, G/P;
- the depthwise conv acts per channel: its rows follow the (x, B, C) / (q, k, v) channels (the same
  permutation), and its carried tail is the local channels' tail;
- the gated RMSNorm normalizes each of its groups on its own (Mamba-2: `mamba_n_groups` groups over d_ssm;
  fast-weight: one group per head). Each group is whole heads, so with G % P == 0 the norm is rank-local (no
  all-reduce of the sum of squares is needed); without the norm (`mamba_rms_norm=False`) the SiLU gate is
  elementwise anyway. Mamba-2 therefore requires `mamba_n_groups % tp == 0` even without the norm (for B/C).
- the per-head parameters are Shard(0) DTensors (FSDP2 and checkpoints see the sharding); the layers read
  them through `.to_local()` (`hybridlm.ops.utils.local_tensor` in the mixer files; the conv and norm instances get a subclass whose
  forward does the same), and the local head / group / width counts are set on the layer, as for attention.

Released Falcon-H1 checkpoints have `mamba_n_groups=1`: for those, `ssm_heads=False` keeps the SSM mixers
replicated on the tp ranks (exact, no saving; `ParallelConfig.ssm_tensor_parallel=False`).
Embeddings, norms and the LM head are not split (the residual stream stays replicated on the tp ranks).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from hybridlm.layers.attention import Attention
from hybridlm.layers.block import HybridBlock
from hybridlm.layers.fast_weight import FastWeightMixer
from hybridlm.layers.mamba2 import Mamba2Mixer
from hybridlm.layers.mlp import GatedMLP
from hybridlm.modules.gated_norm import GatedRMSNorm, gated_rms_norm
from hybridlm.modules.short_conv import ShortConvolution, causal_conv1d
from hybridlm.ops.utils import local_tensor


def check_tensor_parallel(model: nn.Module, tp: int, *, ssm_heads: bool = True) -> None:
    """Raise ValueError (naming the config field) when a head or channel count does not divide by `tp`.

    `ssm_heads=False`: the SSM mixers stay replicated, so their head counts need not divide."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    for block in _blocks(model):
        if block.attn is not None:
            check_attention_split(block.attn, tp, what="tensor parallelism")
        if block.ssm is not None and ssm_heads:
            check_ssm_split(block.ssm, tp, what="tensor parallelism")
        if block.mlp is not None:
            width = block.mlp.gate_proj.out_features
            if width % tp:
                raise ValueError(
                    f"tensor parallelism tp={tp} splits the MLP: intermediate_size={width} is not divisible by "
                    f"{tp} (layer {block.layer_idx})"
                )


def check_attention_split(attn: Attention, size: int, *, what: str) -> None:
    """ValueError unless the attention heads of `attn` divide over `size` ranks."""
    for field, value in (("num_attention_heads", attn.num_heads), ("num_key_value_heads", attn.num_kv_heads)):
        if value % size:
            raise ValueError(
                f"{what} splits attention heads over {size} ranks: {field}={value} is not divisible by {size} "
                f"(layer {attn.layer_idx})"
            )


def check_ssm_split(mixer: nn.Module, size: int, *, what: str) -> None:
    """ValueError unless the SSM mixer's heads (and Mamba-2's B/C groups) divide over `size` ranks."""
    hint = "(or keep the SSM mixers replicated: ParallelConfig(ssm_tensor_parallel=False))"
    if isinstance(mixer, Mamba2Mixer):
        counts = (("mamba_n_heads", mixer.num_heads), ("mamba_n_groups", mixer.groups))
    elif isinstance(mixer, FastWeightMixer):
        heads = "fw_heads (the fast-weight head count; derived from mamba_n_heads when unset: fast_weight_heads)"
        counts = ((heads, mixer.num_heads),)
    else:
        raise TypeError(f"{what}: no head split is defined for {type(mixer).__name__}")
    for field, value in counts:
        if value % size:
            raise ValueError(
                f"{what} splits the SSM heads over {size} ranks: {field}={value} is not divisible by {size} "
                f"(layer {mixer.layer_idx}) {hint}"
            )


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, *, ssm_heads: bool = True) -> nn.Module:
    """Split every block's attention, SSM mixer and MLP over `tp_mesh` (1-D) in place; returns `model`.

    `ssm_heads=False` keeps the SSM mixers replicated (see the module docstring). A mesh of size 1 leaves the
    model as it is."""
    tp = tp_mesh.size()
    check_tensor_parallel(model, tp, ssm_heads=ssm_heads)
    if tp == 1:
        return model
    for block in _blocks(model):
        parallelize_block(block, tp_mesh, ssm_heads=ssm_heads)
    return model


def parallelize_block(block: HybridBlock, tp_mesh: DeviceMesh, *, ssm_heads: bool) -> None:
    """Every part of one block split over `tp_mesh`: attention heads, SSM heads (unless `ssm_heads=False`), MLP."""
    if block.attn is not None:
        parallelize_attention(block.attn, tp_mesh)
    if block.ssm is not None and ssm_heads:
        parallelize_ssm(block.ssm, tp_mesh)
    if block.mlp is not None:
        parallelize_mlp(block.mlp, tp_mesh)


def parallelize_attention(attn: Attention, tp_mesh: DeviceMesh) -> None:
    """Heads of `attn` split over `tp_mesh` (q/k/v colwise, o rowwise); local head counts set on the layer."""
    check_attention_split(attn, tp_mesh.size(), what="tensor parallelism")
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


def parallelize_mlp(mlp: GatedMLP, tp_mesh: DeviceMesh) -> None:
    """Intermediate channels of `mlp` split over `tp_mesh` (gate/up colwise, down rowwise)."""
    plan = {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}
    parallelize_module(mlp, tp_mesh, plan)


def parallelize_ssm(mixer: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Heads of a Mamba-2 or fast-weight mixer split over `tp_mesh` (module docstring); local sizes set."""
    tp = tp_mesh.size()
    check_ssm_split(mixer, tp, what="tensor parallelism")
    if tp == 1:
        return
    rows = ssm_row_layout(mixer)
    in_segments = rows.pop("in_proj.weight")
    rows.pop("in_proj.bias", None)  # SegmentColwiseParallel permutes and shards the bias with the weight
    parallelize_module(mixer, tp_mesh, ShardRows(rows=rows))  # conv, norm, per-head parameters
    parallelize_module(mixer, tp_mesh, {"in_proj": SegmentColwiseParallel(segments=in_segments),
                                        "out_proj": RowwiseParallel()})
    _localize(mixer.conv, _LocalShortConvolution)
    if mixer.norm is not None:
        _localize(mixer.norm, _LocalGatedRMSNorm)
        mixer.norm.groups //= tp
    # The local sizes: the forward splits and reshapes the local projection by these.
    if isinstance(mixer, Mamba2Mixer):
        mixer.d_ssm //= tp
        mixer.num_heads //= tp
        mixer.groups //= tp
        mixer.conv_channels //= tp
    else:
        mixer.num_heads //= tp
        mixer.width //= tp
        mixer.beta_width //= tp
        mixer.lam_width //= tp
        mixer.conv_channels //= tp


def ssm_row_layout(mixer: nn.Module) -> dict[str, tuple[int, ...] | None]:
    """How the head split shards each parameter of an SSM mixer along dim 0: path -> segment sizes (rows
    permuted by `segment_permutation`, then Shard(0)) or None (heads already contiguous: a plain Shard(0)).
    out_proj (rowwise, Shard(1)) is not listed. Sizes are the full (unsplit) ones."""
    if isinstance(mixer, Mamba2Mixer):
        d, bc, h = mixer.d_ssm, mixer.groups * mixer.d_state, mixer.num_heads
        in_segments, conv_segments = (d, d, bc, bc, h), (d, bc, bc)  # (z, x, B, C, dt); conv on (x, B, C)
        rows: dict[str, tuple[int, ...] | None] = {"A_log": None, "D": None, "dt_bias": None}
    elif isinstance(mixer, FastWeightMixer):
        if mixer.gates != "context":
            raise ValueError(f"fw_gates={mixer.gates!r} has no head split (its fixed decays are indexed by the "
                             "global head); tensor parallelism needs fw_gates='context'")
        hk = hv = mixer.num_heads * mixer.head_dim
        in_segments = (hk, hk, hv, hv, mixer.beta_width, mixer.num_heads)  # (q, k, v, z, beta, lam)
        conv_segments = (hk, hk, hv)  # conv on (q, k, v)
        rows = {"beta_bias": None, "lam_bias": None}  # beta_bias [H] or head-major [H V]
    else:
        raise TypeError(f"no head split is defined for {type(mixer).__name__}")
    rows["in_proj.weight"] = in_segments
    if mixer.in_proj.bias is not None:
        rows["in_proj.bias"] = in_segments
    rows["conv.weight"] = conv_segments
    if mixer.conv.bias is not None:
        rows["conv.bias"] = conv_segments
    if mixer.norm is not None:
        rows["norm.weight"] = None  # [d_ssm] / [H V], heads contiguous
    return rows


def segment_permutation(segments: Sequence[int], parts: int) -> torch.Tensor:
    """Row order that makes the contiguous chunk r (of `parts`) hold part r of every segment, in order.

    segments (s_0, s_1, ...) stacked along rows, each divisible by `parts` -> index [sum s_i] (int64).
    `weight[segment_permutation(...)]` is the layout `SegmentColwiseParallel` shards; `.argsort()` undoes it."""
    offsets, start = [], 0
    for size in segments:
        if size % parts:
            raise ValueError(f"segment of {size} rows does not split into {parts} parts")
        offsets.append(start)
        start += size
    order = [
        torch.arange(offset + rank * (size // parts), offset + (rank + 1) * (size // parts))
        for rank in range(parts)
        for offset, size in zip(offsets, segments)
    ]
    return torch.cat(order)


class SegmentColwiseParallel(ColwiseParallel):
    """ColwiseParallel for a fused Linear whose output rows are `segments` stacked: each rank gets its slice of
    every segment (rows permuted by `segment_permutation`, then Shard(0)), so its local output is the fused
    layout of its heads. Input: replicated (one all-reduce of the input gradient); output: local tensor."""

    def __init__(self, *, segments: Sequence[int]) -> None:
        super().__init__()
        self.segments = tuple(segments)

    def _partition_linear_fn(self, name, module, device_mesh):
        if sum(self.segments) != module.out_features:
            raise ValueError(f"segments {self.segments} do not add up to out_features={module.out_features}")
        order = segment_permutation(self.segments, device_mesh.size())
        with torch.no_grad():
            for param in module.parameters(recurse=False):
                param.copy_(param[order.to(param.device)])  # rows only: weight [out, in], bias [out]
        super()._partition_linear_fn(name, module, device_mesh)


class ShardRows(ParallelStyle):
    """Shard parameters of a module along dim 0 over a 1-D mesh, as DTensors; no input/output handling.

    rows: parameter path (relative to the module) -> None (plain Shard(0)) or the segment sizes stacked along
    dim 0 (rows permuted first, as in `SegmentColwiseParallel`). Whoever uses the parameter must read its
    local shard (`.to_local()`)."""

    def __init__(self, *, rows: dict[str, Sequence[int] | None]) -> None:
        super().__init__()
        self.rows = dict(rows)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for path, segments in self.rows.items():
            owner_path, _, name = path.rpartition(".")
            owner = module.get_submodule(owner_path)
            param = getattr(owner, name)
            data = param.detach()
            if segments is not None:
                data = data[segment_permutation(segments, device_mesh.size()).to(data.device)]
            sharded = distribute_tensor(data, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
            owner.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        return module


class _LocalShortConvolution(ShortConvolution):
    """A ShortConvolution whose channel-sharded DTensor parameters are used through their local shards."""

    def forward(self, x, *, initial_state=None, output_final_state=False, cu_seqlens=None, seq_idx=None,
                state_in_place=False):
        return causal_conv1d(
            x, local_tensor(self.weight), local_tensor(self.bias), activation=self.activation,
            initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
            seq_idx=seq_idx, backend=self.backend, state_in_place=state_in_place,
        )


class _LocalGatedRMSNorm(GatedRMSNorm):
    """A GatedRMSNorm whose channel-sharded scale is used through its local shard (its groups are local)."""

    def forward(self, x, gate=None):
        return gated_rms_norm(
            x, local_tensor(self.weight), gate, groups=self.groups, eps=self.eps,
            norm_before_gate=self.norm_before_gate, backend=self.backend,
        )


def _localize(module: nn.Module, cls: type) -> None:
    """Switch an instance to its local-view subclass (as FSDP2's `fully_shard` switches classes)."""
    if not isinstance(module, cls.__mro__[1]):
        raise TypeError(f"expected a {cls.__mro__[1].__name__}, got {type(module).__name__}")
    module.__class__ = cls


def _blocks(model: nn.Module) -> list[HybridBlock]:
    return [m for m in model.modules() if isinstance(m, HybridBlock)]
