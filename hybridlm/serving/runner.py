"""The engine on a thread of its own, fed from an asyncio event loop (the HTTP server's).

    runner = EngineRunner(engine); runner.start()
    request_ids, outputs = runner.submit([prompt_ids], params)   # on the event loop; outputs: an asyncio.Queue
    index, out = await outputs.get()                              # (which prompt, RequestOutput) as steps produce them
    runner.abort(request_ids)                                     # a client went away: freed at the next step
    runner.shutdown()

Model work never runs on the event loop, so the server keeps answering (health, errors, streams) while the engine
steps. A step's outputs reach the loop together, in one call: one wake-up of the loop per step rather than one per
running request (each wake-up takes the interpreter from the engine's thread). A step that raises fails the requests in flight (each queue gets the exception), the engine drops them and
the runner goes on with the next requests.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from hybridlm.serving.engine import Engine, RequestOutput
from hybridlm.serving.params import SamplingParams

log = logging.getLogger("hybridlm.serving")


class EngineUnavailable(RuntimeError):
    """The engine cannot take requests (its process died): the server answers 503, not a client error."""


class EngineRunner:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="hybridlm-engine", daemon=True)
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}  # request id -> its outputs' queue
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue, tuple]] = []  # this step's outputs (the engine's thread only)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join()

    def submit(self, prompts: list[list[int]], params: SamplingParams) -> tuple[list[str], asyncio.Queue]:
        """Queue one request per prompt (call on the event loop); their outputs arrive on the returned queue as
        (prompt index, RequestOutput). ValueError (nothing queued) when one of them is refused."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        for prompt in prompts:  # checked together first: a refused prompt queues none of them
            self.engine.check_request(prompt, params)
        request_ids = []
        for index, prompt in enumerate(prompts):
            def deliver(out: RequestOutput, index: int = index) -> None:
                self._pending.append((loop, queue, (index, out)))
                if out.finished:
                    with self._lock:
                        self._queues.pop(out.request_id, None)

            request_id = self.engine.add_request(prompt, params, on_output=deliver)
            with self._lock:
                self._queues[request_id] = (loop, queue)
            request_ids.append(request_id)
        self._wake.set()
        return request_ids, queue

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.engine.abort(request_id)
        self._wake.set()

    def _run(self) -> None:
        while not self._stopping:
            if not self.engine.has_work():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                self.engine.step()
                self._flush()
            except Exception as error:  # a failed step fails its requests, not the server
                log.exception("engine step failed; failing the requests in flight")
                self._flush()
                self.engine.reset()
                with self._lock:
                    failed, self._queues = self._queues, {}
                for loop, queue in failed.values():
                    loop.call_soon_threadsafe(queue.put_nowait, (None, error))

    def _flush(self) -> None:
        """Hand the step's outputs to their event loops, one call per loop."""
        pending, self._pending = self._pending, []
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, tuple]]] = {}
        for loop, queue, item in pending:
            by_loop.setdefault(loop, []).append((queue, item))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(put_all, items)


def put_all(items: list[tuple[asyncio.Queue, tuple]]) -> None:
    """On the event loop: each (queue, item) put."""
    for queue, item in items:
        queue.put_nowait(item)
