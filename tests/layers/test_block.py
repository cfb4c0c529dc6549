"""Hybrid block: the three arrangements as written, either half off, the SSM mixer factory."""

import pytest
import torch

from hybridlm.layers import HybridBlock, LayerCache, Mamba2Mixer, build_ssm_mixer
from hybridlm.models.config import HybridConfig
from tests.helpers import rel_err
from tests.layers.block_helpers import make_block, runs_with_and_without_seq_idx


def ssm(block, n):
    return block.ssm(n * 1.3) * 0.4


def attn(block, n):
    return block.attn(n * 0.8) * 1.7


def test_sa_m():
    block = make_block()
    x = torch.randn(2, 7, 16)
    n = block.norm(x)
    h = x + ssm(block, n) + attn(block, n)
    torch.testing.assert_close(block(x), h + block.mlp(block.mlp_norm(h)))
    assert block.attn_norm is None


def test_sam():
    block = make_block(block_arrangement="SAM")
    x = torch.randn(2, 7, 16)
    n = block.norm(x)
    torch.testing.assert_close(block(x), x + ssm(block, n) + attn(block, n) + block.mlp(n))
    assert block.mlp_norm is None


def test_s_a_m():
    block = make_block(block_arrangement="S_A_M")
    x = torch.randn(2, 7, 16)
    h1 = x + ssm(block, block.norm(x))
    h2 = h1 + attn(block, block.attn_norm(h1))
    torch.testing.assert_close(block(x), h2 + block.mlp(block.mlp_norm(h2)))


@pytest.mark.parametrize("arrangement", ["SA_M", "SAM", "S_A_M"])
def test_either_half_can_be_off(arrangement):
    """Each block with one half off against the formula of its arrangement with that term removed."""
    x = torch.randn(1, 5, 16)
    no_attn = make_block(block_arrangement=arrangement, use_attention=False)
    no_ssm = make_block(block_arrangement=arrangement, ssm_mixer="none")
    no_mlp = make_block(block_arrangement=arrangement, intermediate_size=0)
    assert no_attn.attn is None and isinstance(no_attn.ssm, Mamba2Mixer)
    assert no_ssm.ssm is None and no_ssm.attn is not None
    assert no_mlp.mlp is None and no_mlp.mlp_norm is None
    # S_A_M keeps its second norm N_A only while both mixers run; with one of them off the other reads N(x).
    assert no_attn.attn_norm is None and no_ssm.attn_norm is None
    assert (no_mlp.attn_norm is not None) == (arrangement == "S_A_M")

    n = no_attn.norm(x)
    h = x + ssm(no_attn, n)
    expected = h + no_attn.mlp(no_attn.mlp_norm(h)) if arrangement != "SAM" else h + no_attn.mlp(n)
    torch.testing.assert_close(no_attn(x), expected)

    n = no_ssm.norm(x)
    h = x + attn(no_ssm, n)
    expected = h + no_ssm.mlp(no_ssm.mlp_norm(h)) if arrangement != "SAM" else h + no_ssm.mlp(n)
    torch.testing.assert_close(no_ssm(x), expected)

    n = no_mlp.norm(x)
    if arrangement == "S_A_M":
        h1 = x + ssm(no_mlp, n)
        expected = h1 + attn(no_mlp, no_mlp.attn_norm(h1))
    else:  # SA_M and SAM differ only in where the MLP reads from
        expected = x + ssm(no_mlp, n) + attn(no_mlp, n)
    torch.testing.assert_close(no_mlp(x), expected)


def test_factory():
    config = HybridConfig(hidden_size=16, num_attention_heads=2, mamba_d_ssm=16, mamba_n_heads=2)
    assert isinstance(build_ssm_mixer(config, 0), Mamba2Mixer)
    assert build_ssm_mixer(config.replace(ssm_mixer="none"), 0) is None


def test_fast_weight_block_runs():
    config = HybridConfig(hidden_size=16, num_attention_heads=2, ssm_mixer="fast_weight", fw_heads=2, fw_head_dim=8)
    block = HybridBlock(config, layer_idx=0)
    assert type(block.ssm).__name__ == "FastWeightMixer"
    x = torch.randn(1, 6, 16)
    assert block(x).shape == x.shape


def test_seq_idx_needs_cu_seqlens_and_the_torch_ssd():
    block = make_block()
    with pytest.raises(ValueError, match="needs its cu_seqlens"):
        block(torch.randn(1, 5, 16), seq_idx=torch.zeros(1, 5, dtype=torch.long))
    fw = make_block(ssm_mixer="fast_weight", fw_heads=2, fw_head_dim=8).ssm
    for extra in ({}, {"cu_seqlens": torch.tensor([0, 5]), "cache": LayerCache()}):
        with pytest.raises(ValueError, match="comes with the packed row"):
            fw(torch.randn(1, 5, 16), seq_idx=torch.zeros(1, 5, dtype=torch.long), **extra)
    assert block.ssm.takes_seq_idx
    block.ssm.backend = "triton"  # its kernels take cu_seqlens only: a compiled block keeps the packed call
    assert not block.ssm.takes_seq_idx


