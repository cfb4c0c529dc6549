"""`HybridTransformersConfig`: the transformers `PretrainedConfig` face of `HybridConfig` (model_type "hybridlm").

`HybridConfig` is the one description of a model; this class exists because transformers' machinery
(`save_pretrained` / `from_pretrained`, `AutoConfig`, `model.config`) needs a `PretrainedConfig`. It carries
every `HybridConfig` field as an attribute (validated through `HybridConfig`), plus the usual transformers
bookkeeping keys. Users build models from a `HybridConfig` (`HybridForCausalLM(HybridConfig(...))`, which
converts it here) and read it back with `model.config.to_hybrid()`. A config of another model_type is refused
(an official `falcon_h1` one with a pointer to `hybridlm.load_model`, which converts it).
"""

from __future__ import annotations

import difflib
from types import MappingProxyType
from typing import Any

from transformers import PretrainedConfig

from hybridlm.models.config import HybridConfig


class HybridTransformersConfig(PretrainedConfig):
    model_type = "hybridlm"
    # No remote code: the classes register with transformers' Auto classes when `hybridlm.models.model` is imported
    # (`hybridlm.HybridForCausalLM`, `hybridlm.load_model` or `hybridlm.models.hf` import it; a bare `import hybridlm`
    # stays light and does not), so name one of them before loading a "hybridlm" directory by path. Tools that
    # read `config.auto_map` unguarded (TRL's model-from-path helper, which builds DPO's reference model, then
    # transformers' Auto classes) find an empty mapping and take AutoModelForCausalLM. A config.json that carries
    # one (`hybridlm eval export-hf` writes it) sets it on the instance.
    auto_map = MappingProxyType({})

    def __init__(self, **kwargs: Any) -> None:
        # A config.json of another model (from_pretrained on its dir) would otherwise fail on its first foreign key.
        model_type = kwargs.get("model_type", self.model_type)
        if model_type == "falcon_h1":
            raise ValueError(
                "this is an official falcon_h1 config (model_type 'falcon_h1'), which "
                "HybridForCausalLM.from_pretrained does not read: load the checkpoint dir with "
                "hybridlm.load_model(path), which converts it (its weights included)"
            )
        if model_type != self.model_type:
            raise ValueError(f"model_type {model_type!r} is not a hybridlm config (model_type {self.model_type!r})")
        names = set(HybridConfig.field_names())
        # Other keys go to transformers (its bookkeeping, and what other tools add: auto_map, use_cache, ...);
        # one that reads like a misspelt model field is refused: it would silently leave that field at its default.
        for key in kwargs:
            near = difflib.get_close_matches(key, names, n=1, cutoff=0.8) if key not in names else []
            if near:
                raise ValueError(f"unknown config key {key!r} (did you mean {near[0]!r}?)")
        hybrid = HybridConfig.from_dict({key: kwargs.pop(key) for key in list(kwargs) if key in names})
        for key, value in hybrid.to_dict().items():
            object.__setattr__(self, key, value)
        super().__init__(**kwargs)

    @classmethod
    def from_hybrid(cls, config: HybridConfig, **kwargs: Any) -> HybridTransformersConfig:
        return cls(**config.to_dict(), **kwargs)

    def to_hybrid(self) -> HybridConfig:
        return HybridConfig.from_dict({name: getattr(self, name) for name in HybridConfig.field_names()})

    def to_diff_dict(self) -> dict[str, Any]:
        # Always write every model field, so a checkpoint never depends on today's defaults.
        out = super().to_diff_dict()
        out.update(self.to_hybrid().to_dict())
        return out


def transformers_config(config: HybridConfig | HybridTransformersConfig, *, model: str) -> HybridTransformersConfig:
    """The transformers face a model class is built on: a `HybridConfig` converted, its face as it is.
    `model` names the class being built, for the error on any other type."""
    if isinstance(config, HybridTransformersConfig):
        return config
    if isinstance(config, HybridConfig):
        return HybridTransformersConfig.from_hybrid(config)
    if isinstance(config, PretrainedConfig) and config.model_type == "falcon_h1":
        raise TypeError(
            f"{model} takes a HybridConfig, got an official falcon_h1 config: convert it with "
            "hybridlm.models.falcon_h1.config_from_falcon_h1(config), or load the checkpoint dir with "
            "hybridlm.load_model(path)"
        )
    raise TypeError(
        f"{model} takes a HybridConfig, got {type(config).__name__}: build one with HybridConfig(**fields) or "
        "hybridlm.get_preset(name), or load a checkpoint dir with hybridlm.load_model(path)"
    )
