"""The SSM mixers in training on the Triton kernels recompute their conv, norms and write preparation in the
backward (`hybridlm.ops.recompute`), keeping the scans' outputs: values and gradients bit for bit the plain path's
(eager; compiled, to rounding), and fewer bytes kept. `tests/ops/test_recompute.py` counts the launches."""

from __future__ import annotations

import pytest
import torch

from hybridlm.layers import fast_weight as fast_weight_layer
from hybridlm.layers import mamba2 as mamba2_layer
from hybridlm.layers.fast_weight import FastWeightMixer
from hybridlm.layers.mamba2 import Mamba2Mixer
from hybridlm.models.config import HybridConfig
from hybridlm.modules.boundaries import sequence_ids
from tests.ops.triton_modes import DEVICE, interpret

FAST_WEIGHT = [dict(fw_rule="1A"), dict(fw_rule="1"), dict(fw_rule="3A", fw_window=3), dict(fw_rule="2A"),
               dict(fw_rule="1A", fw_gates="fixed", fw_step_size="direct")]
D = 24


def fast_weight_mixer(**fw) -> FastWeightMixer:
    fields = dict(vocab_size=32, hidden_size=D, num_attention_heads=2, intermediate_size=0, num_hidden_layers=1,
                  ssm_mixer="fast_weight", fw_heads=2, fw_head_dim=16, fw_chunk_size=16, fw_conv_size=3)
    config = HybridConfig(**{**fields, **fw})
    torch.manual_seed(0)
    mixer = FastWeightMixer(config, layer_idx=0)
    if mixer.beta_bias is not None:
        with torch.no_grad():
            mixer.beta_bias.normal_(0.0, 0.5)
            mixer.lam_bias.normal_(0.0, 1.0)
    mixer.backend = "triton"
    return mixer.to(DEVICE)


def mamba2_mixer(**changes) -> Mamba2Mixer:
    fields = dict(vocab_size=32, hidden_size=D, num_attention_heads=2, intermediate_size=0, num_hidden_layers=1,
                  mamba_d_ssm=32, mamba_n_heads=2, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1,
                  mamba_chunk_size=16)
    torch.manual_seed(0)
    mixer = Mamba2Mixer(HybridConfig(**{**fields, **changes}), layer_idx=0)
    with torch.no_grad():
        mixer.A_log.copy_(torch.randn(mixer.num_heads) * 0.5)
        mixer.dt_bias.copy_(torch.randn(mixer.num_heads))
    mixer.backend = "triton"
    return mixer.to(DEVICE)


