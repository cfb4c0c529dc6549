"""Mixer parallelism (Falcon-H1 report, 3.3.2): attention and the SSM mixer of a block on different ranks.

Within a tp group of size P (even), the group is cut into two halves of P/2 ranks. In every block that has
both mixers, one half runs attention and the other half runs the SSM mixer, concurrently; the block's mixer
output is the sum of both halves, formed by one all-reduce across the halves:

    n = N(x)                                          (replicated on the P ranks)
    attention half:  c = m_attn_out attn(m_attn_in n)     SSM half:  c = m_ssm_out ssm(m_ssm_in n)
    h = x + all_reduce_over_the_pair(c)               (= x + attention + SSM on every rank)

Modes: "on" (the first half always runs attention) and "interleaved" (layer l runs attention on the first half
when l is even, else on the second), which balances the work per rank when the two mixers cost differently.

Layout over the tp mesh, built with DeviceMesh's own `_unflatten`: tp -> ("mixer", "mixer_tp") of shape
(2, P/2). "mixer" pairs rank i of the first half with rank i of the second (the all-reduce of the sum);
"mixer_tp" is a half, over which the rank's mixer is itself tensor-parallel (attention heads colwise/rowwise,
SSM heads by the per-segment head split of `tensor_parallel`), so P = 4 gives attention TP=2 on tp ranks
{0, 1} and SSM TP=2 on {2, 3}. The MLP stays tensor-parallel over the whole tp group (as without mixer
parallelism: it runs after the sum, on the replicated residual, and its compute is split P ways).

Autograd of the two collectives (why they are written here, not `torch.distributed.nn.all_reduce`): every rank
runs the rest of the network on the same replicated activations and so holds the whole gradient of the sum.
- The sum's backward is the identity: d(sum)/d(c) = 1 on each half. torch's differentiable all_reduce would
  all-reduce the gradient in backward too and multiply it by the group size (2).
- The mixer input `n` is used by one mixer per rank, so its gradient on a rank is only that mixer's part:
  the input passes through an identity whose backward all-reduces over the pair (the same pair as forward).
  Within a half the inner TP's own DTensor input handling has already summed the gradient over mixer_tp.

Mixer parameters not owned by a rank are dropped (`block.attn` / `block.ssm` set to None), so a rank holds,
per layer, one mixer's weights (1/(P/2) of them with inner TP). Blocks with only one mixer are tensor-
parallel over the whole group as usual. The sequential arrangement "S_A_M" cannot be split (attention reads
the SSM's output): a ValueError names `block_arrangement`. A rank's state dict then holds only its mixers:
`hybridlm.parallel.checkpoint` gathers the full, single-process state dict from the owning ranks.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from hybridlm.layers.block import HybridBlock
from hybridlm.parallel.mesh import MIXER_PARALLEL_MODES
from hybridlm.parallel.tensor_parallel import (
    _blocks,
    check_attention_split,
    check_ssm_split,
    parallelize_attention,
    parallelize_block,
    parallelize_mlp,
    parallelize_ssm,
)

ATTENTION, SSM = "attention", "ssm"


def attention_half(layer_idx: int, mode: str) -> int:
    """Which half (0 = the first P/2 tp ranks, 1 = the rest) runs attention in layer `layer_idx`."""
    if mode == "on":
        return 0
    if mode == "interleaved":
        return layer_idx % 2
    raise ValueError(f"mixer_parallel mode must be 'on' or 'interleaved' here, got {mode!r}")


def check_mixer_parallel(model: nn.Module, tp: int, *, mode: str, ssm_heads: bool = True) -> None:
    """ValueError (naming the config field) when `model` cannot run mixer parallelism over a tp group of `tp`."""
    if mode not in MIXER_PARALLEL_MODES or mode == "off":
        raise ValueError(f"mixer_parallel must be 'on' or 'interleaved', got {mode!r}")
    if tp < 2 or tp % 2:
        raise ValueError(f"mixer parallelism needs an even tp >= 2 (two halves), got tp={tp}")
    half = tp // 2
    what = f"mixer parallelism (tp={tp}: two halves of {half})"
    for block in _blocks(model):
        if block.attn is not None and block.ssm is not None:
            if block.arrangement == "S_A_M":
                raise ValueError(
                    f"{what} runs attention and the SSM side by side: block_arrangement='S_A_M' is sequential "
                    "(attention reads the SSM output); use 'SA_M' or 'SAM'"
                )
            check_attention_split(block.attn, half, what=what)
            if ssm_heads:
                check_ssm_split(block.ssm, half, what=what)
        else:  # one mixer only: plain TP over the whole group
            if block.attn is not None:
                check_attention_split(block.attn, tp, what=what)
            if block.ssm is not None and ssm_heads:
                check_ssm_split(block.ssm, tp, what=what)
        if block.mlp is not None and block.mlp.gate_proj.out_features % tp:
            raise ValueError(
                f"{what} splits the MLP over the tp group: intermediate_size={block.mlp.gate_proj.out_features} "
                f"is not divisible by {tp} (layer {block.layer_idx})"
            )


def apply_mixer_parallel(model: nn.Module, tp_mesh: DeviceMesh, *, mode: str, ssm_heads: bool = True) -> nn.Module:
    """Mixer parallelism over `tp_mesh` (1-D, even size) in place (module docstring); returns `model`.

    `ssm_heads=False` keeps an SSM mixer whole (replicated) on the ranks of its half instead of head-split."""
    tp = tp_mesh.size()
    check_mixer_parallel(model, tp, mode=mode, ssm_heads=ssm_heads)
    split = tp_mesh._unflatten(0, (2, tp // 2), ("mixer", "mixer_tp"))
    pair, inner = split["mixer"], split["mixer_tp"]
    my_half = split.get_local_rank("mixer")
    for block in _blocks(model):
        if block.attn is not None and block.ssm is not None:
            role = ATTENTION if my_half == attention_half(block.layer_idx, mode) else SSM
            if role == ATTENTION:
                block.ssm = None  # not this rank's: free it
                if inner.size() > 1:
                    parallelize_attention(block.attn, inner)
            else:
                block.attn = None
                if inner.size() > 1 and ssm_heads:
                    parallelize_ssm(block.ssm, inner)
            block.__class__ = MixerParallelBlock  # as FSDP2's fully_shard does: a subclass for this instance
            block.mixer_role, block.mixer_pair = role, pair
            if block.mlp is not None:
                parallelize_mlp(block.mlp, tp_mesh)
        else:
            parallelize_block(block, tp_mesh, ssm_heads=ssm_heads)
    return model


class MixerParallelBlock(HybridBlock):
    """A HybridBlock that holds one of its two mixers (`mixer_role`); the other half of the tp group holds the
    other. The block's forward is HybridBlock's: with the other mixer None it adds this rank's mixer output,
    which `_attn` / `_ssm` here turn into the sum of both mixers (an all-reduce over `mixer_pair`)."""

    mixer_role: str
    mixer_pair: DeviceMesh

    def _attn(self, n: torch.Tensor, mix: dict, rotary: tuple[torch.Tensor, torch.Tensor] | None, fuses: bool,
              parts: dict) -> torch.Tensor:
        own = super()._attn(_ToMixer.apply(n, self.mixer_pair), mix, rotary, fuses, parts)
        return _SumOverMixers.apply(own, self.mixer_pair)

    def _ssm(self, n: torch.Tensor, mix: dict, seq_idx: torch.Tensor | None, parts: dict) -> torch.Tensor:
        own = super()._ssm(_ToMixer.apply(n, self.mixer_pair), mix, seq_idx, parts)
        return _SumOverMixers.apply(own, self.mixer_pair)

    def extra_repr(self) -> str:
        return f"mixer_role={self.mixer_role!r}"


class _SumOverMixers(torch.autograd.Function):
    """Forward: the sum of the pair's mixer outputs. Backward: identity (each rank already holds d(loss)/d(sum))."""

    @staticmethod
    def forward(ctx, own: torch.Tensor, pair: DeviceMesh) -> torch.Tensor:
        return funcol.all_reduce(own.contiguous(), "sum", pair).wait()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _ToMixer(torch.autograd.Function):
    """Forward: identity. Backward: sum of the pair's input gradients (each rank's mixer saw its part only)."""

    @staticmethod
    def forward(ctx, n: torch.Tensor, pair: DeviceMesh) -> torch.Tensor:
        ctx.pair = pair
        return n.view_as(n)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return funcol.all_reduce(grad.contiguous(), "sum", ctx.pair).wait(), None
