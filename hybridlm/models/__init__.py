"""The model: its config (`HybridConfig`, the one description of a model), presets, the transformers-compatible
model classes (`model.py`, built from a HybridConfig), their decoding loop (`generation.py`, with `sampling.py` and
`graphed.py`), checkpoint loading (`hf.py`) and the falcon_h1 conversion.

Importing `hybridlm.models.model` (or `hybridlm.models.hf`) registers model_type "hybridlm" with
transformers' AutoConfig / AutoModel / AutoModelForCausalLM.
"""

from hybridlm.models.allocation import channel_allocation
from hybridlm.models.config import HybridConfig
from hybridlm.models.presets import get_preset, list_presets, nominal_parameters

__all__ = ["HybridConfig", "channel_allocation", "get_preset", "list_presets", "nominal_parameters"]
