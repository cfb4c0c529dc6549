"""`load_model(path)`: one front door for checkpoint dirs, ours ("hybridlm") or official ("falcon_h1").

    model = hybridlm.load_model("runs/my-model")               # saved by HybridForCausalLM.save_pretrained
    model = hybridlm.load_model("Falcon-H1-0.5B-Base")          # a downloaded official checkpoint dir
    model.save_pretrained("out", format="falcon_h1")            # back to the official format
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError

from hybridlm.models.config import HybridConfig
from hybridlm.models.configuration import HybridTransformersConfig
from hybridlm.models.falcon_h1 import load_falcon_h1_weights, mismatch_error, read_falcon_h1_config
from hybridlm.models.model import HybridForCausalLM
from hybridlm.models.progress import transformers_progress_bars


def load_model(path: str | Path, *, dtype: torch.dtype | str | None = None) -> HybridForCausalLM:
    """Load a local checkpoint dir by its config.json model_type; returns the model in eval mode (without
    transformers' progress bar). dtype: a floating torch.dtype or its name ("bfloat16"); None keeps the saved one."""
    path = Path(path)
    dtype = _floating_dtype(dtype)
    model_type = _model_type(path)
    try:
        if model_type == "falcon_h1":
            return load_falcon_h1(path, dtype=dtype)
        kwargs = {"dtype": dtype} if dtype is not None else {}
        with transformers_progress_bars(False):
            model, info = HybridForCausalLM.from_pretrained(str(path), output_loading_info=True, **kwargs)
    except SafetensorError as err:  # a truncated or overwritten weights file
        raise ValueError(f"{path}: a weights file is damaged ({err}); copy or export the checkpoint again") from None
    except (OSError, RuntimeError) as err:  # no weights file, a shard missing, weights that do not fit the config
        raise ValueError(f"{path}: the weights do not load ({err})") from None
    # Only the fast-weight gate biases may be missing (a checkpoint written without them): the mixer initializes them.
    missing = [k for k in info.get("missing_keys", ()) if not k.endswith(_OPTIONAL_WEIGHTS)]
    unexpected = list(info.get("unexpected_keys", ()))
    if missing or unexpected:
        raise mismatch_error(path, missing=missing, unexpected=unexpected)
    return model.eval()


_OPTIONAL_WEIGHTS = (".ssm.beta_bias", ".ssm.lam_bias")


def check_weight_files(path: str | Path) -> None:
    """ValueError unless the directory's safetensors weights are all there and whole (each file's header read and
    its tensors' bytes present; the index's shards, when sharded), without loading them."""
    from safetensors import safe_open

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{index} is damaged ({err!r}); copy or export the checkpoint again") from None
    else:
        names = ["model.safetensors"]
    for name in names:
        if not (path / name).is_file():
            raise ValueError(f"{path}: the weights file {name} is missing; copy or export the checkpoint again")
        try:
            with safe_open(path / name, framework="pt"):
                pass
        except SafetensorError as err:
            raise ValueError(f"{path}: a weights file is damaged ({name}: {err}); copy or export the checkpoint "
                             "again") from None


def _floating_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """`dtype` as a floating torch.dtype ("bfloat16", "torch.float16" or the dtype itself), None as None."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), dtype)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch dtype or its name (torch.bfloat16, 'bfloat16', "
                         f"'float32'), got {dtype!r}")
    return dtype


def load_auto_tokenizer(path: str | Path):
    """transformers' AutoTokenizer of a model directory (or a tokenizer directory), without its download progress
    bars. With model_type "hybridlm" registered (importing this module does), transformers reads the directory's
    config.json without its warning about instantiating a model of an unknown type."""
    from transformers import AutoTokenizer

    with transformers_progress_bars(False):
        return AutoTokenizer.from_pretrained(str(path))


def model_dir_problem(path: str | Path) -> str:
    """Why `path` is not a model directory, "" where it holds a config.json: it does not exist, it is a file (the
    weights, say), it is a training run (its model is in final/) or another folder."""
    path = Path(path)
    if (path / "config.json").is_file():
        return ""
    if not path.exists():
        return f"model directory {path} does not exist"
    if path.is_file():
        return (f"{path} is a file; give the model directory (the folder holding config.json), e.g. {path.parent}")
    if (path / "final" / "config.json").is_file():
        return f"{path} is a training run, not a model directory; its model is {path / 'final'}"
    return f"{path} has no config.json; not a model directory"


def _model_type(path: Path) -> str:
    """The model_type of a model directory's config.json: "hybridlm" or "falcon_h1"; errors say what is wrong."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(model_dir_problem(path))
    try:
        config = json.loads(config_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{config_file} is not valid JSON ({err})") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type not in ("falcon_h1", "hybridlm"):
        raise ValueError(f"{path}: unsupported model_type {model_type!r}; expected 'hybridlm' or 'falcon_h1'")
    return model_type


def read_model_config(path: str | Path) -> HybridConfig:
    """The `HybridConfig` of a model directory (ours or falcon_h1) from its config.json, without the weights."""
    path = Path(path)
    if _model_type(path) == "falcon_h1":
        return read_falcon_h1_config(path)
    return HybridTransformersConfig.from_pretrained(str(path)).to_hybrid()


def load_falcon_h1(path: Path, *, dtype: torch.dtype | None = None) -> HybridForCausalLM:
    """A `HybridForCausalLM` from an official falcon_h1 dir (config.json + safetensors, sharded or not), in eval
    mode. dtype: the parameters' dtype (default: the checkpoint's)."""
    config = read_falcon_h1_config(path)
    with torch.device("meta"):
        model = HybridForCausalLM(config)
    load_falcon_h1_weights(model, path, dtype=dtype)
    return model.eval()
