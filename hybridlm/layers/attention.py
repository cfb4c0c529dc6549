"""Grouped-query self-attention with RoPE and Falcon-H1's key multiplier.

    q = W_q h,   k = m_key W_k h,   v = W_v h          (heads: q [B, T, Hq, D], k, v [B, T, Hkv, D])
    q, k = RoPE(q), RoPE(k) at position_ids (the tables given by the model, `rotary`, computed once per forward for
                                            every layer; or from position_ids here)
    o = W_o softmax(q k^T / sqrt(D) + mask) v

    mask[p, j] = 0 where key j may be read by query p, else -inf: j <= p (causal), and with a sliding window
    (`attention_window` W) also p - j < W, so query p reads keys p - W + 1 .. p (itself and the W - 1 before it);
    W >= the sequence length is full causal attention. Always inside the query's own document.

Packed batches (`cu_seqlens`, B == 1): tokens attend only inside their own document. On CUDA in bf16/fp16 this runs
flash attention's variable-length kernel (`torch.nn.attention.varlen.varlen_attn`: each document's own causal
attention, nothing computed across documents). Elsewhere (CPU, float32, dropout in training, a torch without it,
head dims flash does not take: not a multiple of 8, or above 256, GPUs before sm80) the documents with equal query
and key counts attend as one batch through SDPA (`_grouped_attention`: the pairs inside documents only, one call
per distinct length); a traced call (torch.compile) instead masks the whole packed row block-diagonally, which does
not depend on the documents' lengths but costs O(T^2) memory and work. A `LayerCache`
makes it incremental: new keys/values are appended and queries attend to everything cached (with a window: to the
last W - 1 cached slots, which is all the cache keeps, at most 2 (W - 1) + T slots; `hybridlm.layers.cache`). A packed
prefill into an empty cache stores one row per document, right-aligned (`LayerCache.store_packed_kv`);
later queries of a row then skip its `pad` leading slots. A cache may instead continue each packed document from
keys it holds (the serving engine's packed prefill of several requests' next pieces): `store_packed_kv` then returns
every document's keys packed with their offsets, and each document's queries attend to its own keys, the new ones
last (the varlen kernel with key offsets, the grouped batches, or a [T, S] block-diagonal mask when traced).
A window outside the varlen kernel is a banded mask [T, S] (O(T S) memory like the causal one: no kernel skips the
band's outside); the flash varlen kernel takes it as `window_size=(W - 1, 0)` where this torch has that keyword.
A prefill piece after a filled cache (rows without left padding) also goes to the varlen kernel, each row a document
whose queries are its last keys; left-padded rows and decoding steps (one query) are masked.
The input multiplier (`attention_in_multiplier`) and output multiplier live in the block.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hybridlm.layers.cache import LayerCache, StaticLayerCache
from hybridlm.modules.boundaries import (
    has_restarts,
    local_positions,
    pack_rows,
    sequence_ids,
)
from hybridlm.modules.multiplier import scaled
from hybridlm.modules.rotary import RotaryEmbedding, rotate_qk
from hybridlm.ops.utils import check_cu_seqlens, host_to_device


class Attention(nn.Module):
    """Self-attention mixer: `forward(hidden [B, T, D], *, cu_seqlens, position_ids, cache) -> [B, T, D]`."""

    def __init__(self, config, layer_idx: int) -> None:  # config: HybridConfig
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.key_multiplier = config.key_multiplier
        self.dropout = config.attention_dropout
        self.window = config.attention_window  # None: full causal attention
        width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, width, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_width, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_width, bias=config.attention_bias)
        self.o_proj = nn.Linear(width, config.hidden_size, bias=config.attention_bias)
        self.rotary = RotaryEmbedding(self.head_dim, base=config.rope_theta)

    def forward(
        self,
        hidden: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: LayerCache | None = None,
        restarts_resolved: bool = False,  # the caller (the model) packed any document restarts and numbered tokens
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,  # (cos, sin) [B or 1, T, D] of the positions
        projected: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,  # (q, k, v)_proj(hidden) computed
    ) -> torch.Tensor:                                                              # by the caller: one fused GEMM
        if cu_seqlens is None and position_ids is not None and not restarts_resolved and has_restarts(position_ids):
            if cache is not None:
                raise ValueError("Attention: a decoding cache cannot be combined with packed documents (restarts)")
            # Documents packed inside rows (position_ids restart at 0): attend as one packed row.
            packed, cu_seqlens, position_ids = pack_rows(hidden, position_ids)
            out = self(packed, cu_seqlens=cu_seqlens, position_ids=position_ids)
            return out.reshape(hidden.shape[0], hidden.shape[1], -1)
        batch, length, _ = hidden.shape
        offsets = None
        if cu_seqlens is not None:
            host_offsets = check_cu_seqlens(cu_seqlens, batch_size=batch, total_len=length)
            offsets = host_to_device(host_offsets, hidden.device)
            if cache is not None and position_ids is not None and not restarts_resolved:
                # the cache continues each document at its own length: other positions here would rotate the stored
                # keys against every later query's
                raise ValueError("Attention: a packed prefill into a cache numbers each document from 0 itself; "
                                 "leave position_ids out")
        if position_ids is None:
            if offsets is not None:
                position_ids = local_positions(offsets, length).unsqueeze(0)  # [1, T]
            elif cache is not None:
                position_ids = cache.positions(length, hidden.device)  # [1, T], or [B, T] for left-padded rows
            else:
                position_ids = torch.arange(length, device=hidden.device).unsqueeze(0)  # [1, T]

        if projected is None:
            projected = (self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden))
        q, k, v = projected
        q = q.view(batch, length, self.num_heads, self.head_dim)  # [B, T, Hq, D]
        k = scaled(k.view(batch, length, self.num_kv_heads, self.head_dim), self.key_multiplier)
        v = v.view(batch, length, self.num_kv_heads, self.head_dim)  # [B, T, Hkv, D]
        if rotary is None:
            rotary = self.rotary(position_ids)  # (cos, sin) [B or 1, T, D] float32

        pad = key_offsets = None  # key_offsets: with documents that continue cached keys, [N + 1] on the host
        # A decoding step into a fixed-address cache: the rotation writes k and v into the storage itself, where its
        # kernel runs (`StaticLayerCache.append_rotated`); None: rotated, then appended
        stored = cache.append_rotated(q, k, v, *rotary, window=self.window) if (
            isinstance(cache, StaticLayerCache) and offsets is None) else None
        if stored is not None:
            q, k, v = stored  # q rotated [B, 1, Hq, D]; k, v the storage [B, S, Hkv, D]
            pad = cache.pad
        else:
            q, k = rotate_qk(q, k, *rotary)  # the tables rounded to q's dtype
            if cache is not None and offsets is not None:
                # one row per document (an empty cache); keys [1, S, Hkv, D] when documents continue cached ones
                k, v, key_offsets = cache.store_packed_kv(k, v, host_offsets, window=self.window)
            elif cache is not None:
                # [B, S, Hkv, D], S = past + T: the earlier slots kept (all of them, or those the window reaches)
                k, v = cache.append_kv(k, v, saved_for_backward=q.requires_grad, window=self.window)
                pad = cache.pad

        if offsets is not None and not isinstance(cache, StaticLayerCache):
            keys = {} if key_offsets is None else dict(
                key_offsets=host_to_device(key_offsets, hidden.device),
                max_key_len=int((key_offsets[1:] - key_offsets[:-1]).max()))
            out = _varlen_attention(q, k, v, offsets, max_len=int((host_offsets[1:] - host_offsets[:-1]).max()),
                                    dropout=self.dropout if self.training else 0.0, window=self.window, **keys)
            if out is not None:
                return self.o_proj(out.reshape(batch, length, self.num_heads * self.head_dim))
        elif (offsets is None and pad is None and not isinstance(cache, StaticLayerCache)
              and (k.shape[1] > length > 1 or (self.window is not None and k.shape[1] == length))):
            # Rows that SDPA's causal flag cannot express: a window with no cache in front (training, a first
            # prefill; a [T, T] band mask keeps flash out, 16 GiB at T = 128K), or a prefill piece after a filled
            # cache (the flag aligns causality to the first key, not the last; a [T, S] mask). The varlen kernel
            # takes each row as a document whose T queries are its last T key slots: flash aligns causal attention
            # and the window to the end of the keys, so query i reads slot S - T + i and the W - 1 before it.
            keys = k.shape[1]  # S = past + T
            rows = torch.arange(0, (batch + 1) * length, length, device=hidden.device)  # [B + 1]
            key_rows = rows if keys == length else torch.arange(0, (batch + 1) * keys, keys, device=hidden.device)
            out = _varlen_attention(q.reshape(1, batch * length, *q.shape[2:]),
                                    *(t.reshape(1, batch * keys, *t.shape[2:]) for t in (k, v)), rows,
                                    max_len=length, key_offsets=key_rows, max_key_len=keys,
                                    dropout=self.dropout if self.training else 0.0, window=self.window)
            if out is not None:
                return self.o_proj(out.reshape(batch, length, self.num_heads * self.head_dim))
        if isinstance(cache, StaticLayerCache):
            mask, is_causal = cache.static_mask(q.dtype), False  # the whole storage, its empty slots masked
        elif offsets is not None and not torch.compiler.is_compiling():
            out = _grouped_attention(q, k, v, host_offsets, key_offsets, window=self.window,
                                     dropout=self.dropout if self.training else 0.0,
                                     gqa=self.num_heads != self.num_kv_heads)  # [T, Hq, D]
            return self.o_proj(out.reshape(batch, length, self.num_heads * self.head_dim))
        else:
            mask, is_causal = _attention_mask(offsets, length=length, past=k.shape[1] - length, pad=pad,
                                              window=self.window, device=hidden.device,
                                              key_offsets=None if key_offsets is None else host_to_device(
                                                  key_offsets, hidden.device))
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),  # [B, Hq, T, D]
            k.transpose(1, 2),  # [B, Hkv, S, D]
            v.transpose(1, 2),
            attn_mask=mask,
            is_causal=is_causal,
            dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )  # [B, Hq, T, D]
        out = out.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim)
        return self.o_proj(out)


def _varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, *, max_len: int, dropout: float,
    window: int | None = None, key_offsets: torch.Tensor | None = None, max_key_len: int | None = None,
) -> torch.Tensor | None:
    """Causal attention (within `window`, if given) inside each packed document with flash attention's varlen kernel:
    q [1, T, Hq, D], k, v [1, S, Hkv, D], offsets [N + 1] on the device -> [T, Hq, D]; None where the kernel does not
    apply (the caller then masks): no varlen_attn in this torch (or, with a window, none that takes one), not CUDA,
    not 16-bit, dropout, a head dim flash does not take, a GPU or a build without flash attention. `key_offsets`
    (default `offsets`) and `max_key_len`: documents with more keys than queries, whose queries are their last keys
    (flash aligns the causal mask and the window to the end of each document's keys)."""
    kernel = _flash_varlen_kernel() if window is None else _flash_window_kernel(window)
    if (kernel is None or not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16) or dropout > 0
            or q.shape[-1] % 8 or q.shape[-1] > 256 or not _has_flash(q.device.index)):
        return None
    offsets = offsets.to(torch.int32)
    if key_offsets is None:
        return kernel(q[0], k[0], v[0], offsets, max_len)
    return kernel(q[0], k[0], v[0], offsets, max_len, key_offsets.to(torch.int32), max_key_len)


