"""The running decode batch's state: one row (slot) per sequence in storage allocated once.

    slots = SlotCache(num_layers, max_rows=8, capacity=2048)
    row = slots.install(prefilled_cache)            # a sequence joins: its B == 1 prefill cache copied into row n
    logits = model(tokens[:, None], cache=slots)    # one decoding step of the rows [0, n): tokens [n]
    slots.commit()                                  # the step's new SSM states written back into their rows
    snapshot = slots.extract(row)                   # a row as a single-sequence cache (the prefix cache's entry)
    moved = slots.release(row)                      # a sequence leaves: the last row moves into its place

Rows [0, n) are the running sequences, kept contiguous (a leaving row is filled by the last one), so a step reads
views of the storage, never a gather. Per layer the storage holds:
- the attention keys/values [max_rows, capacity, H_kv, D]; each row writes its next token at its own length and
  attends to its own filled slots (a [n, 1, 1, S] mask, S = the longest row's length + 1, so a step reads no more
  than the longest row needs). With a sliding window W < capacity the storage is a ring of W slots per row
  (position p at p mod W): O(W) memory per sequence, however long it runs;
- every SSM state the mixer keeps in `cache.ssm` (conv tails, SSD / fast-weight states), [max_rows, ...].

The mixers' step kernels write the new SSM states over the rows' views they are given (`states_in_place`); where a
mixer replaces an `ssm` entry with a new tensor instead (its torch paths), `commit` copies it into the rows (as the
graphed decoder does), so the storage keeps its addresses.
"""

from __future__ import annotations

import torch

from hybridlm.layers.cache import HybridCache, LayerCache, StaticLayerCache, additive_mask
from hybridlm.modules.rotary import rotate_into_cache_fuses
from hybridlm.ops.rotary import rotary_qk_into_cache_triton


