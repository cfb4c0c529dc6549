"""AdamW parameter groups by parameter role, with the Falcon-H1 report's ELR / EWD multipliers, and muP width transfer.

Roles. Every trainable parameter gets one role from a classifier: a callable `name -> role`, or an
ordered mapping `regex -> role` (`re.search`, first match wins; `DEFAULT_ROLE_PATTERNS` is the default,
written for the names of `hybridlm.models` / `hybridlm.layers`). Roles are *matrix* roles (weight
decay on, ELR / EWD multipliers) or *vector* roles (weight decay 0, an lr multiplier):

    matrix  embedding (embed_tokens), unembedding (lm_head), attn_in (q/k/v_proj), attn_out (o_proj),
            ssm_in (in_proj, fw_*_proj), ssm_out (out_proj, fw_o/out_proj), mlp_up, mlp_gate, mlp_down
    vector  final_norm, mixer_norm (the block's pre-mixer norms), mlp_norm, ssm_norm (the mixer's gated
            norm), conv (short-conv weight and bias), dt_bias, A_log, D, fw_bias (fast-weight gain / ridge
            biases), bias (biases of linear layers)

The report tunes 7 matrix types (embedding, unembedding, input projection, output projection, MLP up,
gate, down); here attention and SSM projections are separate roles so they can be tuned apart; give them
equal multipliers to reproduce the report's 7.

ELR / EWD (report, "Effective Learning Rate, Effective Weight Decay"). With AdamW's (eta, lambda)
(torch: p <- p - eta * lambda * p), the stationary norm is ||W|| ~ sqrt(eta / lambda) and

    eta_eff = sqrt(eta * lambda)        (update size relative to the norm; sets the noise level)
    lambda_eff = sqrt(lambda / eta)     (~ 1 / ||W||; sets the parameter norm)

Multipliers (elr, ewd) of role j act on these: eta_eff_j = elr * eta_eff, lambda_eff_j = ewd * lambda_eff.
Solving for (eta_j, lambda_j):

    eta_j * lambda_j = elr^2 * eta * lambda         (square of the first)
    lambda_j / eta_j = ewd^2 * lambda / eta         (square of the second)
    multiply: lambda_j^2 = elr^2 ewd^2 lambda^2  ->  lambda_j = lambda * elr * ewd
    divide:   eta_j^2 = elr^2 / ewd^2 * eta^2    ->  eta_j = eta * elr / ewd

so elr scales (eta, lambda) together (the report's ELR micro-sweep) and ewd moves them apart (its EWD
sweep). Direction: `ewd = p` gives (eta / p, lambda * p) (a larger ewd: a larger lambda_eff, smaller norms),
while the report writes its EWD sweep as (p * eta, lambda / p), which is `ewd = 1/p` here: invert EWD values
imported from it (elr = p is its ELR sweep's (p * eta, p * lambda) as written). Vector roles get eta_j = eta * m_j
and lambda_j = 0.

Each group stores `base_lr` and `base_weight_decay` (the values above); `apply_schedule` sets
`lr = base_lr * lr_factor` and `weight_decay = base_weight_decay * wd_factor`, so schedules never compound.

muP width transfer (`scale_multipliers`): m(d) = m(d0) * (d / d0)^e with e from `MUP_WIDTH_EXPONENTS`.
The report moves all width scaling out of (eta, lambda) into forward multipliers, so the same lr and wd
serve every width. Its Table 7 is known here only through a summary, which gives m_emb ~ 1 and
m_unemb ~ d^-1; the hidden-layer entries below are derived, not copied. (The summary's example
"hidden layer m ~ d, sigma ~ d^-1/2" contradicts its own symmetry (m, sigma, eta, lambda) ->
(m/p, p sigma, p eta, lambda/p): taking standard muP (1, d^-1/2, d^-1, d) to eta ~ 1 needs p = d, giving
m ~ d^-1, sigma ~ d^+1/2.) Derivation: a matrix W with fan-in ~ d, updated by Adam with width-independent
eta, changes its output by ~ eta * d per coordinate; a forward factor ~ d^-1 keeps that O(1). Falcon-H1
has one multiplier per site, not per matrix; a site's exponent is the sum over the matrices it scales
on a path that is linear up to the next nonlinearity (Adam's update is invariant to gradient scale, so
only products of multipliers along such a path matter):

    multiplier                       e    matrices it covers
    embedding_multiplier             0    embed_tokens (fan-in = vocab, width-independent)      [report]
    lm_head_multiplier              -1    lm_head                                                [report]
    attention_in_multiplier         -1    q_proj, k_proj, v_proj (it scales their common input)
    key_multiplier                   0    (k_proj is covered by attention_in)
    attention_out_multiplier        -1    o_proj
    ssm_in_multiplier               -1    in_proj (Mamba-2 and fast-weight mixers)
    ssm_multiplier_z/_x/_B/_C/_dt    0    (pieces of in_proj, covered by ssm_in)
    ssm_out_multiplier              -1    out_proj
    mlp_multiplier_gate             -1    gate_proj
    mlp_multiplier_down             -2    down_proj and up_proj (the output is linear in W_up, which has
                                          no multiplier of its own)

Widths are the residual width `hidden_size`; head_dim, d_state and the channel ratios are assumed fixed,
so attention, SSM and MLP widths grow in proportion. This covers updates; at init a hidden layer's
output then shrinks like (d0/d)^(1/2) when the init std is width-independent (full muP would grow the
hidden init std like (d/d0)^(1/2)). Pass `exponents=` to use another table.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

MATRIX_ROLES: tuple[str, ...] = (
    "embedding", "unembedding", "attn_in", "attn_out", "ssm_in", "ssm_out", "mlp_up", "mlp_gate", "mlp_down",
)
VECTOR_ROLES: tuple[str, ...] = (
    "final_norm", "mixer_norm", "mlp_norm", "ssm_norm", "conv", "dt_bias", "A_log", "D", "fw_bias", "bias",
)

# Ordered: the first pattern that matches (re.search) names the role. Written for parameter names such as
# "model.layers.3.ssm.in_proj.weight"; the fast-weight mixer sits under ".ssm." like Mamba-2.
DEFAULT_ROLE_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"(^|\.)embed_tokens\.weight$", "embedding"),
    (r"(^|\.)lm_head\.weight$", "unembedding"),
    # vectors first: biases, convs and norms are never matrices, whatever module holds them
    (r"(^|\.)\w*conv\w*\.(weight|bias)$", "conv"),
    (r"(^|\.)dt_bias$", "dt_bias"),
    (r"(^|\.)A_log$", "A_log"),
    (r"(^|\.)D$", "D"),
    (r"(^|\.)(beta_bias|lam_bias|fw_\w*bias)$", "fw_bias"),
    (r"(^|\.)(ssm|mamba)\.\w*norm\.weight$", "ssm_norm"),
    (r"(^|\.)mlp_norm\.weight$", "mlp_norm"),
    (r"(^|\.)layers\.\d+\.(norm|attn_norm)\.weight$", "mixer_norm"),
    (r"(^|\.)norm\.weight$", "final_norm"),
    (r"\.bias$", "bias"),
    # matrices
    (r"(^|\.)(q_proj|k_proj|v_proj)\.weight$", "attn_in"),
    (r"(^|\.)o_proj\.weight$", "attn_out"),
    (r"(^|\.)(out_proj|fw_o_proj|fw_out_proj)\.weight$", "ssm_out"),
    (r"(^|\.)(in_proj|fw_\w*proj)\.weight$", "ssm_in"),
    (r"(^|\.)up_proj\.weight$", "mlp_up"),
    (r"(^|\.)gate_proj\.weight$", "mlp_gate"),
    (r"(^|\.)down_proj\.weight$", "mlp_down"),
)

MUP_WIDTH_EXPONENTS: dict[str, float] = {
    "embedding_multiplier": 0.0,
    "lm_head_multiplier": -1.0,
    "attention_in_multiplier": -1.0,
    "key_multiplier": 0.0,
    "attention_out_multiplier": -1.0,
    "ssm_in_multiplier": -1.0,
    "ssm_out_multiplier": -1.0,
    "ssm_multiplier_z": 0.0,
    "ssm_multiplier_x": 0.0,
    "ssm_multiplier_B": 0.0,
    "ssm_multiplier_C": 0.0,
    "ssm_multiplier_dt": 0.0,
    "mlp_multiplier_gate": -1.0,
    "mlp_multiplier_down": -2.0,
}

Classifier = Callable[[str], "str | None"]


@dataclass(frozen=True)
class MatrixMultipliers:
    """Per-role multipliers of the effective lr and effective weight decay of a matrix role."""

    elr: float = 1.0
    ewd: float = 1.0

    def __post_init__(self) -> None:
        for name in ("elr", "ewd"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"MatrixMultipliers.{name} must be a finite number > 0, got {value!r}")


def matrix_lr_wd(lr: float, weight_decay: float, elr: float = 1.0, ewd: float = 1.0) -> tuple[float, float]:
    """(eta_j, lambda_j) = (lr * elr / ewd, weight_decay * elr * ewd): see the module docstring."""
    return lr * elr / ewd, weight_decay * elr * ewd


def regex_classifier(patterns: Mapping[str, str] | Sequence[tuple[str, str]]) -> Classifier:
    """A classifier from ordered `regex -> role` pairs (re.search; the first match wins; None if none)."""
    items = list(patterns.items()) if isinstance(patterns, Mapping) else list(patterns)
    compiled = [(re.compile(pattern), role) for pattern, role in items]

    def classify(name: str) -> str | None:
        for pattern, role in compiled:
            if pattern.search(name):
                return role
        return None

    return classify


default_classifier: Classifier = regex_classifier(DEFAULT_ROLE_PATTERNS)


def classify_parameters(
    named_parameters: Iterable[tuple[str, nn.Parameter]],
    classifier: Classifier | Mapping[str, str] | None = None,
    *,
    matrix_roles: Sequence[str] = MATRIX_ROLES,
    vector_roles: Sequence[str] = VECTOR_ROLES,
) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Role -> [(name, parameter)] for every parameter with requires_grad (frozen ones are left out).

    Raises ValueError naming the parameter when the classifier gives no role or a role outside
    `matrix_roles` + `vector_roles`, when a matrix role lands on a parameter that is not 2-D, or when one
    tensor appears under two names.
    """
    if classifier is None:
        classify = default_classifier
    elif isinstance(classifier, Mapping):
        classify = regex_classifier(classifier)
    else:
        classify = classifier
    known = set(matrix_roles) | set(vector_roles)
    overlap = set(matrix_roles) & set(vector_roles)
    if overlap:
        raise ValueError(f"roles cannot be both matrix and vector roles: {sorted(overlap)}")
    by_role: dict[str, list[tuple[str, nn.Parameter]]] = {}
    seen: dict[int, str] = {}
    for name, param in named_parameters:
        if not param.requires_grad:
            continue
        if id(param) in seen:
            raise ValueError(
                f"parameter {name!r} is the same tensor as {seen[id(param)]!r}; pass model.named_parameters() "
                "(which lists a shared tensor once)"
            )
        seen[id(param)] = name
        role = classify(name)
        if role is None:
            raise ValueError(
                f"parameter {name!r} (shape {tuple(param.shape)}) matches no role; add a pattern for it to the "
                "classifier (known roles: " + ", ".join(sorted(known)) + ")"
            )
        if role not in known:
            raise ValueError(
                f"parameter {name!r} got unknown role {role!r}; known roles: " + ", ".join(sorted(known))
            )
        if role in matrix_roles and param.dim() != 2:
            raise ValueError(
                f"parameter {name!r} has shape {tuple(param.shape)} but matrix role {role!r}; matrix roles are "
                "for 2-D weights (classify it as a vector role)"
            )
        by_role.setdefault(role, []).append((name, param))
    return by_role