def _grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, key_offsets: torch.Tensor | None, *,
    window: int | None, dropout: float, gqa: bool,
) -> torch.Tensor:
    """Causal attention (within `window`, if given) inside each packed document without a varlen kernel: the
    documents with the same query and key counts attend as one batch through SDPA, each one's queries its last keys.
    q [1, T, Hq, D], k, v [1, S, Hkv, D], offsets / key_offsets [N + 1] on the host (key_offsets None: S = T, the
    documents' own keys) -> [T, Hq, D]. The work is sum_i T_i S_i pairs in one SDPA call per distinct (T_i, S_i)
    (a serving prefill's pieces of one block size make one group), where the block-diagonal mask of the whole packed
    row (`_attention_mask`, what a traced call uses: it does not depend on the documents' lengths) costs T S."""
    lengths = (offsets[1:] - offsets[:-1]).tolist()
    key_lengths = lengths if key_offsets is None else (key_offsets[1:] - key_offsets[:-1]).tolist()
    starts = offsets[:-1].tolist()
    key_starts = starts if key_offsets is None else key_offsets[:-1].tolist()
    groups: dict[tuple[int, int], list[int]] = {}
    for doc, (n, m) in enumerate(zip(lengths, key_lengths)):
        if n:
            groups.setdefault((n, m), []).append(doc)
    out = q.new_empty(q.shape[1:])  # [T, Hq, D]
    for (n, m), docs in groups.items():
        if len(docs) == 1:  # views, no gather
            rows = slice(starts[docs[0]], starts[docs[0]] + n)
            key_rows = slice(key_starts[docs[0]], key_starts[docs[0]] + m)
            qg, kg, vg = q[:, rows], k[:, key_rows], v[:, key_rows]  # [1, n, Hq, D], [1, m, Hkv, D]
        else:
            rows = host_to_device(torch.tensor([starts[d] for d in docs])[:, None] + torch.arange(n), q.device)
            key_rows = host_to_device(torch.tensor([key_starts[d] for d in docs])[:, None] + torch.arange(m), q.device)
            qg, kg, vg = q[0][rows], k[0][key_rows], v[0][key_rows]  # [G, n, Hq, D], [G, m, Hkv, D]
        if window is None and (m == n or n == 1):
            mask, causal = None, n > 1  # SDPA's flag (top-left aligned) is right when there is nothing in front
        else:
            mask, causal = _band(n, past=m - n, window=window, device=q.device), False  # [n, m], queries last
        o = F.scaled_dot_product_attention(qg.transpose(1, 2), kg.transpose(1, 2), vg.transpose(1, 2),
                                           attn_mask=mask, is_causal=causal, dropout_p=dropout,
                                           enable_gqa=gqa).transpose(1, 2)  # [G, n, Hq, D]
        out[rows] = o[0] if len(docs) == 1 else o
    return out


