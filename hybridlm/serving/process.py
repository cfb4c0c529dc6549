"""The engine in a process of its own, fed from the HTTP server's event loop (what `hybridlm serve` runs).

    runner = EngineProcess("runs/demo/final", engine_kwargs={"max_num_seqs": 16}); runner.start()  # loads, warms up
    request_ids, outputs = runner.submit([prompt_ids], params)   # on the event loop: as `EngineRunner.submit`
    index, out = await outputs.get()
    runner.abort(request_ids)
    runner.shutdown()

The same interface as `EngineRunner` (runner.py), which runs the engine on a thread of the server's process. There
the engine's Python work (scheduling, sampling, detokenizing every row's token) and the server's (HTTP, one
server-sent event per token and request) take turns on one interpreter: on an H200 the server delivered two thirds of
the engine's own tokens/s (benchmarks/RESULTS.md). Here they run side by side:
- the engine process (spawned, so CUDA starts fresh in it) loads the model and tokenizer, captures its decoding
  graphs, then loops: take the commands that arrived (add, abort, stop), step, send the step's outputs in one
  message;
- the server process keeps a tokenizer of its own for what it answers without the engine (prompt encoding, the chat
  template, request checks) and a reader thread that hands each message's outputs to the event loops in one call.
Outputs travel as each request's new text and token ids; the server side accumulates them into the usual
`RequestOutput`s. A step that raises fails the requests in flight (the engine resets and goes on); an engine process
that dies fails them all and makes `/health` report it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import threading
import time
from pathlib import Path

from hybridlm.serving.engine import RequestOutput, check_length, encode_prompt
from hybridlm.serving.params import SamplingParams
from hybridlm.serving.runner import EngineUnavailable, put_all

log = logging.getLogger("hybridlm.serving")

POLL_S = 0.5  # an idle engine process checks for commands (and the server for the process's death) this often


class EngineFront:
    """What the server asks of its engine that the server's process answers itself: prompt encoding and checks, the
    tokenizer, `max_model_len`, and the engine's stats as of its last message."""

    def __init__(self, tokenizer, *, max_model_len: int, vocab_size: int, stats: dict) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self._stats = stats
        self.failure: str | None = None  # set when the engine process died

    def encode(self, prompt: str | list[int]) -> list[int]:
        return encode_prompt(prompt, self.tokenizer, self.vocab_size)

    def check_request(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        return check_length(self.encode(prompt), params, self.max_model_len)

    def update(self, stats: dict) -> None:
        """The engine's stats as its latest message reports them (the reader thread)."""
        self._stats = stats

    def stats(self) -> dict:
        if self.failure is not None:
            return {**self._stats, "engine": f"failed: {self.failure}"}
        return dict(self._stats)


class _Request:
    """A request's outputs so far, on the server's side."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, index: int, prompt_tokens: int):
        self.loop, self.queue, self.index = loop, queue, index
        self.prompt_tokens = prompt_tokens
        self.text = ""
        self.token_ids: list[int] = []


class EngineProcess:
    """`hybridlm.serving.Engine(model_dir, tokenizer, **engine_kwargs)` in a spawned process (module docstring).

    Args:
        model_dir: the checkpoint directory the engine loads.
        engine_kwargs: `Engine`'s keyword arguments (max_num_seqs, max_model_len, dtype, device, ...).
        tokenizer_dir: the tokenizer's directory (default: the model directory).
        threads: CPU threads of the engine process's ops (torch.set_num_threads; default torch's).
        start_timeout: seconds `start` waits for the engine to load and capture its graphs.
    """

    def __init__(self, model_dir: str | Path, *, engine_kwargs: dict | None = None,
                 tokenizer_dir: str | Path | None = None, threads: int | None = None,
                 start_timeout: float = 600.0) -> None:
        self.model_dir = str(model_dir)
        self.tokenizer_dir = str(tokenizer_dir or model_dir)
        self.engine_kwargs = dict(engine_kwargs or {})
        self.threads = threads
        self.start_timeout = start_timeout
        self.engine: EngineFront | None = None
        self._requests: dict[str, _Request] = {}
        self._lock = threading.Lock()  # _requests, and the command pipe's sending end
        self._ids = itertools.count()
        self._process = None
        self._commands = self._outputs = None
        self._reader: threading.Thread | None = None
        self._stopping = False

    def start(self) -> None:
        """Start the engine process; return once it is ready. RuntimeError (with the engine's error) if it fails."""
        from hybridlm.models.hf import load_auto_tokenizer

        tokenizer = load_auto_tokenizer(self.tokenizer_dir)
        context = multiprocessing.get_context("spawn")
        commands_out, commands_in = context.Pipe(duplex=False)  # (receiving end, sending end)
        outputs_out, outputs_in = context.Pipe(duplex=False)
        self._process = context.Process(
            target=_engine_main, name="hybridlm-engine", daemon=True,
            args=(commands_out, outputs_in, self.model_dir, self.tokenizer_dir, self.engine_kwargs, self.threads))
        self._process.start()
        commands_out.close()
        outputs_in.close()
        self._commands, self._outputs = commands_in, outputs_out
        deadline = time.monotonic() + self.start_timeout
        while not self._outputs.poll(POLL_S):
            if not self._process.is_alive():
                raise RuntimeError(f"the engine process exited with code {self._process.exitcode} while starting")
            if time.monotonic() > deadline:
                self._process.kill()
                raise RuntimeError(f"the engine did not start within {self.start_timeout:.0f} s")
        try:
            kind, info = self._outputs.recv()
        except EOFError:  # it closed its end as it died (killed for memory, ...)
            self._process.join(timeout=10)
            raise RuntimeError(f"the engine process exited with code {self._process.exitcode} while starting") from None
        if kind != "ready":
            self._process.join(timeout=10)
            raise RuntimeError(f"the engine failed to start: {info}")
        self.engine = EngineFront(tokenizer, **info)
        self._reader = threading.Thread(target=self._read, name="hybridlm-engine-reader", daemon=True)
        self._reader.start()

    def shutdown(self) -> None:
        if self._process is None:
            return
        self._stopping = True
        if self._process.is_alive():
            with contextlib.suppress(OSError):  # it exited meanwhile: its end of the pipe is closed
                self._send(("stop",))
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        if self._reader is not None:
            self._reader.join(timeout=10)
        self._commands.close()
        self._process = None

    def submit(self, prompts: list[list[int]], params: SamplingParams) -> tuple[list[str], asyncio.Queue]:
        """As `EngineRunner.submit`: one request per prompt, outputs on the returned queue as (prompt index,
        RequestOutput); ValueError (nothing queued) when a prompt is refused or the engine process is gone."""
        if self.engine.failure is not None:
            raise EngineUnavailable(f"the engine is not running ({self.engine.failure}); restart the server")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        ids = [self.engine.check_request(prompt, params) for prompt in prompts]  # all checked before any is queued
        request_ids = [f"req-{next(self._ids)}" for _ in prompts]
        with self._lock:
            for index, (request_id, prompt) in enumerate(zip(request_ids, ids)):
                self._requests[request_id] = _Request(loop, queue, index, len(prompt))
        self._send(("add", [(request_id, prompt, params) for request_id, prompt in zip(request_ids, ids)]))
        return request_ids, queue

    def abort(self, request_ids: list[str]) -> None:
        if request_ids and self.engine.failure is None:
            self._send(("abort", list(request_ids)))

    def _send(self, message: tuple) -> None:
        with self._lock:
            self._commands.send(message)

    def _read(self) -> None:
        """The reader thread: each message from the engine process, delivered to the event loops."""
        while True:
            try:
                message = self._outputs.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "outputs":
                _, outputs, stats = message
                self.engine.update(stats)
                self._deliver(outputs)
            elif kind == "failed":
                _, request_ids, error = message
                self._fail(request_ids, RuntimeError(error))
        if not self._stopping:  # the process died
            self._process.join(timeout=5)
            self.engine.failure = f"the engine process exited with code {self._process.exitcode}"
            log.error("%s; failing the requests in flight", self.engine.failure)
            with self._lock:
                pending = list(self._requests)
            self._fail(pending, RuntimeError(self.engine.failure))

    def _deliver(self, outputs: list[tuple]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, tuple]]] = {}
        with self._lock:
            for request_id, delta, new_ids, cached, finish_reason in outputs:
                request = self._requests.get(request_id)
                if request is None:
                    continue
                request.text += delta
                request.token_ids += new_ids
                out = RequestOutput(request_id, delta, request.text, list(request.token_ids), request.prompt_tokens,
                                    cached, finish_reason is not None, finish_reason)
                if out.finished:
                    del self._requests[request_id]
                by_loop.setdefault(request.loop, []).append((request.queue, (request.index, out)))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(put_all, items)

    def _fail(self, request_ids: list[str], error: Exception) -> None:
        """Each failed request's queue gets (None, error) once."""
        queues: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        with self._lock:
            for request_id in request_ids:
                request = self._requests.pop(request_id, None)
                if request is not None:
                    queues[id(request.queue)] = (request.loop, request.queue)
        for loop, queue in queues.values():
            loop.call_soon_threadsafe(queue.put_nowait, (None, error))


