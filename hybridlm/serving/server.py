"""The OpenAI-compatible HTTP server over the engine (FastAPI; SSE streaming).

    app = build_app(runner, model_name="my-model", api_key=None)     # runner: a started EngineRunner
    uvicorn.run(app, host="127.0.0.1", port=8000)                    # what `hybridlm serve` does

Routes: GET /health (with the engine's counters: running requests, prefix-cache hits and tokens saved), GET /v1/models,
POST /v1/completions, POST /v1/chat/completions (the prompt from the tokenizer's chat template). Request fields as
OpenAI's: model, prompt or messages, max_tokens (chat: also max_completion_tokens; default for chat: what room the
context leaves), temperature (default 1), top_p, stop, seed, stream, stream_options.include_usage; plus vLLM's top_k
and ignore_eos. `usage.prompt_tokens_details.cached_tokens` counts the prompt tokens restored from the prefix cache.

Errors are OpenAI's error object `{"error": {"message", "type", "param", "code"}}` with a 4xx status: 400 for
malformed JSON, invalid parameters, unsupported ones (logprobs, tools, logit_bias, penalties, ...: `_UNIMPLEMENTED`)
set to anything but their idle value, empty messages, a message whose role is not system, user or assistant or that
has no content, text that is not valid Unicode (a lone surrogate), and prompts that with max_tokens pass the context
length; 401 for a missing or
wrong API key (when the server has one); 404 for an unknown model. A client that disconnects (mid-stream or while
waiting) has its requests aborted, which frees their slots at the next step.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt
from starlette.exceptions import HTTPException

from hybridlm.data.chat import ChatEncoder
from hybridlm.data.errors import DataError
from hybridlm.serving.engine import RequestOutput, text_problem
from hybridlm.serving.params import SamplingParams
from hybridlm.serving.runner import EngineRunner, EngineUnavailable

_TYPE_NAME = re.compile(r"^(str|int|float|bool|list\[.*\]|dict\[.*\])$")
DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there
# The roles a chat message may have: those of the conversations the models are trained on. Not "tool", although our
# chat template has a token for it: the server takes no `tools`, so no assistant message calls one for it to answer.
CHAT_ROLES = ("system", "user", "assistant")


class APIError(Exception):
    """An error answered as OpenAI's error object."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


class _Sampling(BaseModel):
    """The fields both endpoints take (unknown fields are accepted and ignored, as OpenAI clients send many). Counts
    and switches are strict, as OpenAI's API checks them: `"max_tokens": true` or `"stream": "yes"` is a 400, not
    1 token or a stream."""

    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    ignore_eos: StrictBool = False
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None  # required, but by `_check_messages`: it names the message


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(default_factory=list)
    max_completion_tokens: StrictInt | None = None


