"""Several requests' next prefill pieces in one forward: a packed row whose documents continue each request's cache.

    packed = PackedPrefill([cache_a, cache_b])                 # single-sequence caches: fresh, or filled alike
    logits = model(tokens, cu_seqlens=offsets, cache=packed,   # tokens [1, total]: piece a then piece b
                   logits_to_keep=offsets[1:] - 1).logits[0]   # [2, V] after each piece's last token
    # cache_a and cache_b now hold their pieces too (keys, SSM states, lengths)

The model runs a packed row (`cu_seqlens`) as separate documents: no conv tap, recurrent state or attention query
crosses a document boundary, and the SSM ops start each document from its own row of the initial state. So a packed
call equals one call per piece, each on its own cache (to float rounding), in one forward instead of N.

What this cache does for the model:
- positions (`packed_positions`): each document's tokens continue its cache, `seq_len` of that request + 0, 1, ...;
- attention (`PackedLayerCache.store_packed_kv`): each document's new keys/values are appended to its own request's
  layer cache (`LayerCache.append_kv`: its window trimming included) and the keys each document attends to come back
  packed with their offsets; attention then lets each document's queries read its own keys only;
- SSM states: the mixers read `ssm` as every request's state stacked on dim 0 (one row per document, what the ops
  take with `cu_seqlens`) and replace them; `start_rows`, which the model calls after a packed call, writes each
  row back into its request's cache and advances each cache by its piece.

The caches packed together must carry the same SSM state fields: all fresh (no state: every document starts from
zeros as a fresh prefill does) or all filled. A fresh request cannot join filled ones with a zero state, since a zero
state is not always a fresh one (the shifted fast-weight rules write nothing at a fresh sequence's first token, but
would pair it with a zero key); the engine packs the two kinds in separate calls (`state_fields`).
"""

from __future__ import annotations

import torch

from hybridlm.layers.cache import HybridCache, LayerCache
from hybridlm.modules.boundaries import local_positions, sequence_ids
from hybridlm.ops.utils import host_to_device


def state_fields(cache: HybridCache) -> tuple[tuple[str, ...], ...]:
    """The SSM state fields a cache carries, per layer: caches with the same ones can be packed together."""
    return tuple(tuple(sorted(layer.ssm)) for layer in cache.layers)


class PackedLayerCache(LayerCache):
    """One layer of `PackedPrefill`: the requests' layer caches, their SSM states stacked (the module docstring)."""

    def __init__(self, layers: list[LayerCache]) -> None:
        super().__init__()
        self._layers = layers
        names = layers[0].ssm.keys()
        if any(layer.ssm.keys() != names for layer in layers):
            raise ValueError("caches packed together must carry the same SSM state fields (all fresh or all filled)")
        self.ssm = {name: torch.cat([layer.ssm[name] for layer in layers]) for name in names}  # [N, ...] each

    def store_packed_kv(self, key: torch.Tensor, value: torch.Tensor, offsets: torch.Tensor, *,
                        window: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Append each document's keys/values [1, T_i, H_kv, D] (of the packed key/value [1, total, ...]) to its
        request's cache; return every document's keys/values, [1, S, H_kv, D] packed, and their offsets [N + 1]."""
        keys, values, counts = [], [], [0]
        bounds = offsets.tolist()
        for layer, start, end in zip(self._layers, bounds[:-1], bounds[1:]):
            k, v = layer.append_kv(key[:, start:end], value[:, start:end], window=window)  # [1, S_i, H_kv, D]
            keys.append(k)
            values.append(v)
            counts.append(counts[-1] + k.shape[1])
        return torch.cat(keys, dim=1), torch.cat(values, dim=1), torch.tensor(counts)

    def commit(self) -> None:
        """Each request's row of the states the mixers produced, back into its cache."""
        for row, layer in enumerate(self._layers):
            layer.ssm = {name: state[row : row + 1] for name, state in self.ssm.items()}


class PackedPrefill(HybridCache):
    """The caches of N requests as the cache of one packed call of N documents (the module docstring)."""

    def __init__(self, caches: list[HybridCache]) -> None:
        super().__init__(0)
        if any(cache.lengths is not None for cache in caches):
            raise ValueError("a packed prefill continues single-sequence caches (one row each)")
        self.caches = caches
        self.layers = [PackedLayerCache([cache.layers[i] for cache in caches]) for i in range(len(caches[0].layers))]

    def packed_positions(self, offsets: torch.Tensor, total: int, device: torch.device) -> torch.Tensor:
        """[1, total]: each document's tokens numbered on from its request's length."""
        if len(offsets) != len(self.caches) + 1:
            raise ValueError(f"{len(offsets) - 1} packed documents for {len(self.caches)} caches")
        past = torch.tensor([cache.seq_len for cache in self.caches])  # [N]
        positions = local_positions(offsets, total) + past[sequence_ids(offsets, total)]  # [total]
        return host_to_device(positions.unsqueeze(0), device)

    def start_rows(self, lengths: torch.Tensor, *, device: torch.device | str) -> None:
        """After the packed call: every request's cache takes its states back and counts its piece's tokens."""
        for layer in self.layers:
            layer.commit()
        for cache, length in zip(self.caches, lengths.tolist()):
            cache.advance(length)

    def positions(self, length: int, device: torch.device) -> torch.Tensor:
        raise ValueError("a packed prefill cache takes packed calls only (cu_seqlens)")

    def advance(self, length: int) -> None:
        raise ValueError("a packed prefill cache takes packed calls only (cu_seqlens)")
