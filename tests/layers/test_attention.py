"""Attention: parity with transformers' FalconH1Attention, packed documents == alone, KV cache == full."""

import pytest
import torch
import torch.nn.functional as F
from transformers import FalconH1Config
from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1Attention, FalconH1RotaryEmbedding

from hybridlm.layers import Attention, LayerCache
from hybridlm.models.config import HybridConfig

ATOL = 1e-5


def make_attention(heads=4, kv_heads=2, head_dim=8, hidden=24, seed=0, **changes) -> Attention:
    torch.manual_seed(seed)
    config = HybridConfig(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                          head_dim=head_dim, rope_theta=1e4, key_multiplier=0.7, mamba_n_heads=4, **changes)
    return Attention(config, layer_idx=0).eval()


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (6, 1)])
def test_matches_falcon_h1_attention(heads, kv_heads):
    ours = make_attention(heads, kv_heads)
    ref_config = FalconH1Config(hidden_size=24, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=8,
                                rope_theta=1e4, key_multiplier=0.7, mamba_d_ssm=24, mamba_n_heads=4)
    ref_config._attn_implementation = "eager"
    ref = FalconH1Attention(ref_config, layer_idx=0).eval()
    ref.load_state_dict(ours.state_dict(), strict=True)
    x = torch.randn(2, 9, 24)
    position_ids = torch.arange(9)[None].expand(2, 9)
    cos, sin = FalconH1RotaryEmbedding(ref_config)(x, position_ids)
    causal = torch.full((9, 9), float("-inf")).triu(1)[None, None]
    expected, _ = ref(x, position_embeddings=(cos, sin), attention_mask=causal)
    torch.testing.assert_close(ours(x), expected, rtol=ATOL, atol=ATOL)


@pytest.mark.parametrize("marker", ["cu_seqlens", "position_ids"])
def test_packed_documents_equal_each_alone(marker):
    attn = make_attention()
    cu = torch.tensor([0, 4, 5, 11])
    x = torch.randn(1, 11, 24)
    if marker == "cu_seqlens":
        packed = attn(x, cu_seqlens=cu)
    else:
        packed = attn(x, position_ids=torch.tensor([[0, 1, 2, 3, 0, 0, 1, 2, 3, 4, 5]]))
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        torch.testing.assert_close(packed[:, start:end], attn(x[:, start:end]), rtol=ATOL, atol=ATOL)
    assert not torch.allclose(packed[:, 5:], attn(x)[:, 5:], atol=1e-3)  # the mask matters


def test_cache_steps_equal_full_forward():
    attn = make_attention(heads=6, kv_heads=2)
    x = torch.randn(2, 10, 24)
    full = attn(x)
    cache = LayerCache()
    outs = [attn(x[:, :4], cache=cache)]  # prefill
    for t in range(4, 7):
        outs.append(attn(x[:, t : t + 1], cache=cache))  # one token at a time
    outs.append(attn(x[:, 7:], cache=cache))  # a chunk after the cache: offset causal mask
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=ATOL, atol=ATOL)
    assert cache.key.shape == (2, 10, 2, 8)


def test_packed_prefill_fills_one_cache_row_per_document():
    """cu_seqlens + an empty cache: each document becomes a left-padded cache row; the next tokens of each
    row then equal that document decoded alone (its own positions, no attention to the pad slots)."""
    attn = make_attention(heads=4, kv_heads=2)
    lengths = [4, 1, 6]
    docs = [torch.randn(1, n + 2, 24, generator=torch.Generator().manual_seed(i)) for i, n in enumerate(lengths)]
    cache = LayerCache()
    packed = attn(torch.cat([d[:, :n] for d, n in zip(docs, lengths)], dim=1), cu_seqlens=torch.tensor([0, 4, 5, 11]),
                  cache=cache)
    assert cache.key.shape == (3, 6, 2, 8) and cache.pad.tolist() == [2, 5, 0]
    steps = [attn(torch.cat([d[:, n + j : n + j + 1] for d, n in zip(docs, lengths)]), cache=cache) for j in range(2)]
    for row, (doc, n) in enumerate(zip(docs, lengths)):
        alone = attn(doc)
        start = sum(lengths[:row])
        torch.testing.assert_close(packed[:, start : start + n], alone[:, :n], rtol=ATOL, atol=ATOL)
        for j in range(2):
            torch.testing.assert_close(steps[j][row], alone[0, n + j : n + j + 1], rtol=ATOL, atol=ATOL)


