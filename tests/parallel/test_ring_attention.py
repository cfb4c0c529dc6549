"""ring_attention equals plain causal attention on the whole sequence (one process), float32, tol 1e-5 relative
to the largest entry, with grouped-query attention (6 query heads on 2 key/value heads), an odd head dim (5) and
a value dim that differs (7):

- over 2 and over 4 gloo processes (`four_process.py`, a spawn shared with test_context_parallel), 13 tokens per rank,
  untiled and in query tiles of 4 rows (4 does not divide 13): the output and the gradients of q, k, v, and
  tiled == untiled;
- in one process: the block math (`block_attention` / `block_attention_backward`, a "ring" of one block) against
  SDPA, causal (the diagonal block) and full (an earlier rank's block), for tiles of 1, 4, 13 rows and untiled;
  `ring_attention` without a process group (one rank) in float32 and from bf16 inputs;
- memory: the largest tensor any aten op produces in forward + backward is one score tile [B, Hq, tile, Q],
  not the [B, Hq, Q, Q] of an untiled block (a dispatch-mode probe; it fails if the tiling is removed).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hybridlm.parallel import ring_attention
from hybridlm.parallel.ring_attention import block_attention, block_attention_backward
from tests.parallel.four_process import (
    CHUNK,
    DIM,
    KV_HEADS,
    Q_HEADS,
    RING_TILES,
    attention_inputs,
    four_process_results,
    reference_attention,
)
from tests.parallel.harness import TOL, max_relative

# --------------------------------------------------------------------------- over 2 and 4 processes


@pytest.mark.parametrize("tile", list(RING_TILES))
@pytest.mark.parametrize("cp", ["cp2", "cp4"])
def test_ring_attention_matches_causal_attention(cp, tile):
    got = four_process_results()["rings"][f"{cp}/{tile}"]
    for name in ("out", "dq", "dk", "dv", "vs_untiled"):
        assert got.get(name, 0.0) < TOL, got
    assert got["last_rank_alone"] > 1e-2, got  # the earlier ranks' keys really matter (the test can fail)


# --------------------------------------------------------------------------- in one process


def _grouped(x: torch.Tensor) -> torch.Tensor:
    """[B, T, Hq, D] -> [B, Hkv, G, T, D], ring_attention's grouped query layout."""
    return x.unflatten(2, (KV_HEADS, Q_HEADS // KV_HEADS)).permute(0, 2, 3, 1, 4)


def _ungrouped(x: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, G, T, D] -> [B, T, Hq, D]."""
    return x.permute(0, 3, 1, 2, 4).flatten(2, 3)


@pytest.mark.parametrize("tile", [1, 4, 13, None], ids=["tile1", "tile4", "tile13", "untiled"])
@pytest.mark.parametrize("causal", [True, False], ids=["diagonal", "earlier-block"])
def test_block_attention_matches_sdpa(causal, tile):
    """One block: the diagonal (causal, S = Q = 13) and an earlier rank's block (no mask; S = 9 keys)."""
    q, k, v, weights = attention_inputs(CHUNK, CHUNK if causal else 9)
    want = reference_attention(q, k, v, causal=causal)
    (want * weights).sum().backward()

    scale = DIM**-0.5
    qg, kh, vh = _grouped(q.detach()), k.detach().transpose(1, 2), v.detach().transpose(1, 2)
    out, lse = block_attention(qg, kh, vh, scale=scale, causal=causal, tile=tile)
    dout = _grouped(weights)
    delta = (dout * out).sum(-1)  # one block: its own output is the final output
    dq, dk, dv = block_attention_backward(qg, kh, vh, dout, lse, delta, scale=scale, causal=causal, tile=tile)

    scores = _grouped(q.detach()) @ kh.unsqueeze(2).transpose(-1, -2) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(CHUNK, CHUNK, dtype=torch.bool).triu(1), float("-inf"))
    assert max_relative(lse, torch.logsumexp(scores, -1)) < TOL
    assert max_relative(_ungrouped(out), want) < TOL
    assert max_relative(_ungrouped(dq), q.grad) < TOL
    assert max_relative(dk.transpose(1, 2), k.grad) < TOL
    assert max_relative(dv.transpose(1, 2), v.grad) < TOL


@pytest.mark.parametrize("tile", [4, None], ids=["tile4", "untiled"])
def test_one_rank_ring_attention_matches_sdpa(tile):
    """Without a process group ring_attention is one rank: causal attention through the autograd Function."""
    q, k, v, weights = attention_inputs(CHUNK)
    want = reference_attention(q, k, v)
    want_grads = torch.autograd.grad((want * weights).sum(), (q, k, v))
    got = ring_attention(q, k, v, tile=tile)
    grads = torch.autograd.grad((got * weights).sum(), (q, k, v))
    assert max_relative(got, want) < TOL
    for a, b in zip(grads, want_grads):
        assert max_relative(a, b) < TOL

    low = [t.detach().bfloat16().requires_grad_(True) for t in (q, k, v)]  # bf16 in, float32 math, bf16 out
    got = ring_attention(*low, tile=tile)
    assert got.dtype == torch.bfloat16
    assert max_relative(got.float(), reference_attention(*(t.detach().float() for t in low))) < 1e-2
    got.float().mul(weights).sum().backward()
    assert all(t.grad.dtype == torch.bfloat16 for t in low)


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor (in elements) any aten op returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.numel = max([self.numel, *sizes])
        return out


def test_score_tiles_bound_the_largest_intermediate():
    """Q = 64, tile 8, head dims 4 < tile: the [B, Hq, tile, Q] score tile is the largest tensor of forward +
    backward; untiled, the [B, Hq, Q, Q] scores are (so the probe sees them)."""
    length, tile, dim = 64, 8, 4
    torch.manual_seed(0)
    q = torch.randn(1, length, Q_HEADS, dim, requires_grad=True)
    k = torch.randn(1, length, KV_HEADS, dim, requires_grad=True)
    v = torch.randn(1, length, KV_HEADS, dim, requires_grad=True)
    largest = {}
    for name, rows in (("tiled", tile), ("untiled", None)):
        with _LargestTensor() as probe:
            ring_attention(q, k, v, tile=rows).sum().backward()
        largest[name] = probe.numel
    assert largest["tiled"] == Q_HEADS * tile * length, largest
    assert largest["untiled"] == Q_HEADS * length * length, largest
