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


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """An untrained 2-layer hybrid in float64 (Falcon-1 SSM half) and its chat encoder: the answers are arbitrary
    tokens, the same whichever way the conversation's cache was filled."""
    from hybridlm.data.chat import ChatEncoder
    from hybridlm.models.hf import load_model
    from tests.posttraining.helpers import make_model_dir

    model_dir = make_model_dir(tmp_path_factory.mktemp("chat"), ssm="1")
    return load_model(model_dir).double().eval(), ChatEncoder.from_model_dir(model_dir)


def _checked_reply(session, text: str) -> tuple[list[int], list[int]]:
    """`session.reply(text)`, checked against the answer a prefill of the whole rendered conversation gives; returns
    the prompt's ids and the token count of every model call the reply made."""
    model, encoder = session.model, session.encoder
    messages = session.messages + [{"role": "user", "content": text}]
    prompt = encoder.encode_text(encoder.render(messages, add_generation_prompt=True))
    expected = chat.answer(model, encoder, prompt, max_new_tokens=session.max_new_tokens)
    widths: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append((args[0] if args else kwargs["input_ids"]).shape[1]),
        with_kwargs=True)
    try:
        assert session.reply(text) == expected
    finally:
        hook.remove()
    return prompt, widths


@pytest.mark.parametrize("graph", [False, True])
def test_each_turn_prefills_only_its_new_tokens_and_answers_as_the_whole_conversation(chat_model, graph):
    """Three turns: the first prefills its prompt, each later one only the tokens past the last prompt (the answer and
    the new message), and every answer is the one a prefill of the whole conversation gives."""
    model, encoder = chat_model
    session = chat.ChatSession(model, encoder, system="Be brief.", max_new_tokens=12, graph=graph)
    held = 0
    for text in ("Spell cat.", "What colour is snow?", "Reverse dog."):
        prompt, widths = _checked_reply(session, text)
        assert widths[:2] == [len(prompt) - 1 - held, 1]  # the new tokens, then the prompt's last one (generate)
        # op by op the held cache stays at the prompt but its last token (a copy decodes); graphed, at the prompt
        assert session.held[0] == (prompt if graph else prompt[:-1])
        held = len(session.held[0])
    assert held > 40  # a conversation long enough that prefilling it whole would show


def test_a_conversation_that_does_not_go_on_from_the_last_prompt_is_prefilled_whole(chat_model):
    """An earlier message edited (its tokens are no longer what the cache holds), then an exchange interrupted inside
    its prefill (the cache half-filled is forgotten): each next turn prefills everything, and answers as a prefill
    of the whole conversation does."""
    model, encoder = chat_model
    session = chat.ChatSession(model, encoder, max_new_tokens=8)
    session.reply("Spell cat.")
    session.messages[0]["content"] = "Spell dog."  # the conversation the cache holds no longer is
    prompt, widths = _checked_reply(session, "Hello!")
    assert widths[0] == len(prompt) - 1

    def interrupt(module, args, kwargs):
        raise KeyboardInterrupt

    hook = model.register_forward_pre_hook(interrupt, with_kwargs=True)
    with pytest.raises(KeyboardInterrupt):
        session.reply("Reverse dog.")
    hook.remove()
    assert session.held is None
    prompt, widths = _checked_reply(session, "Reverse dog.")
    assert widths[0] == len(prompt) - 1
