"""Inference: cached generation (greedy and sampled, batched left-padded prompts; decoding steps as a CUDA graph)
and its CLI.

The decoding cache itself lives in `hybridlm.layers.cache` (the mixers read and write it); it is
re-exported here.
"""

from hybridlm.inference.generate import GenerationOutput, generate, prefill
from hybridlm.inference.graphed import GraphedDecoder
from hybridlm.inference.sampling import sample_next, top_k_filter, top_p_filter
from hybridlm.layers.cache import HybridCache, LayerCache, StaticCache

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