def _has_flash(device_index: int | None) -> bool:
    """Flash attention runs on this GPU: built into torch, and an Ampere or newer card (sm80+). Not memoized: a
    `functools.cache` wrapper makes torch.compile warn at every trace (it traces through it), and both queries are
    cached by torch itself."""
    built = torch.backends.cuda.is_flash_attention_available()
    return built and torch.cuda.get_device_capability(device_index) >= (8, 0)


def _varlen_attn() -> Callable | None:
    """torch's `varlen_attn`, or None on a torch without it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


# Resolved once at import: binding reads `varlen_attn`'s signature (~50 us), too slow for every call, and
# torch.compile warns when it traces through a memoizing wrapper; with the keywords known, a binding is a closure.
_VARLEN_ATTN = _varlen_attn()
_VARLEN_KEYWORDS = frozenset(inspect.signature(_VARLEN_ATTN).parameters) if _VARLEN_ATTN is not None else frozenset()


def _flash_varlen_kernel() -> Callable | None:
    """torch's `varlen_attn` bound by `bind_varlen` (causal), or None on a torch without it."""
    return _flash_window_kernel(None)


def _flash_window_kernel(window: int | None) -> Callable | None:
    """`_flash_varlen_kernel` within a sliding window (None: none), or None on a torch whose `varlen_attn` takes no
    window."""
    if _VARLEN_ATTN is None:
        return None
    return bind_varlen(_VARLEN_ATTN, window=window, keywords=_VARLEN_KEYWORDS)


