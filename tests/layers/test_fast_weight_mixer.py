"""FastWeightMixer: chunk vs naive through the layer, packed documents, cached decoding, gradients, dtypes, errors."""

from __future__ import annotations

import math

import pytest
import torch

from hybridlm.layers import fast_weight as fast_weight_layer
from hybridlm.layers.cache import LayerCache
from hybridlm.layers.fast_weight import FastWeightMixer
from hybridlm.models.config import HybridConfig
from tests.helpers import rel_err
from tests.layers.packed_prefill import check_packed_prefill_matches_alone

RULES = ("1", "2", "3", "1A", "2A", "3A")
PAIRINGS = ("shifted", "same_step")
CASES = [pytest.param(rule, pairing, id=f"rule{rule}-{pairing}") for rule in RULES for pairing in PAIRINGS]
D, H, K = 20, 2, 6  # hidden size, fast-weight heads, head dim (odd sizes on purpose)


def make_config(rule: str, pairing: str = "shifted", **changes) -> HybridConfig:
    fields = dict(
        vocab_size=32, hidden_size=D, num_attention_heads=2, intermediate_size=0, num_hidden_layers=1,
        ssm_mixer="fast_weight", fw_rule=rule, fw_window=3 if rule in ("3", "3A") else 1, fw_pairing=pairing,
        fw_heads=H, fw_head_dim=K, fw_conv_size=3,
    )
    fields.update(changes)
    return HybridConfig(**fields)


def make_mixer(config: HybridConfig, *, dtype=torch.float32, seed: int = 0) -> FastWeightMixer:
    """A mixer with seeded weights; the gate biases are spread out so that decay and gains vary widely."""
    torch.manual_seed(seed)
    mixer = FastWeightMixer(config, layer_idx=0)
    with torch.no_grad():
        mixer.beta_bias.normal_(0.0, 0.5)
        mixer.lam_bias.normal_(0.0, 1.0)
        mixer.norm.weight.uniform_(0.5, 1.5)
    return mixer.to(dtype)


def make_hidden(B: int, T: int, *, dtype=torch.float32, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, D, generator=g, dtype=torch.float64).to(dtype)


def op_outputs(mixer: FastWeightMixer, hidden: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(mixer output, the op's output o before the gated norm), captured with a hook on the norm."""
    seen = []
    handle = mixer.norm.register_forward_hook(lambda module, args, out: seen.append(args[0]))
    try:
        out = mixer(hidden, **kwargs)
    finally:
        handle.remove()
    return out, seen[0]


@pytest.mark.parametrize("rule,pairing", CASES)
def test_shape_and_dtype(rule, pairing):
    mixer = make_mixer(make_config(rule, pairing))
    out = mixer(make_hidden(2, 9))
    assert out.shape == (2, 9, D) and out.dtype == torch.float32
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("rule,pairing", CASES)
def test_chunk_matches_naive(rule, pairing):
    mixer = make_mixer(make_config(rule, pairing), dtype=torch.float64)
    mixer.chunk_size = 8  # T = 21: two full chunks and a partial one
    hidden = make_hidden(2, 21, dtype=torch.float64)
    mixer.backend = "naive"
    out_naive, o_naive = op_outputs(mixer, hidden)
    mixer.backend = "chunk"
    out_chunk, o_chunk = op_outputs(mixer, hidden)
    assert o_chunk.dtype == torch.float64 and out_chunk.dtype == torch.float64
    assert rel_err(o_chunk, o_naive) < 1e-10
    assert rel_err(out_chunk, out_naive) < 1e-10  # the gated norm stays in float64 too


@pytest.mark.parametrize("rule,pairing", CASES)
def test_packed_documents_match_each_document_alone(rule, pairing):
    mixer = make_mixer(make_config(rule, pairing), dtype=torch.float64)
    lengths = [7, 1, 12, 5]  # a one-token document: no write pair at all under the shifted pairing
    hidden = make_hidden(1, sum(lengths), dtype=torch.float64)
    cu_seqlens = torch.tensor([0, 7, 8, 20, 25])
    packed, o_packed = op_outputs(mixer, hidden, cu_seqlens=cu_seqlens)
    alone, o_alone = zip(*[op_outputs(mixer, doc) for doc in hidden.split(lengths, dim=1)])
    alone, o_alone = torch.cat(alone, dim=1), torch.cat(o_alone, dim=1)
    assert rel_err(o_packed, o_alone) < 1e-10
    assert rel_err(packed, alone) < 1e-10
    # Without the offsets the documents would mix: the comparison above can tell.
    assert rel_err(mixer(hidden), alone) > 1e-3


@pytest.mark.parametrize("rule,pairing", CASES)
def test_position_id_restarts_match_cu_seqlens(rule, pairing):
    mixer = make_mixer(make_config(rule, pairing), dtype=torch.float64)
    hidden = make_hidden(2, 10, dtype=torch.float64)
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5], list(range(10))])
    by_positions = mixer(hidden, position_ids=position_ids)
    by_offsets = mixer(hidden.reshape(1, 20, D), cu_seqlens=torch.tensor([0, 4, 10, 20])).reshape(2, 10, D)
    assert rel_err(by_positions, by_offsets) < 1e-12
    # Positions without a restart (a continuation) change nothing.
    plain = mixer(hidden)
    assert rel_err(mixer(hidden, position_ids=torch.arange(3, 13)[None]), plain) == 0.0
    assert rel_err(by_positions[1], plain[1]) < 1e-12 and rel_err(by_positions[0], plain[0]) > 1e-3


