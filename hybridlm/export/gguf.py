"""A Falcon-H1 model (a hybrid whose SSM half is Mamba-2) as one GGUF file for llama.cpp's `falcon-h1` architecture.

    export_gguf("runs/demo/final", "demo.gguf")                       # f32, the tokenizer from the same dir
    export_gguf(model, "model.gguf", tokenizer="tok/", dtype="q8_0")  # a HybridForCausalLM in memory

Tensor names come from the `gguf` package's own table for `falcon-h1` (`gguf.get_tensor_name_map`), applied to the
model's falcon_h1 names (`hybridlm.models.falcon_h1`), as llama.cpp's converter applies it to a falcon_h1 checkpoint.
llama.cpp's falcon-h1 graph has no muP multipliers: every one is folded into the weight (or bias) it scales, in
float64, before the tensor is encoded. Models llama.cpp would run differently are refused with a ValueError that
names the field. README.md in this folder has the whole mapping, field by field.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from tokenizers import Tokenizer

from hybridlm.data.tokenizer import without_generation_tags
from hybridlm.export import GGUF_DTYPES
from hybridlm.fileio import fsync_dir
from hybridlm.models.config import HybridConfig
from hybridlm.models.falcon_h1 import config_to_falcon_h1, state_dict_to_falcon_h1
from hybridlm.models.hf import load_model, model_dir_problem
from hybridlm.models.model import HybridForCausalLM

ARCH = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.FALCON_H1]  # "falcon-h1"
# llama.cpp's pre-tokenizer for Falcon-H1 vocabularies (its converter detects the official ones by a hash).
PRE_TOKENIZER = "falcon-h1"

# A merge no text reaches: BPE starts from single byte symbols and only merges make longer ones, so with no other
# merge "ĠĠ" (two spaces in GPT-2's byte alphabet) never forms.
NO_MERGE = "ĠĠ ĠĠ"

_Q = gguf.GGMLQuantizationType
# --dtype -> (general.file_type, the encoding of the weight matrices)
_FILE_TYPES = dict(zip(GGUF_DTYPES, (
    (gguf.LlamaFileType.ALL_F32, _Q.F32),
    (gguf.LlamaFileType.MOSTLY_F16, _Q.F16),
    (gguf.LlamaFileType.MOSTLY_BF16, _Q.BF16),
    (gguf.LlamaFileType.MOSTLY_Q8_0, _Q.Q8_0),
)))


def export_gguf(model: str | Path | HybridForCausalLM, out: str | Path, *, tokenizer: str | Path | None = None,
                dtype: str = "f32", overwrite: bool = False) -> Path:
    """Write `model` (a checkpoint dir, ours or falcon_h1, or a HybridForCausalLM) and its tokenizer (a dir holding
    tokenizer.json; default: the model dir) to the GGUF file `out`; returns its path.

    Checked before anything is written: `dtype` is one of GGUF_DTYPES, `out` does not exist (FileExistsError unless
    `overwrite`), the model is one llama.cpp's falcon-h1 runs as we do (ValueError naming the field), the tokenizer
    is a BPE without a normalizer whose ids fit the embedding. The file is written under a temporary name in `out`'s directory
    and renamed into place, so `out` is either the whole new file or left as it was."""
    if dtype not in _FILE_TYPES:
        raise ValueError(f"dtype must be one of {', '.join(GGUF_DTYPES)}, got {dtype!r}")
    out = Path(out)
    if not out.parent.is_dir():
        raise FileNotFoundError(f"{out.parent} is not a directory; create it first or choose another output path")
    if out.is_dir():
        raise IsADirectoryError(f"{out} is a directory; give a file path for the GGUF (e.g. {out / 'model.gguf'})")
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; pass --overwrite to replace it")
    if isinstance(model, (str, Path)):
        model_dir = Path(model)
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(model_dir_problem(model_dir))
        tokenizer = model_dir if tokenizer is None else tokenizer
        model = load_model(model_dir)
    elif tokenizer is None:
        raise ValueError("a model given as an object needs tokenizer=DIR (a directory holding tokenizer.json)")
    config = model.config.to_hybrid()
    check_exportable(config)
    vocab = read_vocab(Path(tokenizer), config.vocab_size)
    tensors = gguf_tensors(model.state_dict(), config)

    staged = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        _write(staged, config, tensors, vocab, dtype)
        os.replace(staged, out)
    except BaseException:
        staged.unlink(missing_ok=True)
        raise
    fsync_dir(out.parent)
    return out


# ---------------------------------------------------------------------------------------------- what llama.cpp runs
def check_exportable(config: HybridConfig) -> None:
    """ValueError naming the first field that llama.cpp's falcon-h1 cannot run as our model does."""
    try:
        config_to_falcon_h1(config)  # Mamba-2 SSM half, attention on and full (no window), SA_M blocks, an MLP
    except ValueError as err:
        raise ValueError(f"cannot export to GGUF falcon-h1: {err}") from None
    refusals = (
        # its graph adds attn_output without its bias, and has no bias slot for the SSM projections
        ("attention_bias", config.attention_bias, "llama.cpp's falcon-h1 drops the attention output bias"),
        ("mamba_proj_bias", config.mamba_proj_bias, "llama.cpp's falcon-h1 has no ssm_in bias"),
        ("projectors_bias", config.projectors_bias, "llama.cpp's falcon-h1 has no ssm_out bias"),
        # its Mamba-2 gates y * SiLU(z) first, then applies the grouped RMS norm
        ("mamba_norm_before_gate", config.mamba_rms_norm and config.mamba_norm_before_gate,
         "llama.cpp's falcon-h1 gates before its grouped RMS norm (needs mamba_norm_before_gate=False)"),
        # its dt is softplus(dt + dt_bias), never clamped
        ("time_step_limit", tuple(config.time_step_limit) != (0.0, float("inf")),
         "llama.cpp's falcon-h1 never clamps dt (needs (0.0, inf))"),
    )
    for field, refused, why in refusals:
        if refused:
            raise ValueError(f"cannot export to GGUF falcon-h1: {field}={getattr(config, field)!r}: {why}")


