"""What the TRL / PEFT tests share: a tiny byte-level tokenizer with our chat template (whose `{% generation %}` tags
mark the assistant's tokens for `assistant_only_loss`), a tiny hybrid sized to it, and a few seeded examples."""

from __future__ import annotations

import pytest
import torch

from hybridlm.data.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, fixed_tokens, train_from_texts
from hybridlm.models.config import HybridConfig
from hybridlm.models.model import HybridForCausalLM

SPECIAL = dict(SPECIAL_TOKENS)
QUESTIONS = ["what is two plus two", "name a colour", "say hello", "count to three"]
ANSWERS = ["four", "blue", "hello there", "one two three"]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import PreTrainedTokenizerFast

    # Bytes and the named specials only (no merges): ~290 ids, every text encodable.
    raw = train_from_texts(QUESTIONS + ANSWERS, vocab_size=len(fixed_tokens(0)) + 257, num_reserved=0)
    return PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token=SPECIAL["bos"], eos_token=SPECIAL["eos"], pad_token=SPECIAL["pad"],
        chat_template=CHAT_TEMPLATE,
    )


def tiny_model(tokenizer, seed: int = 0, **changes) -> HybridForCausalLM:
    """A 2-layer Falcon-H1 hybrid (attention + Mamba-2 by default) over the tokenizer's ids, in float32."""
    fields = dict(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, mamba_d_ssm=32, mamba_n_heads=2, mamba_d_head=16, mamba_d_state=8,
        mamba_chunk_size=16, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    fields.update(changes)
    torch.manual_seed(seed)
    return HybridForCausalLM(HybridConfig(**fields))


@pytest.fixture
def make_model():
    return tiny_model


def conversations(repeat: int = 4) -> list[dict]:
    return [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
        for q, a in zip(QUESTIONS * repeat, ANSWERS * repeat)
    ]


def prompt_completions(repeat: int = 4) -> list[dict]:
    return [{"prompt": q + "?", "completion": " " + a} for q, a in zip(QUESTIONS * repeat, ANSWERS * repeat)]


def preferences(repeat: int = 2) -> list[dict]:
    wrong = ANSWERS[1:] + ANSWERS[:1]
    return [
        {"prompt": q + "?", "chosen": " " + a, "rejected": " " + w}
        for q, a, w in zip(QUESTIONS * repeat, ANSWERS * repeat, wrong * repeat)
    ]


@pytest.fixture
def data():
    return dict(conversations=conversations, prompt_completions=prompt_completions, preferences=preferences)
