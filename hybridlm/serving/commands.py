"""`hybridlm serve`: an OpenAI-compatible server for a checkpoint directory (ours or official falcon_h1).

    hybridlm serve --model runs/demo/final                          # http://127.0.0.1:8000/v1, loopback only
    hybridlm serve --model Falcon-H1-0.5B-Instruct --max-num-seqs 64 --dtype bfloat16 --api-key secret

Then any OpenAI client: `OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="secret")`, with the served model
name (`--served-model-name`, default the --model argument as given). One log line per request (id, prompt /
completion tokens, cached prompt tokens, time to first token, total time). The tokenizer and its chat template come
from the model directory (or --tokenizer). On a CUDA device the decoding step replays CUDA graphs, captured at
start-up for every batch and key-span bucket (`hybridlm.serving.graphed`); --compile compiles that step with
torch.compile (inductor) before the capture, so each graph replays fused kernels; --enforce-eager runs the step op by
op. The muP multipliers are folded into the loaded weights and, on CUDA, the projections that read one input run as
one GEMM (`hybridlm.models.fuse`; --no-fold-multipliers, --no-fuse-projections keep them apart) and each parallel
block's SSM half decodes on a second stream beside attention in the graphed steps (`hybridlm.layers.block`;
--no-concurrent-mixers: one stream). The engine runs in a process of its own (`hybridlm.serving.process`;
--engine-thread: on a thread of the server's).

Exit status: 0 the server stopped, 1 it could not start (a missing model or tokenizer directory, a directory without
tokenizer files, the server's dependencies, the engine's failure), 2 a usage error (options that contradict each other
or a value out of range, such as a --port outside 0-65535 or a negative --prefix-cache-gb).
"""

from __future__ import annotations

import argparse
import math
import sys

