"""Model names of the benchmark lists -> small `HybridConfig`s that share one size.

    task_config("fw-3A", vocab_size=16)                  # Falcon-3A, window 3, shifted pair, SSM + MLP blocks
    task_config("hybrid:mamba2", vocab_size=16, size="tiny")

Grammar (case of the rule as written: "1A", "3A"; "-" or ":" after "hybrid"):

    transformer                      attention (RoPE, theta 1e4) + MLP, no SSM
    mamba2                           Mamba-2 + MLP, no attention (Falcon-H1's Mamba-2 init: A = -(1..H), dt = 1.31)
    mamba2-ref                       the same with Mamba-2's reference init (A = -U[1, 16], dt log-uniform in
                                     [1e-3, 1e-1]: `HybridConfig.mamba_init`), the paper baselines' Mamba-2
    fw-<rule>[-w<B>][-same|-shifted][-eta|-nlms]
                                     Falcon fast-weight rule 1 | 2 | 3 | 1A | 2A | 3A + MLP, no attention;
                                     window B (default 3 for the sliding rules 3 / 3A, else 1); pairing
                                     shifted (default; the write pair (k_{t-1}, v_t)) or same_step
                                     (k_t, v_t); step size nlms (ctx-beta, default) or eta (ctx-eta, the
                                     paper's ".2"/".3" variants: `fw_step_size="direct"`)
    fw-1A.1 | fw-1A.2 | fw-1A.3 | fw-3A.3
                                     the fast-weight paper's named variants (Tables 1-3; `PAPER_SSMS`): rule 1A or
                                     3A (window 4), shifted pair, ridge scaled by the key energy (its "scaled
                                     formulation", 4.1 / C.1); ".1" QK-l2 with ctx-beta, ".2" QK-l2 with ctx-eta,
                                     ".3" QK-RMSNorm with ctx-eta; every one with ctx-lambda
    retnet                           RetNet's retention as Falcon-1A: same-step pair, step 1 and the fixed per-head
                                     decays gamma_h = 1 - 2^(-5-h) (`fw_gates="fixed"`, `fw_step_size="direct"`),
                                     no QK normalization
    hybrid-<ssm> | hybrid:<ssm>      attention heads and the SSM side by side (Falcon-H1 SA_M block)

Every model of one size has the same residual width, depth, MLP and per-mixer widths (the SSM half is
`mamba_d_ssm` channels whichever mixer fills it), so a hybrid has both mixers' parameters: the
comparison holds the mixers' widths fixed, not the total count (`parameter_count` reports it).

Sizes (`SIZES`):
    "small"  d_model 256, 4 blocks, MLP 768; attention 4 heads x 64; SSM 512 channels = 8 heads x 64,
             Mamba-2 d_state 64 (3.4M parameters for the transformer to 6.1M for a fast-weight hybrid):
             the GPU recipe of the benchmarks
    "medium" d_model 512, 8 blocks, MLP 1536; attention 8 heads x 64; SSM 1024 channels = 16 heads x 64
             (about 8x "small"): for tasks the small size does not learn
    "base"   d_model 768, 12 blocks, MLP 2304; attention 12 heads x 64; SSM 1536 channels = 24 heads x 64
             (92M parameters for the transformer, 108M Mamba-2, 135M a fast-weight model): the depth and width of the
             fast-weight paper's 124M-130M language models, whose names its addition table (Table 3) reuses
    "lm130m" d_model 768, 12 blocks, MLP 2048; every mixer 768 channels = 12 heads x 64 (attention, fast weight,
             Mamba-2 with d_state 128): the non-embedding size of the paper's 124M Transformer (85M here) and 130M
             fast-weight models (92M here), whose totals include a 50,257-token tied embedding (38.6M)
    "tiny"   d_model 32, 2 blocks: CPU smoke tests only
"""

from __future__ import annotations

import re
from typing import Any

from hybridlm.models.config import HybridConfig
from hybridlm.ops.fast_weight import RULES as FW_RULES

