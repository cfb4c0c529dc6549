"""Parameter groups by role, the ELR / EWD map, apply_schedule, and the muP width transfer."""

from __future__ import annotations

import math

import pytest
import torch

from hybridlm.training.optim import (
    MATRIX_ROLES,
    MUP_WIDTH_EXPONENTS,
    VECTOR_ROLES,
    MatrixMultipliers,
    apply_schedule,
    build_param_groups,
    classify_parameters,
    matrix_lr_wd,
    scale_multipliers,
)
from tests.training.toys import EXPECTED_ROLES, ToyLM

LR, WD = 1e-3, 0.1


def toy() -> ToyLM:
    torch.manual_seed(0)
    return ToyLM()


def test_default_classifier_gives_every_toy_parameter_its_role() -> None:
    model = toy()
    by_role = classify_parameters(model.named_parameters())
    got = {name: role for role, items in by_role.items() for name, _ in items}
    assert got == EXPECTED_ROLES
    assert set(got) == {name for name, _ in model.named_parameters()}


def test_groups_partition_the_parameters_with_the_derived_multipliers() -> None:
    model = toy()
    groups = build_param_groups(
        model.named_parameters(),
        lr=LR,
        weight_decay=WD,
        matrix_multipliers={"ssm_in": MatrixMultipliers(elr=2.0, ewd=4.0), "embedding": (0.5, 1.0)},
        vector_lr_multipliers={"A_log": 0.1, "mixer_norm": 3.0},
    )
    params = [p for g in groups for p in g["params"]]
    assert len(params) == len({id(p) for p in params}) == len(list(model.parameters()))  # exactly one group each
    by_role = {g["role"]: g for g in groups}
    assert [g["role"] for g in groups] == [r for r in (*MATRIX_ROLES, *VECTOR_ROLES) if r in by_role]
    for group in groups:
        assert len(group["param_names"]) == len(group["params"])
        assert (group["base_lr"], group["base_weight_decay"]) == (group["lr"], group["weight_decay"])
        if group["role"] in VECTOR_ROLES:
            assert group["weight_decay"] == 0.0
    # eta_j = eta * elr / ewd, lambda_j = lambda * elr * ewd
    assert by_role["ssm_in"]["lr"] == pytest.approx(LR * 2 / 4)
    assert by_role["ssm_in"]["weight_decay"] == pytest.approx(WD * 2 * 4)
    assert (by_role["embedding"]["lr"], by_role["embedding"]["weight_decay"]) == (pytest.approx(LR / 2), pytest.approx(WD / 2))
    assert (by_role["mlp_down"]["lr"], by_role["mlp_down"]["weight_decay"]) == (LR, WD)
    assert by_role["A_log"]["lr"] == pytest.approx(LR * 0.1)
    assert by_role["mixer_norm"]["lr"] == pytest.approx(LR * 3.0)
    assert by_role["conv"]["lr"] == LR


@pytest.mark.parametrize("elr, ewd", [(2.0, 4.0), (0.25, 1.0), (1.0, 0.5), (3.0, 1.7)])
def test_matrix_map_hits_the_effective_targets(elr: float, ewd: float) -> None:
    lr, wd = matrix_lr_wd(LR, WD, elr, ewd)
    assert math.sqrt(lr * wd) == pytest.approx(elr * math.sqrt(LR * WD))  # eta_eff scaled by elr
    assert math.sqrt(wd / lr) == pytest.approx(ewd * math.sqrt(WD / LR))  # lambda_eff scaled by ewd


def test_groups_drive_adamw_as_configured() -> None:
    """With zero gradients AdamW only decays: p <- p (1 - lr_j wd_j); vectors (wd 0) do not move."""
    model = toy()
    groups = build_param_groups(
        model.named_parameters(), lr=LR, weight_decay=WD, matrix_multipliers={"mlp_up": (2.0, 4.0)}
    )
    optimizer = torch.optim.AdamW(groups, betas=(0.9, 0.95))
    apply_schedule(optimizer, 0.5, 2.0)
    apply_schedule(optimizer, 0.5, 2.0)  # from the base values: never compounds
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for name, p in model.named_parameters():
        role = EXPECTED_ROLES[name]
        if role in VECTOR_ROLES:
            assert torch.equal(p, before[name]), name
        else:
            lr_j, wd_j = matrix_lr_wd(LR, WD, *((2.0, 4.0) if role == "mlp_up" else (1.0, 1.0)))
            shrink = 1 - (lr_j * 0.5) * (wd_j * 2.0)
            assert shrink < 1 - 5e-5
            torch.testing.assert_close(p, before[name] * shrink, rtol=1e-6, atol=0, msg=name)