def build_app(runner: EngineRunner, *, model_name: str, api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving `runner`'s engine as `model_name`. ValueError when the tokenizer's chat template (if
    it has one) does not render a user message: every chat request would fail."""
    app = FastAPI(title="hybridlm", docs_url=None, redoc_url=None)
    engine = runner.engine
    has_template = getattr(engine.tokenizer, "chat_template", None) is not None
    end_ids, end_text = _turn_end(engine.tokenizer) if has_template else ((), ())  # one template per server

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        if first.get("type") == "json_invalid":
            return APIError(400, f"the request body is not valid JSON: {first.get('msg', '')}").response()
        # the field's path, without pydantic's names of the union members it tried ("stop.str", "prompt.list[int]")
        parts = [p for p in first.get("loc", ()) if p != "body" and not _TYPE_NAME.match(str(p))]
        # messages[0].content, as the server's own checks name a field
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts).lstrip(".")
        return APIError(400, f"{where or 'body'}: {first.get('msg', 'invalid')}", param=where or None).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        return APIError(error.status_code, str(error.detail), code=str(error.status_code)).response()

    if api_key is not None:
        app.add_middleware(_RequireKey, api_key=api_key)

    @app.get("/health")
    async def health():
        stats = engine.stats()
        if getattr(engine, "failure", None) is not None:  # the engine process died: 503, so that a balancer moves on
            return JSONResponse({"status": "failed", **stats}, status_code=503)
        return {"status": "ok", **stats}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "hybridlm", "max_model_len": engine.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(body.model, model_name)
        prompts = _prompts(body.prompt)
        params = _sampling(body, body.max_tokens if body.max_tokens is not None else 16)
        answer = _Answer("cmpl", "text_completion", model_name, chat=False)
        return await _respond(runner, request, body, [_encode(engine, p) for p in prompts], params, answer)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        _check_model(body.model, model_name)
        if not body.messages:
            raise APIError(400, "messages must hold at least one message", param="messages")
        _check_messages(body.messages)
        if not has_template:
            raise APIError(400, "this model's tokenizer has no chat template: use /v1/completions")
        messages = [{"role": m.role, "content": _text(m.content)} for m in body.messages]
        ids = _chat_ids(engine.tokenizer, messages)
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        limit_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        params = _sampling(body, limit if limit is not None else max(1, engine.max_model_len - len(ids)),
                           stop_token_ids=end_ids, more_stop=end_text, max_tokens_field=limit_field)
        answer = _Answer("chatcmpl", "chat.completion", model_name, chat=True)
        return await _respond(runner, request, body, [ids], params, answer)

    return app


class _RequireKey:
    """A /v1/ request without `Authorization: Bearer KEY` gets a 401; everything else passes through untouched. Pure
    ASGI: an `@app.middleware("http")` function wraps the request's `receive`, and `request.is_disconnected()` then
    does not see a client that left while its whole (non-streamed) answer was being generated."""

    def __init__(self, app, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode("latin-1")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            if dict(scope["headers"]).get(b"authorization", b"") != self.expected:
                error = APIError(401, "missing or wrong API key (Authorization: Bearer KEY)", code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _Answer:
    """The response objects of one request: whole (non-streaming) or chunks, completion or chat shaped."""

    def __init__(self, prefix: str, kind: str, model: str, *, chat: bool) -> None:
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.kind, self.model, self.chat = kind, model, chat
        self.created = int(time.time())

    def _object(self, kind: str, choices: list[dict], usage: dict | None) -> dict:
        out = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def whole(self, outputs: list[RequestOutput]) -> dict:
        choices = []
        for index, out in enumerate(outputs):
            content = {"message": {"role": "assistant", "content": out.text}} if self.chat else {
                "text": out.text, "logprobs": None}
            choices.append({"index": index, **content, "finish_reason": out.finish_reason})
        return self._object(self.kind, choices, _usage(outputs))

    def chunk(self, index: int, text: str | None, finish_reason: str | None, *, role: bool = False) -> dict:
        if self.chat:
            delta = ({"role": "assistant", "content": ""} if role else {}) | ({} if text is None else {"content": text})
            choice = {"index": index, "delta": delta, "finish_reason": finish_reason}
            return self._object(f"{self.kind}.chunk", [choice], None)
        choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return self._object(self.kind, [choice], None)

    def usage_chunk(self, outputs: list[RequestOutput]) -> dict:
        return self._object(f"{self.kind}.chunk" if self.chat else self.kind, [], _usage(outputs))


async def _respond(runner: EngineRunner, request: Request, body: _Sampling, prompts: list[list[int]],
                   params: SamplingParams, answer: _Answer):
    try:
        request_ids, queue = runner.submit(prompts, params)
    except EngineUnavailable as error:
        raise APIError(503, str(error), kind="server_error") from None
    except ValueError as error:
        raise APIError(400, str(error)) from None
    if body.stream:
        usage = bool((body.stream_options or {}).get("include_usage"))
        return StreamingResponse(_stream(runner, request_ids, queue, answer, usage), media_type="text/event-stream")
    final: list[RequestOutput | None] = [None] * len(prompts)
    checked = time.monotonic()
    try:
        while any(out is None for out in final):
            # every DISCONNECT_POLL_S, whether or not outputs keep coming (a decoding request sends one per token)
            if time.monotonic() - checked >= DISCONNECT_POLL_S:
                if await request.is_disconnected():
                    return JSONResponse({}, status_code=499)  # nobody reads it; the finally aborts the requests
                checked = time.monotonic()
            try:
                index, out = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                continue
            if isinstance(out, Exception):
                raise APIError(500, f"the engine failed: {out}", kind="server_error")
            if out.finished:
                final[index] = out
    finally:
        runner.abort([rid for rid, out in zip(request_ids, final) if out is None])
    return answer.whole(final)


async def _stream(runner: EngineRunner, request_ids: list[str], queue: asyncio.Queue, answer: _Answer,
                  include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: OpenAI chunks as the engine produces text, then `data: [DONE]`. Closing the stream (a
    client that went away) aborts whatever has not finished.

    Each wake-up takes every output that has arrived: a choice's new text becomes one chunk and the chunks one
    write. While the stream keeps up that is a chunk per token; when the engine steps faster than this event loop
    (or the client) can send one event per token, the chunks carry several tokens' text instead of falling further
    behind (what vLLM's output collector does)."""
    final: list[RequestOutput | None] = [None] * len(request_ids)
    try:
        if answer.chat:
            yield "".join(_event(answer.chunk(index, None, None, role=True)) for index in range(len(request_ids)))
        while any(out is None for out in final):
            arrived = [await queue.get()]
            while not queue.empty():
                arrived.append(queue.get_nowait())
            texts: dict[int, list[str]] = {}
            finished: list[int] = []
            failure = None
            for index, out in arrived:
                if isinstance(out, Exception):
                    failure = out
                    break
                if out.delta:
                    texts.setdefault(index, []).append(out.delta)
                if out.finished:
                    final[index] = out
                    finished.append(index)
            events = [_event(answer.chunk(index, "".join(parts), None)) for index, parts in texts.items()]
            events += [_event(answer.chunk(index, None if answer.chat else "", final[index].finish_reason))
                       for index in finished]
            if failure is not None:
                events.append(_event({"error": {"message": f"the engine failed: {failure}", "type": "server_error",
                                                "param": None, "code": None}}))
            if events:
                yield "".join(events)
            if failure is not None:
                break
        else:
            if include_usage:
                yield _event(answer.usage_chunk(final))
        yield "data: [DONE]\n\n"
    finally:
        runner.abort([rid for rid, out in zip(request_ids, final) if out is None])


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(out.prompt_tokens for out in outputs)
    completion = sum(len(out.token_ids) for out in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(out.cached_tokens for out in outputs)}}