SIZES: dict[str, dict[str, Any]] = {
    "small": dict(
        hidden_size=256, num_hidden_layers=4, intermediate_size=768, num_attention_heads=4, num_key_value_heads=4,
        head_dim=64, mamba_d_ssm=512, mamba_n_heads=8, mamba_d_head=64, mamba_d_state=64, mamba_chunk_size=64,
    ),
    "medium": dict(
        hidden_size=512, num_hidden_layers=8, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=8,
        head_dim=64, mamba_d_ssm=1024, mamba_n_heads=16, mamba_d_head=64, mamba_d_state=64, mamba_chunk_size=64,
    ),
    "base": dict(
        hidden_size=768, num_hidden_layers=12, intermediate_size=2304, num_attention_heads=12, num_key_value_heads=12,
        head_dim=64, mamba_d_ssm=1536, mamba_n_heads=24, mamba_d_head=64, mamba_d_state=64, mamba_chunk_size=64,
    ),
    "lm130m": dict(
        hidden_size=768, num_hidden_layers=12, intermediate_size=2048, num_attention_heads=12, num_key_value_heads=12,
        head_dim=64, mamba_d_ssm=768, mamba_n_heads=12, mamba_d_head=64, mamba_d_state=128, mamba_chunk_size=64,
    ),
    "tiny": dict(
        hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2,
        head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16,
    ),
}
COMMON: dict[str, Any] = dict(rope_theta=1e4, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                              eos_token_id=2, max_position_embeddings=65536)
SLIDING_DEFAULT_WINDOW = 3
_PAPER_FW = dict(ssm_mixer="fast_weight", fw_pairing="shifted", fw_ridge_scaling=True, fw_gates="context")
PAPER_SSMS: dict[str, dict[str, Any]] = {  # the fast-weight paper's named rows (Tables 1-3) and its RetNet baseline
    "fw-1A.1": dict(_PAPER_FW, fw_rule="1A", fw_window=1, fw_qk_norm="l2", fw_step_size="nlms"),
    "fw-1A.2": dict(_PAPER_FW, fw_rule="1A", fw_window=1, fw_qk_norm="l2", fw_step_size="direct"),
    "fw-1A.3": dict(_PAPER_FW, fw_rule="1A", fw_window=1, fw_qk_norm="rms", fw_step_size="direct"),
    "fw-3A.3": dict(_PAPER_FW, fw_rule="3A", fw_window=4, fw_qk_norm="rms", fw_step_size="direct"),
    "retnet": dict(ssm_mixer="fast_weight", fw_rule="1A", fw_window=1, fw_pairing="same_step", fw_qk_norm="none",
                   fw_step_size="direct", fw_gates="fixed", fw_ridge_scaling=False),
}
_PAPER_LABELS = {"fw-1A.1": "Falcon-1A.1 (QK-l2, ctx-beta / ctx-lambda)",
                 "fw-1A.2": "Falcon-1A.2 (QK-l2, ctx-eta / ctx-lambda)",
                 "fw-1A.3": "Falcon-1A.3 (QK-RMSNorm, ctx-eta / ctx-lambda)",
                 "fw-3A.3": "Falcon-3A.3 (B=4, QK-RMSNorm, ctx-eta / ctx-lambda)",
                 "retnet": "RetNet (fixed decays, as Falcon-1A same-step)"}
_FW = re.compile(r"^fw-(?P<rule>1A|2A|3A|1|2|3)(?P<opts>(-[a-z0-9]+)*)$")


def ssm_fields(name: str) -> dict[str, Any]:
    """HybridConfig fields of an SSM name without "hybrid": "mamba2" or "fw-..." (see the module docstring)."""
    if name in ("mamba2", "mamba2-ref"):
        return {"ssm_mixer": "mamba2", "mamba_init": "mamba2" if name == "mamba2-ref" else "falcon_h1"}
    if name in PAPER_SSMS:
        return dict(PAPER_SSMS[name])
    match = _FW.match(name)
    if match is None:
        raise ValueError(
            f"unknown model name {name!r}; use transformer, mamba2, mamba2-ref, "
            "fw-<rule>[-w<B>][-same|-shifted][-eta|-nlms] "
            f"(rule in {', '.join(FW_RULES)}), {', '.join(PAPER_SSMS)} or hybrid-<one of those SSMs>"
        )
    rule = match["rule"]
    fields: dict[str, Any] = {"ssm_mixer": "fast_weight", "fw_rule": rule, "fw_pairing": "shifted",
                              "fw_step_size": "nlms", "fw_window": SLIDING_DEFAULT_WINDOW if rule in ("3", "3A") else 1}
    for option in filter(None, match["opts"].split("-")):
        if re.fullmatch(r"w\d+", option):
            fields["fw_window"] = int(option[1:])
            if fields["fw_window"] < 1:
                raise ValueError(f"model {name!r}: the window of -w<B> must be >= 1, got {option!r}")
        elif option in ("same", "shifted"):
            fields["fw_pairing"] = "same_step" if option == "same" else "shifted"
        elif option in ("eta", "nlms"):
            fields["fw_step_size"] = "direct" if option == "eta" else "nlms"
        else:
            raise ValueError(f"model {name!r}: unknown option {option!r} (w<B>, same, shifted, eta, nlms)")
    if fields["fw_window"] > 1 and rule not in ("3", "3A"):
        raise ValueError(f"model {name!r}: a window needs a sliding rule (3 or 3A), not {rule}")
    return fields


