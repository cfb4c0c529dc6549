"""Cached generation: one prefill, then one recurrent step per new token.

    out = generate(model, ids, max_new_tokens=32)                                   # greedy
    out = generate(model, ids, attention_mask=mask, max_new_tokens=32, temperature=0.8, top_p=0.95,
                   eos_token_id=11, seed=0)                                         # sampled, batched
    out.sequences                                                                   # [B, T + n]

Prompts of different lengths go in one batch LEFT-padded, with `attention_mask` [B, T] (1 = token).
Padding is handled by packing, not masking: the prefill runs the rows' tokens end to end as one packed
row with `cu_seqlens`, so every mixer sees each prompt alone (attention cannot see pad keys, the convs
restart at each prompt, and the SSD / fast-weight states of a row are exactly those of its unpadded
prompt, to float rounding). The cache then holds one row per prompt and every row continues from its own
length; see `hybridlm.layers.cache`.

`graph=True` runs the decoding steps through `GraphedDecoder` (hybridlm/models/graphed.py): one replayed CUDA
graph per token on a GPU, the same fixed-shape step run eagerly on the CPU; the same tokens and logits in float32 (in
bf16 the two paths round differently, so a near-tie between two tokens can go either way). Its attention reads the
prompt length + max_new_tokens slots at every step, whether or not an eos ends the rows early: ask for the tokens
you need.

`prefill_chunk=n` runs the prefill as pieces of n tokens per row, each continuing from the cache the last one filled:
the same cache and logits (to float rounding), with peak activation memory bounded by n rows' tokens instead of the
whole prompt's (a batch of 32 prompts of 64K tokens is 2M tokens at once otherwise). In a left-padded batch the
first piece is the packed prefill of every row's padding and at least one of its tokens (so it is longer than n when
some row's padding is), and the pieces after it hold no padding.

`cache=` continues a cache an earlier call filled with the first `cache.seq_len` tokens of every row (a chat's
conversation so far, `prefill` of a shared prefix): only the rest of the prompt is prefilled, onto that cache, which
the call goes on filling in place (pass `cache.copy()` to keep it). The tokens and logits are those of a prefill of
the whole prompt (to float rounding, as with `prefill_chunk`). The caller vouches that the cache holds those tokens:
the call sees only how many.

Stopping: a row is finished once it produces one of `eos_token_id`, or once the `stop` callback says so (called
after every new token with the sequences so far, the way transformers calls a `StoppingCriteriaList`); its later
positions hold `pad_token_id` (or the first eos id when no pad id is known) and decoding ends when every row is done
or after `max_new_tokens`. Nothing stops at an eos that is not asked for: `eos_token_id=None` (the default) decodes
`max_new_tokens` tokens whatever the model's config says, so that a caller always gets what it asked for (`hybridlm
generate` passes the tokenizer's and the config's eos). `HybridForCausalLM.generate`, the transformers-style entry
point, defaults to the config's `eos_token_id` instead, as transformers does.

Length: the prompt + `max_new_tokens` may run past the config's `max_position_embeddings`; nothing is refused. The
field is informational (`hybridlm.models.config`): RoPE angles are computed from the positions on every call (no table
to run off), the SSM states and caches have no length limit, and the decoded tokens past it are exactly what a full
forward over the longer sequence gives. What the field marks is the length the model was trained for, beyond which
quality is the model's own question (long-context extrapolation is something one measures with this function).
The front ends that take a length from a user refuse one past it: `hybridlm generate`, `hybridlm eval ppl`, the
training config.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridlm.layers.cache import HybridCache, StaticCache, filled_rows
from hybridlm.models.graphed import GraphedDecoder
from hybridlm.models.sampling import check_sampling, sample_next
from hybridlm.modules.boundaries import left_padding_mask


@dataclass
class GenerationOutput:
    sequences: torch.Tensor  # [B, T + n] prompt (with its left padding) + new tokens
    attention_mask: torch.Tensor  # [B, T + n] 1 = a real token, 0 = left padding or filler after eos
    logits: torch.Tensor | None = None  # [B, n, V] float32 raw logits of every new position (output_logits)


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int = 20,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    generator: torch.Generator | None = None,
    seed: int | None = None,
    output_logits: bool = False,
    graph: bool = False,
    prefill_chunk: int | None = None,
    stop: Callable[[torch.Tensor, torch.Tensor], bool | torch.Tensor] | None = None,
    cache: HybridCache | None = None,
) -> GenerationOutput:
    """Generate up to `max_new_tokens` tokens after each prompt of `input_ids` [B, T].

    Args:
        model: a `HybridForCausalLM` (anything with `new_cache()` and its forward signature).
        attention_mask: [B, T], 1 = token, 0 = left padding; None = no padding.
        temperature: 0 = greedy (argmax); > 0 samples from softmax(logits / temperature).
        top_k, top_p: sampling filters (None = off), applied after the temperature.
        eos_token_id: one id or a list; a row stops after producing any of them. None (default): no eos stops a row,
            not even the model config's (`HybridForCausalLM.generate` defaults to the config's; module docstring).
        pad_token_id: what finished rows get after their eos (default: the model config's pad id).
        generator / seed: the random source of sampling (give at most one); a seed makes a fresh
            `torch.Generator` on the ids' device, so the same seed gives the same tokens.
        output_logits: also return the raw logits of every generated position.
        graph: decode through a `GraphedDecoder` (a CUDA graph of the step; see the module docstring).
        prefill_chunk: prefill in pieces of this many tokens per row (None: the whole prompt at once).
        stop: called after every new token as `stop(sequences, logits)`: the sequences so far [B, T + i] (prompt,
            padding and the i new tokens, finished rows' filler included) and the logits [B, V] the last token was
            chosen from (read them during the call: the next step may overwrite them). It returns a bool (True: every
            row is done) or a bool tensor [B] (True: that row is done). A transformers `StoppingCriteriaList` (the
            stop strings of lm_eval's `generate_until`) is such a callable. A done row keeps its tokens so far, the
            one just chosen included, and gets filler after it.
        cache: a cache filled with the first `cache.seq_len` tokens of every row (module docstring); the prefill runs
            on the rest, at least one token, and the cache goes on in place. Not with `attention_mask`.

    The prompt + max_new_tokens may pass the config's max_position_embeddings (module docstring, "Length").
    """
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [B, T] with T >= 1, got shape {list(input_ids.shape)}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    check_sampling(temperature=temperature, top_k=top_k, top_p=top_p)
    if generator is not None and seed is not None:
        raise ValueError("pass a generator or a seed, not both")
    if seed is not None:
        generator = torch.Generator(device=input_ids.device).manual_seed(seed)
    eos = _eos_ids(eos_token_id, input_ids.device)
    if pad_token_id is None:
        pad_token_id = getattr(model.config, "pad_token_id", None)
    filler = pad_token_id if pad_token_id is not None else (int(eos[0]) if eos is not None else 0)
    if eos is not None or stop is not None:  # rows can finish: the steps after feed them the filler
        _check_filler(model, filler, "pad_token_id" if pad_token_id is not None else "eos_token_id")
    batch = input_ids.shape[0]
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(input_ids.dtype)
    if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                      or prefill_chunk < 1):
        raise ValueError(f"prefill_chunk must be an int >= 1 (tokens per row per piece), got {prefill_chunk!r}")

    if stop is not None and not callable(stop):
        raise ValueError(f"stop must be a callable stop(sequences, logits) -> bool or [B] bool tensor, got {stop!r}")

    # the prompt then the new tokens, written in place: `stop` reads the sequences so far without a copy per step
    tokens = torch.cat([input_ids, input_ids.new_full((batch, max_new_tokens), filler)], dim=1)  # [B, T + n]
    length = input_ids.shape[1]
    new_mask, step_logits = [], []
    done = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
    if max_new_tokens > 0:
        cache, logits = prefill(model, input_ids, attention_mask=attention_mask, chunk=prefill_chunk, cache=cache)
        decoder = None
        if graph and max_new_tokens > 1:
            decoder = GraphedDecoder(model, cache, capacity=cache.seq_len + max_new_tokens - 1, batch_size=batch)
            cache = None  # the decoder holds a copy: free the prefill's keys and values
        for step in range(max_new_tokens):
            if output_logits:
                step_logits.append(logits.float().clone())  # (the decoder's logits buffer is rewritten)
            token = sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
            new_mask.append(~done)
            token = torch.where(done, torch.full_like(token, filler), token)
            tokens[:, length] = token
            length += 1
            if eos is not None:
                done = done | torch.isin(token, eos)
            if stop is not None:
                done = done | _stopped(stop(tokens[:, :length], logits), batch, input_ids.device)
            if (eos is not None or stop is not None) and bool(done.all()):
                break
            if step + 1 < max_new_tokens and decoder is not None:
                logits = decoder.step(token)  # [B, V]
            elif step + 1 < max_new_tokens:
                logits = model(token[:, None], cache=cache, logits_to_keep=1).logits[:, -1]  # [B, V]

    sequences = tokens[:, :length].contiguous()  # a copy only when decoding ended early
    out_mask = torch.cat([mask, *[m[:, None].to(mask.dtype) for m in new_mask]], dim=1)
    logits_out = torch.stack(step_logits, dim=1) if output_logits and step_logits else None
    return GenerationOutput(sequences=sequences, attention_mask=out_mask, logits=logits_out)


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
            chunk: int | None = None, cache: HybridCache | None = None) -> tuple[HybridCache, torch.Tensor]:
    """A new decoding cache filled with the prompts `input_ids` [B, T] (left-padded where `attention_mask` [B, T] has
    zeros), and the logits [B, V] of their last positions. `chunk`: pieces of that many tokens per row (the module
    docstring's `prefill_chunk`); None: one call. `cache`: one that holds the first `cache.seq_len` tokens of every
    row (no `attention_mask` then), continued in place with the rest (`generate`'s `cache`)."""
    if cache is not None:
        _check_continued(cache, input_ids, attention_mask)
        rest = input_ids[:, cache.seq_len:]  # [B, T - S]
        piece = chunk or rest.shape[1]
        for start in range(0, rest.shape[1], piece):
            logits = model(rest[:, start:start + piece], cache=cache, logits_to_keep=1).logits[:, -1]
        return cache, logits
    cache = model.new_cache()
    if chunk is None:
        return cache, model(input_ids, attention_mask=attention_mask, cache=cache, logits_to_keep=1).logits[:, -1]
    # the whole mask checked here: the pieces after the first run without one
    keep = None if attention_mask is None else left_padding_mask(attention_mask, input_ids.shape)
    padding = 0 if keep is None else int((~keep).sum(1).max())
    first = max(chunk, padding + 1)  # all the (left) padding and a token of every row are in the first piece
    first_mask = None if attention_mask is None else attention_mask[:, :first]
    logits = model(input_ids[:, :first], attention_mask=first_mask, cache=cache, logits_to_keep=1).logits[:, -1]
    for start in range(first, input_ids.shape[1], chunk):
        logits = model(input_ids[:, start:start + chunk], cache=cache, logits_to_keep=1).logits[:, -1]
    return cache, logits


def _check_continued(cache: HybridCache, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
    """A cache to continue holds fewer tokens than the prompt, in rows of its batch, none left-padded."""
    if not isinstance(cache, HybridCache) or isinstance(cache, StaticCache):
        raise ValueError(f"cache must be a HybridCache filled by a prefill (model.new_cache()), got "
                         f"{type(cache).__name__}")
    if attention_mask is not None or cache.lengths is not None:
        raise ValueError("a cache is continued for prompts without left padding: pass no attention_mask, and a cache "
                         "whose rows all hold the same number of tokens")
    if cache.seq_len >= input_ids.shape[1]:
        raise ValueError(f"the cache holds {cache.seq_len} tokens and the prompt has {input_ids.shape[1]}: the prompt "
                         "must go on past the cache by at least one token (whose logits choose the first new one)")
    rows = filled_rows(cache)
    if rows is not None and rows != input_ids.shape[0]:
        raise ValueError(f"the cache holds {rows} rows and input_ids has {input_ids.shape[0]}")


def _stopped(result, batch: int, device: torch.device) -> torch.Tensor:
    """What a `stop` callback returned -> the rows it says are done, [B] bool."""
    try:
        done = torch.as_tensor(result, device=device)
    except (TypeError, RuntimeError, ValueError):
        done = None
    if done is None or done.dtype != torch.bool or done.shape not in ((), (1,), (batch,)):
        what = type(result).__name__
        if isinstance(result, torch.Tensor):
            what += f" of dtype {result.dtype} and shape {list(result.shape)}"
        raise ValueError(f"stop(sequences, logits) must return a bool (every row) or a bool tensor of shape [{batch}] "
                         f"(one per row), got {what}")
    return done.expand(batch)


def _check_filler(model, filler, source: str) -> None:
    """Finished rows are fed `filler` (the pad id, else the first eos id) in the steps after their eos, so it must be
    an id of the model's embedding."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = embeddings.num_embeddings if embeddings is not None else getattr(model.config, "vocab_size", None)
    if isinstance(filler, bool) or not isinstance(filler, int) or (vocab is not None and not 0 <= filler < vocab):
        raise ValueError(f"{source}={filler!r} is the token that rows get after their eos, so it must be an id of the "
                         f"model's vocabulary (0..{vocab - 1 if vocab else '?'}); pass pad_token_id=<an id in it>")


def _eos_ids(eos_token_id, device: torch.device) -> torch.Tensor | None:
    if eos_token_id is None:
        return None
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"eos_token_id must be an id >= 0 or a non-empty list of them, got {eos_token_id!r}")
    return torch.tensor(ids, device=device)
