"""The tiny Falcon-H1 hybrids, tokenizers and checkpoint dirs the export tests share."""

from __future__ import annotations

from pathlib import Path

from hybridlm.data.tokenizer import SPECIAL_TOKENS, HybridTokenizer, fixed_tokens, train_from_texts
from hybridlm.models.model import HybridForCausalLM
from hybridlm.training.demo import build_byte_tokenizer, stdlib_sources
from tests.models.helpers import make_model

# Every muP multiplier away from 1 and from the others, so that a multiplier folded into the wrong weight shows.
MULTIPLIERS = dict(
    embedding_multiplier=2.0, lm_head_multiplier=0.5, key_multiplier=0.5, attention_in_multiplier=0.7,
    attention_out_multiplier=1.3, ssm_in_multiplier=0.8, ssm_out_multiplier=0.6, ssm_multiplier_z=1.1,
    ssm_multiplier_x=0.9, ssm_multiplier_B=1.25, ssm_multiplier_C=0.75, ssm_multiplier_dt=1.5,
    mlp_multiplier_gate=1.2, mlp_multiplier_down=0.8,
)
BYTE_VOCAB = 300  # the demo's 259 byte-tokenizer ids, then 41 rows no token uses


def falcon_model(seed: int = 0, **changes) -> HybridForCausalLM:
    """A seeded 2-layer hybrid in the arrangement llama.cpp's falcon-h1 runs: GQA attention, grouped Mamba-2 with its
    RMS norm after the gate, an MLP with biases, every multiplier set; vocab BYTE_VOCAB. `changes` override fields."""
    fields = dict(vocab_size=BYTE_VOCAB, mamba_norm_before_gate=False, mlp_bias=True, **MULTIPLIERS)
    return make_model(seed, **{**fields, **changes})


def byte_tokenizer(directory: Path) -> Path:
    """The `hybridlm train` demo's byte tokenizer, saved in `directory`."""
    build_byte_tokenizer().save(directory)
    return directory


def bpe_tokenizer(directory: Path, *, merges: int = 300) -> HybridTokenizer:
    """Our BPE (the `hybridlm tokenizer train` pipeline: pre-tokenizer, LaTeX tokens, specials) with `merges` merges
    learned from ~200 KB of the demo corpus and 8 reserved tokens instead of 1,024 (to stay small); saved in
    `directory`."""
    texts = [path.read_text(encoding="utf-8", errors="replace") for path in stdlib_sources(200_000)]
    trained = train_from_texts(texts, len(fixed_tokens(8)) + 256 + merges, num_reserved=8)
    tok = HybridTokenizer(trained, {"special_tokens": {name: i for i, (name, _) in enumerate(SPECIAL_TOKENS)}})
    tok.save(directory)
    return tok


def checkpoint_dir(model: HybridForCausalLM, tokenizer_dir: Path, directory: Path, *, fmt: str = "hybridlm") -> Path:
    """`model` saved in `directory` (format "hybridlm" or "falcon_h1") with the tokenizer's files beside it, as
    `hybridlm train` leaves final/."""
    model.save_pretrained(directory, format=fmt)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_text((tokenizer_dir / name).read_text(encoding="utf-8"), encoding="utf-8")
    return directory

