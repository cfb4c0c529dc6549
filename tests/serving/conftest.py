"""What the serving tests share: a tiny byte-level tokenizer with our chat template and a tiny hybrid saved beside
it (a checkpoint directory, as `hybridlm serve --model` takes), and a server on a free loopback port."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from hybridlm.data.tokenizer import SPECIAL_TOKENS, HybridTokenizer, fixed_tokens, train_from_texts
from tests.inference.helpers import make_model

API_KEY = "test-key"
MODEL_NAME = "tiny"
TEXTS = ["the quick brown fox", "jumps over the lazy dog", "hello world", "serve me a token"]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A checkpoint directory: a 2-layer Mamba-2 hybrid (float32, seeded random weights) and its tokenizer (bytes
    and the named special tokens, ~290 ids; our chat template)."""
    path = tmp_path_factory.mktemp("tiny-serve")
    raw = train_from_texts(TEXTS, vocab_size=len(fixed_tokens(0)) + 257, num_reserved=0)
    tokenizer = HybridTokenizer(raw, {"special_tokens": {name: i for i, (name, _) in enumerate(SPECIAL_TOKENS)}})
    tokenizer.save(path)
    model = make_model(vocab_size=tokenizer.vocab_size, max_position_embeddings=96, pad_token_id=tokenizer.pad_id,
                       bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["thread", "process"])
def server(model_dir, request):
    """A server (uvicorn on a thread; the engine on a thread of this process, or in a process of its own) at
    http://127.0.0.1:PORT with API key `API_KEY`: yields (base URL, engine: the `Engine`, or the process runner's
    `EngineFront`); stopped after the module's tests."""
    import uvicorn

    from hybridlm.serving import Engine, EngineProcess, EngineRunner, build_app

    settings = dict(max_num_seqs=4, max_model_len=96, block_size=8, max_prefill_tokens=16, prefix_cache_bytes=1 << 24,
                    device="cpu")
    if request.param == "thread":
        runner = EngineRunner(Engine(model_dir, **settings))
    else:
        runner = EngineProcess(model_dir, engine_kwargs=settings, threads=1, start_timeout=120)
    runner.start()
    engine = runner.engine
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = build_app(runner, model_name=MODEL_NAME, api_key=API_KEY)
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(200):  # bounded: up to 10 s for the server to start
        if uv.started:
            break
        time.sleep(0.05)
    assert uv.started, "the server did not start"
    yield f"http://127.0.0.1:{port}", engine
    uv.should_exit = True
    thread.join(timeout=10)
    runner.shutdown()
    sock.close()