def bind_varlen(
    varlen_attn: Callable, *, window: int | None = None, keywords: frozenset[str] | None = None,
) -> Callable | None:
    """`(q [T, Hq, D], k, v [S, Hkv, D], cu [N + 1] int32, max_len, cu_k = cu, max_len_k = max_len) -> [T, Hq, D]`:
    `varlen_attn` as causal attention with grouped keys (query head h reads key head h // (Hq / Hkv)), or None if it
    takes no causal option (a document with more keys than queries: its queries are its last keys). Its
    keywords changed between releases: causal is `is_causal=True` in torch 2.10 and `window_size=(-1, 0)` later, and
    grouped keys (`enable_gqa`) arrived after 2.10; without it the key/value heads are repeated for the query heads.
    `window` W: query p reads keys p - W + 1 .. p only, `window_size=(W - 1, 0)` (keys to the left, to the right);
    None (the caller masks) where `varlen_attn` has no `window_size` (torch 2.10's `is_causal` form). `keywords`:
    `varlen_attn`'s parameter names, if already known (else read from its signature)."""
    params = keywords if keywords is not None else frozenset(inspect.signature(varlen_attn).parameters)
    if "window_size" in params:
        causal = {"window_size": (-1 if window is None else window - 1, 0)}
    elif "is_causal" in params and window is None:
        causal = {"is_causal": True}
    else:
        return None
    native_gqa = "enable_gqa" in params

    def attend(q, k, v, cu, max_len, cu_k=None, max_len_k=None):
        groups = q.shape[1] // k.shape[1]
        if groups > 1 and not native_gqa:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        extra = {"enable_gqa": True} if groups > 1 and native_gqa else {}
        cu_k, max_len_k = (cu, max_len) if cu_k is None else (cu_k, max_len_k)
        return varlen_attn(q, k, v, cu, cu_k, max_len, max_len_k, **causal, **extra)

    return attend


