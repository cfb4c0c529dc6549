"""Decoding cache: per layer, the attention KV and whatever the SSM mixer carries.

    cache = HybridCache(num_layers)
    out = model(prompt, cache=cache)          # prefill: fills every layer, cache.seq_len = len(prompt)
    out = model(next_token, cache=cache)      # one step: reads and updates the states

Each mixer owns its fields of `LayerCache`: attention appends to the keys/values ([B, S, H_kv, D]);
an SSM mixer keeps its tensors in the `ssm` dict under names it chooses (Mamba-2: "conv" [B, K-1, C]
and "ssm" [B, H, P, N] float32, float64 for a float64 model). The model advances the cache after every call, so
positions of later tokens continue where the cache stopped.

Rows of different lengths (a left-padded batch of prompts) enter the cache through a packed prefill:
the prompts run end to end as one packed row with `cu_seqlens`, every SSM mixer stores one state per
prompt (padding never reaches a recurrent state), and attention stores each prompt's keys right-aligned
in a row of `seq_len` slots, the `pad` leading slots of a shorter row masked out for every later query.
`HybridCache.lengths` then holds each row's own token count, from which its next positions follow.

Sliding-window attention (`attention_window` W): no later query reaches further back than W - 1 slots, so a layer
keeps only those. When a call finds more than 2 (W - 1) slots filled, it moves the last W - 1 to the front of the
storage (one copy of W - 1 slots per W or more tokens: O(1) per token) and counts the others in `dropped`; the storage
holds at most 2 (W - 1) + T slots (T: the call's tokens). Positions keep counting every slot (`seen`), and the left
padding `pad` shrinks by the dropped slots.

`StaticCache` (built from a filled cache) is the form a CUDA graph of the decoding step needs
(`hybridlm.models.graphed`): attention keys/values in storage of a fixed capacity written at a slot that is a
device tensor, masks over the whole capacity, positions from device tensors. One token per call; every tensor a
step reads stays at one address: its `states_in_place` lets the mixers' step kernels write the new SSM states over
the ones they read, and the decoder copies back into their buffers only what other paths return as new tensors
(`LayerCache.states_in_place`). With a window
W smaller than the capacity the storage is a ring of W slots instead (slot s written at s mod W), so its memory does
not depend on the capacity.
"""

from __future__ import annotations

import torch

from hybridlm.modules.boundaries import local_positions, sequence_ids
from hybridlm.modules.rotary import rotate_into_cache_fuses
from hybridlm.ops.rotary import rotary_qk_into_cache_triton
from hybridlm.ops.utils import host_to_device


