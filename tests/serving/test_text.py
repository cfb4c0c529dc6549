"""Reply text: the engine's decoder equals the tokenizer's decode, whichever way it takes."""

from __future__ import annotations

import functools
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from hybridlm.serving.engine import text_decoder

SPECIALS = ("<|pad|>", "<|begin_of_text|>", "<|end_of_text|>")


def byte_level_tokenizer(*, clean_up: bool) -> PreTrainedTokenizerFast:
    """Byte-level BPE with merges, special tokens and tokens that split characters (what streaming text must
    survive)."""
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(["hello world , it is 3.14 ; ça va ? 日本語 text ."] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token=SPECIALS[0], bos_token=SPECIALS[1],
                                   eos_token=SPECIALS[2], clean_up_tokenization_spaces=clean_up)


@pytest.mark.parametrize("clean_up", [False, True])
def test_text_decoder_equals_the_tokenizers_decode(clean_up):
    tokenizer = byte_level_tokenizer(clean_up=clean_up)
    decode = text_decoder(tokenizer)
    direct = isinstance(decode, functools.partial) and decode.func == tokenizer.backend_tokenizer.decode
    assert direct is not clean_up  # the backend directly exactly when no spaces are cleaned up
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(0, 12))]
        assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=True)
    assert text_decoder(None)([1, 2]) == ""
