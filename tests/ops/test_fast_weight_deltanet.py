"""DeltaNet and Gated DeltaNet as special cases of the Falcon rules, against independent step loops in float64.

DeltaNet (Schlag et al. 2021; the paper's eq. 4.3 with the same-step pair), per head, S [K, V]:

    S_t = S_{t-1} + b_t k_t (v_t - S_{t-1}^T k_t)^T,   o_t = S_t^T q_t

is rule "1" with `pairing="same_step"`, `step_size="direct"` (eta = b), lam = 0 (gamma = 1), `read="after"`: exact.

Gated DeltaNet (Yang et al. 2024; the paper's eq. C.1), with the gate g_t in (0, 1]:

    S_t = g_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T

is not rule 1 with a decay as such: rule 1 writes gamma S + eta k (v - S^T k)^T, whose residual is taken against the
undecayed S, so the k k^T term carries eta where Gated DeltaNet's carries g b. Matching both terms needs the inputs
reparametrized: eta = g b, lam = (1 - g) / (g b) (so gamma = 1 - eta lam = g) and v' = v / g (so eta v' = b v). The
state sequence is then the same, exactly, provided b > 0 (lam is finite) and g >= eps_gamma (the decay clamp stays
inactive). These tests check both identities, outputs and carried states, on odd sizes and several heads.
"""

from __future__ import annotations

import pytest
import torch

from hybridlm.ops.fast_weight import FastWeightState, fast_weight_attention

B, T, H, K, V = 2, 23, 3, 7, 5
SPLIT = 10  # the state is carried over from [0:SPLIT] into [SPLIT:T]


def _delta_rule_reference(q, k, v, b, g, S):
    """Gated DeltaNet's step loop (DeltaNet for g = 1), written from its defining recurrence.

    q, k [B, T, H, K]; v [B, T, H, V]; b, g [B, T, H]; S [B, H, K, V] the entry state. Returns o, S_T."""
    outputs = []
    eye = torch.eye(k.shape[-1], dtype=k.dtype)
    for t in range(q.shape[1]):
        kt, vt, bt, gt = k[:, t], v[:, t], b[:, t, :, None, None], g[:, t, :, None, None]
        transition = eye - bt * torch.einsum("bhi,bhj->bhij", kt, kt)              # I - b k k^T  [B, H, K, K]
        S = gt * (transition @ S) + bt * torch.einsum("bhk,bhv->bhkv", kt, vt)     # [B, H, K, V]
        outputs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))                 # o_t = S_t^T q_t
    return torch.stack(outputs, dim=1), S


def _inputs(seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    b = 0.1 + 0.9 * torch.rand(B, T, H, generator=gen, dtype=torch.float64)     # b in (0.1, 1)
    g = 0.5 + 0.5 * torch.rand(B, T, H, generator=gen, dtype=torch.float64)     # g in (0.5, 1)
    S0 = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)
    return q, k, v, b, g, S0


def _rule1_same_step(q, k, v, eta, lam, S0, backend):
    """Rule 1, same-step pair, direct step size, run as [0:SPLIT] then [SPLIT:T] from the carried state."""
    options = dict(rule="1", pairing="same_step", step_size="direct", read="after", backend=backend, chunk_size=4)
    state = FastWeightState(S=S0)
    outputs = []
    for part in (slice(0, SPLIT), slice(SPLIT, T)):
        o, state = fast_weight_attention(q[:, part], k[:, part], v[:, part], eta[:, part], lam[:, part],
                                         initial_state=state, output_final_state=True, **options)
        outputs.append(o)
    return torch.cat(outputs, dim=1), state.S


@pytest.mark.parametrize("backend", ["naive", "chunk"])
def test_deltanet_is_rule_1_same_step_direct_without_decay(backend):
    q, k, v, b, _, S0 = _inputs(0)
    expected_o, expected_S = _delta_rule_reference(q, k, v, b, torch.ones_like(b), S0)
    o, S = _rule1_same_step(q, k, v, b, torch.zeros_like(b), S0, backend)
    torch.testing.assert_close(o, expected_o, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(S, expected_S, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", ["naive", "chunk"])
def test_gated_deltanet_is_rule_1_with_reparametrized_inputs(backend):
    q, k, v, b, g, S0 = _inputs(1)
    expected_o, expected_S = _delta_rule_reference(q, k, v, b, g, S0)
    eta = g * b
    lam = (1 - g) / eta
    o, S = _rule1_same_step(q, k, v / g[..., None], eta, lam, S0, backend)
    torch.testing.assert_close(o, expected_o, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(S, expected_S, rtol=1e-10, atol=1e-10)


def test_gated_deltanet_is_not_rule_1_with_the_gate_as_its_decay():
    """The direct mapping (gamma = g, eta = b, v unchanged) differs: the residual is taken against the undecayed S."""
    q, k, v, b, g, S0 = _inputs(2)
    expected_o, _ = _delta_rule_reference(q, k, v, b, g, S0)
    o, _ = _rule1_same_step(q, k, v, b, (1 - g) / b, S0, "naive")
    assert (o - expected_o).abs().max() > 1e-3
