"""The serving engine: continuous batching of requests over one model, with prefix caching of recurrent state.

    engine = Engine("runs/demo/final", max_num_seqs=16)                    # a checkpoint directory (or a model)
    outputs = engine.generate(["def main(", "import os"], SamplingParams(max_tokens=32))
    outputs[0].text, outputs[0].finish_reason, outputs[0].usage

    request_id = engine.add_request(prompt, params, on_output=callback)  # any thread; the server does this
    while engine.has_work():
        engine.step()                                                      # one thread: the engine's own

A step (`step`):
1. takes the requests added and aborted since the last step (thread-safe queues);
2. admits waiting requests while fewer than `max_num_seqs` are running or prefilling, each restoring the longest
   prefix of its prompt that the prefix cache holds (`hybridlm.serving.prefix_cache`);
3. prefills: the prefilling requests in arrival order, each in pieces that end at multiples of `block_size` (and
   at its prompt's end), until `max_prefill_tokens` tokens are chosen this step. Every request keeps its own
   single-sequence `HybridCache`; the requests' first pieces run together as one packed forward (documents of one
   row, each continuing its own cache: `hybridlm.serving.packed`), then their second pieces, and so on; each piece's
   end is checkpointed into the prefix cache. A request whose prompt is done samples its first token and joins the
   running rows (`hybridlm.serving.slots`);
4. decodes one token for every running row in one batched forward (on a CUDA device a replayed CUDA graph of a
   fixed shape that holds the rows: `hybridlm.serving.graphed`), samples each row with its own settings and
   random generator, and retires the rows that finished (eos, stop string, max_tokens) or were aborted; a finished
   row's state (prompt + reply but its last token) goes into the prefix cache first, so the next turn of a chat
   (previous prompt + reply + a new message) restores it instead of prefilling the reply again.
Long prompts thus prefill a few blocks per step while the running streams keep getting a token every step.

Results do not depend on the batch: a row's logits come from its own tokens and states only (the rows of a step
are independent; a padded key slot is masked), and a seeded request samples from its own generator. Greedy
outputs equal `hybridlm.inference.generate` on the request alone (to float rounding; exactly so in the tests).
"""

from __future__ import annotations

import functools
import itertools
import logging
import secrets
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hybridlm.layers.cache import HybridCache
from hybridlm.models.sampling import sample_next
from hybridlm.serving.graphed import SlotStepGraphs
from hybridlm.serving.packed import PackedPrefill, state_fields
from hybridlm.serving.params import SamplingParams
from hybridlm.serving.prefix_cache import PrefixCache
from hybridlm.serving.slots import SlotCache
from hybridlm.serving.text import TextStream

log = logging.getLogger("hybridlm.serving")


@dataclass
class RequestOutput:
    """A request's progress after a step: the new text (`delta`) and everything so far."""

    request_id: str
    delta: str  # text new since the last output
    text: str  # the completion so far
    token_ids: list[int]  # the completion's tokens so far (an eos that ended it included)
    prompt_tokens: int
    cached_tokens: int  # prompt tokens restored from the prefix cache
    finished: bool = False
    finish_reason: str | None = None  # "stop" (eos or a stop string), "length" (max_tokens), "abort"

    @property
    def usage(self) -> dict:
        return dict(prompt_tokens=self.prompt_tokens, completion_tokens=len(self.token_ids),
                    total_tokens=self.prompt_tokens + len(self.token_ids))


@dataclass
class StepCounters:
    """Where the engine's time went since its warm-up: prefill (steps, prompt tokens, seconds) and decode (steps,
    rows, seconds), host wall time of each phase (a CUDA step's sampling waits for its kernels, so this counts them)."""

    prefill_steps: int = 0
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_steps: int = 0
    decode_rows: int = 0
    decode_s: float = 0.0

    def prefill(self, tokens: int, seconds: float) -> None:
        self.prefill_steps += 1
        self.prefill_tokens += tokens
        self.prefill_s += seconds

    def decode(self, rows: int, seconds: float) -> None:
        self.decode_steps += 1
        self.decode_rows += rows
        self.decode_s += seconds

    def as_dict(self) -> dict:
        return dict(vars(self))


