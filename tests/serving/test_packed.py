"""The packed prefill of several requests' pieces equals one call per piece, each on its own cache (float64)."""

from __future__ import annotations

import itertools

import pytest
import torch

from hybridlm.serving.packed import PackedPrefill, state_fields
from tests.inference.helpers import ids, make_model
from tests.serving.test_engine import MODELS


def states(cache) -> list[torch.Tensor]:
    """Every tensor a cache carries on: the SSM states and the filled key/value slots, layer by layer."""
    out = []
    for layer in cache.layers:
        out += [layer.ssm[name] for name in sorted(layer.ssm)]
        out += [t for t in (layer.key, layer.value) if t is not None]
    return out


def run_pieces(model, done: list[int], pieces: list[int]) -> tuple[torch.Tensor, torch.Tensor, list, list]:
    """Prompts whose first `done` tokens fill a cache each, then their next `pieces` tokens: the logits after each
    piece run alone on its cache [N, V], the same pieces run packed [N, V], and the two sets of caches."""
    prompts = [ids(1, d + p, seed=30 + i)[0] for i, (d, p) in enumerate(zip(done, pieces))]
    alone, together = [], []
    with torch.no_grad():
        for prompt, d in zip(prompts, done):
            for caches in (alone, together):
                caches.append(model.new_cache())
                if d:
                    model(prompt[None, :d], cache=caches[-1])
        expected = [model(p[None, d:], cache=c, logits_to_keep=1).logits[0, -1] for p, d, c in zip(prompts, done, alone)]
        assert len({state_fields(c) for c in together}) == 1
        offsets = torch.tensor([0, *itertools.accumulate(pieces)])
        tokens = torch.cat([p[d:] for p, d in zip(prompts, done)])[None]  # [1, total]
        got = model(tokens, cu_seqlens=offsets, cache=PackedPrefill(together), logits_to_keep=offsets[1:] - 1).logits[0]
    return torch.stack(expected), got, alone, together


@pytest.mark.parametrize("filled", [False, True], ids=["fresh", "continuing"])
@pytest.mark.parametrize("changes", MODELS.values(), ids=MODELS.keys())
def test_packed_pieces_equal_each_piece_on_its_own_cache(changes, filled):
    """Pieces of 5, 1 and 9 tokens after 0 (fresh caches) or 7, 3 and 12 tokens: the same logits and the same caches
    after (SSM states, keys and values: the window's trimming included)."""
    model = make_model(**changes).double()
    expected, got, alone, together = run_pieces(model, [7, 3, 12] if filled else [0, 0, 0], [5, 1, 9])
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-10)
    for a, b in zip(alone, together):
        assert a.seq_len == b.seq_len
        for x, y in zip(states(a), states(b), strict=True):
            torch.testing.assert_close(y, x, rtol=1e-9, atol=1e-10)


def test_documents_that_continue_cached_keys_go_to_the_varlen_kernel_with_key_offsets(monkeypatch):
    """Where flash's varlen kernel runs (CUDA, 16-bit) a packed continuation is one call of it, each document's keys
    delimited by key offsets (its queries the last of them); here a stand-in computes what the kernel does."""
    import hybridlm.layers.attention as attention
    from tests.layers.test_attention_window import recording_varlen

    model = make_model(attention_window=5).double()
    calls = []
    monkeypatch.setattr(attention, "_varlen_attention", recording_varlen(calls))
    expected, got, _, _ = run_pieces(model, [7, 3, 12], [5, 1, 9])
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-10)
    packed = [c for c in calls if c[0] == [0, 5, 6, 15]]
    assert packed and all(c[1][-1] > 15 and c[4] == 5 for c in packed)  # the cached keys in front, the window


def test_caches_of_different_state_fields_are_not_packed():
    model = make_model()
    filled = model.new_cache()
    with torch.no_grad():
        model(ids(1, 3), cache=filled)
    with pytest.raises(ValueError, match="same SSM state fields"):
        PackedPrefill([model.new_cache(), filled])
