"""Direct preference optimization as a `Loss` of the training loop.

For a pair (prompt x, chosen y_w, rejected y_l), with log pi(y | x) the summed log-probability of the response's
tokens under the trained policy and log pi_ref(y | x) under the reference (the starting model):

    r_w = log pi(y_w | x) - log pi_ref(y_w | x)        r_l = log pi(y_l | x) - log pi_ref(y_l | x)
    "sigmoid" (DPO, Rafailov et al. 2023):  loss = -log sigmoid(beta (r_w - r_l))
    "norm" (length-normalized DPO, `dpo_norm`, the Falcon-H1 report's): each log-probability, the policy's and the
        reference's, divided by its response's token count before the differences

The loss of a micro-batch is the sum over its pairs (the loop divides by the global number of pairs). Metrics, as
TRL names them, per pair averaged over an update: rewards/chosen = beta r_w, rewards/rejected = beta r_l,
rewards/margin = beta (r_w - r_l), rewards/accuracy = share of pairs with r_w > r_l (with "norm": the normalized
rewards).

The reference log-probabilities are computed once before training (`reference_log_probs`: one pass of the starting
model over every pair, kept in memory and in checkpoints), so no second model is held; `dpo.reference: frozen`
keeps a frozen copy of the starting model instead and runs it beside the policy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from hybridlm.training.loop import IGNORE_INDEX, Batch, ForwardContext, scored_positions

MODEL_KEYS = ("input_ids", "position_ids", "cu_seqlens")
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy")


def sequence_log_probs(logits: torch.Tensor, labels: torch.Tensor, cu_seqlens: torch.Tensor,
                       positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per packed sequence: the summed log-probability of its scored labels and their count.

    logits [1, N, V] (any float dtype; computed in at least float32), labels [1, N] (-100: not scored), cu_seqlens
    [S + 1] offsets -> (sums [S], counts [S]). With `positions` [K] the logits are those of these positions of the
    packed row only ([1, K, V], `logits_to_keep`)."""
    logits = logits[0].to(torch.promote_types(logits.dtype, torch.float32))
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(logits.device, torch.long)
    segment = torch.repeat_interleave(torch.arange(len(lengths), device=logits.device), lengths)  # [N]
    labels = labels[0].to(logits.device)
    if positions is not None:
        segment, labels = segment[positions], labels[positions]  # [K]
    token = -F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")  # 0 where ignored
    sums = torch.zeros(len(lengths), dtype=token.dtype, device=logits.device).index_add(0, segment, token)
    counts = torch.zeros(len(lengths), dtype=token.dtype, device=logits.device).index_add(
        0, segment, (labels != IGNORE_INDEX).to(token.dtype))
    return sums, counts


def preference_losses(policy: torch.Tensor, reference: torch.Tensor, counts: torch.Tensor, *, beta: float,
                      kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per pair: (loss [P], r_w [P], r_l [P]) from the summed log-probabilities of the interleaved sequences
    (chosen_0, rejected_0, chosen_1, ...): policy [2P], reference [2P], counts [2P] (scored tokens)."""
    if kind == "norm":
        policy, reference = policy / counts.clamp(min=1), reference / counts.clamp(min=1)
    elif kind != "sigmoid":
        raise ValueError(f"kind must be 'sigmoid' or 'norm', got {kind!r}")
    ratio = policy - reference.to(policy.dtype)
    chosen, rejected = ratio[0::2], ratio[1::2]
    return -F.logsigmoid(beta * (chosen - rejected)), chosen, rejected


def _no_context(model: nn.Module) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


@dataclass
class PreferenceLoss:
    """The DPO `Loss` (module docstring). A batch holds the packed pairs (`input_ids`, `position_ids`, `cu_seqlens`,
    `labels`) and either `reference` [P, 2] (precomputed) or, with `reference_model`, nothing more."""

    beta: float
    kind: str = "sigmoid"
    context: ForwardContext = _no_context
    reference_model: nn.Module | None = None
    _totals: torch.Tensor | None = field(default=None, repr=False)  # sums of the METRICS and the pair count

    def count(self, batch: Batch) -> int:
        return int(batch["cu_seqlens"].numel() - 1) // 2

    def log_probs(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        return _log_probs(model, batch, self.context)

    def __call__(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        policy, counts = self.log_probs(model, batch)
        if self.reference_model is not None:
            with torch.no_grad():
                reference, _ = self.log_probs(self.reference_model, batch)
        else:
            reference = batch["reference"].to(policy.device).reshape(-1)
        losses, chosen, rejected = preference_losses(policy, reference, counts, beta=self.beta, kind=self.kind)
        with torch.no_grad():
            c, r = self.beta * chosen.double(), self.beta * rejected.double()
            step = torch.stack([c.sum(), r.sum(), (c - r).sum(), (c > r).double().sum(),
                                torch.tensor(float(len(c)), dtype=torch.float64, device=c.device)])
            self._totals = step if self._totals is None else self._totals + step
        return losses.sum()

    def pop_metrics(self, reduce: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> dict[str, float]:
        """The METRICS averaged over the pairs since the last call (`reduce`: a sum over the ranks)."""
        if self._totals is None:
            return {}
        totals = reduce(self._totals.cpu())
        self._totals = None
        return {name: float(totals[i] / totals[4]) for i, name in enumerate(METRICS)}


def _log_probs(model: nn.Module, batch: Batch, context: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
    """`sequence_log_probs` of a packed batch, the LM head run only at the responses' positions."""
    positions = scored_positions(batch["labels"])
    with context(model):
        logits = model(**{k: batch[k] for k in MODEL_KEYS}, logits_to_keep=positions).logits  # [1, K, V]
    return sequence_log_probs(logits, batch["labels"], batch["cu_seqlens"], positions)


@torch.no_grad()
def reference_log_probs(model: nn.Module, make_batch: Callable[[list[int]], Batch], num_pairs: int, *,
                        pairs_per_batch: int, context: ForwardContext = _no_context,
                        to_device: Callable[[Batch], Batch] = lambda b: b,
                        progress: Callable[[int], None] | None = None) -> torch.Tensor:
    """[num_pairs, 2] float64: the model's summed log-probabilities of every pair's chosen and rejected response,
    `pairs_per_batch` pairs per forward (`make_batch(indices)` packs them)."""
    was_training = model.training
    model.eval()
    out = torch.empty(num_pairs, 2, dtype=torch.float64)
    for start in range(0, num_pairs, pairs_per_batch):
        indices = list(range(start, min(start + pairs_per_batch, num_pairs)))
        sums, _ = _log_probs(model, to_device(make_batch(indices)), context)
        out[start:start + len(indices)] = sums.double().cpu().reshape(-1, 2)
        if progress is not None:
            progress(len(indices))
    model.train(was_training)
    return out
