"""Fill-in-the-middle and section reordering on token ids."""

from __future__ import annotations

import numpy as np
import pytest

from hybridlm.data.augment import AugmentConfig, augment, fill_in_middle, reorder_sections
from hybridlm.data.tokenizer import SPECIAL_TOKENS

IDS = {name: i for i, (name, _) in enumerate(SPECIAL_TOKENS)}
PRE, MID, SUF, SEC, ORIG, EOS = (IDS[k] for k in ("fim_prefix", "fim_middle", "fim_suffix", "section", "original_order", "eos"))


def _body(rng, n):
    return rng.integers(100, 2000, size=n)


@pytest.mark.parametrize("n", [0, 1, 2, 37])
def test_fill_in_middle_is_psm_and_loses_nothing(n):
    rng = np.random.default_rng(n)
    for _ in range(50):
        body = _body(rng, n)
        out = fill_in_middle(body, rng, prefix_id=PRE, suffix_id=SUF, middle_id=MID)
        assert len(out) == n + 3 and out[0] == PRE
        (s,), (m,) = np.flatnonzero(out == SUF), np.flatnonzero(out == MID)
        prefix, suffix, middle = out[1:s], out[s + 1:m], out[m + 1:]
        assert np.array_equal(np.concatenate([prefix, middle, suffix]), body)


def test_fill_in_middle_cuts_are_spread():
    rng = np.random.default_rng(0)
    body = _body(rng, 20)
    lengths = {fill_in_middle(body, rng, prefix_id=PRE, suffix_id=SUF, middle_id=MID).tolist().index(SUF) - 1
               for _ in range(3000)}
    assert lengths == set(range(21))  # every prefix length 0..20 occurs


def test_reorder_sections_shuffles_then_restores():
    rng = np.random.default_rng(1)
    seen_k = set()
    for _ in range(100):
        body = _body(rng, 30)
        out = reorder_sections(body, rng, section_id=SEC, original_id=ORIG, max_sections=4)
        (o,) = np.flatnonzero(out == ORIG)
        assert np.array_equal(out[o + 1:], body)
        marks = np.flatnonzero(out[:o] == SEC)
        sections = [out[a + 1:b] for a, b in zip(marks, list(marks[1:]) + [o])]
        seen_k.add(len(sections))
        assert all(len(s) for s in sections)
        assert not np.array_equal(np.concatenate(sections), body)  # not the original order
        starts = sorted(sections, key=lambda s: _find(body, s))
        assert np.array_equal(np.concatenate(starts), body)  # a permutation of contiguous pieces
    assert seen_k == {2, 3, 4}


def _find(body, piece):
    for i in range(len(body) - len(piece) + 1):
        if np.array_equal(body[i:i + len(piece)], piece):
            return i
    raise AssertionError("section not found in the document")


def test_augment_rates_lengths_and_eos():
    cfg = AugmentConfig(fim_rate=0.3, reorder_rate=0.2, fim_min_tokens=8, reorder_min_tokens=16)
    rng = np.random.default_rng(2)
    kinds = {"fim": 0, "reorder": 0, "none": 0}
    n = 4000
    for _ in range(n):
        doc = np.append(_body(rng, 20), EOS)
        out = augment(doc, rng, cfg, IDS)
        assert out[-1] == EOS and EOS not in out[:-1]
        kinds["fim" if PRE in out else "reorder" if ORIG in out else "none"] += 1
    for kind, p in [("fim", 0.3), ("reorder", 0.2), ("none", 0.5)]:
        assert abs(kinds[kind] / n - p) < 4 * np.sqrt(p * (1 - p) / n)
    short = np.append(_body(rng, 7), EOS)
    assert np.array_equal(augment(short, rng, AugmentConfig(fim_rate=1.0), IDS), short)
    long = np.append(_body(rng, 40), EOS)
    assert np.array_equal(augment(long, rng, AugmentConfig(), IDS), long)


def test_augment_is_a_function_of_the_generator_seed():
    cfg = AugmentConfig(fim_rate=0.5, reorder_rate=0.5)
    doc = np.append(np.arange(100, 160), EOS)
    a = [augment(doc, np.random.default_rng([3, k]), cfg, IDS).tolist() for k in range(20)]
    b = [augment(doc, np.random.default_rng([3, k]), cfg, IDS).tolist() for k in range(20)]
    c = [augment(doc, np.random.default_rng([4, k]), cfg, IDS).tolist() for k in range(20)]
    assert a == b and a != c


@pytest.mark.parametrize("kwargs", [{"fim_rate": 1.5}, {"reorder_rate": -0.1}, {"fim_rate": 0.6, "reorder_rate": 0.6},
                                    {"max_sections": 1}, {"reorder_min_tokens": 2}])
def test_config_validation(kwargs):
    with pytest.raises(ValueError):
        AugmentConfig(**kwargs)
