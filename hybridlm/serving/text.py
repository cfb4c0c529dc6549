"""A sequence's new tokens as text, piece by piece as they come, cut at the first stop string.

    stream = TextStream(tokenizer.decode, stop=("\\n\\n",))
    piece = stream.add(token)       # the text that can be sent now ("" while a character or a stop string may be
                                    # incomplete); stream.stopped: a stop string appeared (not part of the text)
    rest = stream.finish()          # what was held back, when the sequence ends

Decoding one token at a time is wrong for byte-level tokenizers (a character split over tokens; a joint that
decodes differently in context), and decoding everything each step costs O(n) per token. So the stream decodes a
short window: the tokens since the last complete piece, with the piece before them as context, and sends the
difference once it does not end in a partial character (U+FFFD). With stop strings, the last max(len(stop)) - 1
characters stay unsent until they cannot begin a stop string (or the sequence ends).
"""

from __future__ import annotations

from collections.abc import Callable


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], *, stop: tuple[str, ...] = ()) -> None:
        self._decode = decode
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1  # characters that may begin a stop string
        self._ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read]: the context decoded before the new tokens
        self._read = 0
        self.text = ""  # the whole text so far (cut at a stop string)
        self._sent = 0  # characters of `text` handed out
        self.stopped = False  # a stop string ended the text

    def add(self, token: int) -> str:
        """Take one new token; return the text that can be sent now."""
        if self.stopped:
            return ""
        self._ids.append(token)
        return self._read_new(final=False)

    def finish(self) -> str:
        """The rest of the text (held back characters, an incomplete character as U+FFFD), at the sequence's end."""
        piece = self._read_new(final=True)
        return piece + self._take(len(self.text))

    def _read_new(self, *, final: bool) -> str:
        """Decode the tokens not yet in `text` (unless they may end inside a character, and this is not the end)."""
        if self.stopped or self._read == len(self._ids):
            return ""
        context = self._decode(self._ids[self._prefix : self._read])
        full = self._decode(self._ids[self._prefix :])
        if not final and (full.endswith("\ufffd") or len(full) <= len(context)):
            return ""  # a character still incomplete (or nothing new yet)
        searched_from = max(0, len(self.text) - self._hold)
        self.text += full[len(context) :]
        self._prefix, self._read = self._read, len(self._ids)
        cut = [i for i in (self.text.find(s, searched_from) for s in self._stop) if i >= 0]
        if cut:
            self.text = self.text[: min(cut)]
            self.stopped = True
            return self._take(len(self.text))
        return self._take(len(self.text) - self._hold)

    def _take(self, end: int) -> str:
        if end <= self._sent:
            return ""
        piece, self._sent = self.text[self._sent : end], end
        return piece
