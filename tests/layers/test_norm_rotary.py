"""RMSNorm, grouped gated RMSNorm and RoPE against the transformers falcon_h1 reference."""

import pytest
import torch
from transformers import FalconH1Config
from transformers.models.falcon_h1.modeling_falcon_h1 import (
    FalconH1RMSNorm,
    FalconH1RMSNormGated,
    FalconH1RotaryEmbedding,
    apply_rotary_pos_emb,
)

from hybridlm.modules import GatedRMSNorm, RMSNorm, RotaryEmbedding, apply_rotary, gated_rms_norm
from hybridlm.modules.norm import rms_normalize


def test_rms_norm_matches_falcon_h1():
    torch.manual_seed(0)
    x = torch.randn(2, 7, 24) * 3
    ours, ref = RMSNorm(24, eps=1e-5), FalconH1RMSNorm(24, eps=1e-5)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(24))
        ref.weight.copy_(ours.weight)
    torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=0)
    expected = ours.weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(ours(x), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the fused bf16 kernel)")
def test_rms_norm_bf16_on_cuda_within_one_rounding():
    """A bf16 CUDA input goes through the fused kernel as it is: the normalized value is the float64 one rounded once
    to bf16 (within two bf16 units: the kernel's float32 rsqrt), then scaled; gradients flow to x and the weight."""
    torch.manual_seed(0)
    x = (torch.randn(4, 33, 768, dtype=torch.float64) * 3).to(torch.bfloat16)
    norm = RMSNorm(768, eps=1e-5).cuda()
    xs = x.cuda().requires_grad_(True)
    out = norm(xs)
    assert out.dtype == torch.float32  # float32 weight times the bf16 normalized tensor
    exact = x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(out.double().cpu(), exact, rtol=2 * 2**-8, atol=0)
    out.sum().backward()
    assert xs.grad is not None and torch.isfinite(xs.grad).all() and norm.weight.grad is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA autocast's float32 policy)")
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_rms_normalize_keeps_bf16_under_cuda_autocast(backend):
    """Under CUDA autocast a bf16 input is normalized as it is: a bf16 result equal to the one outside autocast, and
    the backward keeps no float32 copy of the input (autocast's own float32 policy for rms_norm would keep one): the
    torch form keeps the bf16 input, "auto" (the Triton kernels) the bf16 output, each with a float32 1/rms per row;
    the gradient matches the float64 one within bf16 rounding."""
    torch.manual_seed(0)
    u = (torch.randn(2, 64, 10, 64, dtype=torch.float64) * 2).to("cuda", torch.bfloat16).requires_grad_(True)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (kept.append(t), t)[1], lambda t: t):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = rms_normalize(u, eps=1e-6, backend=backend)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, rms_normalize(u.detach(), eps=1e-6, backend=backend), rtol=0, atol=0)
    assert not [t for t in kept if t.dtype == torch.float32 and t.numel() == u.numel()], [t.shape for t in kept]
    kept_storage = {t.untyped_storage().data_ptr() for t in kept}
    expected = u if backend == "torch" else out
    assert expected.untyped_storage().data_ptr() in kept_storage
    probe = torch.randn(u.shape, dtype=torch.float64)
    (out.double() * probe.cuda()).sum().backward()
    exact = u.detach().double().cpu().requires_grad_(True)
    ((exact / torch.sqrt(exact.pow(2).mean(-1, keepdim=True) + 1e-6)) * probe).sum().backward()
    torch.testing.assert_close(u.grad.double().cpu(), exact.grad, rtol=3 * 2**-8, atol=3 * 2**-8)


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("norm_before_gate", [True, False])
@pytest.mark.parametrize("with_gate", [True, False])
def test_gated_norm_matches_falcon_h1(groups, norm_before_gate, with_gate):
    torch.manual_seed(1)
    x, z = torch.randn(3, 5, 32), torch.randn(3, 5, 32)
    ours = GatedRMSNorm(32, groups=groups, eps=1e-6, norm_before_gate=norm_before_gate)
    ref = FalconH1RMSNormGated(32, eps=1e-6, n_groups=groups, norm_before_gate=norm_before_gate)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(32))
        ref.weight.copy_(ours.weight)
    gate = z if with_gate else None
    torch.testing.assert_close(ours(x, gate), ref(x, gate), rtol=1e-6, atol=1e-6)


def test_gated_norm_groups_and_gate_order_matter():
    torch.manual_seed(2)
    x, z, w = torch.randn(2, 4, 16), torch.randn(2, 4, 16), torch.ones(16)
    one = gated_rms_norm(x, w, z, groups=1)
    assert not torch.allclose(one, gated_rms_norm(x, w, z, groups=2), atol=1e-3)
    assert not torch.allclose(one, gated_rms_norm(x, w, z, groups=1, norm_before_gate=False), atol=1e-3)


@pytest.mark.parametrize("base", [1e4, 1e11])
def test_rotary_matches_falcon_h1(base):
    torch.manual_seed(3)
    head_dim, heads = 16, 3
    config = FalconH1Config(hidden_size=48, num_attention_heads=heads, head_dim=head_dim, rope_theta=base,
                            mamba_d_ssm=48, mamba_n_heads=3)
    ref_rope = FalconH1RotaryEmbedding(config)
    position_ids = torch.tensor([[0, 1, 2, 5, 9, 100, 4000]])
    q, k = torch.randn(1, 7, heads, head_dim), torch.randn(1, 7, heads, head_dim)
    cos, sin = RotaryEmbedding(head_dim, base=base)(position_ids)
    ref_cos, ref_sin = ref_rope(q, position_ids)
    torch.testing.assert_close(cos, ref_cos, rtol=0, atol=1e-6)
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), ref_cos, ref_sin)
    torch.testing.assert_close(apply_rotary(q, cos, sin), ref_q.transpose(1, 2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(apply_rotary(k, cos, sin), ref_k.transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_rotary_scores_depend_on_relative_position_only():
    torch.manual_seed(4)
    rope = RotaryEmbedding(8, base=100.0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def score(m, n):
        cos_m, sin_m = rope(torch.tensor([[m]]))
        cos_n, sin_n = rope(torch.tensor([[n]]))
        return (apply_rotary(q, cos_m, sin_m) * apply_rotary(k, cos_n, sin_n)).sum()

    torch.testing.assert_close(score(7, 3), score(14, 10), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(score(7, 3), score(7, 4), atol=1e-3)
