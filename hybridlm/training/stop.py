"""`StopRequest`: a stop flag set by SIGTERM / SIGINT or by hand, for loops that save between two updates.

Shared by the corpus trainer (`hybridlm.training.trainer`) and the papers' experiment runs
(`hybridlm.experiments.bench`).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable


class SecondSignal(KeyboardInterrupt):
    """A second SIGINT / SIGTERM: stop at once, unsaved. A KeyboardInterrupt that knows its signal (`signum`),
    so a command can exit with 128 + its number and say so in one line."""

    def __init__(self, signum: int) -> None:
        self.signum = int(signum)
        super().__init__(f"second {signal.Signals(signum).name}: stopping without saving")

    def __reduce__(self):  # (pickled by its signal, e.g. across processes)
        return type(self), (self.signum,)


class StopRequest:
    """Set by SIGTERM / SIGINT (`handle_signals`) or by hand; runs check it after every update.

    A second signal more than `REPEAT_WINDOW` seconds after the first raises `SecondSignal` (a KeyboardInterrupt:
    stop at once, unsaved). Signals closer together count as one: `timeout` sends its signal to the command and
    then to the command's whole process group, so the command gets it twice at once."""

    REPEAT_WINDOW = 2.0

    def __init__(self, on_signal: Callable[[str], None] | None = None) -> None:
        self.reason: str | None = None
        self._first_signal: float | None = None
        self._on_first = on_signal  # told the signal's name once (e.g. to print what happens next)

    def __bool__(self) -> bool:
        return self.reason is not None

    def request(self, reason: str) -> None:
        self.reason = self.reason or reason

    def _on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self._first_signal is None:
            self._first_signal = now
            if self._on_first is not None:
                self._on_first(name)
        elif now - self._first_signal > self.REPEAT_WINDOW:
            raise SecondSignal(signum)
        self.request(name)  # only a flag: the training loop saves, between two updates

    @contextlib.contextmanager
    def handle_signals(self):
        """SIGTERM and SIGINT set the request while inside (main thread only; elsewhere nothing changes)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