def test_cache_storage_grows_without_copying_every_step():
    attn = make_attention()
    cache = LayerCache()
    with torch.no_grad():
        attn(torch.randn(1, 5, 24), cache=cache)
        attn(torch.randn(1, 1, 24), cache=cache)
        storage = cache._key
        attn(torch.randn(1, 1, 24), cache=cache)
    assert storage.shape[1] == 10 and cache._key is storage and cache.key.shape[1] == 7


def test_packed_prefill_needs_an_empty_cache():
    attn = make_attention()
    cache = LayerCache()
    attn(torch.randn(1, 4, 24), cache=cache)
    with pytest.raises(ValueError, match="needs an empty cache"):
        attn(torch.randn(1, 4, 24), cu_seqlens=torch.tensor([0, 2, 4]), cache=cache)


def test_gradients_through_cached_steps_with_frozen_key_and_value_projections():
    """Only the query needs gradients (a q-only adapter): attention still saves the cached keys/values for
    backward, so the next step may not write into their storage; the gradients equal the full forward's."""
    attn = make_attention(heads=4, kv_heads=2).double()
    for p in (*attn.k_proj.parameters(), *attn.v_proj.parameters()):
        p.requires_grad_(False)
    x = torch.randn(2, 6, 24, dtype=torch.float64)
    cache = LayerCache()
    stepped = torch.cat([attn(x[:, :3], cache=cache)] + [attn(x[:, t : t + 1], cache=cache) for t in range(3, 6)], 1)
    grad_out = torch.randn_like(stepped)
    stepped.backward(grad_out)
    cached_grad = attn.q_proj.weight.grad.clone()
    attn.q_proj.weight.grad = None
    attn(x).backward(grad_out)
    torch.testing.assert_close(cached_grad, attn.q_proj.weight.grad, rtol=1e-10, atol=1e-12)


def test_a_step_of_another_batch_size_is_refused_and_leaves_the_cache_intact():
    attn = make_attention(heads=6, kv_heads=2)
    cache = LayerCache()
    with torch.no_grad():
        attn(torch.randn(3, 4, 24), cache=cache)
        attn(torch.randn(3, 1, 24), cache=cache)
        key, length = cache.key.clone(), cache.length  # the filled slots (the rest of the storage is uninitialized)
        with pytest.raises(ValueError, match="batch size of its prefill"):
            attn(torch.randn(1, 1, 24), cache=cache)
    assert cache.length == length == 5 and torch.equal(cache.key, key)


def test_packed_prefill_into_a_cache_refuses_position_ids():
    """Later tokens continue each document at its own length: a global numbering in the prefill would rotate the
    cached keys against them (every decoded token wrong, the prefill's own output unchanged)."""
    attn = make_attention()
    with pytest.raises(ValueError, match="leave position_ids out"):
        attn(torch.randn(1, 8, 24), cu_seqlens=torch.tensor([0, 3, 8]), position_ids=torch.arange(8)[None],
             cache=LayerCache())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (flash attention's varlen kernel)")
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4)])
def test_packed_documents_on_cuda_run_flash_varlen_like_the_mask(heads, kv_heads, monkeypatch):
    """bf16 packed documents on CUDA take flash attention's varlen kernel; its output and gradients match the
    block-diagonal mask's (the path every other device takes), and each document alone."""
    import hybridlm.layers.attention as attention

    attn = make_attention(heads, kv_heads, head_dim=64, hidden=96).cuda().to(torch.bfloat16)
    offsets = [0, 1, 130, 131, 400, 517]
    cu = torch.tensor(offsets)
    x = torch.randn(1, offsets[-1], 96, device="cuda", dtype=torch.bfloat16)
    taken = []
    kernel = attention._flash_varlen_kernel()
    assert kernel is not None, "this torch has no torch.nn.attention.varlen"
    monkeypatch.setattr(attention, "_flash_varlen_kernel", lambda: lambda *a: taken.append(1) or kernel(*a))

    def run(module_input):
        module_input = module_input.detach().requires_grad_()
        out = attn(module_input, cu_seqlens=cu)
        grads = torch.autograd.grad(out.float().square().sum(), [module_input, attn.q_proj.weight, attn.k_proj.weight])
        return out, grads

    out, grads = run(x)
    assert taken == [1]
    monkeypatch.setattr(attention, "_flash_varlen_kernel", lambda: None)
    masked, masked_grads = run(x)
    torch.testing.assert_close(out, masked, rtol=2e-2, atol=2e-2)
    for got, want in zip(grads, masked_grads):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    alone = torch.cat([attn(x[:, a:b]) for a, b in zip(offsets[:-1], offsets[1:])], dim=1)
    torch.testing.assert_close(out, alone, rtol=2e-2, atol=2e-2)