def check_decoding_matches_full(mixer: FastWeightMixer, *, B=2, T=13, prefix=5, middle=4):
    hidden = make_hidden(B, T, seed=3)
    full = mixer(hidden)
    cache = LayerCache()
    pieces = [mixer(hidden[:, :prefix], cache=cache)]  # prefill: the chunk path
    pieces.append(mixer(hidden[:, prefix : prefix + middle], cache=cache))  # a chunk continuing from the state
    for t in range(prefix + middle, T):  # then one token at a time: the recurrent step
        pieces.append(mixer(hidden[:, t : t + 1], cache=cache))
    stepped = torch.cat(pieces, dim=1)
    for t in range(T):
        assert rel_err(stepped[:, t], full[:, t]) < 1e-4, f"position {t}"
    assert cache.ssm["S"].dtype == torch.float32
    assert cache.ssm["S"].shape == (B, mixer.num_heads, mixer.head_dim, mixer.head_dim)


@pytest.mark.parametrize("rule,pairing", CASES)
def test_cached_decoding_matches_full_forward(rule, pairing):
    check_decoding_matches_full(make_mixer(make_config(rule, pairing)))


VARIANTS = [
    pytest.param("1", dict(fw_step_size="direct", fw_qk_norm="l2"), id="rule1-direct-l2"),
    pytest.param("2A", dict(fw_read="before", fw_ridge_scaling=True), id="rule2A-read_before-ridge_scaling"),
    pytest.param("3", dict(fw_step_size="direct", fw_ridge_scaling=True, fw_qk_norm="none"),
                 id="rule3-direct-ridge_scaling-no_qk_norm"),
    pytest.param("3A", dict(fw_read="before", fw_conv_size=1), id="rule3A-read_before-no_conv_history"),
]


@pytest.mark.parametrize("rule,changes", VARIANTS)
def test_options_decode_and_match_naive(rule, changes):
    mixer = make_mixer(make_config(rule, **changes))
    check_decoding_matches_full(mixer)
    mixer = mixer.double()
    hidden = make_hidden(2, 11, dtype=torch.float64)
    mixer.backend = "naive"
    _, o_naive = op_outputs(mixer, hidden)
    mixer.backend = "chunk"
    _, o_chunk = op_outputs(mixer, hidden)
    assert rel_err(o_chunk, o_naive) < 1e-10


