"""Adapter to and from the official `falcon_h1` format (transformers' FalconH1Config / FalconH1ForCausalLM).

Config: FalconH1Config fields map one to one onto HybridConfig, except the positional multiplier
lists (`ssm_multipliers` [z, x, B, C, dt], `mlp_multipliers` [gate, down]) that become named fields,
and `rope_parameters["rope_theta"]` that becomes `rope_theta`. Only what Falcon-H1 can express is
exported: Mamba-2 SSM channels, attention on (full, no `attention_window`), SA_M blocks, an MLP.

Weights (ours <-> falcon_h1, per layer i; everything else has the same name):

    model.norm                      <-> model.final_layernorm
    model.layers.i.norm             <-> model.layers.i.input_layernorm
    model.layers.i.mlp_norm         <-> model.layers.i.pre_ff_layernorm
    model.layers.i.attn.*           <-> model.layers.i.self_attn.*
    model.layers.i.mlp.*            <-> model.layers.i.feed_forward.*
    model.layers.i.ssm.conv.*       <-> model.layers.i.mamba.conv1d.*   (weight [C, K] <-> [C, 1, K])
    model.layers.i.ssm.*            <-> model.layers.i.mamba.*
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import FalconH1Config

from hybridlm.models.config import HybridConfig

# FalconH1Config fields with the same name and meaning in HybridConfig.
SHARED_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "mamba_d_ssm", "mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state",
    "mamba_d_conv", "mamba_expand", "mamba_chunk_size", "mamba_conv_bias", "mamba_proj_bias", "mamba_rms_norm",
    "mamba_norm_before_gate", "rms_norm_eps", "tie_word_embeddings", "attention_bias", "mlp_bias",
    "projectors_bias", "hidden_act", "max_position_embeddings", "initializer_range", "pad_token_id",
    "bos_token_id", "eos_token_id", "embedding_multiplier", "lm_head_multiplier", "key_multiplier",
    "attention_in_multiplier", "attention_out_multiplier", "ssm_in_multiplier", "ssm_out_multiplier",
)
SSM_MULTIPLIER_FIELDS = ("ssm_multiplier_z", "ssm_multiplier_x", "ssm_multiplier_B", "ssm_multiplier_C",
                         "ssm_multiplier_dt")
MLP_MULTIPLIER_FIELDS = ("mlp_multiplier_gate", "mlp_multiplier_down")

# (ours, falcon_h1) name prefixes: whole-model ones, then the ones inside `model.layers.<i>.`;
# the first matching pair wins, in either direction.
_MODEL_NAMES = (
    ("model.embed_tokens.", "model.embed_tokens."),
    ("model.norm.", "model.final_layernorm."),
    ("lm_head.", "lm_head."),
)
_LAYER_NAMES = (
    ("norm.", "input_layernorm."),
    ("mlp_norm.", "pre_ff_layernorm."),
    ("attn.", "self_attn."),
    ("mlp.", "feed_forward."),
    ("ssm.conv.", "mamba.conv1d."),
    ("ssm.", "mamba."),
)
_LAYER_PREFIX = re.compile(r"^model\.layers\.\d+\.")
_CONV_WEIGHT = re.compile(r"^model\.layers\.\d+\.(ssm\.conv|mamba\.conv1d)\.weight$")


# ---------------------------------------------------------------------------------------------- config
def config_from_falcon_h1(falcon: FalconH1Config | dict) -> HybridConfig:
    """HybridConfig of an official falcon_h1 config (a FalconH1Config, or its decoded `to_dict()`)."""
    if isinstance(falcon, dict):
        falcon = FalconH1Config.from_dict(dict(falcon))
    rope = dict(getattr(falcon, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"falcon_h1 rope_parameters: only the default RoPE is supported, got {rope!r}")
    for key in ("attn_layer_indices", "quantization_config"):
        if getattr(falcon, key, None):
            raise ValueError(f"falcon_h1 config: {key}={getattr(falcon, key)!r} is not supported")
    values = {name: getattr(falcon, name) for name in SHARED_FIELDS}
    values["head_dim"] = getattr(falcon, "head_dim", None) or falcon.hidden_size // falcon.num_attention_heads
    values["rope_theta"] = float(rope.get("rope_theta", getattr(falcon, "rope_theta", 10000.0)))
    limit = falcon.time_step_limit
    values["time_step_limit"] = (0.0, math.inf) if limit is None else tuple(float(v) for v in limit)
    values["attention_dropout"] = float(falcon.attention_dropout or 0.0)
    values.update(_named(SSM_MULTIPLIER_FIELDS, falcon.ssm_multipliers, "ssm_multipliers"))
    values.update(_named(MLP_MULTIPLIER_FIELDS, falcon.mlp_multipliers, "mlp_multipliers"))
    if isinstance(values["eos_token_id"], tuple):
        values["eos_token_id"] = list(values["eos_token_id"])
    return HybridConfig(**values, ssm_mixer="mamba2", use_attention=True, block_arrangement="SA_M")


def config_to_falcon_h1(config: HybridConfig) -> FalconH1Config:
    """FalconH1Config for a HybridConfig that Falcon-H1 can express (else a ValueError naming the field)."""
    for name, needed in (("ssm_mixer", "mamba2"), ("use_attention", True), ("block_arrangement", "SA_M")):
        if getattr(config, name) != needed:
            raise ValueError(f"the falcon_h1 format needs {name}={needed!r}, this model has {getattr(config, name)!r}")
    if config.intermediate_size == 0:
        raise ValueError("the falcon_h1 format needs an MLP: intermediate_size must be > 0")
    if config.attention_window is not None:
        # FalconH1Config has no sliding window: its attention would read the whole context, another model
        raise ValueError(f"the falcon_h1 format has no sliding-window attention: this model has attention_window="
                         f"{config.attention_window} (falcon_h1 needs attention_window=None)")
    values = {name: getattr(config, name) for name in SHARED_FIELDS}
    return FalconH1Config(
        **values,
        head_dim=config.head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": float(config.rope_theta)},
        time_step_limit=tuple(config.time_step_limit),
        attention_dropout=config.attention_dropout,
        ssm_multipliers=list(config.ssm_multipliers),
        mlp_multipliers=list(config.mlp_multipliers),
        architectures=["FalconH1ForCausalLM"],
    )


def _named(names: tuple[str, ...], values, field_name: str) -> dict[str, float]:
    values = list(values if values is not None else [1.0] * len(names))
    if len(values) != len(names):
        raise ValueError(f"falcon_h1 {field_name} must have {len(names)} entries, got {values!r}")
    return {name: float(value) for name, value in zip(names, values)}


# ---------------------------------------------------------------------------------------------- weights
def state_dict_to_falcon_h1(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our `HybridForCausalLM` state dict -> falcon_h1 names and shapes."""
    return {_rename(key, to_falcon=True): _conv_to_falcon(key, value) for key, value in state.items()}