# ---------------------------------------------------------------------------------------------- tensors
def gguf_tensors(state: dict[str, torch.Tensor], config: HybridConfig) -> dict[str, torch.Tensor]:
    """GGUF name -> float32 tensor in llama.cpp's layout (torch order: GGUF's `ne` is this shape reversed), with the
    muP multipliers folded in. `state`: a HybridForCausalLM state dict."""
    falcon = state_dict_to_falcon_h1(state)
    if config.tie_word_embeddings:
        # no output.weight: llama.cpp reads token_embd, right only when the two multipliers agree
        head = falcon.pop("lm_head.weight", falcon["model.embed_tokens.weight"])
        if config.lm_head_multiplier != config.embedding_multiplier:
            falcon["lm_head.weight"] = head
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.FALCON_H1, config.num_hidden_layers)
    out: dict[str, torch.Tensor] = {}
    for key, value in falcon.items():
        # llama.cpp's converter renames dt_bias to the Mamba-1 name its table knows
        source = key.replace(".mamba.dt_bias", ".mamba.dt_proj.bias")
        name = names.get_name(source, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"no GGUF falcon-h1 tensor for weight {key!r}")
        value = value.detach().to("cpu", torch.float64) * _multiplier(key, config)
        out[name] = _llama_layout(key, value, config).to(torch.float32).contiguous()
    if not config.mamba_conv_bias:  # llama.cpp adds ssm_conv1d.bias unconditionally: zeros are the same model
        channels = config.mamba_d_ssm + 2 * config.mamba_n_groups * config.mamba_d_state
        for i in range(config.num_hidden_layers):
            out[f"blk.{i}.ssm_conv1d.bias"] = torch.zeros(channels)
    return out