@dataclass
class _Sequence:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    stream: TextStream
    generator: torch.Generator
    on_output: Callable[[RequestOutput], None] | None
    arrival: float
    output: list[int] = field(default_factory=list)
    cache: HybridCache | None = None  # the single-sequence cache while prefilling
    prefilled: int = 0  # prompt tokens in `cache`
    logits: torch.Tensor | None = None  # [V] after the last prefilled token
    cached_tokens: int = 0
    first_token_time: float | None = None
    finish_reason: str | None = None


class Engine:
    """Continuous batching over `model` (a `HybridForCausalLM`, or a checkpoint directory loaded with its
    tokenizer). `tokenizer`: a transformers tokenizer (text prompts and text outputs); None: token-id prompts only,
    empty texts.

    Args:
        max_num_seqs: sequences running or prefilling at once (decode rows).
        max_model_len: prompt + new tokens per request at most (default: the config's max_position_embeddings); the
            key/value slots of every row hold this many.
        block_size: prefill pieces end at multiples of this (and prefix-cache checkpoints are taken there).
        max_prefill_tokens: prompt tokens prefilled per step at most (at least one piece runs). Default: 8192 on a
            CUDA device (an eager packed prefill step there costs about the same at 2048 tokens as at 8192: fewer,
            larger steps start a burst of prompts sooner; benchmarks/RESULTS.md), 2048 elsewhere (a CPU's step time
            grows with its tokens, and running streams wait for it).
        prefix_cache_bytes: memory of the prefix cache's snapshots (0: no prefix caching).
        dtype, device: where a model loaded from a directory goes (default float32; cuda when available).
        fold_multipliers: a model loaded from a directory has its muP multipliers folded into its weights
            (`hybridlm.models.fold`: the same function, an elementwise kernel fewer per multiplier and call; an
            official Falcon-H1 checkpoint's decoding step loses some thirteen per layer). A model given as an object
            is used as it is.
        fuse_projections: a model loaded from a directory onto a CUDA device has the projections that read one input
            fused into one GEMM each (`hybridlm.models.fuse`: q, k, v with a parallel block's SSM in_proj, the MLP's up
            and gate).
        concurrent_mixers: a model loaded from a directory onto a CUDA device decodes each parallel block's SSM half
            on a second stream beside attention in the graphed steps (`hybridlm.layers.block`: the same values, the
            halves overlapping; decode_step "eager" and "fixed" run without a graph and stay on one stream, as their
            launches set their time).
        decode_step: "auto" (CUDA graphs on a CUDA device, else "eager"), "graph" (each step at a fixed shape replayed
            as a CUDA graph: `hybridlm.serving.graphed`), "fixed" (the same fixed-shape step run eagerly) or "eager"
            (the running rows and the longest row's keys exactly, one kernel launch per operator).
        compile_step: a torch.compile backend ("inductor") for the fixed-shape step, compiled before the graphs are
            captured: fused kernels, so fewer of them per step (`hybridlm.serving.graphed`). With decode_step "auto"
            it takes the fixed-shape step on a CPU; "eager" steps are not compiled.
    """

    def __init__(self, model, tokenizer=None, *, max_num_seqs: int = 8, max_model_len: int | None = None,
                 block_size: int = 256, max_prefill_tokens: int | None = None, prefix_cache_bytes: int = 1 << 30,
                 dtype: torch.dtype | None = None, device: str | torch.device | None = None,
                 decode_step: str = "auto", compile_step: str | Callable | None = None,
                 fold_multipliers: bool = True, fuse_projections: bool = True, concurrent_mixers: bool = True) -> None:
        if isinstance(model, (str, Path)):
            from hybridlm.models.fuse import prepare_for_generation

            model, tokenizer = _load(Path(model), tokenizer, dtype=dtype, device=device)
            prepare_for_generation(model, fold=fold_multipliers, fuse=fuse_projections,
                                   concurrent=concurrent_mixers)
        self.device = next(model.parameters()).device
        if max_prefill_tokens is None:
            max_prefill_tokens = 8192 if self.device.type == "cuda" else 2048
        for name, value in (("max_num_seqs", max_num_seqs), ("block_size", block_size),
                            ("max_prefill_tokens", max_prefill_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if decode_step not in ("auto", "graph", "fixed", "eager"):
            raise ValueError(f"decode_step must be auto, graph, fixed or eager, got {decode_step!r}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self._detokenize = text_decoder(tokenizer)  # ids -> the reply's text
        config = model.config
        self.max_model_len = config.max_position_embeddings if max_model_len is None else max_model_len
        if isinstance(self.max_model_len, bool) or not isinstance(self.max_model_len, int) or self.max_model_len < 2:
            raise ValueError(f"max_model_len must be an int >= 2, got {self.max_model_len!r}")
        self.max_num_seqs = max_num_seqs
        self.block_size = block_size
        self.max_prefill_tokens = max_prefill_tokens
        self.eos_ids = frozenset(_ids(getattr(tokenizer, "eos_token_id", None), config.eos_token_id))
        self.prefix_cache = PrefixCache(block_size, prefix_cache_bytes) if prefix_cache_bytes > 0 else None
        if decode_step == "auto":
            decode_step = "graph" if self.device.type == "cuda" else "fixed" if compile_step is not None else "eager"
        if decode_step == "eager" and compile_step is not None:
            raise ValueError("compile_step compiles the fixed-shape step: use decode_step 'graph' or 'fixed' with it")
        if decode_step == "graph" and self.device.type != "cuda":
            raise ValueError(f"decode_step='graph' needs a CUDA device, the model is on {self.device}")
        self.decode_step = decode_step
        self.compile_step = compile_step
        self.reset()
        self._ids = itertools.count()
        self.finished: Counter[str] = Counter()  # requests finished, by finish_reason
        self.work = StepCounters()

    # -- requests (callable from any thread) ------------------------------------------------------------------

    def encode(self, prompt: str | list[int]) -> list[int]:
        """Prompt ids: a text through the tokenizer, or ids as given (checked against the vocabulary)."""
        return encode_prompt(prompt, self.tokenizer, self.model.config.vocab_size)

    def check_request(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """The prompt's ids; ValueError when it is empty or prompt + max_tokens passes `max_model_len`."""
        return check_length(self.encode(prompt), params, self.max_model_len)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None,
                    on_output: Callable[[RequestOutput], None] | None = None) -> str:
        """Queue a request; the next step admits it. `on_output` is called (on the stepping thread) with each of
        its outputs. ValueError when the prompt is empty or prompt + max_tokens passes `max_model_len`."""
        params = params or SamplingParams()
        ids = self.check_request(prompt, params)
        request_id = request_id or f"req-{next(self._ids)}"
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        generator = torch.Generator(device=self.device).manual_seed(seed)
        stream = TextStream(self._detokenize, stop=params.stop)
        self._incoming.append(_Sequence(request_id, ids, params, stream, generator, on_output, time.monotonic()))
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request at the next step and free its slot (its last output has finish_reason "abort")."""
        self._aborts.append(request_id)

    def has_work(self) -> bool:
        return bool(self._incoming or self._aborts or self._waiting or self._prefilling or self._running)

    def stats(self) -> dict:
        """Requests by state, the step counters since the warm-up (`StepCounters`) and the prefix cache's counters
        (a snapshot; read from any thread)."""
        out = dict(running=len(self._running), prefilling=len(self._prefilling),
                   waiting=len(self._waiting) + len(self._incoming), finished=dict(self.finished),
                   steps=self.work.as_dict())
        if self.prefix_cache is not None:
            out["prefix_cache"] = dict(**self.prefix_cache.stats.as_dict(), entries=len(self.prefix_cache),
                                       bytes=self.prefix_cache.bytes)
        return out

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | None = None) -> list[RequestOutput]:
        """Run `prompts` to completion (batched as the scheduler admits them); their final outputs, in order."""
        final: dict[str, RequestOutput] = {}

        def keep(out: RequestOutput) -> None:
            if out.finished:
                final[out.request_id] = out

        ids = [self.add_request(p, params, on_output=keep) for p in prompts]
        while self.has_work():
            self.step()
        return [final[i] for i in ids]

    def warm_up(self) -> int:
        """Allocate the slots' storage (one short request, kept out of the prefix cache) and capture every decoding
        graph now rather than on first use (what a server does before taking requests); the graphs captured."""
        if self.has_work():
            raise ValueError("warm_up runs before any request is added")
        prefix_cache, self.prefix_cache = self.prefix_cache, None
        try:  # logged as "warm-up", not under the first id a request gets
            self.add_request([0], SamplingParams(max_tokens=2, ignore_eos=True), request_id="warm-up")
            while self.has_work():
                self.step()
        finally:
            self.prefix_cache = prefix_cache
        self.finished.clear()
        captured = 0 if self.step_graphs is None else self.step_graphs.capture_all()
        self.work = StepCounters()
        return captured

    def reset(self) -> None:
        """Start with no requests and empty slots (also after a failed step, whose requests' state is unknown)."""
        self.slots = SlotCache(self.model.config.num_hidden_layers, max_rows=self.max_num_seqs,
                               capacity=self.max_model_len, device=self.device)
        self.step_graphs = None if self.decode_step == "eager" else SlotStepGraphs(
            self.model, self.slots, use_graph=self.decode_step == "graph", compile_step=self.compile_step)
        self._incoming: deque[_Sequence] = deque()  # added, not yet seen by a step (any thread appends)
        self._aborts: deque[str] = deque()
        self._waiting: deque[_Sequence] = deque()
        self._prefilling: list[_Sequence] = []
        self._running: list[_Sequence] = []  # index = row of the slot cache

    # -- the step (one thread) ----------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> None:
        """Admit, prefill, decode one token per running row, retire (the module docstring)."""
        while self._incoming:
            self._waiting.append(self._incoming.popleft())
        while self._aborts:
            self._abort(self._aborts.popleft())
        while self._waiting and len(self._prefilling) + self.slots.rows < self.max_num_seqs:
            self._admit(self._waiting.popleft())
        if self._prefilling:
            start = time.perf_counter()
            tokens = self._prefill()
            self.work.prefill(tokens, time.perf_counter() - start)
        if self._running:
            start, rows = time.perf_counter(), len(self._running)
            self._decode()
            self.work.decode(rows, time.perf_counter() - start)

    def _admit(self, seq: _Sequence) -> None:
        hit = self.prefix_cache.lookup(seq.prompt) if self.prefix_cache is not None else None
        if hit is None:
            seq.cache = self.model.new_cache()
        else:
            seq.prefilled, seq.cache, seq.logits = hit
            seq.cached_tokens = seq.prefilled
        self._prefilling.append(seq)

    def _prefill(self) -> int:
        """Prefill this step's pieces: chosen in arrival order within `max_prefill_tokens`, run in waves (the i-th
        piece of every sequence in wave i), each wave as one packed forward per kind of cache (`_run_pieces`);
        return the tokens prefilled."""
        budget = self.max_prefill_tokens
        plan: list[tuple[_Sequence, list[int]]] = []  # (sequence, the ends of its pieces this step)
        for seq in self._prefilling:
            if budget <= 0:
                break
            ends, start = [], seq.prefilled
            while start < len(seq.prompt) and budget > 0:
                end = min(len(seq.prompt), (start // self.block_size + 1) * self.block_size)
                ends.append(end)
                budget, start = budget - (end - start), end
            plan.append((seq, ends))
        tokens = sum(ends[-1] - seq.prefilled for seq, ends in plan if ends)  # a whole-prompt cache hit has none
        for wave in range(max((len(ends) for _, ends in plan), default=0)):
            groups: dict[tuple, list[tuple[_Sequence, int]]] = {}
            for seq, ends in plan:
                if wave < len(ends):
                    groups.setdefault(state_fields(seq.cache), []).append((seq, ends[wave]))
            for pieces in groups.values():
                self._run_pieces(pieces)
        done = [seq for seq, _ in plan if seq.prefilled == len(seq.prompt)]
        if done:  # their first tokens, sampled together (one read of the device)
            for seq, token in zip(done, self._sample(torch.stack([seq.logits for seq in done]), done)):
                self._prefilling.remove(seq)
                if not self._append(seq, token):
                    self.slots.install(seq.cache)
                    self._running.append(seq)
                seq.cache = seq.logits = None
        return tokens

    def _run_pieces(self, pieces: list[tuple[_Sequence, int]]) -> None:
        """Prefill each sequence's prompt up to its `end` in one forward: the pieces packed as documents of one row
        (`PackedPrefill`; one piece runs on its cache directly). Each piece's end at a block boundary or the
        prompt's end is checkpointed into the prefix cache."""
        if len(pieces) == 1:
            (seq, end), = pieces
            tokens = torch.tensor([seq.prompt[seq.prefilled : end]], device=self.device)  # [1, T]
            logits = self.model(tokens, cache=seq.cache, logits_to_keep=1).logits[0]  # [1, V]
        else:
            lengths = [end - seq.prefilled for seq, end in pieces]
            offsets = torch.tensor([0, *itertools.accumulate(lengths)])  # [N + 1] on the host
            tokens = torch.tensor([[t for seq, end in pieces for t in seq.prompt[seq.prefilled : end]]],
                                  device=self.device)  # [1, total]
            last = (offsets[1:] - 1).to(self.device)  # [N] each piece's last token
            logits = self.model(tokens, cu_seqlens=offsets, cache=PackedPrefill([seq.cache for seq, _ in pieces]),
                                logits_to_keep=last).logits[0]  # [N, V]
        for (seq, end), row in zip(pieces, logits):
            seq.prefilled, seq.logits = end, row
            if self.prefix_cache is not None and (end % self.block_size == 0 or end == len(seq.prompt)):
                self.prefix_cache.put(seq.prompt[:end], seq.cache, seq.logits)

    def _decode(self) -> None:
        running = self._running
        if self.step_graphs is not None:
            logits = self.step_graphs.step([seq.output[-1] for seq in running])  # [n, V]
        else:
            tokens = torch.tensor([seq.output[-1] for seq in running], device=self.device)  # [n]
            self.slots.begin()
            logits = self.model(tokens[:, None], cache=self.slots, logits_to_keep=1).logits[:, -1]  # [n, V]
            self.slots.commit()
        done = [row for row, (seq, token) in enumerate(zip(running, self._sample(logits, running)))
                if self._append(seq, token)]
        if self.prefix_cache is not None:
            # The row holds the prompt and every new token but the last (sampled from logits[row], never fed):
            # the next turn of a chat, whose prompt repeats them, restores this instead of the prompt's end.
            for row in done:
                seq = running[row]
                self.prefix_cache.put(seq.prompt + seq.output[:-1], self.slots.extract(row), logits[row])
        for row in reversed(done):  # highest first: the rows that move into freed ones are never finished ones
            self._release(row)

    def _sample(self, logits: torch.Tensor, seqs: list[_Sequence]) -> list[int]:
        """logits [n, V] -> a token per sequence, each with its own settings and generator."""
        tokens = logits.argmax(-1).tolist()
        for i, seq in enumerate(seqs):
            p = seq.params
            if p.temperature > 0:
                tokens[i] = int(sample_next(logits[i : i + 1], temperature=p.temperature, top_k=p.top_k,
                                            top_p=p.top_p, generator=seq.generator))
        return tokens

    def _append(self, seq: _Sequence, token: int) -> bool:
        """Add a sampled token; emit the output; True when the sequence finished (its log line written)."""
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        seq.output.append(token)
        delta = ""
        if (token in self.eos_ids and not seq.params.ignore_eos) or token in seq.params.stop_token_ids:
            seq.finish_reason = "stop"
        else:
            delta = seq.stream.add(token)
            if seq.stream.stopped:
                seq.finish_reason = "stop"
            elif len(seq.output) == seq.params.max_tokens:
                seq.finish_reason = "length"
        if seq.finish_reason is not None:
            delta += seq.stream.finish()
        self._emit(seq, delta)
        return seq.finish_reason is not None

    def _emit(self, seq: _Sequence, delta: str) -> None:
        finished = seq.finish_reason is not None
        out = RequestOutput(seq.request_id, delta, seq.stream.text, list(seq.output), len(seq.prompt),
                            seq.cached_tokens, finished, seq.finish_reason)
        if finished:
            self.finished[seq.finish_reason] += 1
            now = time.monotonic()
            ttft = "-" if seq.first_token_time is None else f"{seq.first_token_time - seq.arrival:.3f}s"
            log.info("%s: prompt %d tokens (%d cached), completion %d tokens, %s, first token %s, total %.3fs",
                     seq.request_id, len(seq.prompt), seq.cached_tokens, len(seq.output), seq.finish_reason, ttft,
                     now - seq.arrival)
        if seq.on_output is not None:
            seq.on_output(out)

    def _abort(self, request_id: str) -> None:
        for queue in (self._waiting, self._prefilling):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    seq.cache = None
                    self._finish_aborted(seq)
                    return
        for row, seq in enumerate(self._running):
            if seq.request_id == request_id:
                self._release(row)
                self._finish_aborted(seq)
                return

    def _finish_aborted(self, seq: _Sequence) -> None:
        seq.finish_reason = "abort"
        self._emit(seq, "")

    def _release(self, row: int) -> None:
        moved = self.slots.release(row)
        if moved is not None:
            self._running[row] = self._running[moved]
        self._running.pop()


def text_decoder(tokenizer) -> Callable[[list[int]], str]:
    """ids -> `tokenizer.decode(ids, skip_special_tokens=True)`, the text of a reply. A fast tokenizer that cleans
    up no spaces decodes in its Rust backend directly, as transformers' wrapper would after converting and checking
    the ids (which takes most of a call's ~8 us; the engine decodes twice per running row and step)."""
    if tokenizer is None:
        return lambda ids: ""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return functools.partial(backend.decode, skip_special_tokens=True)
    return functools.partial(tokenizer.decode, skip_special_tokens=True)


def text_problem(text: str) -> str | None:
    """What keeps `text` from being encoded: an unpaired UTF-16 surrogate, which JSON's escapes admit ("\\ud800") and
    no tokenizer encodes; None when it is valid Unicode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return f"is not valid Unicode: an unpaired surrogate {text[err.start]!r} at character {err.start}"
    return None


def encode_prompt(prompt: str | list[int], tokenizer, vocab_size: int) -> list[int]:
    """A prompt's ids: a text through `tokenizer`, or ids as given; ValueError when empty or out of the vocabulary."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this engine has no tokenizer: give the prompt as token ids")
        problem = text_problem(prompt)
        if problem:
            raise ValueError(f"the prompt {problem}")
        ids = list(tokenizer.encode(prompt))
    else:
        ids = list(prompt)
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be ints in [0, {vocab_size})")
    if not ids:
        raise ValueError("the prompt is empty")
    return ids


def check_length(ids: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    """`ids`, or ValueError when prompt + max_tokens passes `max_model_len`."""
    if len(ids) + params.max_tokens > max_model_len:
        raise ValueError(f"the prompt's {len(ids)} tokens + max_tokens {params.max_tokens} = "
                         f"{len(ids) + params.max_tokens}, more than max_model_len {max_model_len}")
    return ids


def _ids(*candidates) -> list[int]:
    """The token ids among `candidates` (each None, an id or a list of ids), once each."""
    out: list[int] = []
    for value in candidates:
        for i in [] if value is None else [value] if isinstance(value, int) else list(value):
            if int(i) not in out:
                out.append(int(i))
    return out


def _load(path: Path, tokenizer, *, dtype: torch.dtype | None, device: str | torch.device | None):
    """A checkpoint directory's model (in eval mode, on `device`) and its tokenizer (or the one given)."""
    from hybridlm.devices import parse_device
    from hybridlm.models.hf import load_auto_tokenizer, load_model

    device = parse_device(str(device or ("cuda" if torch.cuda.is_available() else "cpu")))
    model = load_model(path, dtype=dtype or torch.float32).to(device)
    if tokenizer is None:
        tokenizer = load_auto_tokenizer(path)
    return model, tokenizer
