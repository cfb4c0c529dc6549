"""The HTTP server through the official `openai` client (and raw httpx for what a client library cannot send): a
tiny model served on a free loopback port by the `server` fixture."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.serving.conftest import API_KEY, MODEL_NAME

pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def client(server):
    url, _ = server
    return openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=30)


def healthy(url: str) -> dict:
    reply = httpx.get(f"{url}/health", timeout=10)
    assert reply.status_code == 200
    return reply.json()


def wait_idle(url: str) -> dict:
    """The health report once no request runs (bounded: 10 s)."""
    for _ in range(200):
        report = healthy(url)
        if report["running"] == report["prefilling"] == report["waiting"] == 0:
            return report
        time.sleep(0.05)
    raise AssertionError(f"requests still in flight: {report}")


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert healthy(server[0])["status"] == "ok"


def test_completion_whole_and_streamed_agree(server, client):
    whole = client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})
    choice = whole.choices[0]
    assert choice.finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(server[1].encode("hello world")), 6)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 6


def test_chat_whole_and_streamed_agree(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say hello"}]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=5, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason in ("stop", "length")
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=5, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_stop_strings_end_the_text(client):
    free = client.completions.create(model=MODEL_NAME, prompt="the lazy", max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0]
    stop = free.text[2:4]
    assert stop and "\ufffd" not in stop, f"the seeded tiny model's text {free.text!r} has no plain characters to stop at"
    cut = client.completions.create(model=MODEL_NAME, prompt="the lazy", max_tokens=8, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert (cut.text, cut.finish_reason) == (free.text[: free.text.index(stop)], "stop")


def test_concurrent_requests_equal_sequential_ones_and_share_the_prefix_cache(server, client):
    system = {"role": "system", "content": "you are a tiny test model; answer in bytes"}
    questions = ["one", "two two", "three three three", "four", "five five"]

    def ask(question: str):
        reply = client.chat.completions.create(
            model=MODEL_NAME, messages=[system, {"role": "user", "content": question}], max_tokens=6,
            temperature=0.7, seed=1, extra_body={"ignore_eos": True})
        return reply.choices[0].message.content, reply.usage

    sequential = [ask(q) for q in questions]
    with ThreadPoolExecutor(len(questions)) as pool:  # 5 requests for 4 rows
        concurrent = list(pool.map(ask, questions))
    assert [text for text, _ in concurrent] == [text for text, _ in sequential]
    # every later prompt restores the system turn's whole blocks (of 8 tokens) from the first one's checkpoints
    tokenizer = server[1].tokenizer
    system_turn = tokenizer.apply_chat_template([system], tokenize=False)  # bos, the turn; then "<|user|>" differs
    shared = len(tokenizer.encode(system_turn, add_special_tokens=False)) + 1
    assert shared >= 40
    assert [u.prompt_tokens_details.cached_tokens for _, u in sequential[1:]] == [shared // 8 * 8] * 4
    assert wait_idle(server[0])["prefix_cache"]["hits"] >= 9


def test_client_disconnect_mid_stream_frees_the_slot(server, monkeypatch):
    url, engine = server
    if not hasattr(engine, "step"):
        pytest.skip("slows the engine's steps in this process (the process runner's abort: test_process.py)")
    step = engine.step

    def slow_step():  # 80 tokens take >= 2 s: the client is gone long before
        time.sleep(0.025)
        step()

    monkeypatch.setattr(engine, "step", slow_step)
    aborted = engine.finished["abort"]
    body = {"model": MODEL_NAME, "prompt": "jumps", "max_tokens": 80, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as reply:
        first = next(line for line in reply.iter_lines() if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
    report = wait_idle(url)
    assert report["finished"]["abort"] == aborted + 1 and engine.slots.rows == 0


def test_client_disconnect_while_a_whole_answer_is_generated_frees_the_slot(server, monkeypatch):
    """A non-streamed request whose client leaves: aborted at the next disconnect check although its outputs keep
    coming (one per token), and seen through the API key's middleware."""
    url, engine = server
    if not hasattr(engine, "step"):
        pytest.skip("slows the engine's steps in this process (the process runner's abort: test_process.py)")
    step = engine.step

    def slow_step():  # 80 tokens take >= 2 s
        time.sleep(0.025)
        step()

    monkeypatch.setattr(engine, "step", slow_step)
    aborted = engine.finished["abort"]
    body = json.dumps({"model": MODEL_NAME, "prompt": "jumps", "max_tokens": 80, "ignore_eos": True}).encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body)
                       + body)
        for _ in range(100):  # until it decodes
            if healthy(url)["running"]:
                break
            time.sleep(0.02)
    report = wait_idle(url)  # within 10 s: well before 80 slow steps and the checks' 0.5 s
    assert report["finished"]["abort"] == aborted + 1 and engine.slots.rows == 0


