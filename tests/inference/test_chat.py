"""`hybridlm chat`'s interactive loop (a stand-in session: no model): the commands are not sent to the model."""

from __future__ import annotations

import pytest

from hybridlm.inference import chat
from tests.helpers import chat_args, type_lines


@pytest.mark.parametrize("command", ["/exit", "/quit"])
def test_exit_and_quit_end_the_chat_without_an_answer(monkeypatch, capsys, command):
    """The command ends the session with status 0, as Ctrl-D does: the model answers the lines before it, not the
    command nor any line after it."""

    class Session:
        def __init__(self):
            self.asked = []

        def reply(self, text, on_text):
            self.asked.append(text)
            on_text("answer")
            return "answer"

    session = Session()
    monkeypatch.setattr(chat, "_session", lambda args: session)
    lines = type_lines(monkeypatch, ["hello", command, "after"])
    assert chat.run_chat(chat_args()) == 0
    out, err = capsys.readouterr()
    assert session.asked == ["hello"] and out.count("answer") == 1
    assert next(lines) == "after"  # never read: the chat ended at the command
    assert "/exit, /quit or Ctrl-D leave" in err
