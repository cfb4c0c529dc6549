"""Perplexity and bits per byte of a model on prepared shards (`hybridlm eval ppl`).

    result = evaluate_perplexity(model, TokenDataset("data/val"), seq_len=2048, byte_lengths=lengths)
    result["perplexity"], result["bits_per_byte"]

What is counted. Documents are read in order: all of them, or whole documents until `max_tokens`
tokens are read (the one that reaches the count is read whole: every document is scored alike). Every
token of a document except its first is a target, EOS included; the first has no context inside its
document and is not scored. A document longer than `seq_len` is cut into
windows of `seq_len` tokens that overlap by one token (window w starts at w (seq_len - 1)), so each
target is predicted exactly once, from the start of its window. Windows are packed into rows of
`seq_len` tokens with `position_ids` restarting at 0 at every window (and a padding segment at the
end of a row), so no token sees another document or window: the model runs them as one packed batch.

    loss (nats / token) = sum of -log p(target) / targets       perplexity = exp(loss)
    bits per byte       = sum of -log2 p(target) / UTF-8 bytes of the targets

Bytes: with the tokenizer, each id's exact byte length (byte-level BPE: a vocabulary string has one
character per byte; special tokens such as EOS have 0 bytes; added LaTeX tokens their UTF-8 length),
checked against the shards' tokenizer hash. Without it, the manifest's average: `counts.bytes`
(UTF-8 bytes of all documents) / (num_tokens - num_docs) bytes per non-EOS token, applied to the
non-EOS targets; `bytes_source` says which was used. Targets that are all EOS (0 bytes) have no bits per
byte (None), and a loss past exp's range (a diverged model) a perplexity of inf.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from hybridlm.data.shards import TokenDataset
from hybridlm.eval import scoring
from hybridlm.eval.scoring import IGNORE_INDEX

TOKENIZER_FILE = "tokenizer.json"
_LARGEST_EXP = math.log(sys.float_info.max)  # exp of more overflows a float


def token_byte_lengths(tokenizer_dir: str | Path) -> np.ndarray:
    """int64 [vocab]: UTF-8 bytes each id stands for (0 for special tokens) from a byte-level BPE tokenizer.json."""
    spec = json.loads((Path(tokenizer_dir) / TOKENIZER_FILE).read_text(encoding="utf-8"))
    vocab: dict[str, int] = spec["model"]["vocab"]
    added = spec.get("added_tokens", [])
    size = max([*vocab.values(), *(t["id"] for t in added)]) + 1
    lengths = np.zeros(size, dtype=np.int64)
    for piece, index in vocab.items():
        lengths[index] = len(piece)  # the byte-level alphabet: one character per byte
    for token in added:
        lengths[token["id"]] = 0 if token["special"] else len(token["content"].encode("utf-8"))
    return lengths


def find_tokenizer(*candidates: str | Path | None) -> Path | None:
    """The first candidate directory that holds a tokenizer.json."""
    for c in candidates:
        if c is not None and (Path(c) / TOKENIZER_FILE).is_file():
            return Path(c)
    return None


def windows(data: TokenDataset, *, seq_len: int, max_tokens: int | None = None) -> Iterator[np.ndarray]:
    """Token windows of at most `seq_len` (overlapping by one inside a document), whole documents in order until
    `max_tokens` tokens are read."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    used = 0
    for i in range(data.num_docs):
        if max_tokens is not None and used >= max_tokens:
            return
        doc = data.doc(i)
        used += len(doc)
        for start in range(0, max(len(doc) - 1, 1), seq_len - 1):
            piece = doc[start:start + seq_len]
            if len(piece) >= 2:
                yield piece


