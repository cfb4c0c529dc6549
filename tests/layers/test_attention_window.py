"""Sliding-window attention (`attention_window`): the full forward against a float64 loop over queries, packed
documents == each alone, the dynamic cache (trimmed to the window, bounded storage, left-padded rows) and the static
ring cache == the full forward, the config field, the refusals (falcon_h1 export, context parallelism), and
`bind_varlen`'s window_size."""

from __future__ import annotations

import inspect
import json
import warnings

import pytest
import torch
import torch.nn.functional as F

from hybridlm.layers import Attention, LayerCache
from hybridlm.layers.cache import StaticLayerCache
from hybridlm.models.config import HybridConfig
from hybridlm.modules.rotary import apply_rotary
from tests.helpers import rel_err

TOL = 1e-10  # relative, float64
HIDDEN = 24


def make_attention(window, heads=6, kv_heads=2, seed=0) -> Attention:
    torch.manual_seed(seed)
    config = HybridConfig(hidden_size=HIDDEN, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=8,
                          rope_theta=1e4, key_multiplier=0.7, mamba_n_heads=4, attention_window=window)
    return Attention(config, layer_idx=0).eval().double()


def inputs(*shape, seed=0) -> torch.Tensor:
    return torch.randn(*shape, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def reference(attn: Attention, x: torch.Tensor, window: int | None) -> torch.Tensor:
    """x [B, T, D], one document per row, positions 0..T-1: an explicit loop over the queries, each a softmax over
    the keys of positions p - window + 1 .. p (0 .. p without a window)."""
    batch, length, _ = x.shape
    heads, kv_heads, dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q = attn.q_proj(x).view(batch, length, heads, dim)
    k = attn.k_proj(x).view(batch, length, kv_heads, dim) * attn.key_multiplier
    v = attn.v_proj(x).view(batch, length, kv_heads, dim)
    cos, sin = attn.rotary(torch.arange(length)[None])
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    k, v = (t.repeat_interleave(heads // kv_heads, dim=2) for t in (k, v))  # query head h reads key head h // group
    out = torch.zeros_like(q)
    for p in range(length):
        first = 0 if window is None else max(0, p - window + 1)
        scores = torch.einsum("bhd,bnhd->bhn", q[:, p], k[:, first : p + 1]) / dim**0.5
        out[:, p] = torch.einsum("bhn,bnhd->bhd", scores.softmax(-1), v[:, first : p + 1])
    return attn.o_proj(out.reshape(batch, length, heads * dim))


T = 11


@pytest.mark.parametrize("window", [1, 2, 3, T - 1, T, T + 5], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4)], ids=["gqa", "mha"])
def test_full_forward_equals_the_loop_over_queries(window, heads, kv_heads):
    attn = make_attention(window, heads, kv_heads)
    x = inputs(2, T)
    with torch.no_grad():
        got = attn(x)
        assert rel_err(got, reference(attn, x, window)) < TOL
        full = reference(attn, x, None)
    if window >= T:
        assert rel_err(got, full) < TOL  # a window as long as the sequence cuts nothing
    else:
        assert rel_err(got, full) > 1e-3  # the window matters (the first `window` queries are unchanged)
        assert rel_err(got[:, :window], full[:, :window]) < TOL


@pytest.mark.parametrize("marker", ["cu_seqlens", "position_ids"])
def test_packed_documents_equal_each_alone(marker):
    attn = make_attention(3)
    cu = torch.tensor([0, 4, 5, 12])
    x = inputs(1, 12)
    with torch.no_grad():
        if marker == "cu_seqlens":
            packed = attn(x, cu_seqlens=cu)
        else:
            packed = attn(x, position_ids=torch.tensor([[0, 1, 2, 3, 0, 0, 1, 2, 3, 4, 5, 6]]))
        for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
            assert rel_err(packed[:, start:end], reference(attn, x[:, start:end], 3)) < TOL
        assert rel_err(packed[:, 5:], attn(x)[:, 5:]) > 1e-3  # the documents' boundaries matter


@pytest.mark.parametrize("window", [1, 2, 4])
def test_cache_prefill_steps_and_a_chunk_equal_the_full_forward(window):
    """T much longer than the window: the cache trims several times (`dropped`), and every call's outputs are the
    full forward's."""
    attn = make_attention(window)
    x = inputs(2, 40)
    cache = LayerCache()
    with torch.no_grad():
        full = attn(x)
        outs = [attn(x[:, :6], cache=cache)]  # prefill
        outs += [attn(x[:, t : t + 1], cache=cache) for t in range(6, 27)]  # one token at a time
        outs.append(attn(x[:, 27:35], cache=cache))  # a chunk after the cache: the band with the cache in front
        outs += [attn(x[:, t : t + 1], cache=cache) for t in range(35, 40)]
    assert rel_err(torch.cat(outs, 1), full) < TOL
    assert rel_err(full, reference(attn, x, window)) < TOL
    assert cache.seen == 40 and cache.dropped >= 40 - 2 * window - 8
    assert cache.key.shape[1] <= 2 * (window - 1) + 1


def test_gradients_through_windowed_cached_steps_equal_the_full_forward():
    """With gradients the storage is reallocated at every call (no in-place write into saved keys), trims included."""
    attn = make_attention(3)
    x = inputs(2, 14).requires_grad_()
    cache = LayerCache()
    stepped = torch.cat([attn(x[:, :5], cache=cache)] + [attn(x[:, t : t + 1], cache=cache) for t in range(5, 14)], 1)
    grad_out = torch.randn_like(stepped)
    cached = torch.autograd.grad(stepped, [x, attn.q_proj.weight, attn.k_proj.weight], grad_out)
    full = torch.autograd.grad(attn(x), [x, attn.q_proj.weight, attn.k_proj.weight], grad_out)
    assert cache.dropped > 0
    for got, want in zip(cached, full):
        assert rel_err(got, want) < TOL


def test_left_padded_packed_prefill_then_steps_equal_each_row_alone():
    """Rows of 4, 1 and 9 tokens (pad 5, 8, 0) then 12 steps: the window drops the padding (pad shrinks, then None)
    and the positions the layer numbers itself stay each row's own."""
    window, steps = 3, 12
    attn = make_attention(window)
    lengths = [4, 1, 9]
    docs = [inputs(1, n + steps, seed=i + 1) for i, n in enumerate(lengths)]
    cache = LayerCache()
    offsets = torch.tensor([0] + lengths).cumsum(0)
    with torch.no_grad():
        packed = attn(torch.cat([d[:, :n] for d, n in zip(docs, lengths)], dim=1), cu_seqlens=offsets, cache=cache)
        assert cache.pad.tolist() == [5, 8, 0]
        stepped, pads = [], []
        for j in range(steps):
            stepped.append(attn(torch.cat([d[:, n + j : n + j + 1] for d, n in zip(docs, lengths)]), cache=cache))
            pads.append(None if cache.pad is None else cache.pad.tolist())
        for row, (doc, n) in enumerate(zip(docs, lengths)):
            alone = reference(attn, doc, window)
            start = int(offsets[row])
            assert rel_err(packed[:, start : start + n], alone[:, :n]) < TOL, f"prefill of row {row}"
            for j in range(steps):
                assert rel_err(stepped[j][row], alone[0, n + j : n + j + 1]) < TOL, f"step {j} of row {row}"
    dropped_pads = [p for p in pads if p is not None and p != [5, 8, 0]]
    assert dropped_pads and all(min(p) >= 0 for p in dropped_pads)  # trimmed while padding remained: shrunk
    assert pads[-1] is None and cache.dropped >= 8  # every row's padding dropped


def test_storage_stays_bounded_while_decoding():
    window = 5
    attn = make_attention(window)
    cache = LayerCache()
    x = inputs(2, 60)
    sizes = {}
    with torch.no_grad():
        attn(x[:, :30], cache=cache)  # a prompt longer than the window: its storage is given back at the first trim
        for t in range(30, 60):
            attn(x[:, t : t + 1], cache=cache)
            sizes[t - 29] = cache.state_bytes()
    slot_bytes = 2 * 2 * 2 * 8 * 8  # key + value, B=2, Hkv=2, D=8, float64
    assert sizes[10] == sizes[30] <= (2 * (window - 1) + 1) * slot_bytes
    assert cache.dropped == 60 - cache.length


@pytest.mark.parametrize("window", [1, 3, 6, 50], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("lengths", [[7, 7], [7, 3], [3, 3], [3, 1]], ids=["even", "padded", "short", "short-padded"])
@pytest.mark.parametrize("warm", [0, 4], ids=["after-prefill", "after-4-steps"])
def test_static_ring_cache_steps_equal_the_dynamic_cache(window, lengths, warm):
    """A StaticLayerCache built after the prefill (ring of W slots when W < capacity, else the plain storage) gives
    the dynamic cache's steps, its slot a device tensor advanced between steps; its storage does not depend on the
    capacity. Built right after the prefill or after `warm` dynamic steps (from a trimmed cache, its padding partly
    dropped); short prompts: the first steps' ring still has empty slots and padding inside the window."""
    attn = make_attention(window)
    steps = 15
    docs = [inputs(1, n + steps, seed=i + 5) for i, n in enumerate(lengths)]
    prompts = torch.cat([d[:, :n] for d, n in zip(docs, lengths)], dim=1)
    offsets = torch.tensor([0] + lengths).cumsum(0)
    capacity = max(lengths) + steps
    with torch.no_grad():
        dynamic, static_source = LayerCache(), LayerCache()
        for cache in (dynamic, static_source):
            attn(prompts, cu_seqlens=offsets, cache=cache)
        tokens = [torch.cat([d[:, n + j : n + j + 1] for d, n in zip(docs, lengths)]) for j in range(steps)]
        for token in tokens[:warm]:
            attn(token, cache=dynamic)
            attn(token, cache=static_source)
        slot = torch.tensor(static_source.seen)
        static = StaticLayerCache(static_source, capacity=capacity, slot=slot)
        for j, token in enumerate(tokens[warm:], start=warm):
            want = attn(token, cache=dynamic)
            got = attn(token, cache=static)
            slot.add_(1)
            assert rel_err(got, want) < TOL, f"step {j}"
    stored = static._key.shape[1]
    assert stored == (window if window < capacity else capacity)
    assert static.state_bytes() == 2 * static._key.untyped_storage().nbytes()


# --------------------------------------------------------------------------- config and refusals


@pytest.mark.parametrize("window", [0, -3, 2.5, True, "4"])
def test_config_refuses_a_bad_window(window):
    with pytest.raises(ValueError, match="attention_window"):
        HybridConfig(attention_window=window)


def test_config_refuses_a_window_without_attention():
    with pytest.raises(ValueError, match="attention_window=4 needs use_attention=True"):
        HybridConfig(attention_window=4, use_attention=False)


def test_config_window_round_trips_through_save_pretrained(tmp_path):
    from hybridlm.models.configuration import HybridTransformersConfig

    assert HybridConfig().attention_window is None and HybridConfig(attention_window=1).attention_window == 1
    HybridTransformersConfig.from_hybrid(HybridConfig(attention_window=7)).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["attention_window"] == 7
    assert HybridTransformersConfig.from_pretrained(tmp_path).to_hybrid().attention_window == 7
    HybridTransformersConfig.from_hybrid(HybridConfig()).save_pretrained(tmp_path)
    assert HybridTransformersConfig.from_pretrained(tmp_path).to_hybrid().attention_window is None


def test_falcon_h1_export_refuses_a_window(tmp_path):
    from hybridlm.models.falcon_h1 import config_to_falcon_h1
    from hybridlm.models.model import HybridForCausalLM

    config_to_falcon_h1(HybridConfig(hidden_size=32, mamba_n_heads=4))  # the same config without a window exports
    with pytest.raises(ValueError, match="attention_window=8"):
        config_to_falcon_h1(HybridConfig(hidden_size=32, mamba_n_heads=4, attention_window=8))
    model = HybridForCausalLM(HybridConfig(
        vocab_size=32, hidden_size=32, intermediate_size=16, num_hidden_layers=1, mamba_n_heads=4, mamba_d_state=4,
        attention_window=8))
    with pytest.raises(ValueError, match="no sliding-window attention"):
        model.save_pretrained(tmp_path / "falcon", format="falcon_h1")
    assert not (tmp_path / "falcon" / "config.json").exists()


def test_context_parallelism_refuses_a_window():
    from hybridlm.layers.block import HybridBlock
    from hybridlm.parallel.context_parallel import context_parallel

    config = HybridConfig(hidden_size=32, mamba_n_heads=4, mamba_d_state=4, attention_window=16)
    with pytest.raises(ValueError, match="attention_window=16"):
        with context_parallel(HybridBlock(config, 0)):
            pass


# --------------------------------------------------------------------------- bind_varlen


def _windowed_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                     window_size=(-1, -1), enable_gqa=False):
    """A CPU stand-in for torch >= 2.11's `varlen_attn`: each document's attention with keys window_size[0] to the
    left and window_size[1] to the right of the query (-1: unbounded), [T, H, D] layout. As FlashAttention-2, a
    document with more keys than queries aligns its queries to its last keys (query i of n reads around key slot
    S - n + i); the maximum lengths must cover every document (flash reads them as such)."""
    left, right = window_size
    outs = []
    for (qa, qb), (ka, kb) in zip(zip(cu_seq_q[:-1].tolist(), cu_seq_q[1:].tolist()),
                                  zip(cu_seq_k[:-1].tolist(), cu_seq_k[1:].tolist())):
        n, keys = qb - qa, kb - ka
        assert n <= max_q and keys <= max_k, "max_q / max_k shorter than a document"
        qd = query[qa:qb].transpose(0, 1)  # [H, n, D]
        kd, vd = (t[ka:kb].transpose(0, 1) for t in (key, value))  # [Hkv, S, D]
        back = torch.arange(keys - n, keys)[:, None] - torch.arange(keys)[None, :]
        allowed = (back >= -right if right >= 0 else True) & (back <= left if left >= 0 else True)
        outs.append(F.scaled_dot_product_attention(qd, kd, vd, attn_mask=allowed, enable_gqa=enable_gqa
                                                   ).transpose(0, 1))
    return torch.cat(outs)


def _torch_2_10_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    raise AssertionError("not called")


@pytest.mark.parametrize("window", [1, 2, 4, None])
def test_bind_varlen_passes_the_window(window):
    """bind_varlen(window=W) asks for window_size=(W - 1, 0): the banded block-diagonal mask's result (and the
    window matters); torch 2.10's `is_causal` form has no window, so it binds nothing and the caller masks."""
    from hybridlm.layers.attention import bind_varlen

    asked = []

    def recording(*args, **kwargs):
        asked.append(kwargs["window_size"])
        return _windowed_varlen(*args, **kwargs)

    recording.__signature__ = inspect.signature(_windowed_varlen)  # what bind_varlen reads its keywords from
    attend = bind_varlen(recording, window=window)
    g = torch.Generator().manual_seed(0)
    offsets = [0, 3, 4, 11]
    q = torch.randn(11, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(11, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    got = attend(q, k, v, torch.tensor(offsets, dtype=torch.int32), 7)
    assert asked == [(-1 if window is None else window - 1, 0)]
    seq = torch.repeat_interleave(torch.arange(3), torch.tensor([3, 1, 7]))
    back = torch.arange(11)[:, None] - torch.arange(11)[None, :]
    band = (back >= 0) & (back < (window or 11))
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          attn_mask=(seq[:, None] == seq[None, :]) & band,
                                          enable_gqa=True).transpose(0, 1)
    assert rel_err(got, want) < TOL
    if window is not None and window < 7:
        causal = bind_varlen(_windowed_varlen)(q, k, v, torch.tensor(offsets, dtype=torch.int32), 7)
        assert rel_err(got, causal) > 1e-3
    assert (bind_varlen(_torch_2_10_varlen, window=window) is None) == (window is not None)


@pytest.mark.parametrize("window", [2, 4, None])
def test_bind_varlen_passes_key_offsets_for_documents_with_more_keys(window):
    """attend(q, k, v, cu, max_len, cu_k, max_len_k): the key offsets and the longest key document reach
    `varlen_attn` (as cu_seq_k, max_k), and each document's queries read as its last keys (the stand-in aligns them
    as flash does): documents of 2 queries / 6 keys and 5 / 5, against a loop over the queries."""
    from hybridlm.layers.attention import bind_varlen

    asked = []

    def recording(*args, **kwargs):
        asked.append((args[4].tolist(), args[5], args[6]))
        return _windowed_varlen(*args, **kwargs)

    recording.__signature__ = inspect.signature(_windowed_varlen)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(7, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(11, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    got = bind_varlen(recording, window=window)(q, k, v, torch.tensor([0, 2, 7], dtype=torch.int32), 5,
                                                torch.tensor([0, 6, 11], dtype=torch.int32), 6)
    assert asked == [([0, 6, 11], 5, 6)]
    kq, vq = (t.repeat_interleave(2, dim=1) for t in (k, v))  # query head h reads key head h // 2
    want = torch.empty_like(q)
    for (qa, qb), (ka, kb) in (((0, 2), (0, 6)), ((2, 7), (6, 11))):
        for i in range(qb - qa):
            slot = (kb - ka) - (qb - qa) + i  # the query's own key slot in its document
            first = 0 if window is None else max(0, slot - window + 1)
            scores = torch.einsum("hd,nhd->hn", q[qa + i], kq[ka + first : ka + slot + 1]) / 8**0.5
            want[qa + i] = torch.einsum("hn,nhd->hd", scores.softmax(-1), vq[ka + first : ka + slot + 1])
    assert rel_err(got, want) < TOL


def test_a_piece_after_left_padded_rows_is_masked_not_sent_to_the_kernel(monkeypatch):
    """Rows of 9 and 6 tokens prefilled packed into a cache (the second row left-padded by 3) then a piece of 4 tokens
    each: with padding in the cache the piece is masked (the varlen kernel's rows would read the padding slots as
    keys), and each row equals the row alone."""
    import hybridlm.layers.attention as attention

    attn = make_attention(None)
    lengths, piece = [9, 6], 4
    docs = [inputs(1, n + piece, seed=20 + i) for i, n in enumerate(lengths)]
    calls = []
    monkeypatch.setattr(attention, "_varlen_attention", recording_varlen(calls))
    cache = LayerCache()
    with torch.no_grad():
        attn(torch.cat([d[:, :n] for d, n in zip(docs, lengths)], dim=1),
             cu_seqlens=torch.tensor([0, 9, 15]), cache=cache)
        assert cache.pad.tolist() == [0, 3]
        out = attn(torch.cat([d[:, n:] for d, n in zip(docs, lengths)]), cache=cache)
    assert [c[2] for c in calls] == [9]  # the packed prefill only (as documents); not the piece
    for row, (doc, n) in enumerate(zip(docs, lengths)):
        assert rel_err(out[row], reference(attn, doc, None)[0, n:]) < TOL


def recording_varlen(calls: list):
    """A stand-in for `_varlen_attention` on the CPU that records its documents and computes them with
    `_windowed_varlen` (queries aligned to each document's last keys, as flash does)."""

    def stand_in(q, k, v, offsets, *, max_len, dropout, window, key_offsets=None, max_key_len=None):
        key_offsets = offsets if key_offsets is None else key_offsets
        calls.append((offsets.tolist(), key_offsets.tolist(), max_len, max_key_len, window))
        return _windowed_varlen(q[0], k[0], v[0], offsets, key_offsets, max_len, max_key_len or max_len,
                                window_size=(-1 if window is None else window - 1, 0), enable_gqa=True)

    return stand_in


@pytest.mark.parametrize("with_cache", [False, True], ids=["training", "first-prefill"])
def test_windowed_rows_go_to_the_varlen_kernel_as_one_document_each(with_cache, monkeypatch):
    """Rows with no cache in front are handed to the varlen kernel (where it runs: CUDA, 16-bit) as documents of T
    tokens with the window, not masked with a [T, T] band (16 GiB at 128K). Here a stand-in kernel computes each
    document by the per-query loop's rule; the rows' result equals the loop's, and the kernel saw the rows' offsets."""
    import hybridlm.layers.attention as attention

    window, x = 3, inputs(3, T, seed=5)
    attn = make_attention(window)
    calls = []
    monkeypatch.setattr(attention, "_varlen_attention", recording_varlen(calls))
    got = attn(x, cache=LayerCache() if with_cache else None)
    rows = [0, T, 2 * T, 3 * T]
    assert calls == [(rows, rows, T, T, window)]
    assert rel_err(got, reference(attn, x, window)) < TOL


@pytest.mark.parametrize("window", [None, 3, 6, T + 5], ids=lambda w: f"W{w}")
def test_prefill_pieces_after_a_filled_cache_go_to_the_varlen_kernel(window, monkeypatch):
    """A prefill piece after a filled cache: each row a document whose queries are its last keys (flash aligns the
    causal mask and the window to the end of the keys), not a [T, S] mask. Pieces of 4, 5, 3 and 1 tokens through the
    stand-in kernel equal the per-query loop over the whole sequence; the kernel saw each row's S cached + new keys
    (at W = 3 the third piece finds the cache trimmed to its last W - 1 = 2 slots), and the decoding step (one
    query) was masked, not sent to it."""
    import hybridlm.layers.attention as attention

    x = inputs(2, 13, seed=6)
    attn = make_attention(window)
    calls = []
    monkeypatch.setattr(attention, "_varlen_attention", recording_varlen(calls))
    cache = LayerCache()
    with torch.no_grad():
        got = torch.cat([attn(x[:, a:b], cache=cache) for a, b in ((0, 4), (4, 9), (9, 12), (12, 13))], dim=1)
    assert rel_err(got, reference(attn, x, window)) < TOL
    first = [([0, 4, 8], [0, 4, 8], 4, 4, window)] if window is not None else []  # else SDPA's causal flag
    third_keys = 2 + 3 if window == 3 else 12
    assert calls == first + [([0, 5, 10], [0, 9, 18], 5, 9, window),
                             ([0, 3, 6], [0, third_keys, 2 * third_keys], 3, third_keys, window)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (flash attention's varlen kernel)")
@pytest.mark.parametrize("window", [1, 64, 200])
def test_windowed_flash_varlen_on_cuda_matches_the_band_mask(window, monkeypatch):
    """bf16 on CUDA: flash's window (window_size=(W - 1, 0)) gives the band mask's output and gradients, for plain rows
    and for packed documents (torch documents the argument loosely: this pins its meaning on the real kernel)."""
    import hybridlm.layers.attention as attention

    torch.manual_seed(0)
    config = HybridConfig(hidden_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=64, rope_theta=1e4,
                          mamba_n_heads=4, attention_window=window)
    attn = Attention(config, layer_idx=0).cuda().to(torch.bfloat16)
    if attention._flash_window_kernel(window) is None:
        pytest.skip("this torch's varlen_attn takes no window_size")
    x = torch.randn(2, 300, 96, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 1, 130, 300])

    def run(**kwargs):
        rows = x[:1] if "cu_seqlens" in kwargs else x
        rows = rows.detach().requires_grad_()
        out = attn(rows, **kwargs)
        return out, torch.autograd.grad(out.float().square().sum(), [rows, attn.q_proj.weight, attn.k_proj.weight])

    flash = [run(), run(cu_seqlens=cu)]
    monkeypatch.setattr(attention, "_varlen_attention", lambda *a, **k: None)
    masked = [run(), run(cu_seqlens=cu)]
    for (out, grads), (want, want_grads) in zip(flash, masked):
        torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
        # The tolerance scales with the largest gradient: at W = 1 each query sees only its own key, the softmax is
        # one-hot and the key projection's gradient is zero in exact arithmetic (both sides give bf16 noise).
        scale = max(g.abs().max().item() for g in want_grads)
        for got, expected in zip(grads, want_grads):
            torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2 * scale)
        if window == 1:
            assert grads[2].abs().max().item() < 1e-4 * scale


def test_compiling_a_windowed_attention_warns_of_nothing():
    """torch.compile traces the flash kernel lookup (on every device: the lookup comes before the device check) without
    warnings (a memoizing wrapper around it would make dynamo warn of possible silent incorrectness at every
    trace)."""
    config = HybridConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16, rope_theta=1e4,
                          mamba_n_heads=2, attention_window=4)
    attn = Attention(config, layer_idx=0)
    x = torch.randn(2, 9, 32)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(attn, backend="eager", fullgraph=True)(x)
    assert [str(w.message) for w in caught if "dynamo" in str(w.message).lower()] == []
    assert rel_err(out, attn(x)) < TOL


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (flash attention's varlen kernel)")
@pytest.mark.parametrize("window", [None, 64])
def test_prefill_pieces_on_cuda_match_the_mask(window, monkeypatch):
    """bf16 on CUDA: a prompt prefilled in pieces of 100, 130 and 70 tokens, the later pieces through flash's varlen
    kernel with more keys than queries (the causal mask and the window aligned to the end of each row's keys: this
    pins that on the real kernel), gives the masked path's outputs and the one-call forward's."""
    import hybridlm.layers.attention as attention

    torch.manual_seed(0)
    config = HybridConfig(hidden_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=64, rope_theta=1e4,
                          mamba_n_heads=4, attention_window=window)
    attn = Attention(config, layer_idx=0).cuda().to(torch.bfloat16)
    if attention._flash_window_kernel(window) is None or not attention._has_flash(0):
        pytest.skip("no flash varlen kernel for this window here")
    x = torch.randn(2, 300, 96, device="cuda", dtype=torch.bfloat16)
    cuts = (0, 100, 230, 300)

    def pieces():
        """The pieces' outputs, and the gradients of the last piece (its input, the query and key projections)."""
        cache = LayerCache()
        with torch.no_grad():
            outs = [attn(x[:, a:b], cache=cache) for a, b in zip(cuts[:-2], cuts[1:-1])]
        last = x[:, cuts[-2]:].detach().requires_grad_()
        outs.append(attn(last, cache=cache))
        grads = torch.autograd.grad(outs[-1].float().square().sum(), [last, attn.q_proj.weight, attn.k_proj.weight])
        return torch.cat(outs, dim=1).detach(), grads

    real, ran = attention._varlen_attention, []

    def watched(*args, **kwargs):
        out = real(*args, **kwargs)
        ran.append(out is not None and (kwargs.get("max_key_len") or 0) > kwargs["max_len"])
        return out

    monkeypatch.setattr(attention, "_varlen_attention", watched)
    flash, flash_grads = pieces()
    assert sum(ran) == 2, "the later pieces did not run flash's varlen kernel"
    monkeypatch.setattr(attention, "_varlen_attention", lambda *a, **k: None)
    masked, masked_grads = pieces()
    with torch.no_grad():
        whole = attn(x)
    torch.testing.assert_close(flash, masked, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(flash, whole, rtol=2e-2, atol=2e-2)
    scale = max(g.abs().max().item() for g in masked_grads)
    for got, want in zip(flash_grads, masked_grads):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * scale)