def _sdpa_per_document(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal=False, window_size=(-1, -1),
                       enable_gqa=False):
    """A stand-in for `varlen_attn` on the CPU: causal SDPA over each document ([T, H, D] layout)."""
    assert is_causal or window_size == (-1, 0), "attention must be asked to be causal"
    assert enable_gqa or q.shape[1] == k.shape[1], "grouped keys without enable_gqa"
    outs = []
    for start, end in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        one = [t[start:end].transpose(0, 1) for t in (q, k, v)]  # [H, len, D]
        outs.append(F.scaled_dot_product_attention(*one, is_causal=True, enable_gqa=enable_gqa).transpose(0, 1))
    return torch.cat(outs)


def _torch_2_10_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    return _sdpa_per_document(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=is_causal)


def _torch_2_13_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                       window_size=(-1, -1), enable_gqa=False):
    return _sdpa_per_document(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size=window_size,
                              enable_gqa=enable_gqa)


@pytest.mark.parametrize("varlen_attn", [_torch_2_10_varlen, _torch_2_13_varlen], ids=["torch-2.10", "torch-2.13"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4)])
def test_bind_varlen_takes_either_signature(varlen_attn, heads, kv_heads):
    """`bind_varlen` asks both releases' keywords for causal attention with grouped keys (the 2.10 form by repeating
    the key/value heads, query head h reading key head h // (Hq / Hkv)): the block-diagonal mask's result."""
    from hybridlm.layers.attention import bind_varlen

    attend = bind_varlen(varlen_attn)
    g = torch.Generator().manual_seed(0)
    offsets = [0, 3, 4, 11]
    q = torch.randn(11, heads, 8, generator=g)
    k, v = (torch.randn(11, kv_heads, 8, generator=g) for _ in range(2))
    got = attend(q, k, v, torch.tensor(offsets, dtype=torch.int32), 7)
    seq = torch.repeat_interleave(torch.arange(3), torch.tensor([3, 1, 7]))
    mask = (seq[:, None] == seq[None, :]) & torch.ones(11, 11, dtype=torch.bool).tril()
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                          enable_gqa=heads != kv_heads).transpose(0, 1)
    torch.testing.assert_close(got, want)
    assert bind_varlen(lambda query, key, value, cu_seq_q, cu_seq_k, max_q, max_k: query) is None  # no causal option


GROUP_CASES = {
    "own keys": ([3, 3, 1, 5, 3, 0, 2], None),
    "continuing cached keys": ([4, 4, 1, 2, 4], [9, 4, 6, 2, 12]),
}


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("case", GROUP_CASES.values(), ids=GROUP_CASES.keys())
def test_grouped_packed_attention_equals_the_block_diagonal_mask(case, window):
    """Eager packed attention without a varlen kernel batches the documents of equal (query, key) counts; a traced
    call masks the whole packed row. Outputs and gradients agree in float64: equal and distinct lengths, an empty
    document, single queries, documents whose queries follow cached keys, a window."""
    from hybridlm.layers.attention import _attention_mask, _grouped_attention

    lengths, key_lengths = case
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    key_offsets = None if key_lengths is None else torch.tensor([0, *torch.tensor(key_lengths).cumsum(0).tolist()])
    T, S = int(offsets[-1]), int(offsets[-1] if key_offsets is None else key_offsets[-1])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, T, 4, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k, v = (torch.randn(1, S, 2, 8, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(2))
    out = _grouped_attention(q, k, v, offsets, key_offsets, window=window, dropout=0.0, gqa=True)  # [T, 4, 8]
    mask, causal = _attention_mask(offsets, length=T, past=S - T, pad=None, window=window, device=q.device,
                                   key_offsets=key_offsets)
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         is_causal=causal, enable_gqa=True).transpose(1, 2)[0]
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    weights = torch.randn(out.shape, dtype=torch.float64, generator=g)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    expected = torch.autograd.grad((ref * weights).sum(), (q, k, v))
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