def build_param_groups(
    named_parameters: Iterable[tuple[str, nn.Parameter]],
    *,
    lr: float,
    weight_decay: float,
    classifier: Classifier | Mapping[str, str] | None = None,
    matrix_multipliers: Mapping[str, MatrixMultipliers | tuple[float, float]] | None = None,
    vector_lr_multipliers: Mapping[str, float] | None = None,
    matrix_roles: Sequence[str] = MATRIX_ROLES,
    vector_roles: Sequence[str] = VECTOR_ROLES,
) -> list[dict]:
    """One AdamW parameter group per role present, in `matrix_roles` then `vector_roles` order.

    Matrix role j: lr = lr * elr / ewd, weight_decay = weight_decay * elr * ewd (multipliers from
    `matrix_multipliers[j]`, a `MatrixMultipliers` or an `(elr, ewd)` pair; default (1, 1)). Vector role
    j: lr = lr * vector_lr_multipliers[j] (default 1), weight_decay = 0. Each group holds "params",
    "param_names", "role", "lr", "weight_decay", "base_lr", "base_weight_decay". Multiplier keys that
    are not roles of the right kind raise ValueError (a typo would otherwise be silently ignored).
    """
    matrix_multipliers = dict(matrix_multipliers or {})
    vector_lr_multipliers = dict(vector_lr_multipliers or {})
    for key in matrix_multipliers:
        if key not in matrix_roles:
            raise ValueError(f"matrix_multipliers has {key!r}, which is not a matrix role: {list(matrix_roles)}")
    for key, value in vector_lr_multipliers.items():
        if key not in vector_roles:
            raise ValueError(f"vector_lr_multipliers has {key!r}, which is not a vector role: {list(vector_roles)}")
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
            raise ValueError(f"vector_lr_multipliers[{key!r}] must be a finite number >= 0, got {value!r}")
    by_role = classify_parameters(
        named_parameters, classifier, matrix_roles=matrix_roles, vector_roles=vector_roles
    )
    groups: list[dict] = []
    for role in (*matrix_roles, *vector_roles):
        if role not in by_role:
            continue
        if role in matrix_roles:
            mult = matrix_multipliers.get(role, MatrixMultipliers())
            if not isinstance(mult, MatrixMultipliers):
                mult = MatrixMultipliers(*mult)
            group_lr, group_wd = matrix_lr_wd(lr, weight_decay, mult.elr, mult.ewd)
        else:
            group_lr, group_wd = lr * vector_lr_multipliers.get(role, 1.0), 0.0
        names, params = zip(*by_role[role])
        groups.append(
            {
                "params": list(params),
                "param_names": list(names),
                "role": role,
                "lr": group_lr,
                "weight_decay": group_wd,
                "base_lr": group_lr,
                "base_weight_decay": group_wd,
            }
        )
    return groups