@pytest.mark.parametrize("ssm_mixer", ["mamba2", "fast_weight"])
def test_compiled_block_on_packed_documents_compiles_once(ssm_mixer):
    """Packed documents change the mixers' padded shapes with every batch. Compiled, a block must neither recompile
    per layout (each frame compiles once static, once with dynamic offsets; the recompile limit, lowered to 2 and
    made an error, stops anything more) nor change the output or the gradients. Given `seq_idx` (as the model
    passes it) the SSM mixers get it and run inside the graphs on the rows' shapes; attention runs packed documents
    outside them. The fast-weight op restarts documents in place there, with float32 sums in another order than
    per document, hence its tolerance on the norm of the difference."""
    import torch._dynamo

    from hybridlm.modules.boundaries import sequence_ids

    block = make_block(ssm_mixer=ssm_mixer, fw_heads=2, fw_head_dim=8)

    def close(a, b):
        if ssm_mixer == "fast_weight":  # in place: float32 sums in another order (the norm of the difference)
            assert rel_err(a, b) < 1e-5
        else:
            torch.testing.assert_close(a, b)
    x = torch.randn(1, 23, 16)
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=True):
            compiled = torch.compile(block, backend="aot_eager")
            for offsets in ([0, 23], [0, 5, 23], [0, 1, 2, 20, 23], [0, 11, 12, 23], [0, 3, 7, 9, 15, 23]):
                cu_seqlens = torch.tensor(offsets)
                seq_idx = sequence_ids(cu_seqlens, 23).unsqueeze(0)
                got_x, want_x = (x.clone().requires_grad_() for _ in range(2))
                got = compiled(got_x, cu_seqlens=cu_seqlens, seq_idx=seq_idx)
                want = block(want_x, cu_seqlens=cu_seqlens)
                close(got, want)
                weight = block.ssm.in_proj.weight
                got_grads = torch.autograd.grad(got.square().sum(), [got_x, weight])
                want_grads = torch.autograd.grad(want.square().sum(), [want_x, weight])
                for a, b in zip(got_grads, want_grads):
                    close(a, b)
        calls = []  # then, apart (dynamo guards on the list a hook appends to): how the compiled block calls the mixer
        block.ssm.register_forward_pre_hook(lambda module, args, kwargs: calls.append("seq_idx" in kwargs),
                                            with_kwargs=True)
        torch.compile(block, backend="eager")(x, cu_seqlens=cu_seqlens, seq_idx=seq_idx)
        assert calls == [True]
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("ssm_mixer,fw", [
    ("mamba2", {}),
    ("fast_weight", {}),
    ("fast_weight", dict(fw_rule="1A", fw_pairing="same_step")),
    ("fast_weight", dict(fw_rule="3A", fw_window=3)),
], ids=["mamba2", "fw-1", "fw-1A-same", "fw-3A"])
def test_ssm_mixers_give_the_same_with_seq_idx(ssm_mixer, fw):
    """An SSM mixer on packed documents gives the same output and gradients of every parameter (float64) with the
    compiled block's seq_idx beside cu_seqlens as with cu_seqlens alone."""
    from hybridlm.modules.boundaries import sequence_ids

    mixer = make_block(ssm_mixer=ssm_mixer, fw_heads=2, fw_head_dim=8, **fw).ssm.double()
    cu_seqlens = torch.tensor([0, 1, 9, 12, 23])
    seq_idx = sequence_ids(cu_seqlens, 23).unsqueeze(0)
    outs, grads = runs_with_and_without_seq_idx(mixer, torch.randn(1, 23, 16, dtype=torch.float64), cu_seqlens,
                                                seq_idx)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-10, atol=1e-10)
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("ssm_mixer,given", [("fast_weight", True), ("mamba2", False)])
def test_eager_block_on_packed_documents(ssm_mixer, given):
    """Outside torch.compile the block hands seq_idx to a mixer that prefers it (the fast-weight mixer: documents
    restarted in place, nothing padded to the longest) and cu_seqlens alone to the others; either way the output and
    the input's gradient equal the block run on each document by itself (float64)."""
    from hybridlm.modules.boundaries import sequence_ids

    block = make_block(ssm_mixer=ssm_mixer, fw_heads=2, fw_head_dim=8).double()
    offsets = [0, 4, 5, 15, 23]
    cu_seqlens = torch.tensor(offsets)
    seq_idx = sequence_ids(cu_seqlens, 23).unsqueeze(0)
    calls = []
    hook = block.ssm.register_forward_pre_hook(lambda module, args, kwargs: calls.append("seq_idx" in kwargs),
                                               with_kwargs=True)
    x = torch.randn(1, 23, 16, dtype=torch.float64, requires_grad=True)
    try:
        got = block(x, cu_seqlens=cu_seqlens, seq_idx=seq_idx)
    finally:
        hook.remove()
    assert calls[0] is given
    want = torch.cat([block(x[:, a:b]) for a, b in zip(offsets[:-1], offsets[1:])], dim=1)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    probe = torch.randn_like(got)
    (got_grad,) = torch.autograd.grad((got * probe).sum(), x)
    (want_grad,) = torch.autograd.grad((want * probe).sum(), x)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-10)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the Triton kernels' in-place restarts)")
def test_eager_block_on_packed_documents_on_cuda():
    """On a GPU the eager block's fast-weight mixer restarts the documents in place in the Triton kernels: float32
    output and input gradient equal the block run on each document by itself, to the kernels' float32 sums."""
    from hybridlm.modules.boundaries import sequence_ids

    block = make_block(ssm_mixer="fast_weight", fw_heads=2, fw_head_dim=16).cuda()
    offsets = [0, 40, 41, 150, 200]
    cu_seqlens = torch.tensor(offsets)
    seq_idx = sequence_ids(cu_seqlens, 200).unsqueeze(0).cuda()
    x = torch.randn(1, 200, 16, device="cuda", requires_grad=True)
    got = block(x, cu_seqlens=cu_seqlens, seq_idx=seq_idx)
    want = torch.cat([block(x[:, a:b]) for a, b in zip(offsets[:-1], offsets[1:])], dim=1)
    assert rel_err(got, want) < 2e-3
    probe = torch.randn_like(got)
    (got_grad,) = torch.autograd.grad((got * probe).sum(), x)
    (want_grad,) = torch.autograd.grad((want * probe).sum(), x)
    assert rel_err(got_grad, want_grad) < 2e-3