def model_fields(name: str) -> dict[str, Any]:
    """The mixer fields of a benchmark model name (no sizes)."""
    name = name.strip()
    if name == "transformer":
        return {"ssm_mixer": "none", "use_attention": True}
    for prefix in ("hybrid-", "hybrid:"):
        if name.startswith(prefix):
            return {**ssm_fields(name[len(prefix):]), "use_attention": True}
    return {**ssm_fields(name), "use_attention": False}


def task_config(name: str, *, vocab_size: int, size: str = "small", **overrides: Any) -> HybridConfig:
    """A HybridConfig for model `name` at `size` with `vocab_size` tokens (pad 0, bos 1, eos 2)."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    fields = {**COMMON, **SIZES[size], **model_fields(name), "vocab_size": vocab_size, **overrides}
    return HybridConfig.from_dict(fields)


def describe(name: str) -> str:
    """A readable label: "Falcon-3A (B=3, shifted, ctx-beta)", "Transformer (RoPE)", "hybrid: attention + Mamba-2"."""
    fields = model_fields(name)
    ssm_name = name.strip().replace("hybrid:", "hybrid-", 1).removeprefix("hybrid-")
    if fields["ssm_mixer"] == "none":
        return "Transformer (RoPE)"
    if ssm_name in _PAPER_LABELS:
        ssm = _PAPER_LABELS[ssm_name]
    elif fields["ssm_mixer"] == "mamba2":
        ssm = "Mamba-2" if fields["mamba_init"] == "falcon_h1" else "Mamba-2 (reference init)"
    else:
        window = f"B={fields['fw_window']}, " if fields["fw_window"] > 1 else ""
        pairing = "shifted" if fields["fw_pairing"] == "shifted" else "same-step"
        step = "ctx-eta" if fields["fw_step_size"] == "direct" else "ctx-beta"
        ssm = f"Falcon-{fields['fw_rule']} ({window}{pairing}, {step})"
    return f"hybrid: attention + {ssm}" if fields["use_attention"] else ssm


def build_model(config: HybridConfig, *, seed: int):
    """A freshly initialized `HybridForCausalLM` (torch seeded with `seed` first)."""
    import torch

    from hybridlm.models.model import HybridForCausalLM

    torch.manual_seed(seed)
    return HybridForCausalLM(config)


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def run_record(model_name: str, seed: int, model, trained) -> dict:
    """What every model-and-seed run's JSON starts with: the model name, the seed, the parameter count, and the
    training record (`trained`, a `TrainResult`: losses, evaluations, best step)."""
    return {"model": model_name, "seed": seed, "parameters": parameter_count(model), "train": trained.to_dict(),
            "best_step": trained.best_step}


def parse_model_list(text: str) -> list[str]:
    """"fw-1A,fw-3A mamba2" -> names (commas or spaces), each checked; duplicates raise (also "hybrid:X" with
    "hybrid-X": one model, whose runs would share their names)."""
    names = [n for n in re.split(r"[,\s]+", text.strip()) if n]
    if not names:
        raise ValueError("the model list is empty; give --models names, e.g. fw-3A,transformer")
    for n in names:
        model_fields(n)
    seen: dict[str, str] = {}  # "hybrid-X" -> the name as written
    for n in names:
        key = n.replace("hybrid:", "hybrid-", 1)
        if key in seen:
            twice = n if seen[key] == n else f"{seen[key]} and {n} (one model)"
            raise ValueError(f"the model list repeats a name: {twice}; give each model once")
        seen[key] = n
    return names