class SlotLayerCache(StaticLayerCache):
    """One layer's rows: key/value storage written at each row's own slot, SSM states per row (module docstring).
    A `StaticLayerCache` to attention (fixed storage, `static_mask`), with one write slot per row instead of one
    shared slot; it is built empty and filled row by row (`SlotCache.install`), not from a filled cache."""

    def __init__(self, owner: SlotCache) -> None:
        LayerCache.__init__(self)  # empty: StaticLayerCache's constructor copies a filled cache, there is none
        self._owner = owner
        self._states: dict[str, torch.Tensor] = {}  # name -> [max_rows, ...] storage of each SSM state
        self._views: dict[str, torch.Tensor] = {}  # the views of rows [0, rows) that `begin` handed the mixer
        self._ring = False  # set with the key/value storage: a ring of `window` slots per row

    def append_kv(self, key: torch.Tensor, value: torch.Tensor, *, saved_for_backward: bool = False,
                  window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write each row's token (key/value [n, 1, H_kv, D]) at its own slot; return the rows' keys/values
        [n, S, H_kv, D] (views of the storage: S the ring's W slots, or the longest row's length + 1)."""
        if key.shape[1] != 1 or torch.is_grad_enabled():
            raise ValueError("a slot cache takes one token per row per call, without gradients")
        if window != self.window:
            raise ValueError(f"this cache was filled with attention_window={self.window}, this call has {window}")
        rows = self._owner.step_rows
        where = self._owner.positions_now()  # [n] the position each row writes
        index = torch.remainder(where, self._key.shape[1]) if self._ring else where
        batch = torch.arange(rows, device=where.device)
        self._key[batch, index] = key[:, 0]
        self._value[batch, index] = value[:, 0]
        span = self._span()
        return self._key[:rows, :span], self._value[:rows, :span]

    def append_rotated(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, *, window: int | None = None) -> tuple[torch.Tensor, ...] | None:
        """`StaticLayerCache.append_rotated` at each row's own slot: (the rotated query, the rows' keys and values as
        `append_kv` returns them), or None where the kernel does not run."""
        if not rotate_into_cache_fuses(query, key, value, cos, sin, self._key):
            return None
        if torch.is_grad_enabled():
            raise ValueError("a slot cache takes one token per row per call, without gradients")
        if window != self.window:
            raise ValueError(f"this cache was filled with attention_window={self.window}, this call has {window}")
        rows = self._owner.step_rows
        query = rotary_qk_into_cache_triton(query, key, value, cos, sin, self._key[:rows], self._value[:rows],
                                            self._owner.positions_now(),
                                            ring=self._key.shape[1] if self._ring else None)
        span = self._span()
        return query, self._key[:rows, :span], self._value[:rows, :span]

    def _span(self) -> int:
        """Key slots a step reads: the ring's W, else the step's fixed span or the longest row's length + 1."""
        if self._ring:
            return self._key.shape[1]
        return self._owner.step_span or self._owner.longest + 1

    def static_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """[n, 1, 1, S] additive mask of `dtype`: 0 where a row's query may attend (its filled slots and the one just
        written), -inf elsewhere. Computed by the step's first layer, the others take it from the owner's step memo
        (`StaticLayerCache.static_mask`)."""
        key = ("static_mask", self._ring, dtype)  # the step's span is the same in every layer
        memo = self._owner.step_memo
        if key not in memo:
            memo[key] = additive_mask(self._attendable(), dtype)
        return memo[key]

    def _attendable(self) -> torch.Tensor:
        """[n, 1, 1, S] True where a row's query may attend."""
        where = self._owner.positions_now()[:, None]  # [n, 1]
        if self._ring:
            index = torch.arange(self._key.shape[1], device=where.device)[None]  # [1, W]
            held = where - torch.remainder(where - index, self._key.shape[1])  # [n, W] position each index holds
            return (held >= 0)[:, None, None]
        index = torch.arange(self._span(), device=where.device)[None]  # [1, S]
        return (index <= where)[:, None, None]

    def install(self, row: int, source: LayerCache, length: int) -> None:
        """Copy the single-sequence cache `source` (its `length` tokens) into `row`."""
        for name, tensor in source.ssm.items():
            if name not in self._states:
                if self._owner.rows:
                    raise ValueError(f"a sequence brought SSM state {name!r} that the running ones do not have")
                self._states[name] = tensor.new_zeros(self._owner.max_rows, *tensor.shape[1:])
                self._owner.storage_version += 1
            self._states[name][row] = tensor[0]
        if source.key is None:
            return
        if self._key is None:
            self.window = source.window
            self._ring = source.window is not None and source.window < self._owner.capacity
            # One slot past the capacity: a step's key view [:rows, :span] then never spans the whole storage, so it
            # is never contiguous where another span's view is not (a compiled step would specialize on that).
            slots = source.window if self._ring else self._owner.capacity + 1
            self._key = source.key.new_zeros(self._owner.max_rows, slots, *source.key.shape[2:])
            self._value = source.value.new_zeros(self._owner.max_rows, slots, *source.value.shape[2:])
            self._owner.storage_version += 1
        if source.window != self.window:
            raise ValueError(f"a sequence prefilled with attention_window={source.window} cannot join rows of "
                             f"attention_window={self.window}")
        if self._ring:
            keep = min(source.length, self.window - 1)  # what the next query's window reaches
            index = torch.arange(length - keep, length, device=self._key.device) % self.window
            self._key[row, index] = source.key[0, source.length - keep :]
            self._value[row, index] = source.value[0, source.length - keep :]
        else:
            if source.dropped or length > self._owner.capacity:
                raise ValueError(f"a sequence of {length} tokens does not fit slots of {self._owner.capacity}")
            self._key[row, :length] = source.key[0]
            self._value[row, :length] = source.value[0]

    def extract(self, row: int, length: int) -> LayerCache:
        """Row `row` (its `length` tokens) as a single-sequence cache with storage of its own, what `install` takes
        back: with a ring, the last min(length, W - 1) slots (all the next query reaches), the others counted as
        dropped."""
        out = LayerCache()
        out.ssm = {name: state[row : row + 1].clone() for name, state in self._states.items()}
        if self._key is None:
            return out
        out.window = self.window
        if self._ring:
            keep = min(length, self.window - 1)
            index = torch.arange(length - keep, length, device=self._key.device) % self.window  # [keep] ring slots
            out._key, out._value = self._key[row, index][None], self._value[row, index][None]  # [1, keep, H_kv, D]
            out.length, out.dropped = keep, length - keep
        else:
            out._key, out._value = self._key[row : row + 1, :length].clone(), self._value[row : row + 1, :length].clone()
            out.length = length
        return out

    def begin(self, rows: int) -> None:
        """Before a step: the mixers' `ssm` dict holds views of rows [0, rows)."""
        self.ssm = {name: state[:rows] for name, state in self._states.items()}
        self._views = dict(self.ssm)

    def commit(self, rows: int) -> None:
        """After a step: the SSM states the mixers produced as new tensors, copied into rows [0, rows) (those written
        over the rows' views in place are there already)."""
        if self.ssm.keys() != self._states.keys():
            raise RuntimeError(f"a decoding step changed the SSM state's fields ({sorted(self._states)} -> "
                               f"{sorted(self.ssm)}): the slots cannot hold them")
        for name, state in self._states.items():
            if self.ssm[name] is not state and self.ssm[name] is not self._views.get(name):
                state[:rows].copy_(self.ssm[name])

    def move(self, source: int, target: int, length: int) -> None:
        """Copy row `source` (its `length` tokens) into row `target`."""
        for state in self._states.values():
            state[target] = state[source]
        if self._key is not None:
            span = self._key.shape[1] if self._ring else length
            self._key[target, :span] = self._key[source, :span]
            self._value[target, :span] = self._value[source, :span]