def _engine_main(commands, outputs, model_dir: str, tokenizer_dir: str, engine_kwargs: dict,
                 threads: int | None) -> None:
    """The engine process: load, warm up, report ready, then serve commands until "stop" (module docstring)."""
    import torch

    from hybridlm.models.hf import load_auto_tokenizer
    from hybridlm.serving.engine import Engine

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        engine = Engine(model_dir, load_auto_tokenizer(tokenizer_dir), **engine_kwargs)
        engine.warm_up()
    except Exception as error:  # reported to the server, which exits with it
        outputs.send(("error", f"{type(error).__name__}: {error}"))
        return
    outputs.send(("ready", {"max_model_len": engine.max_model_len, "vocab_size": engine.model.config.vocab_size,
                            "stats": engine.stats()}))
    step_outputs: list[tuple] = []
    sent: dict[str, int] = {}  # request id -> tokens sent so far

    def collect(out: RequestOutput) -> None:
        start = sent.get(out.request_id, 0)
        step_outputs.append((out.request_id, out.delta, out.token_ids[start:], out.cached_tokens, out.finish_reason))
        if out.finished:
            sent.pop(out.request_id, None)
        else:
            sent[out.request_id] = len(out.token_ids)

    while True:
        if engine.has_work() or commands.poll(POLL_S):
            while commands.poll():
                try:
                    message = commands.recv()
                except EOFError:  # the server's process is gone: nobody to serve
                    return
                if message[0] == "stop":
                    return
                if message[0] == "add":
                    for request_id, prompt, params in message[1]:
                        engine.add_request(prompt, params, request_id=request_id, on_output=collect)
                        sent[request_id] = 0
                elif message[0] == "abort":
                    for request_id in message[1]:
                        engine.abort(request_id)
        if not engine.has_work():
            continue
        try:
            engine.step()
        except Exception as error:  # a failed step fails its requests, not the server
            logging.getLogger("hybridlm.serving").exception("engine step failed; failing the requests in flight")
            engine.reset()
            step_outputs.clear()
            outputs.send(("failed", list(sent), f"{type(error).__name__}: {error}"))
            sent.clear()
            continue
        if step_outputs:
            outputs.send(("outputs", list(step_outputs), engine.stats()))
            step_outputs.clear()