BAD_REQUESTS = {
    "unknown model": ("/v1/completions", {"model": "gpt-9", "prompt": "a"}, 404),
    "negative max_tokens": ("/v1/completions", {"model": MODEL_NAME, "prompt": "a", "max_tokens": -1}, 400),
    "temperature out of range": ("/v1/completions", {"model": MODEL_NAME, "prompt": "a", "temperature": -2}, 400),
    "top_p out of range": ("/v1/chat/completions", {"model": MODEL_NAME, "top_p": 1.5,
                                                     "messages": [{"role": "user", "content": "a"}]}, 400),
    "wrong type": ("/v1/completions", {"model": MODEL_NAME, "prompt": "a", "max_tokens": "many"}, 400),
    "missing prompt": ("/v1/completions", {"model": MODEL_NAME}, 400),
    "empty prompt": ("/v1/completions", {"model": MODEL_NAME, "prompt": ""}, 400),
    "empty messages": ("/v1/chat/completions", {"model": MODEL_NAME, "messages": []}, 400),
    "past max-model-len": ("/v1/completions", {"model": MODEL_NAME, "prompt": "a" * 90, "max_tokens": 10}, 400),
    "n > 1": ("/v1/completions", {"model": MODEL_NAME, "prompt": "a", "n": 2}, 400),
    "seed past 2^64": ("/v1/completions", {"model": MODEL_NAME, "prompt": "a", "seed": 2**64}, 400),
    "max_tokens true": ("/v1/completions", {"model": MODEL_NAME, "prompt": "a", "max_tokens": True}, 400),
    "stream 'yes'": ("/v1/completions", {"model": MODEL_NAME, "prompt": "a", "stream": "yes"}, 400),
    "malformed JSON": ("/v1/completions", b'{"model": "tiny", "prompt": ', 400),
    # JSON's escapes admit UTF-16 halves that no text encodes (json.dumps writes them escaped)
    "a lone surrogate": ("/v1/completions", json.dumps({"model": MODEL_NAME, "prompt": "a\ud800"}).encode(), 400),
    "a lone surrogate in a message": ("/v1/chat/completions", json.dumps(
        {"model": MODEL_NAME, "messages": [{"role": "user", "content": "\udfff"}]}).encode(), 400),
    **{f"{name} (not implemented)": ("/v1/completions", {"model": MODEL_NAME, "prompt": "a", name: value}, 400)
       for name, value in (("logit_bias", {"5": 100}), ("best_of", 2), ("logprobs", 1), ("top_logprobs", 2),
                           ("tool_choice", "auto"), ("min_tokens", 3), ("repetition_penalty", 1.2),
                           ("presence_penalty", 0.5), ("min_p", 0.1), ("echo", True))},
}


def test_parameters_that_ask_for_nothing_are_accepted(server, client):
    idle = dict(logit_bias={}, best_of=1, logprobs=None, presence_penalty=0, frequency_penalty=0.0,
                repetition_penalty=1.0, min_tokens=0, tool_choice="none", echo=False)
    reply = httpx.post(server[0] + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"model": MODEL_NAME, "prompt": "a", "max_tokens": 1, **idle})
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize("case", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, client, case):
    path, body, status = case
    headers = {"Authorization": f"Bearer {API_KEY}"}
    if isinstance(body, bytes):
        reply = httpx.post(server[0] + path, content=body, headers={**headers, "content-type": "application/json"})
    else:
        reply = httpx.post(server[0] + path, json=body, headers=headers)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    assert client.completions.create(model=MODEL_NAME, prompt="ok", max_tokens=1).choices[0].finish_reason


