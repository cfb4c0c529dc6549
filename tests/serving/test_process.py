"""The engine in a process of its own (`EngineProcess`): outputs equal the in-process engine's, aborts free their
requests, an engine that dies fails the requests in flight and is reported, one that cannot start says why."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from hybridlm.serving import Engine, EngineProcess, SamplingParams, build_app
from hybridlm.serving.runner import EngineUnavailable

SETTINGS = dict(max_num_seqs=3, max_model_len=96, block_size=8, device="cpu")


@pytest.fixture(scope="module")
def runner(model_dir):
    runner = EngineProcess(model_dir, engine_kwargs=SETTINGS, threads=1, start_timeout=120)
    runner.start()
    yield runner
    runner.shutdown()


async def collect(runner, prompts, params, *, abort_after: int | None = None):
    """Submit `prompts`; their final outputs (aborting them all once `abort_after` outputs arrived)."""
    request_ids, queue = runner.submit(prompts, params)
    final, seen = [None] * len(prompts), 0
    while any(out is None for out in final):
        index, out = await asyncio.wait_for(queue.get(), 60)
        if index is None:
            raise out
        seen += 1
        if abort_after is not None and seen == abort_after:
            runner.abort(request_ids)
        if out.finished:
            final[index] = out
    return final


def test_outputs_equal_the_engine_in_this_process(runner, model_dir):
    prompts = [[5, 17, 33], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49], [7]]
    params = SamplingParams(max_tokens=9, temperature=0.8, seed=3, ignore_eos=True)
    got = asyncio.run(collect(runner, prompts, params))
    want = Engine(model_dir, **SETTINGS).generate(prompts, params)
    assert [(o.token_ids, o.text, o.finish_reason, o.usage) for o in got] == \
        [(o.token_ids, o.text, o.finish_reason, o.usage) for o in want]
    assert runner.engine.stats()["finished"]["length"] >= 3


def test_an_abort_frees_the_request(runner):
    before = runner.engine.stats()["finished"].get("abort", 0)
    out, = asyncio.run(collect(runner, [[1, 2, 3]], SamplingParams(max_tokens=80, ignore_eos=True), abort_after=1))
    assert out.finish_reason == "abort" and len(out.token_ids) < 80
    stats = runner.engine.stats()
    assert stats["finished"]["abort"] == before + 1 and stats["running"] == 0


def test_a_dead_engine_fails_the_requests_in_flight_and_refuses_new_ones(model_dir):
    TestClient = pytest.importorskip("fastapi.testclient").TestClient

    runner = EngineProcess(model_dir, engine_kwargs=SETTINGS, threads=1, start_timeout=120)
    runner.start()
    try:
        async def scenario():
            request_ids, queue = runner.submit([[1, 2, 3]], SamplingParams(max_tokens=80, ignore_eos=True))
            await queue.get()  # running
            os.kill(runner._process.pid, signal.SIGKILL)
            while True:
                index, out = await asyncio.wait_for(queue.get(), 30)
                if index is None:
                    return out

        error = asyncio.run(scenario())
        assert isinstance(error, RuntimeError) and "engine process exited" in str(error)
        assert "failed" in runner.engine.stats()["engine"]

        async def submit_again():
            runner.submit([[1]], SamplingParams())

        with pytest.raises(EngineUnavailable, match="the engine is not running"):
            asyncio.run(submit_again())
        # the server: 503 for a generation and from /health (a balancer moves on), not a client error
        client = TestClient(build_app(runner, model_name="tiny"))
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "failed"
        reply = client.post("/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 1})
        assert reply.status_code == 503 and reply.json()["error"]["type"] == "server_error"
    finally:
        runner.shutdown()


def test_an_engine_that_cannot_start_says_why(model_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in os.listdir(model_dir):
        if not name.endswith(".safetensors"):
            (broken / name).write_bytes((model_dir / name).read_bytes())
    runner = EngineProcess(broken, engine_kwargs=SETTINGS, threads=1, start_timeout=120)
    with pytest.raises(RuntimeError, match="the engine failed to start: .*the weights do not load"):
        runner.start()
