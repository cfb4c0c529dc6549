"""`fold_multipliers`: the muP multipliers moved into the weights give the same logits (float64), decoding included,
with fewer elementwise kernels, and the folded model saves and reloads as itself."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hybridlm import fold_multipliers
from hybridlm.models.model import HybridForCausalLM
from tests.helpers import rel_err
from tests.models.helpers import VOCAB, make_model

# Every multiplier away from 1 (Falcon-H1's checkpoints set them all), each a different value.
MULTIPLIERS = dict(
    embedding_multiplier=2.0, lm_head_multiplier=0.5, attention_in_multiplier=1.5, key_multiplier=0.5,
    attention_out_multiplier=0.75, ssm_in_multiplier=1.25, ssm_out_multiplier=0.5, ssm_multiplier_z=0.3,
    ssm_multiplier_x=0.7, ssm_multiplier_B=1.3, ssm_multiplier_C=0.6, ssm_multiplier_dt=0.4,
    mlp_multiplier_gate=0.9, mlp_multiplier_down=1.1,
)
MAMBA2_ONLY = {"ssm_multiplier_z", "ssm_multiplier_x", "ssm_multiplier_B", "ssm_multiplier_C", "ssm_multiplier_dt"}
MODELS = {
    "mamba2": dict(),
    "mamba2 biases, SAM": dict(mamba_proj_bias=True, projectors_bias=True, attention_bias=True, mlp_bias=True,
                               block_arrangement="SAM", mamba_rms_norm=False),
    "mamba2 S_A_M, tied": dict(block_arrangement="S_A_M", tie_word_embeddings=True),
    "fast_weight 1A": dict(ssm_mixer="fast_weight", fw_rule="1A", fw_heads=2, fw_head_dim=8),
    "attention only": dict(ssm_mixer="none"),
    "mamba2 only": dict(use_attention=False),
}


class Muls(TorchDispatchMode):
    """Counts the elementwise multiplications dispatched."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket.__name__ == "mul"
        return func(*args, **(kwargs or {}))


def _decode(model, ids, steps: int = 3) -> torch.Tensor:
    """The prompt's last logits, then `steps` greedy cached steps' logits [B, 1 + steps, V]."""
    cache = model.new_cache()
    logits = [model(ids, cache=cache, logits_to_keep=1).logits[:, -1]]
    for _ in range(steps):
        logits.append(model(logits[-1].argmax(-1, keepdim=True), cache=cache, logits_to_keep=1).logits[:, -1])
    return torch.stack(logits, dim=1)


@pytest.mark.parametrize("name", list(MODELS))
def test_folded_model_gives_the_same_logits(name, tmp_path):
    """Float64: the full forward and a cached decode (prefill + 3 steps) agree to float64 rounding; every multiplier
    the model uses is reported with its value and reads 1 afterwards (the tied embeddings' two excepted); a step runs
    fewer multiplications; save_pretrained / from_pretrained give the folded model back."""
    changes = MODELS[name]
    model = make_model(seed=3, **MULTIPLIERS, **changes).double()
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want, want_steps = model(ids).logits, _decode(model, ids)
        before = Muls()
        with before:
            model(ids[:, :1])
        folded = fold_multipliers(model)
        got, got_steps = model(ids).logits, _decode(model, ids)
        after = Muls()
        with after:
            model(ids[:, :1])
    assert rel_err(got, want) < 1e-12 and rel_err(got_steps, want_steps) < 1e-12
    expected = dict(MULTIPLIERS)
    if changes.get("ssm_mixer") in ("fast_weight", "none"):
        expected = {k: v for k, v in expected.items() if k not in MAMBA2_ONLY}
    if changes.get("ssm_mixer") == "none":
        expected = {k: v for k, v in expected.items() if not k.startswith("ssm_")}
    if changes.get("use_attention") is False:
        expected = {k: v for k, v in expected.items() if k not in ("attention_in_multiplier", "key_multiplier",
                                                                   "attention_out_multiplier")}
    if changes.get("tie_word_embeddings"):
        expected = {k: v for k, v in expected.items() if k not in ("embedding_multiplier", "lm_head_multiplier")}
    assert folded == expected
    assert all(getattr(model.config, field) == 1.0 for field in folded)
    assert after.count < before.count
    assert fold_multipliers(model) == {}  # nothing left to fold
    model.save_pretrained(tmp_path)
    reloaded = HybridForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, got)


def test_folding_keeps_a_filled_cache_going():
    """Folded between two decoding steps of one cache (keys and states stored at the multipliers' scale): the next
    steps equal the unfolded model's."""
    model = make_model(seed=5, **MULTIPLIERS).double()
    ids = torch.randint(3, VOCAB, (1, 7), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = _decode(model, ids, steps=4)
        cache = model.new_cache()
        logits = model(ids, cache=cache, logits_to_keep=1).logits[:, -1]
        fold_multipliers(model)
        got = [logits]
        for _ in range(4):
            got.append(model(got[-1].argmax(-1, keepdim=True), cache=cache, logits_to_keep=1).logits[:, -1])
    assert rel_err(torch.stack(got, dim=1), want) < 1e-12


def test_folding_refuses_sharded_weights(monkeypatch):
    """A tensor-parallel model (DTensor weights) is refused before anything changes."""
    model = make_model(seed=7, **MULTIPLIERS)
    weight = model.model.layers[0].mlp.gate_proj.weight
    before = weight.clone()
    monkeypatch.setattr(type(weight), "to_local", lambda self: self, raising=False)
    with pytest.raises(ValueError, match="sharded"):
        fold_multipliers(model)
    monkeypatch.undo()
    assert torch.equal(weight, before) and model.config.mlp_multiplier_gate == MULTIPLIERS["mlp_multiplier_gate"]


def test_folding_refuses_adapter_wrapped_projections():
    """A projection wrapped by an adapter (as PEFT's LoRA wraps it) would not see its weight scaled: refused, the model
    unchanged."""
    model = make_model(seed=8, **MULTIPLIERS)
    attn = model.model.layers[0].attn

    class Adapter(torch.nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base_layer = base

        def forward(self, x):
            return self.base_layer(x)

    attn.k_proj = Adapter(attn.k_proj)
    with pytest.raises(ValueError, match="adapters"):
        fold_multipliers(model)
    assert model.config.key_multiplier == MULTIPLIERS["key_multiplier"]
    with pytest.raises(ValueError, match="HybridForCausalLM or HybridModel"):
        fold_multipliers(torch.nn.Linear(2, 2))
