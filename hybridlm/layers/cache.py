"""Decoding cache: per layer, the attention KV and whatever the SSM mixer carries.

    cache = HybridCache(num_layers)
    out = model(prompt, cache=cache)          # prefill: fills every layer, cache.seq_len = len(prompt)
    out = model(next_token, cache=cache)      # one step: reads and updates the states

Each mixer owns its fields of `LayerCache`: attention reads and grows `key`/`value`
([B, S, H_kv, D]); an SSM mixer keeps its tensors in the `ssm` dict under names it chooses
(Mamba-2: "conv" [B, K-1, C] and "ssm" [B, H, P, N] float32). The model advances `seq_len`
after every call, so positions of later tokens continue where the cache stopped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LayerCache:
    key: torch.Tensor | None = None  # [B, S, H_kv, D] keys after RoPE and the key multiplier
    value: torch.Tensor | None = None  # [B, S, H_kv, D]
    ssm: dict[str, torch.Tensor] = field(default_factory=dict)  # the SSM mixer's carried state


class HybridCache:
    """One `LayerCache` per block plus the number of tokens already seen."""

    def __init__(self, num_layers: int) -> None:
        self.layers = [LayerCache() for _ in range(num_layers)]
        self.seq_len = 0

    def __getitem__(self, layer_idx: int) -> LayerCache:
        return self.layers[layer_idx]

    def __len__(self) -> int:
        return len(self.layers)
