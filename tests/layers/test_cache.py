"""`LayerCache.state_bytes`: the memory a layer's cache keeps alive, counted by the storages it pins."""

from __future__ import annotations

import torch

from hybridlm.layers.cache import LayerCache


def test_state_bytes_counts_the_storage_a_slice_pins_once():
    layer = LayerCache()
    window = torch.zeros(2, 3, 5)  # 120 bytes; the state keeps only a slice of it
    states = torch.zeros(2, 4, dtype=torch.float64)  # 64 bytes, two views of it
    layer.ssm = {"tail": window[:, 1:], "first": states[:, :2], "second": states[:, 2:]}
    assert layer.state_bytes() == 120 + 64
    layer.append_kv(torch.ones(2, 3, 1, 4), torch.ones(2, 3, 1, 4))  # key and value [B, T, H_kv, D]
    assert layer.state_bytes() == 120 + 64 + 2 * layer._key.untyped_storage().nbytes()
    assert layer._key.untyped_storage().nbytes() == 2 * 3 * 4 * 4
