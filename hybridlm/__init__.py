"""hybridlm: hybrid attention + state-space language models (Falcon-H1 blocks, Falcon fast-weight attention)."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Public names, imported on first use so that `import hybridlm` stays light (no transformers import).
_EXPORTS = {
    "HybridConfig": "hybridlm.models.config",
    "channel_allocation": "hybridlm.models.allocation",
    "get_preset": "hybridlm.models.presets",
    "list_presets": "hybridlm.models.presets",
    "HybridModel": "hybridlm.models.model",
    "HybridForCausalLM": "hybridlm.models.model",
    "HybridCache": "hybridlm.layers.cache",
    "load_model": "hybridlm.models.hf",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hybridlm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