def _multiplier(key: str, c: HybridConfig) -> float | torch.Tensor:
    """The muP multiplier that scales the output of weight `key` (a falcon_h1 name); a [rows, 1] column for the
    SSM in_proj, whose rows are [z | x | B | C | dt]; 1.0 for a weight without one."""
    if key == "model.embed_tokens.weight":
        return c.embedding_multiplier
    if key == "lm_head.weight":
        return c.lm_head_multiplier
    inner = key.split(".", 3)[-1]  # after "model.layers.<i>."
    if inner == "mamba.in_proj.weight":
        widths = (c.mamba_d_ssm, c.mamba_d_ssm, c.mamba_n_groups * c.mamba_d_state,
                  c.mamba_n_groups * c.mamba_d_state, c.mamba_n_heads)
        rows = [torch.full((width,), c.ssm_in_multiplier * m, dtype=torch.float64)
                for width, m in zip(widths, c.ssm_multipliers)]
        return torch.cat(rows).unsqueeze(1)  # [2*d_ssm + 2*G*N + H, 1]
    return {
        "self_attn.q_proj.weight": c.attention_in_multiplier,
        "self_attn.k_proj.weight": c.attention_in_multiplier * c.key_multiplier,
        "self_attn.v_proj.weight": c.attention_in_multiplier,
        "self_attn.o_proj.weight": c.attention_out_multiplier,
        "mamba.out_proj.weight": c.ssm_out_multiplier,
        "feed_forward.gate_proj.weight": c.mlp_multiplier_gate,
        "feed_forward.gate_proj.bias": c.mlp_multiplier_gate,
        "feed_forward.down_proj.weight": c.mlp_multiplier_down,
        "feed_forward.down_proj.bias": c.mlp_multiplier_down,
    }.get(inner, 1.0)


