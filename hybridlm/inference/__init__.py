"""Inference: cached generation (greedy and sampled, batched left-padded prompts; decoding steps as a CUDA graph)
and the `hybridlm generate` command.

    from hybridlm.inference import generate
    out = generate(model, ids, max_new_tokens=32).sequences

The decoding loop is part of the model's contract (`HybridForCausalLM.generate` runs it), so it lives beside the
model in `hybridlm.models.generation` (with `sampling` and `graphed`); the decoding cache lives in
`hybridlm.layers.cache`, which the mixers read and write. This package is their public front door.
"""

from hybridlm.layers.cache import HybridCache, LayerCache, StaticCache
from hybridlm.models.generation import GenerationOutput, generate, prefill
from hybridlm.models.graphed import GraphedDecoder
from hybridlm.models.sampling import sample_next, top_k_filter, top_p_filter

__all__ = [
    "GenerationOutput",
    "GraphedDecoder",
    "HybridCache",
    "LayerCache",
    "StaticCache",
    "generate",
    "prefill",
    "sample_next",
    "top_k_filter",
    "top_p_filter",
]