def test_apply_schedule_needs_base_values() -> None:
    optimizer = torch.optim.AdamW(toy().parameters(), lr=LR)
    with pytest.raises(ValueError, match="base_lr"):
        apply_schedule(optimizer, 1.0, 1.0)


def test_unknown_names_and_roles_are_named() -> None:
    model = toy()
    model.model.register_parameter("mystery", torch.nn.Parameter(torch.zeros(3)))
    with pytest.raises(ValueError, match=r"'model\.mystery'.*matches no role"):
        build_param_groups(model.named_parameters(), lr=LR, weight_decay=WD)
    with pytest.raises(ValueError, match=r"'model\.embed_tokens\.weight' got unknown role 'weird'"):
        classify_parameters(toy().named_parameters(), lambda name: "weird")
    with pytest.raises(ValueError, match="matrix role 'ssm_in'"):
        classify_parameters(toy().named_parameters(), {r"A_log$": "ssm_in", r".": "bias"})
    with pytest.raises(ValueError, match="not a matrix role"):
        build_param_groups(toy().named_parameters(), lr=LR, weight_decay=WD, matrix_multipliers={"ssm_inn": (1, 1)})
    with pytest.raises(ValueError, match="not a vector role"):
        build_param_groups(toy().named_parameters(), lr=LR, weight_decay=WD, vector_lr_multipliers={"ssm_in": 2.0})
    with pytest.raises(ValueError, match="elr"):
        MatrixMultipliers(elr=0.0)


def test_custom_regex_classifier_and_frozen_parameters() -> None:
    model = toy()
    model.model.embed_tokens.weight.requires_grad_(False)
    patterns = {r"\.(weight)$": "mlp_up", r".": "bias"}  # norm weights are 1-D: not a matrix role
    with pytest.raises(ValueError, match="matrix role"):
        build_param_groups(model.named_parameters(), lr=LR, weight_decay=WD, classifier=patterns)
    patterns = {r"(proj|lm_head)\.weight$": "mlp_up", r".": "bias"}
    groups = build_param_groups(model.named_parameters(), lr=LR, weight_decay=WD, classifier=patterns)
    names = {g["role"]: set(g["param_names"]) for g in groups}
    assert "model.embed_tokens.weight" not in names["bias"] | names["mlp_up"]  # frozen: left out
    assert "lm_head.weight" in names["mlp_up"] and "model.layers.1.ssm.conv.weight" in names["bias"]


def test_default_classifier_on_the_real_model() -> None:
    from hybridlm.models.config import HybridConfig
    from hybridlm.models.model import HybridForCausalLM

    for mixer, arrangement in (("mamba2", "SA_M"), ("fast_weight", "S_A_M")):
        config = HybridConfig(
            vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
            mamba_n_heads=4, mamba_d_state=8, ssm_mixer=mixer, block_arrangement=arrangement,
            mamba_rms_norm=True, attention_bias=True,
        )
        model = HybridForCausalLM(config)
        roles = {n: r for r, items in classify_parameters(model.named_parameters()).items() for n, _ in items}
        assert len(roles) == len(list(model.parameters()))
        assert roles["lm_head.weight"] == "unembedding" and roles["model.norm.weight"] == "final_norm"
        assert roles["model.layers.1.ssm.in_proj.weight"] == "ssm_in"
        assert roles["model.layers.1.ssm.norm.weight"] == "ssm_norm"
        assert roles["model.layers.0.norm.weight"] == "mixer_norm"


def test_scale_multipliers_width_transfer() -> None:
    base = {"embedding_multiplier": 5.66, "lm_head_multiplier": 1 / 32, "mlp_multiplier_down": 0.5,
            "key_multiplier": 0.4, "ssm_out_multiplier": 0.25}
    scaled = scale_multipliers(base, 1280, 5120)  # 4x wider
    assert scaled["embedding_multiplier"] == 5.66
    assert scaled["lm_head_multiplier"] == pytest.approx(1 / 128)
    assert scaled["mlp_multiplier_down"] == pytest.approx(0.5 / 16)
    assert scaled["key_multiplier"] == 0.4
    assert scaled["ssm_out_multiplier"] == pytest.approx(0.25 / 4)
    assert scale_multipliers(base, 1280, 1280) == base
    assert set(MUP_WIDTH_EXPONENTS) >= set(base)
    assert scale_multipliers({"x": 2.0}, 100, 400, exponents={"x": 0.5}) == {"x": 4.0}
    with pytest.raises(ValueError, match="no width exponent for multiplier.*attention_in_multiplierr"):
        scale_multipliers({"attention_in_multiplierr": 1.0}, 1, 2)


def test_width_table_names_match_the_model_config() -> None:
    from hybridlm.models.config import HybridConfig

    assert set(MUP_WIDTH_EXPONENTS) == set(HybridConfig.multiplier_names())
