"""What the generation tests share: the small model with small fast-weight chunks, the SSM mixers to run it with,
prompt ids, and a count of the static decoder's steps."""

from __future__ import annotations

import pytest
import torch

from hybridlm.inference import GraphedDecoder
from hybridlm.models.model import HybridForCausalLM
from tests.models import helpers as model_helpers

VOCAB = model_helpers.VOCAB
FAST_WEIGHT_SIZES = dict(fw_heads=2, fw_head_dim=8, fw_chunk_size=4, fw_conv_size=3)


def make_model(seed: int = 0, **changes) -> HybridForCausalLM:
    """The model tests' small model (vocab 61, 2 layers, GQA, grouped Mamba-2, muP multipliers), with small
    fast-weight chunks so that the prompts of the tests span several of them."""
    sizes = FAST_WEIGHT_SIZES if changes.get("ssm_mixer") == "fast_weight" else {}  # fw_* read by no other mixer
    return model_helpers.make_model(seed, **{**sizes, **changes})


def fast_weight(rule: str, **changes) -> dict:
    return dict(ssm_mixer="fast_weight", fw_rule=rule, fw_window=3 if rule in ("3", "3A") else 1, **changes)


MIXERS = {
    "mamba2": dict(),
    **{f"fast_weight-{rule}": fast_weight(rule) for rule in ("1", "2", "3", "1A", "2A", "3A")},
    "fast_weight-3A-same_step-read_before": fast_weight("3A", fw_pairing="same_step", fw_read="before"),
    "none": dict(ssm_mixer="none"),
    "mamba2-ssm_only": dict(use_attention=False),
    "fast_weight-3-ssm_only": fast_weight("3", use_attention=False),
}


def ids(*shape: int, seed: int = 0) -> torch.Tensor:
    """Seeded prompt ids of `shape`, none of them the special ids 0-2."""
    return torch.randint(3, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


class StepCount:
    count = 0


def count_decoder_steps(monkeypatch: pytest.MonkeyPatch) -> StepCount:
    """Count `GraphedDecoder.step` calls, so a test knows the static path ran (the dynamic one gives the same
    output)."""
    counter, step = StepCount(), GraphedDecoder.step

    def counted(self, token):
        counter.count += 1
        return step(self, token)

    monkeypatch.setattr(GraphedDecoder, "step", counted)
    return counter