def apply_schedule(optimizer: torch.optim.Optimizer, lr_factor: float, wd_factor: float) -> None:
    """Set every group's lr = base_lr * lr_factor and weight_decay = base_weight_decay * wd_factor.

    Groups must carry "base_lr" and "base_weight_decay" (as `build_param_groups` makes them).
    """
    for index, group in enumerate(optimizer.param_groups):
        if "base_lr" not in group or "base_weight_decay" not in group:
            raise ValueError(
                f"optimizer param group {index} (role {group.get('role', '?')!r}) has no base_lr / "
                "base_weight_decay; build the groups with build_param_groups"
            )
        group["lr"] = group["base_lr"] * lr_factor
        group["weight_decay"] = group["base_weight_decay"] * wd_factor


def scale_multipliers(
    multipliers: Mapping[str, float],
    base_width: int,
    width: int,
    exponents: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """Forward multipliers tuned at `base_width`, transferred to `width`: m * (width / base_width) ** e.

    `exponents` defaults to `MUP_WIDTH_EXPONENTS` (the table in the module docstring). A multiplier
    without an exponent raises ValueError naming it.
    """
    table = MUP_WIDTH_EXPONENTS if exponents is None else exponents
    for name, value in (("base_width", base_width), ("width", width)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    missing = sorted(set(multipliers) - set(table))
    if missing:
        raise ValueError(
            f"no width exponent for multiplier(s) {', '.join(missing)}; pass exponents= with an entry for each"
        )
    ratio = width / base_width
    return {name: value * ratio ** table[name] for name, value in multipliers.items()}
