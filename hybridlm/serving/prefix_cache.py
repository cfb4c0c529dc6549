"""Prefix caching of recurrent state: restart a prompt from the deepest checkpoint of a prompt seen before.

    store = PrefixCache(block_size=256, max_bytes=2 << 30)
    hit = store.lookup(prompt_ids)              # (length, cache copy, logits [V]) of the longest stored prefix, or None
    store.put(prompt_ids[:n], cache, logits)    # a snapshot of a single-sequence cache after n tokens

A hybrid model's state after n tokens is not a list of per-token entries a later prompt can share piecewise (as an
attention KV cache is): the SSD / fast-weight states and conv tails summarize the whole prefix. So the engine
checkpoints the whole per-layer state (those states, conv tails and the attention keys/values so far) at fixed
block boundaries while it prefills (every `block_size` tokens), at the end of every prompt and at the end of every
generation (the prompt and the reply's tokens but the last, from the decoding row), keyed by the token prefix; a
request whose prompt starts with a stored prefix restores the deepest one (a copy: the entry stays as it was) and
prefills only the rest. A shared system prompt hits at its last block boundary; a growing multi-turn chat hits after
the previous turn's reply (when the chat template renders the reply as the tokens generated), else at the end of the
previous turn's prompt.

Exactness: a restored state is the state a cold prefill reaches at that point, because the engine's prefill always
cuts a prompt at the same block boundaries, stored or not; from a block-boundary hit on, the prefill runs the same
pieces as a cold one, so the output equals the cold output. A hit at a prompt's end (not a block boundary) cuts the
next piece differently, and a generation's state was reached one token at a time (and in a batch), which changes
only float rounding.

Entries are keyed by a hash of the prefix (checked against the stored tokens on a hit), evicted least recently used
first when their tensors pass `max_bytes`. `stats` counts lookups, hits and the prompt tokens they saved.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from hybridlm.layers.cache import HybridCache

_MODULUS = (1 << 61) - 1  # the prefix hash: a polynomial rolling hash modulo a Mersenne prime
_BASE = 1_000_003


@dataclass
class PrefixCacheStats:
    lookups: int = 0  # prompts looked up
    hits: int = 0  # of them, those that restored a stored prefix
    prompt_tokens: int = 0  # tokens of the prompts looked up
    tokens_saved: int = 0  # of them, those restored instead of prefilled

    def as_dict(self) -> dict:
        return dict(lookups=self.lookups, hits=self.hits, prompt_tokens=self.prompt_tokens,
                    tokens_saved=self.tokens_saved)


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    cache: HybridCache
    logits: torch.Tensor  # [V] the logits after the prefix's last token
    nbytes: int


@dataclass
class PrefixCache:
    block_size: int
    max_bytes: int
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.max_bytes < 0:
            raise ValueError(f"block_size must be >= 1 and max_bytes >= 0, got {self.block_size}, {self.max_bytes}")
        self._entries: OrderedDict[tuple[int, int], _Entry] = OrderedDict()  # (length, hash) -> entry, LRU first
        self._lengths: dict[int, int] = {}  # prefix length -> how many entries have it
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, tokens: list[int]) -> tuple[int, HybridCache, torch.Tensor] | None:
        """The longest stored prefix of `tokens`: (its length, a copy of its cache, its last logits [V]); None when
        no stored prefix matches. Counted in `stats`."""
        self.stats.lookups += 1
        self.stats.prompt_tokens += len(tokens)
        hashes = prefix_hashes(tokens)
        for length in sorted((n for n in self._lengths if n <= len(tokens)), reverse=True):
            key = (length, hashes[length])
            entry = self._entries.get(key)
            if entry is not None and entry.tokens == tuple(tokens[:length]):
                self._entries.move_to_end(key)
                self.stats.hits += 1
                self.stats.tokens_saved += length
                return length, entry.cache.copy(), entry.logits
        return None

    def put(self, tokens: list[int], cache: HybridCache, logits: torch.Tensor) -> None:
        """Store a snapshot of `cache` (a single sequence after `tokens`) and its last logits [V]; evict the least
        recently used entries past `max_bytes` (an entry larger than that alone is not stored)."""
        key = (len(tokens), prefix_hashes(tokens)[-1])
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        snapshot = cache.copy()
        nbytes = sum(layer.state_bytes() for layer in snapshot.layers) + logits.numel() * logits.element_size()
        if nbytes > self.max_bytes:
            return
        self._entries[key] = _Entry(tuple(tokens), snapshot, logits.clone(), nbytes)
        self._lengths[key[0]] = self._lengths.get(key[0], 0) + 1
        self.bytes += nbytes
        while self.bytes > self.max_bytes:
            (length, _), old = self._entries.popitem(last=False)
            self.bytes -= old.nbytes
            self._lengths[length] -= 1
            if not self._lengths[length]:
                del self._lengths[length]


def prefix_hashes(tokens: list[int]) -> list[int]:
    """[len + 1] the hash of every prefix tokens[:n] (n = 0 .. len), one pass."""
    out = [0]
    h = 0
    for t in tokens:
        h = (h * _BASE + t + 1) % _MODULUS
        out.append(h)
    return out