class LayerCache:
    """One layer's decoding state: the attention keys/values and the SSM mixer's `ssm` dict."""

    # Whether a mixer's decoding step may write its new state over the tensors in `ssm` (its step kernels do; the
    # torch paths return new tensors either way). Not here: whoever holds a dynamic cache's state tensors (read out
    # before a step, or handed in as a prefill's initial state) expects them unchanged, so a step replaces them. A
    # cache of fixed addresses, which a replayed CUDA graph reads, says yes: it would otherwise copy every new state
    # into its buffer after each step.
    states_in_place = False

    def __init__(self) -> None:
        self.ssm: dict[str, torch.Tensor] = {}  # the SSM mixer's carried state
        self.pad: torch.Tensor | None = None  # [B] leading key slots of each row that hold no token (None: none)
        self._key: torch.Tensor | None = None  # [B, capacity, H_kv, D] storage; slots [0, length) are filled
        self._value: torch.Tensor | None = None
        self.length = 0  # filled key/value slots
        self.window: int | None = None  # the attention window the keys were appended under (None: full attention)
        self.dropped = 0  # leading slots the window dropped: storage slot i holds slot dropped + i of every row
        # [B] slot of each row's first token, counted from the rows' start (its left padding; None: none): `pad` is
        # this minus `dropped` (floor 0), kept so that positions stay right once the window dropped the padding.
        self._first: torch.Tensor | None = None
        self._pad_bound = 0  # max(pad) as known on the host: trimming past it clears `pad` without reading the device

    @property
    def seen(self) -> int:
        """Key slots this cache has been given: the filled ones and those the window dropped."""
        return self.dropped + self.length

    def positions(self, length: int, device: torch.device) -> torch.Tensor:
        """Positions of the next `length` tokens: [1, T], or [B, T] with left-padded rows (each its own count)."""
        positions = torch.arange(self.seen, self.seen + length, device=device).unsqueeze(0)
        return positions if self._first is None else positions - self._first.to(device)[:, None]

    @property
    def key(self) -> torch.Tensor | None:
        """[B, S, H_kv, D] keys after RoPE and the key multiplier (a view of the storage), or None."""
        return None if self._key is None else self._key[:, : self.length]

    @property
    def value(self) -> torch.Tensor | None:
        return None if self._value is None else self._value[:, : self.length]

    def append_kv(self, key: torch.Tensor, value: torch.Tensor, *, saved_for_backward: bool = False,
                  window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Append [B, T, H_kv, D] keys/values; return every cached key/value [B, S + T, H_kv, D].

        The storage grows geometrically, so a decoding step writes only its own token instead of copying
        the whole cache. When autograd may save the returned keys/values (gradients flow into the new keys, or
        `saved_for_backward`: the caller's query needs gradients, so attention saves them even with frozen key and
        value projections), it is reallocated instead: no in-place write into a tensor autograd saved.
        `window` (the layer's `attention_window`): first drop the slots no query of this call or a later one can
        reach (the module docstring); S is then at most 2 (window - 1)."""
        if self._key is not None and (key.shape[0] != self._key.shape[0] or key.shape[2:] != self._key.shape[2:]
                                      or value.shape[:2] != key.shape[:2] or value.shape[2:] != self._value.shape[2:]):
            raise ValueError(
                f"keys {tuple(key.shape)} / values {tuple(value.shape)} do not fit this cache's rows "
                f"{tuple(self._key.shape[:1]) + tuple(self._key.shape[2:])} (batch, heads, head dim): a cache holds one "
                "batch of sequences; decode with the batch size of its prefill"
            )
        if self._key is not None and window != self.window:
            raise ValueError(f"this cache was filled with attention_window={self.window}, this call has {window}")
        self.window = window
        incoming = key.shape[1]
        # With a window, the first `start` filled slots are out of reach of every query from now on (trimmed only past
        # 2 (window - 1) filled slots, so that the copy of the kept ones is paid once per window - 1 tokens or more).
        start = self.length - (window - 1) if window is not None and self.length > 2 * (window - 1) else 0
        kept = self.length - start
        needed = kept + incoming
        # At most this much storage with a window: a long prompt's (or a longer call's) is given back at the next call.
        limit = None if window is None else 2 * (window - 1) + incoming
        grad = torch.is_grad_enabled() and (key.requires_grad or value.requires_grad or saved_for_backward)
        capacity = 0 if self._key is None else self._key.shape[1]
        if self._key is None or needed > capacity or grad or (limit is not None and capacity > limit):
            if grad or self._key is None:
                capacity = needed
            else:
                capacity = max(needed, 2 * capacity if limit is None else min(2 * capacity, limit))
            self._key = _grow(self._key, kept, key, capacity, start=start)
            self._value = _grow(self._value, kept, value, capacity, start=start)
        elif start:
            # disjoint ranges (start > kept: trimmed only past 2 kept filled slots), so one plain copy
            self._key[:, :kept] = self._key[:, start : self.length]
            self._value[:, :kept] = self._value[:, start : self.length]
        if start:
            self._drop(start)
        self._key[:, kept:needed] = key
        self._value[:, kept:needed] = value
        self.length = needed
        return self.key, self.value

    def _drop(self, count: int) -> None:
        """Count `count` more leading slots as dropped (the storage already moved); shrink the left padding."""
        self.dropped += count
        self.length -= count
        if self._first is not None:
            self._pad_bound = max(0, self._pad_bound - count)
            self.pad = (self._first - self.dropped).clamp_min(0) if self._pad_bound else None

    def state_bytes(self) -> int:
        """Bytes of memory this layer's cache keeps alive: the key/value storage (its whole capacity) and the SSM
        states, each counted by the storage it pins (a state kept as a slice of a larger tensor pins all of it),
        every storage once."""
        tensors = [t for t in (self._key, self._value) if t is not None] + list(self.ssm.values())
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return sum(storages.values())

    def copy(self) -> LayerCache:
        """A copy that shares no storage with this cache and keeps only its filled key/value slots (no spare
        capacity): a snapshot to continue from later, however this cache goes on (a prefix cache's entry)."""
        out = LayerCache()
        out.ssm = {name: t.clone() for name, t in self.ssm.items()}
        if self._key is not None:
            out._key, out._value = self.key.clone(), self.value.clone()
        out.length, out.window, out.dropped, out._pad_bound = self.length, self.window, self.dropped, self._pad_bound
        out.pad = None if self.pad is None else self.pad.clone()
        out._first = None if self._first is None else self._first.clone()
        return out

    def store_packed_kv(self, key: torch.Tensor, value: torch.Tensor, offsets: torch.Tensor, *,
                        window: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Fill an empty cache from a packed prefill: key/value [1, total, H_kv, D] of the sequences that
        `offsets` [N + 1] delimit become N rows, each right-aligned in max(length) slots (left padding). The sizes
        are read from the offsets on the host (`offsets.cpu()`: a no-op for the host offsets the model passes).
        `window`: the layer's attention window (`append_kv`).

        Returns what the packed queries attend to: (keys, values, key offsets). Here the call's own keys/values and
        None (each document attends to its own tokens only); a cache that continues each document from keys it
        holds returns them packed, [1, S, H_kv, D], with their documents' offsets [N + 1] on the host (each
        document's queries are its last keys)."""
        if self.seen:
            raise ValueError("a packed prefill (cu_seqlens) needs an empty cache")
        total = key.shape[1]
        host = offsets.cpu()
        host_lengths = host[1:] - host[:-1]  # [N]
        slots = int(host_lengths.max())
        padded = bool((host_lengths < slots).any())
        offsets = host_to_device(offsets, key.device)
        lengths = offsets[1:] - offsets[:-1]  # [N]
        pad = slots - lengths  # [N]
        seq = sequence_ids(offsets, total)  # [total] row of each token
        where = pad[seq] + local_positions(offsets, total)  # [total] its slot in the row
        rows_key = key.new_zeros(len(lengths), slots, *key.shape[2:])
        rows_value = value.new_zeros(len(lengths), slots, *value.shape[2:])
        rows_key[seq, where] = key[0]
        rows_value[seq, where] = value[0]
        self.append_kv(rows_key, rows_value, window=window)
        self.pad = self._first = pad if padded else None
        self._pad_bound = int(slots - host_lengths.min())
        return key, value, None


class HybridCache:
    """One `LayerCache` per block, the number of time slots filled (`seq_len`) and, after a packed
    prefill of prompts of different lengths, each row's own token count (`lengths`)."""

    def __init__(self, num_layers: int) -> None:
        self.layers = [LayerCache() for _ in range(num_layers)]
        self.seq_len = 0  # time slots filled (the longest row)
        self.lengths: torch.Tensor | None = None  # [B] tokens of each row; None: every row has seq_len

    def __getitem__(self, layer_idx: int) -> LayerCache:
        return self.layers[layer_idx]

    def __len__(self) -> int:
        return len(self.layers)

    def copy(self) -> HybridCache:
        """A copy that shares no storage with this cache, holding only filled slots (`LayerCache.copy`)."""
        out = HybridCache(0)
        out.layers = [layer.copy() for layer in self.layers]
        out.seq_len = self.seq_len
        out.lengths = None if self.lengths is None else self.lengths.clone()
        return out

    def positions(self, length: int, device: torch.device) -> torch.Tensor:
        """Positions of the next `length` tokens: [1, T], or [B, T] when the rows have their own lengths."""
        steps = torch.arange(length, device=device)
        if self.lengths is None:
            return (self.seq_len + steps).unsqueeze(0)
        return self.lengths.to(device)[:, None] + steps

    def packed_positions(self, offsets: torch.Tensor, total: int, device: torch.device) -> torch.Tensor:
        """[1, total] positions of a packed prefill's tokens (documents delimited by the host `offsets` [N + 1]):
        each document numbered from 0, for an empty cache only."""
        if self.seq_len:
            raise ValueError("a packed prefill (cu_seqlens) needs an empty cache; decode one row per sequence")
        return host_to_device(local_positions(offsets, total).unsqueeze(0), device)

    def advance(self, length: int) -> None:
        """Count `length` more tokens in every row."""
        self.seq_len += length
        if self.lengths is not None:
            self.lengths = self.lengths + length

    def start_rows(self, lengths: torch.Tensor, *, device: torch.device | str) -> None:
        """After a packed prefill into an empty cache: one row per sequence, `lengths` [N] tokens each (read on the
        host; kept on `device`, where the decoding positions are computed)."""
        if self.seq_len:
            raise ValueError("a packed prefill (cu_seqlens) needs an empty cache")
        lengths = lengths.cpu()
        self.seq_len = int(lengths.max())
        self.lengths = None if bool((lengths == self.seq_len).all()) else host_to_device(lengths, device)


class StaticLayerCache(LayerCache):
    """A layer's cache with key/value storage of `capacity` slots and the write slot `slot` (a device scalar shared
    by the layers): `append_kv` writes one token there and returns the whole storage; `static_mask` says which
    slots hold a token (the filled ones and the one being written, minus each row's left padding).

    With an attention window W < capacity (`source.window`) the storage is a ring of W slots: slot s goes to ring
    index s mod W, and index i then holds slot `slot - ((slot - i) mod W)`: the one being written and the W - 1
    before it, exactly what the window lets the new query see. Built from the last min(filled, W - 1) slots of
    `source`. `length` counts every slot seen (with a ring, more than it holds). The mixers' step kernels write the
    new SSM states over the ones in `ssm` (`states_in_place`). `step_memo`: a dict the layers of one cache share,
    emptied whenever the slot advances, where the step's mask is kept once computed (`static_mask`; None: each call
    computes it)."""

    states_in_place = True

    def __init__(self, source: LayerCache, *, capacity: int, slot: torch.Tensor,
                 step_memo: dict | None = None) -> None:
        super().__init__()
        self._memo = step_memo
        self.ssm = {name: t.clone() for name, t in source.ssm.items()}
        self.window = source.window
        # Slots here are counted from the rows' start (nothing is dropped), so the left padding is the rows' first.
        self.pad = self._first = source._first
        self.length = source.seen
        self._slot = slot
        # A window at least the capacity cuts nothing any query here can reach (distances stay below the capacity).
        self._ring = source.window is not None and source.window < capacity
        if source._key is None:
            return
        if self._ring:
            keep = min(source.length, self.window - 1)
            where = torch.arange(source.seen - keep, source.seen) % self.window  # ring index of each kept slot
            self._key = source._key.new_zeros(source._key.shape[0], self.window, *source._key.shape[2:])
            self._value = source._value.new_zeros(source._value.shape[0], self.window, *source._value.shape[2:])
            self._key[:, where.to(self._key.device)] = source._key[:, source.length - keep : source.length]
            self._value[:, where.to(self._value.device)] = source._value[:, source.length - keep : source.length]
        else:
            if source.dropped:  # cannot happen: a drop needs over 2 (window - 1) slots seen, the capacity exceeds them
                raise ValueError(f"a static cache of capacity {capacity} cannot hold a cache whose window dropped "
                                 f"slots (attention_window={source.window})")
            self._key = _grow(source._key, source.length, source._key, capacity)
            self._value = _grow(source._value, source.length, source._value, capacity)
            self._key[:, source.length :] = 0  # never attended (masked), but no stale NaN/inf can reach a product
            self._value[:, source.length :] = 0
        self._slots = torch.arange(self._key.shape[1], device=slot.device)  # [S] storage indices

    def append_kv(self, key: torch.Tensor, value: torch.Tensor, *, saved_for_backward: bool = False,
                  window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_append(key, value, saved_for_backward, window)
        index = (torch.remainder(self._slot, self.window) if self._ring else self._slot).view(1)
        self._key.index_copy_(1, index, key)
        self._value.index_copy_(1, index, value)
        self.length += 1
        return self._key, self._value

    def append_rotated(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, *, window: int | None = None) -> tuple[torch.Tensor, ...] | None:
        """A decoding step's RoPE and append in one kernel, where it runs (`rotate_into_cache_fuses`: CUDA, no
        gradient, the kernels' dtypes): query and key (unrotated, [B, 1, H, D]) rotated by the tables cos, sin, the
        rotated key and the value written into the storage at the slot. Returns (the rotated query, the keys and
        values as `append_kv` returns them), or None where the kernel does not run (the caller then rotates and calls
        `append_kv`): the same values either way."""
        if not rotate_into_cache_fuses(query, key, value, cos, sin, self._key):
            return None
        self._check_append(key, value, False, window)
        query = rotary_qk_into_cache_triton(query, key, value, cos, sin, self._key, self._value, self._slot,
                                            ring=self.window if self._ring else None)
        self.length += 1
        return query, self._key, self._value

    def _check_append(self, key: torch.Tensor, value: torch.Tensor, saved_for_backward: bool,
                      window: int | None) -> None:
        if torch.is_grad_enabled() and (key.requires_grad or value.requires_grad or saved_for_backward):
            raise ValueError("a static cache decodes without gradients (its storage is written in place): run the "
                             "steps under torch.no_grad()")
        if key.shape[1] != 1:
            raise ValueError(f"a static cache takes one token per call, got {key.shape[1]}")
        if self._key is None:
            raise ValueError("a static cache is built from a filled cache (run the prefill first)")
        if window != self.window:
            raise ValueError(f"this cache was filled with attention_window={self.window}, this call has {window}")

    def static_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """[B or 1, 1, 1, S] additive mask of `dtype`: 0 where the new query may attend, -inf elsewhere (from device
        tensors only: no host read). Every layer of a step reads the same mask, so the first computes it and the others
        take it from the step's memo: a few kernels once per step rather than per layer, and in the queries' dtype,
        which SDPA would otherwise convert a boolean mask into in every layer."""
        if self._memo is None:
            return additive_mask(self._attendable(), dtype)
        key = ("static_mask", self._ring, self.window, id(self._first), dtype)
        if key not in self._memo:
            self._memo[key] = additive_mask(self._attendable(), dtype)
        return self._memo[key]

    def _attendable(self) -> torch.Tensor:
        """[B or 1, 1, 1, S] True where the new query may attend."""
        if self._ring:
            held = self._slot - torch.remainder(self._slot - self._slots, self.window)  # [W] slot each index holds
            valid = held >= 0  # before the ring came round, some indices hold nothing yet
        else:
            held = self._slots
            valid = held <= self._slot  # [S]
        if self._first is None:
            return valid.view(1, 1, 1, -1)
        return (valid[None] & (held[None] >= self._first.to(valid.device)[:, None]))[:, None, None]


class StaticCache(HybridCache):
    """`HybridCache` for one-token decoding steps of fixed shapes (the module docstring): built from a filled cache
    with room for `capacity` time slots in all. The next token's positions ([B, 1]) and write slot are device
    tensors that `advance` increments in place; `seq_len` counts on the host (`free` slots left)."""

    def __init__(self, cache: HybridCache, *, capacity: int, batch_size: int, device: torch.device) -> None:
        if capacity <= cache.seq_len:
            raise ValueError(f"a static cache needs room for new tokens: capacity {capacity} <= the {cache.seq_len} "
                             "slots already filled")
        self.capacity = capacity
        self.slot = torch.tensor(cache.seq_len, dtype=torch.int64, device=device)
        self.step_memo: dict = {}  # what the layers compute once per step (`StaticLayerCache.static_mask`)
        self.layers = [StaticLayerCache(layer, capacity=capacity, slot=self.slot, step_memo=self.step_memo)
                       for layer in cache.layers]
        # Every layer holds the same rows, so one tensor of their left padding serves them all (and they share a mask)
        firsts = [layer._first for layer in self.layers if layer._first is not None]
        if any(not torch.equal(first, firsts[0]) for first in firsts[1:]):
            raise ValueError("the cache's layers disagree on their rows' left padding")
        for layer in self.layers:
            if layer._first is not None:
                layer.pad = layer._first = firsts[0]
        self.seq_len = cache.seq_len
        rows = cache.lengths if cache.lengths is not None else torch.full((batch_size,), cache.seq_len)
        self.next_positions = rows.to(device=device, dtype=torch.int64).clone()[:, None]  # [B, 1]

    @property
    def free(self) -> int:
        return self.capacity - self.seq_len

    @property
    def lengths(self) -> torch.Tensor:
        """[B] tokens of each row so far (the device tensor the steps advance, also inside a replayed graph)."""
        return self.next_positions[:, 0]

    def positions(self, length: int, device: torch.device) -> torch.Tensor:
        if length != 1:
            raise ValueError(f"a static cache takes one token per call, got {length}")
        return self.next_positions

    def advance(self, length: int) -> None:
        self.step_memo.clear()
        self.slot.add_(length)
        self.next_positions.add_(length)
        self.seq_len += length

    def start_rows(self, lengths: torch.Tensor, *, device: torch.device | str) -> None:
        raise ValueError("a static cache continues a filled cache: run the prefill on a HybridCache")


def filled_rows(cache: HybridCache) -> int | None:
    """The number of rows (sequences) a filled cache holds; None while it holds no tensor yet."""
    if cache.lengths is not None:
        return int(cache.lengths.shape[0])
    for layer in cache.layers:
        for tensor in (layer._key, *layer.ssm.values()):
            if tensor is not None:
                return int(tensor.shape[0])
    return None


def additive_mask(attendable: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask as SDPA's additive one of `dtype`: 0 where True, -inf where False."""
    return torch.full(attendable.shape, float("-inf"), dtype=dtype, device=attendable.device).masked_fill_(
        attendable, 0.0)


def _grow(storage: torch.Tensor | None, filled: int, like: torch.Tensor, capacity: int, *,
          start: int = 0) -> torch.Tensor:
    """New storage [B, capacity, ...] holding the `filled` slots of the old one from `start` at its front."""
    out = like.new_empty(like.shape[0], capacity, *like.shape[2:])
    if storage is not None and filled:
        out[:, :filled] = storage[:, start : start + filled]
    return out