def train_once(forward, mixer, **kwargs):
    """forward(x) on a fixed input, then a backward: the output, the input's and parameters' gradients, and the bytes
    of the storages autograd keeps after the forward (the parameters' not counted)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 50, D, generator=g).to(DEVICE).requires_grad_()
    kept = {}
    with torch.autograd.graph.saved_tensors_hooks(
            lambda t: (kept.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()), t)[1],
            lambda t: t):
        out = forward(x, **kwargs)
    out.backward(torch.linspace(-1, 1, out.numel(), device=DEVICE).reshape(out.shape))
    grads = [x.grad] + [p.grad.clone() for p in mixer.parameters()]
    mixer.zero_grad()
    params = {p.untyped_storage().data_ptr() for p in mixer.parameters()}
    return out.detach(), grads, sum(n for ptr, n in kept.items() if ptr not in params)


def run(mixer, module, monkeypatch, *, recompute: bool, **kwargs):
    """train_once on the mixer itself, with the number of recomputed regions it ran."""
    mixer.recompute = recompute
    regions = []
    original = module.recompute_except_kernels
    monkeypatch.setattr(module, "recompute_except_kernels",
                        lambda fn, *inputs: regions.append(1) or original(fn, *inputs))
    out, grads, nbytes = train_once(mixer, mixer, **kwargs)
    monkeypatch.undo()
    return out, grads, len(regions), nbytes


def assert_same(a, b):
    assert torch.equal(a[0], b[0])
    for ga, gb in zip(a[1], b[1]):
        assert (ga is None and gb is None) or torch.equal(ga, gb)


def packed_kwargs(length: int = 50):
    cu_seqlens = torch.tensor([0, 1, 19, 34, length])
    return dict(cu_seqlens=cu_seqlens.to(DEVICE), seq_idx=sequence_ids(cu_seqlens, length).unsqueeze(0).to(DEVICE))


@interpret
@pytest.mark.parametrize("fw", FAST_WEIGHT, ids=lambda fw: "-".join(str(v) for v in fw.values()))
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_fast_weight_mixer_recomputes_exactly(monkeypatch, fw, packed):
    """float32; `packed`: four documents restarted in place (seq_idx), or through cu_seqlens where the op cannot."""
    mixer = fast_weight_mixer(**fw)
    kwargs = packed_kwargs() if packed else {}
    plain = run(mixer, fast_weight_layer, monkeypatch, recompute=False, **kwargs)
    recomputed = run(mixer, fast_weight_layer, monkeypatch, recompute=True, **kwargs)
    assert_same(recomputed, plain)
    assert (plain[2], recomputed[2]) == (0, 1)
    # q, k, the write events (x, y) at the least: 4 x [T, H, K] float32 fewer.
    assert recomputed[3] <= plain[3] - 4 * 50 * 2 * 16 * 4


@interpret
@pytest.mark.parametrize("changes", [{}, dict(ssm_multiplier_x=1.5, ssm_multiplier_B=0.7, ssm_multiplier_C=1.3,
                                              ssm_multiplier_dt=0.6, mamba_rms_norm=True)], ids=["plain", "muP"])
def test_mamba2_mixer_recomputes_exactly(monkeypatch, changes):
    mixer = mamba2_mixer(**changes)
    plain = run(mixer, mamba2_layer, monkeypatch, recompute=False)
    recomputed = run(mixer, mamba2_layer, monkeypatch, recompute=True)
    assert_same(recomputed, plain)
    assert (plain[2], recomputed[2]) == (0, 1)
    # The conv's output (x, B, C): [T, d_ssm + 2 G N] float32 fewer.
    assert recomputed[3] <= plain[3] - 50 * (32 + 2 * 16) * 4


def test_no_recomputation_without_the_triton_kernels_or_a_gradient(monkeypatch):
    """The torch paths would run whole again: the chunk backend keeps the plain path in training; so do no gradient
    and a decoding cache on the Triton backend."""
    from hybridlm.layers.cache import LayerCache

    for module in (fast_weight_layer, mamba2_layer):
        monkeypatch.setattr(module, "recompute_except_kernels", lambda *args: pytest.fail("recomputed"))
    x = torch.randn(1, 12, D, requires_grad=True)
    for mixer in (fast_weight_mixer(fw_rule="1A").cpu(), mamba2_mixer().cpu()):
        mixer.recompute = True  # (Mamba-2's default is off)
        mixer.backend = "chunk"
        mixer(x).sum().backward()
        mixer.backend = "triton"
        pieces = mixer.in_proj(x)[..., : mixer.conv_channels]
        assert mixer._recomputes(pieces, None, None)
        assert not mixer._recomputes(pieces, LayerCache(), None)
        assert not mixer._recomputes(pieces.detach(), None, None)
        with torch.no_grad():
            assert not mixer._recomputes(pieces, None, None)


def compiled_run(mixer, *, recompute: bool, **kwargs):
    """train_once through torch.compile, fullgraph (aot_eager: inductor's graphs and recomputation tags, without its
    code generation)."""
    mixer.recompute = recompute
    torch._dynamo.reset()
    return train_once(torch.compile(mixer, backend="aot_eager", fullgraph=True), mixer, **kwargs)


@interpret
@pytest.mark.parametrize("case", ["fw-1A", "fw-1A-packed", "mamba2"])
def test_compiled_mixers_keep_the_scans_outputs_only(case):
    """Compiled, the region is selective checkpointing (the scans' custom ops kept): the same values and gradients
    (rel. < 1e-5) and fewer bytes kept than the compiled plain path."""
    mixer = mamba2_mixer() if case == "mamba2" else fast_weight_mixer(fw_rule="1A")
    kwargs = packed_kwargs() if case.endswith("packed") else {}
    plain = compiled_run(mixer, recompute=False, **kwargs)
    recomputed = compiled_run(mixer, recompute=True, **kwargs)
    torch.testing.assert_close(recomputed[0], plain[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(recomputed[1], plain[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    width = 32 + 2 * 16 if case == "mamba2" else 4 * 2 * 16  # x, B, C | q, k and the write events x, y
    assert recomputed[2] <= plain[2] - 50 * width * 4


def live_bytes_after_forward(mixer, **kwargs) -> int:
    """Bytes of the tensors the mixer's forward made (parameters and input aside) still alive once it returns: what
    the backward will find, saved or held by the recomputation alike."""
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    made = {}

    class Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()
                    made.setdefault(storage.data_ptr(), (StorageWeakRef(storage), storage.nbytes()))
            return out

    x = torch.randn(1, 64, D, device=DEVICE, requires_grad=True)
    with Track():
        out = mixer(x, **kwargs)
    alive = sum(n for ref, n in made.values() if not ref.expired())
    out.sum().backward()
    return alive


@interpret
@pytest.mark.parametrize("case", ["fw-1-read-before", "mamba2"])
def test_many_short_documents_keep_no_more_than_the_plain_path(case):
    """Packed on cu_seqlens (16 documents of 4 tokens) the kernels pad every document and return a final state per
    document, which the plain path frees after the forward; the region holds them by weak reference only, so it keeps
    less (the conv's output and the write events fewer). The states are large here (64 x 64, 16 x 128 per head),
    larger than what the region saves: holding them would keep more than the plain path."""
    if case == "mamba2":
        mixer = mamba2_mixer(mamba_d_state=128)
    else:
        mixer = fast_weight_mixer(fw_rule="1", fw_read="before", fw_heads=1, fw_head_dim=64)
    cu_seqlens = torch.arange(0, 65, 4).to(DEVICE)
    mixer.recompute = False
    plain = live_bytes_after_forward(mixer, cu_seqlens=cu_seqlens)
    mixer.recompute = True
    recomputed = live_bytes_after_forward(mixer, cu_seqlens=cu_seqlens)
    assert recomputed < plain
