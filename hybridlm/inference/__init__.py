"""Inference: cached generation (greedy and sampled, batched left-padded prompts; decoding steps as a CUDA graph)
and the `hybridlm generate` command.

    from hybridlm.inference import generate
    out = generate(model, ids, max_new_tokens=32).sequences

The decoding loop is part of the model's contract (`HybridForCausalLM.generate` runs it), so it lives beside the
model in `hybridlm.models.generation` (with `sampling` and `graphed`); the decoding cache lives in
`hybridlm.layers.cache`, which the mixers read and write. This package is their public front door.
"""

from __future__ import annotations

from hybridlm.lazy import lazy_exports

_EXPORTS = {
    "HybridCache": "hybridlm.layers.cache",
    "LayerCache": "hybridlm.layers.cache",
    "StaticCache": "hybridlm.layers.cache",
    "GenerationOutput": "hybridlm.models.generation",
    "generate": "hybridlm.models.generation",
    "prefill": "hybridlm.models.generation",
    "GraphedDecoder": "hybridlm.models.graphed",
    "sample_next": "hybridlm.models.sampling",
    "top_k_filter": "hybridlm.models.sampling",
    "top_p_filter": "hybridlm.models.sampling",
}

__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
