"""Helpers shared by the block tests and the op tests that run a block's mixers: a small seeded block and the
mixer run on packed documents with and without `seq_idx`."""

import torch

from hybridlm.layers import HybridBlock
from hybridlm.models.config import HybridConfig

MULT = dict(ssm_in_multiplier=1.3, ssm_out_multiplier=0.4, attention_in_multiplier=0.8, attention_out_multiplier=1.7)


def make_block(**changes) -> HybridBlock:
    """A seeded 16-wide block in eval mode with distinct norm weights; `changes` override its HybridConfig fields."""
    torch.manual_seed(0)
    fields = dict(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8, mamba_d_ssm=16,
                  mamba_n_heads=2, mamba_d_state=4, mamba_chunk_size=4, intermediate_size=24, **MULT)
    fields.update(changes)
    block = HybridBlock(HybridConfig(**fields), layer_idx=0).eval()
    with torch.no_grad():
        for norm in (block.norm, block.attn_norm, block.mlp_norm):
            if norm is not None:
                norm.weight.uniform_(0.5, 1.5)  # distinct norms, so swapping them would be caught
    return block


def runs_with_and_without_seq_idx(mixer: torch.nn.Module, x: torch.Tensor, cu_seqlens: torch.Tensor,
                                  seq_idx: torch.Tensor) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, ...]]]:
    """The mixer's outputs on packed documents (x: (1, T, hidden), cu_seqlens: (docs + 1,), seq_idx: (1, T)), given
    cu_seqlens alone and then seq_idx beside it, and for each the gradients of (output^2).sum() in its input and
    every parameter."""
    outs, grads = [], []
    for extra in ({}, {"seq_idx": seq_idx}):
        inp = x.clone().requires_grad_()
        out = mixer(inp, cu_seqlens=cu_seqlens, **extra)
        outs.append(out)
        grads.append(torch.autograd.grad(out.square().sum(), [inp, *mixer.parameters()]))
    return outs, grads