class SlotCache(HybridCache):
    """`max_rows` sequence slots of up to `capacity` tokens each, rows [0, rows) running (module docstring). A
    `HybridCache` to the model: positions and `advance` count each row on its own."""

    def __init__(self, num_layers: int, *, max_rows: int, capacity: int, device: torch.device) -> None:
        super().__init__(0)
        self.max_rows, self.capacity, self.device = max_rows, capacity, device
        self.layers = [SlotLayerCache(self) for _ in range(num_layers)]
        self.rows = 0  # running rows
        self.host_lengths: list[int] = []  # tokens of each running row, on the host
        self.lengths_device = torch.zeros(max_rows, dtype=torch.int64, device=device)  # the same, on the device
        # The rows and key span of the step being run (`begin`): the running rows and the longest row's length + 1,
        # or fixed ones (rows past the running ones are padding) for steps of fixed shapes (`serving.graphed`).
        self.step_rows = 0
        self.step_span: int | None = None
        self.storage_version = 0  # counts storage allocations: tensors captured before a change are stale
        # What the layers compute once per step (`SlotLayerCache.static_mask`), emptied as each step begins and ends.
        self.step_memo: dict = {}

    @property
    def longest(self) -> int:
        return max(self.host_lengths, default=0)

    def positions_now(self) -> torch.Tensor:
        """[n] the position each row of the step takes (the running rows', then the padding rows' 0)."""
        return self.lengths_device[: self.step_rows]

    def positions(self, length: int, device: torch.device) -> torch.Tensor:
        if length != 1:
            raise ValueError(f"a slot cache takes one token per row per call, got {length}")
        return self.positions_now()[:, None]

    def advance(self, length: int) -> None:
        """Count a step's tokens: on the device, and on the host unless the step has a fixed span (`begin`): such a
        step is the body of a replayed graph, so its caller counts the host's (`count_step`) after each run."""
        self.step_memo.clear()
        self.lengths_device[: self.step_rows] += length
        if self.step_span is None:
            self.count_step(length)

    def count_step(self, length: int = 1) -> None:
        """The host's count of a step's tokens (a replayed graph advances only the device's)."""
        self.host_lengths = [n + length for n in self.host_lengths]

    def start_rows(self, lengths: torch.Tensor, *, device: torch.device | str) -> None:
        raise ValueError("a slot cache is filled by install(), one prefilled sequence at a time")

    def install(self, source: HybridCache) -> int:
        """Copy a single-sequence prefill cache into the next free row; return that row."""
        if self.rows == self.max_rows:
            raise ValueError(f"all {self.max_rows} slots are taken")
        length = source.seq_len
        if length >= self.capacity:
            raise ValueError(f"a sequence of {length} tokens leaves no room in slots of {self.capacity} tokens")
        row = self.rows
        for layer, prefilled in zip(self.layers, source.layers):
            layer.install(row, prefilled, length)
        self.lengths_device[row] = length
        self.host_lengths.append(length)
        self.rows += 1
        return row

    def extract(self, row: int) -> HybridCache:
        """A running row as a single-sequence cache of its own (a snapshot: the row goes on unchanged)."""
        out = HybridCache(0)
        out.layers = [layer.extract(row, self.host_lengths[row]) for layer in self.layers]
        out.seq_len = self.host_lengths[row]
        return out

    def begin(self, rows: int | None = None, span: int | None = None, *, views: bool = True) -> None:
        """Before a decoding step of the running rows; `rows` >= the running rows and `span` > the longest row's
        length fix the step's shapes (the rows past the running ones are padding: they write their key at slot 0,
        which every sequence installed later overwrites, and nothing reads their output). views=False: the checks
        only, for a replayed graph, which reads and writes the storage at the addresses it captured."""
        if any(n >= self.capacity for n in self.host_lengths):
            raise ValueError(f"a running sequence reached the slots' capacity of {self.capacity} tokens")
        rows = self.rows if rows is None else rows
        if not self.rows <= rows <= self.max_rows or (span is not None and not self.longest < span <= self.capacity):
            raise ValueError(f"a step of {rows} rows and span {span} cannot hold {self.rows} rows of up to "
                             f"{self.longest} tokens in slots of {self.capacity}")
        self.step_rows, self.step_span = rows, span
        self.step_memo.clear()
        if views:
            for layer in self.layers:
                layer.begin(rows)

    def commit(self) -> None:
        """After a decoding step of the running rows."""
        for layer in self.layers:
            layer.commit(self.step_rows)

    def snapshot(self, rows: int) -> dict:
        """What a step of `rows` rows changes besides the key/value slot each writes: counts and SSM states."""
        return {"host": list(self.host_lengths), "device": self.lengths_device.clone(),
                "states": [{name: t[:rows].clone() for name, t in layer._states.items()} for layer in self.layers]}

    def restore(self, saved: dict) -> None:
        """Undo the steps since `snapshot` (but the key/value slots they wrote, which the next step rewrites)."""
        self.host_lengths = list(saved["host"])
        self.step_memo.clear()
        self.lengths_device.copy_(saved["device"])
        for layer, states in zip(self.layers, saved["states"]):
            for name, value in states.items():
                layer._states[name][: value.shape[0]].copy_(value)

    def release(self, row: int) -> int | None:
        """Free `row`; the last running row moves into it. Returns the row that moved (None: none did)."""
        last = self.rows - 1
        moved = None
        if row != last:
            for layer in self.layers:
                layer.move(last, row, self.host_lengths[last])
            self.lengths_device[row] = self.lengths_device[last]
            self.host_lengths[row] = self.host_lengths[last]
            moved = last
        self.host_lengths.pop()
        self.rows -= 1
        return moved
