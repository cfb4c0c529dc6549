"""hybridlm: hybrid attention + state-space language models (Falcon-H1 blocks, Falcon fast-weight attention)."""

from __future__ import annotations

from hybridlm.lazy import lazy_exports

__version__ = "0.1.0"

# Public names, imported on first use so that `import hybridlm` stays light (no torch or transformers import).
_EXPORTS = {
    "HybridConfig": "hybridlm.models.config",
    "channel_allocation": "hybridlm.models.allocation",
    "get_preset": "hybridlm.models.presets",
    "list_presets": "hybridlm.models.presets",
    "HybridModel": "hybridlm.models.model",
    "HybridForCausalLM": "hybridlm.models.model",
    "HybridCache": "hybridlm.layers.cache",
    "load_model": "hybridlm.models.hf",
    "fold_multipliers": "hybridlm.models.fold",
    "fuse_projections": "hybridlm.models.fuse",
    "prepare_for_generation": "hybridlm.models.fuse",
}

__all__ = ["__version__", *_EXPORTS]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