def packed_batches(pieces: Iterator[np.ndarray], *, seq_len: int, batch_size: int,
                   pad_id: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """Pack windows into [B, seq_len] rows: input_ids, labels (-100 on each window's first token and on
    padding), position_ids (restarting at 0 per window and for the padding)."""
    rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    ids, labels, pos = [], [], []
    filled = 0

    def close_row() -> None:
        nonlocal ids, labels, pos, filled
        if filled < seq_len:
            pad = seq_len - filled
            ids.append(np.full(pad, pad_id))
            labels.append(np.full(pad, IGNORE_INDEX))
            pos.append(np.arange(pad))
        rows.append((np.concatenate(ids), np.concatenate(labels), np.concatenate(pos)))
        ids, labels, pos, filled = [], [], [], 0

    def emit() -> dict[str, torch.Tensor]:
        batch = {name: torch.from_numpy(np.stack([r[k] for r in rows]).astype(np.int64))
                 for k, name in enumerate(("input_ids", "labels", "position_ids"))}
        rows.clear()
        return batch

    for piece in pieces:
        if filled + len(piece) > seq_len:
            close_row()
            if len(rows) == batch_size:
                yield emit()
        target = piece.copy()
        target[0] = IGNORE_INDEX
        ids.append(piece)
        labels.append(target)
        pos.append(np.arange(len(piece)))
        filled += len(piece)
    if filled:
        close_row()
    if rows:
        yield emit()


@torch.no_grad()
def evaluate_perplexity(
    model,
    data: TokenDataset,
    *,
    seq_len: int = 2048,
    batch_size: int = 4,
    max_tokens: int | None = None,
    byte_lengths: np.ndarray | None = None,
    device: str | torch.device | None = None,
    progress: bool = False,
) -> dict:
    """Token-weighted NLL, perplexity and bits per byte; see the module docstring. `device`: where the batches go
    (default: the model's). `progress`: a tqdm bar on stderr counting scored tokens (rate in tok/s, running loss).
    The model runs in eval mode and is left in the mode it came in."""
    was_training = model.training
    model.eval()
    try:
        return _evaluate(model, data, seq_len=seq_len, batch_size=batch_size, max_tokens=max_tokens,
                         byte_lengths=byte_lengths, device=device or next(model.parameters()).device,
                         progress=progress)
    finally:
        model.train(was_training)


def _evaluate(model, data: TokenDataset, *, seq_len: int, batch_size: int, max_tokens: int | None,
              byte_lengths: np.ndarray | None, device: str | torch.device, progress: bool) -> dict:
    from tqdm.auto import tqdm

    total = None
    target_bytes = 0
    non_eos_targets = 0
    eos = data.eos_id
    # Every token but each document's first is scored once; with max_tokens the documents read are not known ahead.
    bar = tqdm(total=None if max_tokens is not None else data.num_tokens - data.num_docs, desc="eval ppl",
               unit="tok", unit_scale=True, dynamic_ncols=True, disable=not progress)
    try:
        for batch in packed_batches(windows(data, seq_len=seq_len, max_tokens=max_tokens), seq_len=seq_len,
                                    batch_size=batch_size):
            batch = {k: v.to(device) for k, v in batch.items()}
            with scoring.autocast_for(device):
                logits = model(batch["input_ids"], position_ids=batch["position_ids"]).logits
            for row in range(logits.shape[0]):  # one row at a time: float32 [T, V] logits stay small
                total = scoring.accumulate(total, scoring.target_scores(logits[row:row + 1],
                                                                        batch["labels"][row:row + 1]))
            targets = batch["labels"][batch["labels"] != IGNORE_INDEX].cpu().numpy()
            non_eos_targets += int((targets != eos).sum())
            if byte_lengths is not None:
                if targets.size and targets.max() >= len(byte_lengths):
                    raise ValueError(f"token id {targets.max()} is outside the tokenizer's {len(byte_lengths)} ids")
                target_bytes += int(byte_lengths[targets].sum())
            bar.update(targets.size)
            if total is not None and total["count"]:
                bar.set_postfix(loss=f"{total['nll'] / total['count']:.4f}", refresh=False)
    finally:
        bar.close()
    if total is None or total["count"] == 0:
        raise ValueError(f"{data.directory}: no token to score (documents of one token, or max_tokens too small)")
    if byte_lengths is not None:
        source = "tokenizer"
    else:
        counts = data.manifest["counts"]
        per_token = counts["bytes"] / max(data.num_tokens - data.num_docs, 1)
        target_bytes = per_token * non_eos_targets
        source = "manifest-average"
    nll = total["nll"]
    tokens = int(total["count"])
    return {
        "data": str(data.directory),
        "tokens": tokens,
        "nll_sum": nll,
        "loss": nll / tokens,
        "perplexity": math.inf if nll / tokens > _LARGEST_EXP else math.exp(nll / tokens),  # (NaN stays NaN)
        "bytes": target_bytes,
        "bits_per_byte": nll / math.log(2) / target_bytes if target_bytes else None,  # (every target an EOS)
        "bytes_per_token": target_bytes / tokens,
        "bytes_source": source,
        "token_accuracy": total["hits"] / tokens,
        "seq_len": seq_len,
        "max_tokens": max_tokens,
    }