def _attention_mask(
    offsets: torch.Tensor | None, *, length: int, past: int, pad: torch.Tensor | None, device: torch.device,
    window: int | None = None, key_offsets: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, bool]:
    """(boolean mask where True = may attend, or None; is_causal flag for SDPA). `past`: the key slots in front of
    this call's T (the cache's), so key j sits `past + i - j` slots before query i.

    Packed documents: [T, T] block-diagonal causal; with `key_offsets` [N + 1] (documents that continue cached keys,
    each document's queries its last keys) [T, S] block-diagonal, causal within each document. Left-padded cache rows (`pad` [B] leading empty slots):
    [B, 1, T, past + T]. Otherwise [T, past + T] causal with the cache in front, or None when SDPA's own
    causal flag (no cache) or no mask at all (one query after the cache) suffices. A `window` keeps only the keys
    less than `window` slots back (the band), and needs a mask unless it cuts nothing."""
    if offsets is not None and key_offsets is not None:
        keys = past + length  # S
        query_doc, key_doc = sequence_ids(offsets, length), sequence_ids(key_offsets, keys)  # [T], [S]
        lengths, key_lengths = offsets[1:] - offsets[:-1], key_offsets[1:] - key_offsets[:-1]  # [N]
        # each query's slot among its document's keys: after the cached ones ([T])
        slot = local_positions(offsets, length) + (key_lengths - lengths)[query_doc]
        back = slot[:, None] - local_positions(key_offsets, keys)[None, :]  # [T, S] slots from key to query
        allowed = (query_doc[:, None] == key_doc[None, :]) & (back >= 0)
        return (allowed & (back < window) if window is not None else allowed), False
    if offsets is not None:
        seq = sequence_ids(offsets, length)  # [T]
        return (seq[:, None] == seq[None, :]) & _band(length, past=0, window=window, device=device), False
    if pad is None and (window is None or window >= past + length):  # no key is out of the window's reach
        if past == 0:
            return None, bool(length > 1)  # a Python bool even for a symbolic length (SDPA's flag)
        if length == 1:
            return None, False  # one new query sees the whole cache
    allowed = _band(length, past=past, window=window, device=device)  # [T, S]
    if pad is None:
        return allowed, False
    filled = torch.arange(past + length, device=device)[None, :] >= pad.to(device)[:, None]  # [B, S]
    return (allowed[None] & filled[:, None, :]).unsqueeze(1), False  # [B, 1, T, S]


def _band(length: int, *, past: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[T, past + T] True where key j may be read by query i (at slot past + i): causal, and within `window`."""
    back = torch.arange(length, device=device)[:, None] + past - torch.arange(past + length, device=device)[None, :]
    return (back >= 0) & (back < window) if window is not None else back >= 0
