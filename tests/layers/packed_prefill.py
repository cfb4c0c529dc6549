"""Shared check of the SSM mixers' packed prefill into a decoding cache (the prefill of a padded batch)."""

from __future__ import annotations

import torch

from hybridlm.layers.cache import LayerCache
from tests.helpers import rel_err


def check_packed_prefill_matches_alone(mixer, docs: list, *, steps: int = 2, tol: float = 1e-10) -> None:
    """A mixer prefilled with the packed `docs` (each [1, n + steps, D]; the first n tokens are the prompt)
    into one empty LayerCache holds, row by row, exactly the states each prompt leaves alone, and its next
    `steps` one-token calls give each document's own outputs. Use float64 mixers (tol is relative)."""
    lengths = [d.shape[1] - steps for d in docs]
    offsets = torch.tensor([0] + lengths).cumsum(0)
    cache = LayerCache()
    packed = mixer(torch.cat([d[:, :n] for d, n in zip(docs, lengths)], dim=1), cu_seqlens=offsets, cache=cache)
    stepped = [mixer(torch.cat([d[:, n + j : n + j + 1] for d, n in zip(docs, lengths)]), cache=cache)
               for j in range(steps)]
    for row, (doc, n) in enumerate(zip(docs, lengths)):
        alone_cache = LayerCache()
        alone = mixer(doc[:, :n], cache=alone_cache)
        start = int(offsets[row])
        assert rel_err(packed[:, start : start + n], alone) < tol, f"prefill output of row {row}"
        after = [mixer(doc[:, n + j : n + j + 1], cache=alone_cache) for j in range(steps)]
        for j in range(steps):
            assert rel_err(stepped[j][row : row + 1], after[j]) < tol, f"step {j} of row {row}"
        assert set(cache.ssm) == set(alone_cache.ssm)
        for name, value in alone_cache.ssm.items():
            assert rel_err(cache.ssm[name][row : row + 1], value) < tol or (
                value.dtype == torch.int64 and torch.equal(cache.ssm[name][row : row + 1], value)
            ), f"state {name!r} of row {row}"