def _check_model(name: str, served: str) -> None:
    if name != served:
        raise APIError(404, f"the model {name!r} does not exist; this server serves {served!r}", param="model",
                       code="model_not_found")


def _prompts(prompt) -> list[str | list[int]]:
    """A completion request's prompts: a text, token ids, or a list of either."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    return list(prompt)


def _encode(engine, prompt: str | list[int]) -> list[int]:
    try:
        return engine.encode(prompt)
    except ValueError as error:
        raise APIError(400, str(error), param="prompt") from None


def _check_messages(messages: list[ChatMessage]) -> None:
    """APIError 400 naming the first message whose role is not one of CHAT_ROLES or that has no content."""
    for i, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            roles = ", ".join(repr(role) for role in CHAT_ROLES)
            raise APIError(400, f"messages[{i}].role must be one of {roles} (got {message.role!r})",
                           param=f"messages[{i}].role")
        if message.content is None:
            problem = "is required" if "content" not in message.model_fields_set else (
                "must be a string or a list of text parts (got null)")
            raise APIError(400, f"messages[{i}].content {problem}", param=f"messages[{i}].content")
        problem = text_problem(_text(message.content))
        if problem:
            raise APIError(400, f"messages[{i}].content {problem}", param=f"messages[{i}].content")


def _text(content: str | list[dict[str, Any]]) -> str:
    """A chat message's content: a string, or OpenAI's list of parts (text parts only)."""
    if isinstance(content, str):
        return content
    if not all(part.get("type") == "text" and isinstance(part.get("text"), str) for part in content):
        raise APIError(400, "only text content parts are supported", param="messages")
    return "".join(part["text"] for part in content)


def _chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The chat template's prompt ids, ending with the assistant's turn opened."""
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as error:  # a template that raises (a role it does not know, a bad order of roles)
        raise APIError(400, f"the chat template refused these messages: {error}", param="messages") from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _turn_end(tokenizer) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """What ends an assistant reply, as `hybridlm chat` ends it (`ChatEncoder`): the text the chat template writes
    after an assistant message ("<|end_of_turn|>", ChatML's "<|im_end|>"), as its token where the tokenizer has it
    as one special token, else as a stop string (a byte-level tokenizer spells it in many tokens), cut from the
    reply; nothing where the template writes nothing there."""
    encoder = ChatEncoder(tokenizer)
    try:
        encoder.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    except DataError as error:  # every chat request would fail: the server's fault, said before it serves
        raise ValueError(f"the model's chat template does not render a user message ({error}); fix its "
                         "chat_template.jinja / tokenizer_config.json") from None
    try:
        end = encoder.turn_end()
    except DataError:  # a template that refuses the probe's plain user / assistant pair: nothing to stop at
        return (), ()
    if not end:
        return (), ()
    ids = tuple(i for i in encoder.stop_ids() if i != encoder.eos_id)
    return (ids, ()) if ids else ((), (end,))


