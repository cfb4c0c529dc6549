"""The exported file run by llama.cpp itself (llama-cpp-python, built from source; skipped when not installed):
next-token logits and greedy continuations equal ours, and its tokenization of text equals our tokenizers'."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridlm.data.tokenizer import HybridTokenizer
from hybridlm.export.gguf import export_gguf
from tests.export.helpers import bpe_tokenizer, byte_tokenizer, falcon_model

llama_cpp = pytest.importorskip("llama_cpp")

GREEDY_TOKENS = 32
TEXTS = (
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "camelCase HTTPServer x2024 = 3.14159; don't (word) [1, 22, 333]",
    "Émile's café — naïve façade, 東京 2024!\r\n\ttabs  and   spaces \n\n",
    "\\frac{1}{2} + \\alpha\\beta \\infty \\input{x} <|end_of_text|> stays text",
)


def _llama(path, **kwargs):
    return llama_cpp.Llama(model_path=str(path), n_ctx=256, n_batch=256, n_threads=1, verbose=False, **kwargs)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(our model, llama.cpp's Llama) of the tiny random hybrid exported to f32 with the demo's byte tokenizer."""
    directory = tmp_path_factory.mktemp("llama")
    model = falcon_model(seed=1)
    path = export_gguf(model, directory / "m.gguf", tokenizer=byte_tokenizer(directory / "tok"))
    return model, _llama(path, logits_all=True)


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, 259, (n,), generator=generator).tolist() for n in (1, 7, 33)]


def test_next_token_logits(exported):
    model, llm = exported
    for ids in _prompts():
        llm.reset()
        llm.eval(ids)
        theirs = torch.tensor(np.asarray(llm.scores[: len(ids)]), dtype=torch.float64)  # [T, vocab]
        with torch.no_grad():
            ours = model(torch.tensor([ids])).logits[0].double()  # [T, vocab]
        difference = (theirs - ours).abs().max(-1).values  # per position
        error = (difference / ours.abs().max(-1).values).max().item()
        print(f"prompt of {len(ids)} tokens: max |logit difference| {difference.max().item():.2e}, "
              f"relative to max |logit| {error:.2e}")
        assert error < 1e-3


def test_greedy_continuation(exported):
    model, llm = exported
    for ids in _prompts():
        llm.reset()
        llm.eval(ids)
        theirs = []
        for _ in range(GREEDY_TOKENS):
            theirs.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval([theirs[-1]])
        ours = model.generate(torch.tensor([ids]), max_new_tokens=GREEDY_TOKENS, do_sample=False)[0, len(ids):]
        assert theirs == ours.tolist()


@pytest.mark.parametrize("kind", ["demo-bytes", "bpe"])
def test_tokenization_matches(tmp_path, kind):
    """The demo's byte tokenizer, and our trained BPE with its pre-tokenizer and LaTeX tokens (llama.cpp splits text
    with its own falcon-h1 pattern, then applies our merges)."""
    tok = bpe_tokenizer(tmp_path / "tok") if kind == "bpe" else HybridTokenizer.load(byte_tokenizer(tmp_path / "tok"))
    path = export_gguf(falcon_model(vocab_size=max(tok.vocab_size, 300)), tmp_path / "m.gguf", tokenizer=tmp_path / "tok")
    llm = _llama(path, vocab_only=True)
    for text in TEXTS:
        assert llm.tokenize(text.encode("utf-8"), add_bos=False, special=False) == tok.encode(text), text
        assert llm.detokenize(tok.encode(text)).decode("utf-8") == text