from hybridlm.argtypes import at_least, positive_int
from hybridlm.models.commands import add_generation_flags


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible server with continuous batching and prefix caching",
        description="Serve a checkpoint directory over OpenAI's completions and chat completions API.",
    )
    p.add_argument("--model", required=True, metavar="DIR", help="checkpoint directory (hybridlm or falcon_h1)")
    p.add_argument("--tokenizer", metavar="DIR", help="tokenizer directory (default: the model directory)")
    p.add_argument("--served-model-name", metavar="NAME", help="the model name clients ask for (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=_port, default=8000,
                   help="port, 0-65535 (default 8000; 0: any free port, which the start-up log names)")
    p.add_argument("--max-num-seqs", type=positive_int, default=16, metavar="N",
                   help="requests decoded at once (default 16)")
    p.add_argument("--max-model-len", type=at_least(2), default=None, metavar="L",
                   help="prompt + new tokens per request (default: the model's max_position_embeddings)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="parameter dtype (default float32)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    p.add_argument("--threads", type=positive_int, metavar="N",
                   help="CPU threads of the model's ops (default: torch's, one per core); 1 on a CPU shared with other "
                        "jobs, where a batched step waits for every descheduled thread")
    p.add_argument("--api-key", metavar="KEY", help="require `Authorization: Bearer KEY` on /v1/ routes")
    p.add_argument("--block-size", type=positive_int, default=256, metavar="N",
                   help="prefill piece and prefix-cache checkpoint interval in tokens (default 256)")
    p.add_argument("--max-prefill-tokens", type=positive_int, default=None, metavar="N",
                   help="prompt tokens prefilled per step at most (default 8192 on a GPU, 2048 on a CPU); larger: "
                        "prompts start sooner, running streams wait longer for their next token while a step prefills")
    p.add_argument("--prefix-cache-gb", type=_cache_gb, default=1.0, metavar="GB",
                   help="memory for prefix-cache snapshots, >= 0 (default 1; 0 turns prefix caching off)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="decode without CUDA graphs (default on a CUDA device: each step replays a captured graph; "
                        "the graphs are captured at start-up)")
    p.add_argument("--compile", action="store_true",
                   help="compile the decoding step with torch.compile (inductor) before capturing its graphs: fewer, "
                        "fused kernels per step, for a longer start-up (one or two compilations)")
    add_generation_flags(p)
    p.add_argument("--engine-thread", action="store_true",
                   help="run the engine on a thread of the server's process (default: a process of its own, so "
                        "the engine's Python work and the server's do not take turns on one interpreter)")
    p.set_defaults(func=run_serve)


def _port(text: str) -> int:
    """argparse type of --port: a TCP port, 0-65535 (0: the OS picks a free one); a bad value is a usage error (exit 2)
    before the model loads, not uvicorn's OverflowError after."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0-65535 (0: any free port), got {value}")
    return value


def _cache_gb(text: str) -> float:
    """argparse type of --prefix-cache-gb: a finite size >= 0 (0: no prefix caching); a bad value is a usage error
    (exit 2)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size in GB (a number >= 0), got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0 (0 turns prefix caching off), got {text}")
    return value


def run_serve(args: argparse.Namespace) -> int:
    import logging
    from pathlib import Path

    import torch

    try:
        import uvicorn

        from hybridlm.serving.server import build_app
    except ImportError as error:
        print(f"hybridlm serve: {error}; install the server's dependencies: pip install 'hybridlm[serve]'",
              file=sys.stderr)
        return 1
    from hybridlm.serving.engine import Engine
    from hybridlm.serving.process import EngineProcess
    from hybridlm.serving.runner import EngineRunner

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.compile and args.enforce_eager:
        print("hybridlm serve: --compile compiles the graphed step; it cannot go with --enforce-eager", file=sys.stderr)
        return 2
    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        from hybridlm.models.hf import model_dir_problem

        print(f"hybridlm serve: {model_dir_problem(model_dir)}", file=sys.stderr)
        return 1
    # The tokenizer as `generate` finds it: a missing directory, or one without tokenizer files, fails here in a line,
    # before the model loads, not as retried downloads from the Hub or transformers' guess at a converter.
    from hybridlm.inference.commands import tokenizer_problem

    problem = tokenizer_problem(Path(args.tokenizer) if args.tokenizer is not None else model_dir)
    if problem:
        print(f"hybridlm serve: {problem}", file=sys.stderr)
        return 1
    if args.max_model_len is not None:  # as `generate` refuses a length past the one the model was trained for
        from hybridlm.models.hf import read_model_config

        try:
            limit = read_model_config(model_dir).max_position_embeddings
        except (ValueError, OSError) as error:
            print(f"hybridlm serve: {error}", file=sys.stderr)
            return 1
        if args.max_model_len > limit:
            print(f"hybridlm serve: --max-model-len {args.max_model_len} is longer than the model's "
                  f"max_position_embeddings {limit}", file=sys.stderr)
            return 2
    settings = dict(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, block_size=args.block_size,
                    max_prefill_tokens=args.max_prefill_tokens, prefix_cache_bytes=int(args.prefix_cache_gb * 2**30),
                    dtype=getattr(torch, args.dtype),
                    device=None if args.device == "auto" else args.device,
                    decode_step="eager" if args.enforce_eager else "auto",
                    fold_multipliers=not args.no_fold_multipliers, fuse_projections=not args.no_fuse_projections,
                    concurrent_mixers=not args.no_concurrent_mixers)
    if args.compile:
        settings["compile_step"] = "inductor"
    try:
        if args.engine_thread:
            if args.threads is not None:
                torch.set_num_threads(args.threads)
            tokenizer = None
            if args.tokenizer is not None:
                from hybridlm.models.hf import load_auto_tokenizer

                tokenizer = load_auto_tokenizer(args.tokenizer)
            engine = Engine(model_dir, tokenizer, **settings)
            engine.warm_up()
            runner = EngineRunner(engine)
        else:
            runner = EngineProcess(model_dir, engine_kwargs=settings, tokenizer_dir=args.tokenizer,
                                   threads=args.threads)
        runner.start()
    except (ValueError, OSError, RuntimeError) as error:
        print(f"hybridlm serve: {error}", file=sys.stderr)
        return 1
    try:
        try:
            app = build_app(runner, model_name=args.served_model_name or args.model, api_key=args.api_key)
        except ValueError as error:  # a chat template that renders nothing
            print(f"hybridlm serve: {error}", file=sys.stderr)
            return 1
        uvicorn.run(app, host=args.host, port=args.port, access_log=False)
    finally:
        runner.shutdown()
    return 0