def _llama_layout(key: str, value: torch.Tensor, c: HybridConfig) -> torch.Tensor:
    """The shape (and, for A, the form) llama.cpp's falcon-h1 loads."""
    if key.endswith(".mamba.conv1d.weight"):
        return value.squeeze(1)  # [C, 1, K] -> [C, K]
    if key.endswith(".mamba.A_log"):
        return -torch.exp(value).unsqueeze(1)  # A = -exp(A_log): [H] -> [H, 1]
    if key.endswith(".mamba.D"):
        return value.unsqueeze(1)  # [H] -> [H, 1]
    if key.endswith(".mamba.norm.weight"):
        return value.view(c.mamba_n_groups, c.mamba_d_ssm // c.mamba_n_groups)  # [d_ssm] -> [G, d_ssm / G]
    return value


def tensor_type(name: str, ndim: int, dtype: str) -> gguf.GGMLQuantizationType:
    """The encoding llama.cpp's converter gives tensor `name` for `dtype`: float32 for vectors, norms, the SSM conv
    and every tensor not named *.weight (ssm_a, ssm_d, blk.<i>.ffn_norm); `dtype` for the weight matrices."""
    if ndim <= 1 or name.endswith("_norm.weight") or ".ssm_conv1d." in name or not name.endswith(".weight"):
        return _Q.F32
    return _FILE_TYPES[dtype][1]


def _encode(name: str, value: torch.Tensor, dtype: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """The tensor's bytes and encoding; a q8_0 matrix whose rows are not whole 32-value blocks falls back to f16, as
    in llama.cpp's converter."""
    qtype = tensor_type(name, value.dim(), dtype)
    array = value.numpy()
    try:
        return gguf.quants.quantize(array, qtype), qtype
    except gguf.QuantError:
        return gguf.quants.quantize(array, _Q.F16), _Q.F16


# ---------------------------------------------------------------------------------------------- tokenizer
@dataclass
class Vocab:
    """The tokenizer as GGUF holds it: one token and one type per embedding row, plus merges, special ids and the
    chat template (`special`, read by the gguf package from tokenizer.json and tokenizer_config.json)."""

    tokens: list[str]
    types: list[int]
    special: gguf.SpecialVocab


def read_vocab(directory: Path, n_vocab: int) -> Vocab:
    """The byte-level BPE in `directory`/tokenizer.json, padded to the model's `n_vocab` rows with unused tokens."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: no tokenizer.json; pass the tokenizer directory (--tokenizer DIR)")
    spec = json.loads(path.read_text(encoding="utf-8"))
    kind = (spec.get("model") or {}).get("type")
    if kind != "BPE":
        raise ValueError(f"{path}: model.type is {kind!r}; GGUF falcon-h1 holds a byte-level BPE (tokenizer.ggml.model "
                         "'gpt2')")
    if spec.get("normalizer"):
        raise ValueError(f"{path}: normalizer {spec['normalizer'].get('type')!r}: llama.cpp's BPE applies none")
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    largest = max(vocab.values())
    if largest >= n_vocab:
        raise ValueError(f"{path}: token id {largest} is outside the model's vocab_size {n_vocab}; is this the "
                         "model's tokenizer?")
    added = tokenizer.get_added_tokens_decoder()
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]  # rows no token uses, named as llama.cpp's converter names them
    types = [gguf.TokenType.UNUSED] * n_vocab
    for text, i in vocab.items():
        tokens[i] = text
        types[i] = (gguf.TokenType.NORMAL if i not in added
                    else gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
    special = gguf.SpecialVocab(directory, load_merges=bool(spec["model"].get("merges")), n_vocab=n_vocab)
    # Our tokenizers add no BOS when encoding; llama.cpp's falcon-h1 pre-tokenizer would add one by default.
    special.add_special_token.setdefault("bos", False)
    own = directory / "chat_template.jinja"  # what transformers reads before tokenizer_config.json's template
    if own.is_file():
        special.chat_template = own.read_text(encoding="utf-8")
    special.chat_template = _inference_template(special.chat_template)
    return Vocab(tokens, [int(t) for t in types], special)


def _inference_template(template: str | list | None) -> str | list | None:
    """The chat template (or transformers' list of named ones) without the training-only {% generation %} tags, which
    llama.cpp's and other engines' Jinja do not parse (`without_generation_tags`: the same rendering)."""
    if isinstance(template, str):
        return without_generation_tags(template)
    if isinstance(template, list):
        return [{**item, "template": without_generation_tags(item["template"])}
                if isinstance(item, dict) and isinstance(item.get("template"), str) else item for item in template]
    return template


# ---------------------------------------------------------------------------------------------- the file
def _write(path: Path, c: HybridConfig, tensors: dict[str, torch.Tensor], vocab: Vocab, dtype: str) -> None:
    writer = gguf.GGUFWriter(path, ARCH)
    try:
        writer.add_type(gguf.GGUFType.MODEL)
        writer.add_file_type(_FILE_TYPES[dtype][0])
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        writer.add_vocab_size(c.vocab_size)
        writer.add_context_length(c.max_position_embeddings)
        writer.add_embedding_length(c.hidden_size)
        writer.add_feed_forward_length(c.intermediate_size)
        writer.add_block_count(c.num_hidden_layers)
        writer.add_head_count(c.num_attention_heads)
        writer.add_head_count_kv(c.num_key_value_heads)
        writer.add_key_length(c.head_dim)
        writer.add_value_length(c.head_dim)
        writer.add_layer_norm_rms_eps(c.rms_norm_eps)
        writer.add_rope_freq_base(c.rope_theta)
        writer.add_ssm_conv_kernel(c.mamba_d_conv)
        writer.add_ssm_inner_size(c.mamba_d_ssm)
        writer.add_ssm_state_size(c.mamba_d_state)
        writer.add_ssm_time_step_rank(c.mamba_n_heads)
        writer.add_ssm_group_count(c.mamba_n_groups)

        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(PRE_TOKENIZER)
        writer.add_token_list(vocab.tokens)
        writer.add_token_types(vocab.types)
        if not vocab.special.merges:
            # A bytes-only vocabulary (the demo's) has no merges, but llama.cpp refuses a BPE file without the key and
            # the gguf package writes no empty list: one merge that never applies stands for none.
            writer.add_token_merges([NO_MERGE])
        vocab.special.add_to_gguf(writer, quiet=True)

        for name, value in tensors.items():
            data, qtype = _encode(name, value, dtype)
            writer.add_tensor(name, data, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