# OpenAI's and vLLM's parameters this server does not implement, with the values that ask for nothing (accepted, as
# clients send them by default); any other value is a 400 rather than silently ignored. Other unknown fields pass.
_UNIMPLEMENTED: dict[str, tuple] = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False), "suffix": (None,), "tools": (None,),
    "functions": (None,), "tool_choice": (None, "none"), "response_format": (None,), "logit_bias": (None, {}),
    "best_of": (None, 1), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0), "min_p": (None, 0, 0.0), "min_tokens": (None, 0),
}


def _sampling(body: _Sampling, max_tokens: int, *, stop_token_ids: tuple[int, ...] = (),
              more_stop: tuple[str, ...] = (), max_tokens_field: str = "max_tokens") -> SamplingParams:
    """SamplingParams from the request's fields (with `more_stop` after the request's stop strings); APIError 400
    naming the field that is out of range (`max_tokens_field`: the request's name of the token limit)."""
    if body.n != 1:
        raise APIError(400, "n must be 1 (one choice per prompt)", param="n")
    extra = body.model_extra or {}
    for name, idle in _UNIMPLEMENTED.items():
        value = extra.get(name)
        if not any(value is v or (type(value) is type(v) and value == v) for v in idle):  # (True is not 1 here)
            allowed = " or ".join("null" if v is None else json.dumps(v) for v in idle)
            raise APIError(400, f"{name} is not supported (only {allowed}), got {json.dumps(value)}", param=name)
    top_p = None if body.top_p is None or body.top_p == 1 else body.top_p
    top_k = None if body.top_k is None or body.top_k in (0, -1) else body.top_k  # vLLM's "off" values
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature, top_p=top_p,
            top_k=top_k, stop=_stop_strings(body.stop) + more_stop, seed=body.seed, ignore_eos=body.ignore_eos,
            stop_token_ids=stop_token_ids,
        )
    except ValueError as error:
        message, field = str(error), str(error).split(" ", 1)[0]
        if field == "max_tokens" and max_tokens_field != field:
            message, field = max_tokens_field + message.removeprefix(field), max_tokens_field
        raise APIError(400, message, param=field) from None


def _stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    """The request's `stop` field as a tuple (SamplingParams checks each string)."""
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)
