"""Nested state (an optimizer's state_dict, RNG states) <-> flat tensors for safetensors + a JSON skeleton.

No pickle: tensors go to a safetensors file under path-like keys ("state/3/exp_avg"), everything else to
a JSON skeleton in which every container is tagged, so types round-trip exactly:

    tensor -> {"__tensor__": key}       tuple -> {"__tuple__": [...]}      list -> [...]
    dict   -> {"__dict__": [[k, v], ...]}  (keys str or int, order kept)
    float  -> itself if finite, else {"__float__": "inf" | "-inf" | "nan"}
    None, bool, int, str -> themselves

Anything else raises TypeError naming its path. Tensors come back on the CPU, detached.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def flatten_tree(tree: Any) -> tuple[dict[str, torch.Tensor], Any]:
    """Split `tree` into (tensors by key, JSON-able skeleton). Tensors are moved to CPU, made contiguous;
    a tensor whose storage another one already uses is cloned (safetensors refuses shared memory)."""
    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()

    def encode(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            tensor = value.detach().cpu().contiguous()
            ptr = tensor.untyped_storage().data_ptr()
            if tensor.numel() > 0 and ptr in storages:
                tensor = tensor.clone()
                ptr = tensor.untyped_storage().data_ptr()
            storages.add(ptr)
            key = path or "."
            tensors[key] = tensor
            return {"__tensor__": key}
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else {"__float__": repr(value)}
        if isinstance(value, tuple):
            return {"__tuple__": [encode(v, f"{path}/{i}") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [encode(v, f"{path}/{i}") for i, v in enumerate(value)]
        if isinstance(value, dict):
            pairs = []
            for k, v in value.items():
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise TypeError(f"cannot store dict key {k!r} ({type(k).__name__}) at {path or '/'}: keys must be str or int")
                pairs.append([k, encode(v, f"{path}/{k}")])
            return {"__dict__": pairs}
        raise TypeError(f"cannot store a {type(value).__name__} at {path or '/'} (tensors and JSON values only)")

    skeleton = encode(tree, "")
    return tensors, skeleton


def unflatten_tree(tensors: dict[str, torch.Tensor], skeleton: Any) -> Any:
    """Inverse of `flatten_tree`. Raises ValueError for a malformed skeleton or a missing tensor key."""

    def decode(node: Any) -> Any:
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, list):
            return [decode(v) for v in node]
        if isinstance(node, dict) and len(node) == 1:
            (tag, body), = node.items()
            if tag == "__tensor__":
                if body not in tensors:
                    raise ValueError(f"skeleton refers to tensor {body!r}, which the tensor file does not hold")
                return tensors[body]
            if tag == "__tuple__":
                return tuple(decode(v) for v in body)
            if tag == "__dict__":
                return {k: decode(v) for k, v in body}
            if tag == "__float__":
                return float(body)
        raise ValueError(f"malformed skeleton node: {str(node)[:80]}")

    return decode(skeleton)