@pytest.mark.parametrize(
    "changes",
    [dict(fw_read="before"), dict(fw_step_size="direct"), dict(fw_ridge_scaling=True), dict(fw_qk_norm="none"),
     dict(fw_qk_norm="l2"), dict(fw_pairing="same_step"), dict(fw_lam_scale=4.0)],
    ids=lambda changes: "-".join(f"{k}={v}" for k, v in changes.items()),
)
def test_each_option_reaches_the_op(changes):
    """Same weights, one option changed: the output changes (so the option is not dropped on the way)."""
    hidden = make_hidden(2, 9)
    # Ridge scaling: unnormalized keys and one lam_scale for both (with QK norm |x|^2 is constant for rule 1,
    # and the default lam_scale makes the scale-coupled ridge lam |x|^2 equal the plain one: module docstring).
    common = dict(fw_qk_norm="none") if "fw_ridge_scaling" in changes else {}
    common.update(fw_lam_scale=1.0)
    base = make_mixer(make_config("1", **common))(hidden)
    changed = make_mixer(make_config("1", **{**common, **changes}))(hidden)
    assert rel_err(changed, base) > 1e-3


def test_read_before_write_sees_the_previous_state():
    """Same-step pairing: reading after the write sees pair 1 at step 1; reading before sees S_0 = 0."""
    hidden = make_hidden(1, 6)
    after = make_mixer(make_config("1A", "same_step"))(hidden)
    before = make_mixer(make_config("1A", "same_step", fw_read="before"))(hidden)
    assert after[:, 0].abs().max() > 0 and before[:, 0].abs().max() == 0


def test_qk_norms():
    u = torch.randn(3, 4, H, K, generator=torch.Generator().manual_seed(0))
    l2 = make_mixer(make_config("1", fw_qk_norm="l2"))
    assert torch.allclose(l2._normalize(u).norm(dim=-1), torch.ones(3, 4, H), atol=1e-5)
    rms = make_mixer(make_config("1"))  # the default
    assert rms.qk_norm == "rms"
    assert torch.allclose(rms._normalize(u).pow(2).mean(-1), torch.ones(3, 4, H), atol=1e-4)
    assert torch.equal(make_mixer(make_config("1", fw_qk_norm="none"))._normalize(u), u)
    # The formulas with their eps, in float64 (small rows, where eps shows).
    small = u.double() * 1e-3
    eps = fast_weight_layer._QK_EPS
    spelled = {"rms": small * torch.rsqrt(small.pow(2).mean(-1, keepdim=True) + eps),
               "l2": small * torch.rsqrt(small.pow(2).sum(-1, keepdim=True) + eps)}
    for mixer in (rms, l2):
        torch.testing.assert_close(mixer._normalize(small), spelled[mixer.qk_norm], rtol=1e-12, atol=1e-15)
    if torch.cuda.is_available():  # 16-bit on a GPU: within one or two roundings of bfloat16
        for mixer in (rms, l2):
            out = mixer._normalize(small.to("cuda", torch.bfloat16))
            assert out.dtype == torch.bfloat16
            reference = mixer._normalize(small.to(torch.bfloat16).double())
            assert ((out.cpu().double() - reference).abs() / reference.abs().clamp_min(1e-6)).max() < 2 ** -7
    # A bool reads as the norm it switches on or off.
    assert make_config("1", fw_qk_norm=True).fw_qk_norm == "rms"
    assert make_config("1", fw_qk_norm=False).fw_qk_norm == "none"


@pytest.mark.parametrize("rule,pairing", CASES)
def test_gradients_reach_every_parameter(rule, pairing):
    mixer = make_mixer(make_config(rule, pairing))
    hidden = make_hidden(2, 11).requires_grad_(True)
    out = mixer(hidden)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    (out * weights).sum().backward()
    for name, param in [("hidden", hidden), *mixer.named_parameters()]:
        assert param.grad is not None, f"{name} got no gradient"
        assert torch.isfinite(param.grad).all(), f"{name} has a non-finite gradient"
        assert param.grad.abs().sum() > 0, f"{name} has an all-zero gradient"


