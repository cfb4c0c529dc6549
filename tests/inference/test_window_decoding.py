"""Decoding a hybrid with sliding-window attention (`attention_window`): greedy generation (dynamic cache and the
static ring step of `graph=True`) gives the tokens and logits of full forwards over the growing sequence, a
left-padded batch too, and the cache's memory does not grow with the number of generated tokens."""

from __future__ import annotations

import pytest
import torch

from hybridlm.inference import GraphedDecoder, generate
from tests.helpers import rel_err
from tests.inference.helpers import MIXERS, ids, make_model

WINDOW = 3
TOL = 1e-6  # relative: a float64 model, whose generated logits come back as float32
HYBRIDS = {"fast_weight-1A": MIXERS["fast_weight-1A"], "mamba2": MIXERS["mamba2"]}


def windowed_model(mixer: str, window: int | None = WINDOW):
    return make_model(seed=3, attention_window=window, **HYBRIDS[mixer]).double()


@pytest.mark.parametrize("graph", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("mixer", list(HYBRIDS))
def test_greedy_generation_equals_full_forwards(mixer, graph):
    model = windowed_model(mixer)
    prompt = ids(2, 7, seed=4)
    new = 12  # the window (3) is passed many times: the dynamic cache trims, the ring comes round
    out = generate(model, prompt, max_new_tokens=new, output_logits=True, graph=graph)
    with torch.no_grad():
        full = model(out.sequences).logits  # [B, 7 + 12, V]
    want = full[:, prompt.shape[1] - 1 : -1]  # the logits each new token was chosen from
    assert rel_err(out.logits, want) < TOL
    assert torch.equal(out.sequences[:, prompt.shape[1]:], want.argmax(-1))  # greedy
    with torch.no_grad():  # the window matters: the same weights with full attention read another context
        unwindowed = windowed_model(mixer, window=None)(out.sequences).logits[:, prompt.shape[1] - 1 : -1]
    assert rel_err(unwindowed, want) > 1e-3


@pytest.mark.parametrize("graph", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("mixer", list(HYBRIDS))
def test_left_padded_batch_equals_each_row_alone(mixer, graph):
    """Prompts of 9, 2 and 5 tokens left-padded to 9 (the short rows' padding is dropped by the window as decoding
    goes on): every row's new tokens and logits are those of a full forward of its own unpadded sequence."""
    model = windowed_model(mixer)
    lengths, new = [9, 2, 5], 10
    rows = [ids(1, n, seed=10 + i)[0] for i, n in enumerate(lengths)]
    prompt = torch.zeros(len(rows), 9, dtype=torch.long)
    mask = torch.zeros_like(prompt)
    for r, row in enumerate(rows):
        prompt[r, 9 - len(row):] = row
        mask[r, 9 - len(row):] = 1
    out = generate(model, prompt, attention_mask=mask, max_new_tokens=new, output_logits=True, graph=graph)
    for r, n in enumerate(lengths):
        sequence = out.sequences[r : r + 1, 9 - n :]  # the row without its padding: prompt + new tokens
        with torch.no_grad():
            want = model(sequence).logits[0, n - 1 : -1]
        assert rel_err(out.logits[r], want) < TOL, f"row {r}"
        assert torch.equal(out.sequences[r, 9:], want.argmax(-1)), f"row {r}"


def test_prefill_in_pieces_with_a_window_equals_one_prefill():
    """A prefill in pieces trims the cache between them (pieces longer than the window)."""
    model = windowed_model("mamba2")
    prompt = ids(2, 13, seed=6)
    one = generate(model, prompt, max_new_tokens=6, output_logits=True)
    pieces = generate(model, prompt, max_new_tokens=6, output_logits=True, prefill_chunk=4)
    assert torch.equal(one.sequences, pieces.sequences) and rel_err(pieces.logits, one.logits) < TOL


def _cache_bytes(cache) -> int:
    return sum(layer.state_bytes() for layer in cache.layers)


@pytest.mark.parametrize("mixer", list(HYBRIDS))
def test_cache_memory_does_not_grow_with_generated_tokens(mixer):
    """Dynamic cache: the same bytes after 10 and after 40 decoded tokens (a full-attention model's grow); the static
    ring: the same bytes for a capacity of 20 or 200 slots."""
    prompt = ids(2, 12, seed=8)
    sizes = {}
    with torch.no_grad():
        for window in (WINDOW, None):
            model = windowed_model(mixer, window)
            cache = model.new_cache()
            token = model(prompt, cache=cache, logits_to_keep=1).logits[:, -1].argmax(-1)
            for step in range(1, 41):
                token = model(token[:, None], cache=cache, logits_to_keep=1).logits[:, -1].argmax(-1)
                if step in (10, 40):
                    sizes[window, step] = _cache_bytes(cache)
            ring = {capacity: _cache_bytes(GraphedDecoder(model, cache, capacity=capacity, batch_size=2).cache)
                    for capacity in (cache.seq_len + 20, cache.seq_len + 200)}
            if window is not None:
                assert len(set(ring.values())) == 1, ring
            else:
                assert len(set(ring.values())) == 2, ring
    assert sizes[WINDOW, 10] == sizes[WINDOW, 40]
    assert sizes[None, 10] < sizes[None, 40]  # the measure sees a growing cache
