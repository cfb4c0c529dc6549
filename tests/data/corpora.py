"""Tiny seeded corpora for the data tests: English-like text with punctuation and numbers, Chinese with
full-width punctuation, and LaTeX."""

from __future__ import annotations

import json
import random
from pathlib import Path

VOCAB_SIZE = 1800  # 1,560 fixed tokens (specials, reserved, LaTeX, bytes) + ~240 merges

_WORDS = ("the model data token train layer state attention memory value query key number system "
          "simple example result paper method first second large small fast slow window").split()
_CJK = "你好 世界 我们 朋友 学习 数据 模型 语言 今天 天气 很好 中文 问题 答案".split()
_LATEX = [r"$\frac{a}{b}$", r"\sqrt{x^2 + 1}", r"\alpha + \beta = \gamma", r"\sum_{i=1}^{n} x_i",
          r"\begin{equation} E = mc^2 \end{equation}", r"\int_0^\infty e^{-x} dx", r"x \in \mathbb{R}"]


def english(rng: random.Random, n_words: int) -> str:
    out = []
    for i in range(n_words):
        w = rng.choice(_WORDS)
        if i == 0 or out[-1].endswith("."):
            w = w.capitalize()
        r = rng.random()
        if r < 0.1:
            w = f"({w})"
        elif r < 0.2:
            w += ","
        elif r < 0.3:
            w += "."
        elif r < 0.35:
            w = f'"{w}"'
        elif r < 0.45:
            w = str(rng.choice([2024, 1999, 3, 42, 100, 2023, 12345]))
        out.append(w)
    return " ".join(out)


def chinese(rng: random.Random, n_words: int) -> str:
    return "".join(rng.choice(_CJK) + rng.choice(["", "", "，", "。", "、", "！"]) for _ in range(n_words))


def document(rng: random.Random, n_words: int) -> str:
    parts = [english(rng, n_words)]
    if rng.random() < 0.3:
        parts.append(chinese(rng, max(2, n_words // 4)))
    if rng.random() < 0.3:
        parts.append(rng.choice(_LATEX))
    return "\n".join(parts)


def documents(seed: int, n_docs: int, lo: int = 5, hi: int = 80) -> list[str]:
    rng = random.Random(seed)
    return [document(rng, rng.randint(lo, hi)) for _ in range(n_docs)]


def write_txt_tree(root: Path, docs: list[str]) -> Path:
    for i, d in enumerate(docs):
        p = root / f"part{i % 3}" / f"doc{i:04d}.txt"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(d, encoding="utf-8")
    return root


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, field: d}, ensure_ascii=False) + "\n")
    return path