@pytest.mark.parametrize("rule,pairing", CASES)
def test_bf16_autocast_keeps_the_state_in_float32(rule, pairing):
    mixer = make_mixer(make_config(rule, pairing))
    hidden = make_hidden(2, 9)
    reference = mixer(hidden)
    cache = LayerCache()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mixer(hidden, cache=cache)
        step = mixer(make_hidden(2, 1, seed=7), cache=cache)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all() and torch.isfinite(step).all()
    assert cache.ssm["S"].dtype == torch.float32
    assert rel_err(out, reference) < 5e-2


def test_history_reaches_later_positions():
    """Changing the first token changes outputs far beyond the conv window: the state carries it."""
    mixer = make_mixer(make_config("1"))
    hidden = make_hidden(1, 12)
    changed = hidden.clone()
    changed[:, 0] += 1.0
    a, b = mixer(hidden), mixer(changed)
    assert rel_err(a[:, -1], b[:, -1]) > 1e-4
    # Shifted pairing, read after write: step 1 of a fresh sequence has no pair, so S_1 = S_0 = 0 (C.5).
    assert a[:, 0].abs().max() == 0 and a[:, 1].abs().max() > 0


def test_initialization():
    mixer = FastWeightMixer(make_config("1", fw_heads=4), layer_idx=0)
    assert torch.all(mixer.beta_bias == 0)  # beta = 2 sigmoid(0) = 1 for a zero projection
    p = torch.sigmoid(mixer.lam_bias)
    assert torch.allclose(p[[0, -1]], torch.tensor([1e-3, 1e-1]), rtol=1e-5)
    assert torch.allclose(p.log().diff(), torch.full((3,), math.log(100.0) / 3), rtol=1e-5)  # log-uniform
    assert mixer.lam_scale == K  # no ridge scaling: the nominal |x|^2 of an RMS-normalized key
    assert FastWeightMixer(make_config("1", fw_ridge_scaling=True), 0).lam_scale == 1.0
    direct = FastWeightMixer(make_config("1", fw_step_size="direct"), 0)
    logits = torch.zeros(1, 1, H)
    beta, lam = direct._gains(logits, logits)
    assert torch.allclose(beta * direct.feature_energy, torch.ones_like(beta))  # eta E0 = 1 at init
    assert lam.shape == (1, 1, H) and bool((lam > 0).all())
    per_column = FastWeightMixer(make_config("2"), 0)
    beta, _ = per_column._gains(torch.zeros(1, 1, H * K), torch.zeros(1, 1, H))
    assert beta.shape == (1, 1, H, K) and torch.allclose(beta, torch.ones_like(beta))


