"""What the `hybridlm sft` / `dpo` / `chat` tests share: a model directory as a `hybridlm train` run's final/ holds
it (a tiny hybrid, our tokenizer with its chat template), built in seconds."""

from __future__ import annotations

from pathlib import Path

import torch

from hybridlm.data.chat import demo_conversations
from hybridlm.data.tokenizer import fixed_tokens, train_tokenizer
from hybridlm.models.config import HybridConfig
from hybridlm.models.model import HybridForCausalLM


def make_model_dir(root: Path, *, ssm: str = "mamba2", seed: int = 0, merges: int = 64) -> Path:
    """`root/model`: a 2-layer hybrid (Mamba-2 or Falcon-1A SSM half) over a byte-level BPE tokenizer trained on the
    demo conversations (no reserved tokens: ~330 ids), saved with `save_pretrained` beside the tokenizer's files."""
    root.mkdir(parents=True, exist_ok=True)
    texts = root / "texts.jsonl"
    import json

    with open(texts, "w") as f:
        for c in demo_conversations(200, seed=1):
            for m in c["messages"]:
                f.write(json.dumps({"text": m["content"]}) + "\n")
    model_dir = root / "model"
    tok = train_tokenizer([texts], len(fixed_tokens(0)) + 256 + merges, model_dir, num_reserved=0)
    fields = dict(
        vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, mamba_d_ssm=32, mamba_n_heads=2, mamba_d_head=16, mamba_d_state=8,
        mamba_chunk_size=16, pad_token_id=tok.pad_id, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
        max_position_embeddings=512,
    )
    if ssm != "mamba2":
        fields.update(ssm_mixer="fast_weight", fw_rule=ssm)
    torch.manual_seed(seed)
    HybridForCausalLM(HybridConfig(**fields)).save_pretrained(model_dir)
    return model_dir
