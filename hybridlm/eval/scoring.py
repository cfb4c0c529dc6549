"""Teacher-forced scoring of target tokens: the one place that turns logits into hits and NLL.

Labels follow the model's convention: `labels[:, t]` is the token at position t (aligned with the
inputs), scored from the logits at t - 1; -100 marks positions that are not targets.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def autocast_for(device: torch.device | str) -> contextlib.AbstractContextManager:
    """The precision a forward runs in: bf16 autocast on CUDA, nothing on the CPU (float32 there)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def target_scores(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """logits [B, T, V], labels [B, T] -> per row [B]: "hits" (argmax == target), "count" (targets),
    "nll" (summed cross entropy in nats, float32). A row is "exact" when hits == count > 0."""
    pred = logits[:, :-1].argmax(-1)  # [B, T-1]: the prediction for position t + 1
    target = labels[:, 1:]  # [B, T-1]
    mask = target != IGNORE_INDEX
    nll = F.cross_entropy(
        logits[:, :-1].float().transpose(1, 2), target.masked_fill(~mask, 0), reduction="none"
    )  # [B, T-1]
    return {
        "hits": ((pred == target) & mask).sum(1),
        "count": mask.sum(1),
        "nll": (nll * mask).sum(1),
    }


def accumulate(total: dict[str, float] | None, scores: dict[str, torch.Tensor]) -> dict[str, float]:
    """Add a batch's row scores to running sums: hits, count, nll, rows, exact (rows with every target hit)."""
    total = dict(total or {"hits": 0.0, "count": 0.0, "nll": 0.0, "rows": 0.0, "exact": 0.0})
    total["hits"] += float(scores["hits"].sum())
    total["count"] += float(scores["count"].sum())
    total["nll"] += float(scores["nll"].sum())
    total["rows"] += float(scores["hits"].numel())
    total["exact"] += float(((scores["hits"] == scores["count"]) & (scores["count"] > 0)).sum())
    return total


def finish(total: dict[str, float]) -> dict[str, float]:
    """Running sums -> token accuracy, exact-match rate, mean NLL per target token, counts."""
    count, rows = total["count"], total["rows"]
    return {
        "token_acc": total["hits"] / count if count else float("nan"),
        "exact_match": total["exact"] / rows if rows else float("nan"),
        "loss": total["nll"] / count if count else float("nan"),
        "targets": int(count),
        "examples": int(rows),
    }