@pytest.mark.parametrize("rule", RULES)
def test_fixed_direct_steps_keep_the_regression_rules_stable(rule):
    """Fixed gates with direct steps: eta = 1 for the inner-product rules (RetNet's retention), eta E0 = 1 for the
    regression rules, whose residual feeds the state back (eta = 1 against rms-normalized keys of energy K would be
    eta E0 = K, outside (0, 2), and the state would grow ~K-fold per step); a long row stays finite."""
    config = make_config(rule, fw_gates="fixed", fw_step_size="direct", fw_head_dim=16, fw_heads=2)
    torch.manual_seed(0)
    mixer = FastWeightMixer(config, layer_idx=0).double()
    width = 2 * 16 if rule in ("2", "2A") else 2
    eta, _ = mixer._gains(torch.zeros(1, 1, width), torch.zeros(1, 1, 2))
    want = 1 / mixer.feature_energy if rule in ("1", "2", "3") else 1.0
    assert mixer.feature_energy == 16 and torch.all(eta == want)
    hidden = torch.randn(1, 200, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    _, o = op_outputs(mixer, hidden)
    assert bool(torch.isfinite(o).all()) and o.abs().max() < 1e3


def test_heads_default_to_the_mamba_allocation():
    config = make_config("1A", fw_heads=None, fw_head_dim=None, mamba_n_heads=4, mamba_d_ssm=40)
    mixer = FastWeightMixer(config, 0)
    assert (mixer.num_heads, mixer.head_dim) == (4, 10)


def test_block_builds_the_fast_weight_mixer():
    from hybridlm.layers.block import HybridBlock

    torch.manual_seed(0)
    block = HybridBlock(make_config("3A"), layer_idx=0)
    assert isinstance(block.ssm, FastWeightMixer)
    out = block(make_hidden(2, 7))
    assert out.shape == (2, 7, D) and torch.isfinite(out).all()


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(fw_qk_norm="cosine"), "fw_qk_norm"),
        (dict(fw_window=3), r"fw_window=3 needs a sliding rule .*fw_rule='1A'"),
        (dict(fw_lam_scale=-1.0), "fw_lam_scale must be > 0"),
        (dict(fw_lam_scale=math.inf), "fw_lam_scale must be a finite number"),
        (dict(fw_rule="4"), "fw_rule"),
        (dict(fw_chunk_size=0), "fw_chunk_size"),
    ],
)
def test_bad_config_raises_clear_errors(changes, message):
    with pytest.raises(ValueError, match=message):
        make_config("1A", **changes)


def test_chunk_size_and_lam_scale_reach_the_mixer():
    mixer = FastWeightMixer(make_config("3", fw_chunk_size=5, fw_lam_scale=0.25), 0)
    assert (mixer.chunk_size, mixer.lam_scale, mixer.window) == (5, 0.25, 3)
    # The chunk length changes only the schedule of the computation, not the result.
    mixer = make_mixer(make_config("3", fw_chunk_size=5), dtype=torch.float64)
    hidden = make_hidden(2, 17, dtype=torch.float64)
    short = mixer(hidden)
    mixer.chunk_size = 64
    assert rel_err(short, mixer(hidden)) < 1e-10


@pytest.mark.parametrize("rule,pairing", CASES)
def test_packed_prefill_states_equal_each_document_alone(rule, pairing):
    """The prefill of a padded batch: packed prompts into one cache leave each row the state of its
    prompt alone (S, last key, sliding tail, conv tail), and decoding continues row by row."""
    mixer = make_mixer(make_config(rule, pairing), dtype=torch.float64)
    docs = [make_hidden(1, n + 2, dtype=torch.float64, seed=10 + n) for n in (6, 1, 2, 9)]  # 1, 2: short tails
    check_packed_prefill_matches_alone(mixer, docs)


def test_cache_with_row_packed_documents_is_refused():
    mixer = make_mixer(make_config("1"))
    with pytest.raises(ValueError, match=r"cannot be combined with packed documents \(position_ids restarts\)"):
        mixer(make_hidden(1, 6), position_ids=torch.tensor([[0, 1, 0, 1, 2, 3]]), cache=LayerCache())


def test_a_nan_ridge_gain_reaches_the_output_instead_of_stopping():
    """The mixer's lam is a scaled sigmoid (>= 0 by construction), so it calls the op without the lam >= 0 check
    (on CUDA a device-side assert that would stop the process): a NaN there (a diverged input) comes out as NaN,
    for the trainer's guard to skip the update, and the other heads are untouched."""
    mixer = make_mixer(make_config("1A"))
    with torch.no_grad():
        mixer.lam_bias[1] = float("nan")
    _, o = op_outputs(mixer, make_hidden(2, 9))
    o = o.unflatten(-1, (H, -1))  # [B, T, H, V], the op's output before the gated norm
    assert o[:, :, 1].isnan().any() and not o[:, :, 0].isnan().any()