@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/completions", {"prompt": "a", "stop": 5}, "stop", "stop: Input should be a valid string"),
    ("/v1/completions", {"prompt": 5}, "prompt", "prompt: Input should be a valid string"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content",
     "messages[0].content: Input should be a valid string"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": -1},
     "max_completion_tokens", "max_completion_tokens must be an int >= 1, got -1"),
])
def test_errors_name_the_field_as_the_request_spelt_it(server, path, body, param, message):
    """Not pydantic's names of the union members it tried ("stop.str"), nor the engine's name for the limit."""
    reply = httpx.post(server[0] + path, json={"model": MODEL_NAME, **body},
                       headers={"Authorization": f"Bearer {API_KEY}"})
    error = reply.json()["error"]
    assert reply.status_code == 400 and (error["param"], error["message"]) == (param, message), error


@pytest.mark.parametrize("messages, param, message", [
    ([{"role": "wizard", "content": "hi"}], "messages[0].role",
     "messages[0].role must be one of 'system', 'user', 'assistant' (got 'wizard')"),
    ([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}], "messages[1].role",
     "messages[1].role must be one of 'system', 'user', 'assistant' (got 'tool')"),
    ([{"role": "user"}], "messages[0].content", "messages[0].content is required"),
    ([{"role": "system", "content": "a"}, {"role": "user", "content": None}], "messages[1].content",
     "messages[1].content must be a string or a list of text parts (got null)"),
], ids=["unknown role", "tool role", "no content", "null content"])
def test_a_message_of_an_unknown_role_or_without_content_gets_a_400_naming_it(server, messages, param, message):
    """A role other than system, user or assistant, or a message without content: 400 naming that message's field
    (not a prompt with the role as text or an empty turn); then a good request (text parts too) answers 200."""
    url, headers = f"{server[0]}/v1/chat/completions", {"Authorization": f"Bearer {API_KEY}"}
    reply = httpx.post(url, json={"model": MODEL_NAME, "messages": messages, "max_tokens": 1}, headers=headers)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"] == {"message": message, "type": "invalid_request_error", "param": param, "code": None}
    good = [{"role": "system", "content": "a"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    reply = httpx.post(url, json={"model": MODEL_NAME, "messages": good, "max_tokens": 1}, headers=headers)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["role"] == "assistant"


def test_api_key_is_required(server, client):
    wrong = openai.OpenAI(base_url=f"{server[0]}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert httpx.post(f"{server[0]}/v1/completions", json={"model": MODEL_NAME, "prompt": "a"}).status_code == 401
    assert client.completions.create(model=MODEL_NAME, prompt="ok", max_tokens=1).choices[0].finish_reason


def test_the_openai_client_raises_its_own_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="a")
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "a" * 100}])


def test_serve_refuses_conflicting_flags_before_loading(tmp_path, capsys):
    from hybridlm.cli import main

    assert main(["serve", "--model", str(tmp_path), "--compile", "--enforce-eager"]) == 2
    assert "cannot go with --enforce-eager" in capsys.readouterr().err


