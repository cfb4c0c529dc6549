"""One sequence mixer per file (attention, Mamba-2, fast-weight), the MLP, the hybrid block and the decoding cache."""

from hybridlm.layers.attention import Attention
from hybridlm.layers.block import HybridBlock, build_ssm_mixer, set_mixers_recompute
from hybridlm.layers.cache import HybridCache, LayerCache
from hybridlm.layers.mamba2 import Mamba2Mixer
from hybridlm.layers.mlp import GatedMLP

__all__ = ["Attention", "GatedMLP", "HybridBlock", "HybridCache", "LayerCache", "Mamba2Mixer", "build_ssm_mixer",
           "set_mixers_recompute"]
