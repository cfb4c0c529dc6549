"""Model configs, presets, the transformers-compatible model classes and checkpoint conversion.

Importing `hybridlm.models.model` (or `hybridlm.models.hf`) registers model_type "hybridlm" with
transformers' AutoConfig / AutoModel / AutoModelForCausalLM.
"""

from hybridlm.models.allocation import channel_allocation
from hybridlm.models.config import HybridConfig
from hybridlm.models.presets import get_preset, list_presets, nominal_parameters

__all__ = ["HybridConfig", "channel_allocation", "get_preset", "list_presets", "nominal_parameters"]