def state_dict_from_falcon_h1(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """falcon_h1 state dict -> our names and shapes."""
    return {_rename(key, to_falcon=False): _conv_from_falcon(key, value) for key, value in state.items()}


def _rename(key: str, *, to_falcon: bool) -> str:
    src, dst = (0, 1) if to_falcon else (1, 0)
    prefix, rest, table = "", key, _MODEL_NAMES
    layer = _LAYER_PREFIX.match(key)
    if layer:
        prefix, rest, table = layer.group(0), key[layer.end():], _LAYER_NAMES
    for names in table:
        if rest.startswith(names[src]):
            return prefix + names[dst] + rest[len(names[src]):]
    raise ValueError(f"no falcon_h1 mapping for weight {key!r}")


def _conv_to_falcon(key: str, value: torch.Tensor) -> torch.Tensor:
    return value.unsqueeze(1) if _CONV_WEIGHT.match(key) else value  # [C, K] -> [C, 1, K]


def _conv_from_falcon(key: str, value: torch.Tensor) -> torch.Tensor:
    if _CONV_WEIGHT.match(key):
        if value.dim() != 3 or value.shape[1] != 1:
            raise ValueError(f"{key}: expected a depthwise conv weight [C, 1, K], got {list(value.shape)}")
        return value.squeeze(1)
    return value


# ---------------------------------------------------------------------------------------------- files
def read_safetensors_dir(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint dir: `model.safetensors`, else the shards its index names (transformers'
    order: a single file wins over a stale index left beside it)."""
    path = Path(path)
    state: dict[str, torch.Tensor] = {}
    for shard in _weight_files(path):
        state.update(load_file(str(path / shard)))
    return state


def _weight_files(path: Path) -> list[str]:
    """The safetensors files `read_safetensors_dir` reads, by name."""
    index = path / "model.safetensors.index.json"
    if (path / "model.safetensors").exists():
        return ["model.safetensors"]
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [name for name in shards if not (path / name).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are not there: {', '.join(missing)}")
        return shards
    raise FileNotFoundError(
        f"{path}: no model.safetensors or model.safetensors.index.json (pickled weights are not read)"
    )


def _file_holding(path: Path, key: str) -> Path:
    """The weights file of the dir that holds tensor `key` (reads the files' headers only)."""
    for name in _weight_files(path):
        with safe_open(str(path / name), framework="pt") as f:
            names = f.keys()  # (a safe_open handle has no `in`)
        if key in names:
            return path / name
    raise KeyError(key)


def mismatch_error(path: Path, *, missing=(), unexpected=(), wrong_shapes=()) -> ValueError:
    """The error for weights that do not fit a checkpoint's config.json; names as the checkpoint spells them."""
    parts = [f"missing {_listed(missing)}" if missing else "",
             f"unexpected {_listed(unexpected)}" if unexpected else "",
             f"wrong shape {_listed(wrong_shapes)}" if wrong_shapes else ""]
    return ValueError(f"{path}: the weights do not fit its config.json ({'; '.join(p for p in parts if p)}); "
                      "the checkpoint is incomplete or the config was edited")


def _listed(names, shown: int = 4) -> str:
    names = sorted(names)
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def read_falcon_h1_config(path: str | Path) -> HybridConfig:
    """The HybridConfig of an official falcon_h1 checkpoint dir (its config.json)."""
    path = Path(path)
    model_type = json.loads((path / "config.json").read_text()).get("model_type")
    if model_type != "falcon_h1":
        raise ValueError(f"{path}: model_type is {model_type!r}, not 'falcon_h1'")
    from huggingface_hub.errors import StrictDataclassError

    try:  # transformers validates the fields (types, head counts that divide the widths) as it reads them
        falcon = FalconH1Config.from_json_file(str(path / "config.json"))
    except (StrictDataclassError, TypeError, ValueError) as err:
        raise ValueError(f"{path / 'config.json'}: {' '.join(str(err).split())}") from None  # one line
    return config_from_falcon_h1(falcon)


def load_falcon_h1_weights(model: torch.nn.Module, path: str | Path, *, dtype: torch.dtype | None = None) -> None:
    """Fill `model` (a HybridForCausalLM of `read_falcon_h1_config(path)`, on the meta device) with the weights of the
    official falcon_h1 dir `path` (safetensors, sharded or not). dtype: the parameters' dtype (default: the
    checkpoint's). Every error names the dir or file and the checkpoint's own weight names."""
    path = Path(path)
    tied = model.config.tie_word_embeddings
    try:
        state = state_dict_from_falcon_h1(read_safetensors_dir(path))
    except ValueError as err:  # a weight with no mapping, a conv weight of the wrong rank
        raise ValueError(f"{path}: {err}") from None
    needed = model.state_dict()  # meta tensors: names and shapes
    if tied:
        _check_tied_head(path, state)
        state.pop("lm_head.weight", None)
        needed.pop("lm_head.weight")
    elif "lm_head.weight" not in state:
        raise ValueError(f"{path}: lm_head.weight is missing and tie_word_embeddings is false")
    falcon_shape = lambda key, shape: list(_conv_to_falcon(key, torch.empty(shape, device="meta")).shape)
    wrong = [f"{_rename(key, to_falcon=True)} {falcon_shape(key, state[key].shape)} (config: "
             f"{falcon_shape(key, needed[key].shape)})"
             for key in sorted(needed.keys() & state.keys()) if state[key].shape != needed[key].shape]
    missing, unexpected = needed.keys() - state.keys(), state.keys() - needed.keys()
    if missing or unexpected or wrong:
        raise mismatch_error(path, missing=[_rename(key, to_falcon=True) for key in missing],
                             unexpected=[_rename(key, to_falcon=True) for key in unexpected], wrong_shapes=wrong)
    if tied:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    if dtype is None:
        dtype = state["model.embed_tokens.weight"].dtype
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight


def _check_tied_head(path: Path, state: dict[str, torch.Tensor]) -> None:
    """A tied checkpoint may also hold lm_head.weight, but only as a copy of the embeddings: tying would
    otherwise drop a head the file holds (transformers keeps it, with a warning)."""
    head, embeddings = state.get("lm_head.weight"), state.get("model.embed_tokens.weight")
    if head is None or embeddings is None or torch.equal(head, embeddings):
        return
    raise ValueError(
        f"{_file_holding(path, 'lm_head.weight')}: config.json has tie_word_embeddings=true, but this file's "
        "lm_head.weight differs from model.embed_tokens.weight, and tying would drop it. To keep the file's head, "
        f'set "tie_word_embeddings": false in {path / "config.json"}; to tie, remove lm_head.weight from the file'
    )


def save_falcon_h1(model, path: str | Path) -> None:
    """Write `model` (a HybridForCausalLM) as an official falcon_h1 checkpoint dir."""
    path = Path(path)
    config = model.config.to_hybrid()
    falcon = config_to_falcon_h1(config)
    falcon.dtype = model.model.embed_tokens.weight.dtype
    state = state_dict_to_falcon_h1(model.state_dict())
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    path.mkdir(parents=True, exist_ok=True)
    falcon.save_pretrained(str(path))
    if getattr(model, "generation_config", None) is not None:  # eos ids and sampling defaults go with the weights
        model.generation_config.save_pretrained(str(path))
    tensors = {key: value.detach().to("cpu").contiguous().clone() for key, value in state.items()}
    staged = path / "model.safetensors.tmp"
    save_file(tensors, str(staged), metadata={"format": "pt"})
    os.replace(staged, path / "model.safetensors")
    # the weights of an earlier sharded checkpoint in this dir would otherwise be what a sharded reader loads
    index = path / "model.safetensors.index.json"
    if index.exists():
        for name in set(json.loads(index.read_text()).get("weight_map", {}).values()):
            if Path(name).name == name and name.endswith(".safetensors") and name != "model.safetensors":
                (path / name).unlink(missing_ok=True)
        index.unlink()