def test_a_stream_sends_a_chunk_per_token_while_it_keeps_up_and_merges_the_text_when_it_falls_behind():
    """`_stream` takes every output that has arrived: one each (a chunk per token), or several (one chunk of their
    text per choice, then the finish chunks, in one write), the same text either way."""
    from hybridlm.serving.engine import RequestOutput
    from hybridlm.serving.server import _Answer, _stream

    class Runner:
        aborted: list[str] | None = None

        def abort(self, request_ids):
            self.aborted = list(request_ids)

    def outputs(index: int) -> list[tuple[int, RequestOutput]]:
        words, text, out = ["a", " b", " c"], "", []
        for n, word in enumerate(words, 1):
            text += word
            done = n == len(words)
            out.append((index, RequestOutput(f"r{index}", word, text, list(range(n)), 2, 0, done,
                                             "length" if done else None)))
        return out

    def events(write: str) -> list[dict]:
        return [json.loads(line[6:]) for line in write.split("\n\n") if line and line != "data: [DONE]"]

    async def run(ahead: bool) -> tuple[list[str], Runner]:
        runner, queue = Runner(), asyncio.Queue()
        stream = _stream(runner, ["r0", "r1"], queue, _Answer("cmpl", "text_completion", "m", chat=False), True)
        pending = outputs(0) + outputs(1)
        writes = []
        if ahead:  # the engine ran ahead: everything arrived before the stream reads
            for item in pending:
                queue.put_nowait(item)
        else:
            for item in pending:
                queue.put_nowait(item)
                writes.append(await stream.__anext__())
        writes += [write async for write in stream]
        return writes, runner

    slow, runner = asyncio.run(run(ahead=True))
    assert runner.aborted == []
    first = events(slow[0])
    assert [(e["choices"][0]["index"], e["choices"][0]["text"], e["choices"][0]["finish_reason"]) for e in first] == [
        (0, "a b c", None), (1, "a b c", None), (0, "", "length"), (1, "", "length")]
    assert events(slow[1])[0]["usage"]["completion_tokens"] == 6 and slow[-1] == "data: [DONE]\n\n"
    fast, _ = asyncio.run(run(ahead=False))
    per_token = [events(write) for write in fast[:6]]
    assert [[e["choices"][0]["text"] for e in write] for write in per_token] == [
        ["a"], [" b"], [" c", ""], ["a"], [" b"], [" c", ""]]
    assert per_token[2][1]["choices"][0]["finish_reason"] == "length"


def test_a_chat_reply_ends_at_the_templates_turn_end_as_a_token_or_as_text(model_dir, tmp_path):
    """The served tokenizer has "<|end_of_turn|>" as one special token: it stops the reply as a token. The demo's
    byte-level tokenizer (what `hybridlm train`'s demo and an SFT of it serve) spells it in 15 byte tokens: it stops
    the reply as a stop string, after the request's own, as `hybridlm chat` cuts it."""
    from hybridlm.data.chat import load_tokenizer
    from hybridlm.serving.server import ChatRequest, _sampling, _turn_end
    from hybridlm.training.demo import build_byte_tokenizer

    special = load_tokenizer(model_dir)
    assert _turn_end(special) == ((special.convert_tokens_to_ids("<|end_of_turn|>"),), ())
    build_byte_tokenizer().save(tmp_path)
    byte_level = load_tokenizer(tmp_path)
    assert len(byte_level("<|end_of_turn|>", add_special_tokens=False)["input_ids"]) == 15
    ids, text = _turn_end(byte_level)
    assert (ids, text) == ((), ("<|end_of_turn|>",))
    body = ChatRequest(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], stop="\n\n")
    params = _sampling(body, 8, stop_token_ids=ids, more_stop=text)
    assert params.stop == ("\n\n", "<|end_of_turn|>") and params.stop_token_ids == ()


def test_a_chat_template_that_renders_no_user_message_is_refused_before_serving(model_dir):
    from hybridlm.data.chat import load_tokenizer
    from hybridlm.serving.server import _turn_end

    tokenizer = load_tokenizer(model_dir)
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }{% endfor %}"
    with pytest.raises(ValueError, match=r"the model's chat template does not render a user message \(.*does not "
                                         r"parse"):
        _turn_end(tokenizer)


def test_the_tokenizer_loads_without_transformers_warning_of_an_unknown_model_type(model_dir):
    """In a fresh process (what `serve`'s front and engine processes are): transformers reads the directory's
    config.json, which it knows once hybridlm's config is registered."""
    import subprocess
    import sys

    code = f"from hybridlm.models.hf import load_auto_tokenizer; load_auto_tokenizer({str(model_dir)!r})"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "instantiate a model of type" not in proc.stderr + proc.stdout
