"""`hybridlm serve` under load, against static-batch `generate` on the same model in the same run.

    python benchmarks/serve_bench.py                                     # H200: 125m shape, 3 variants, bf16
    python benchmarks/serve_bench.py --quick --variants "h1 fw-1A" "h1 mamba2"   # H200: minutes, the headline numbers
    python benchmarks/serve_bench.py --variants "h1 fw-1A" --concurrency 1 16 64 --requests 128
    python benchmarks/serve_bench.py --cpu --quick --preset tiny --variants "h1 fw-1A"   # smoke run (2 CPU cores)

For each variant (`gpu_model.py`'s: "h1 fw-1A" a Falcon-1A hybrid, "h1 mamba2" a Mamba-2 hybrid, "transformer
matched" a Transformer of the same size; random weights, `--requests` prompts of random words, every request decoding
exactly `--output-tokens` tokens with `ignore_eos`), this script saves the model with a word-level tokenizer (one
token per word of the text, so every token streams as text), starts `hybridlm serve` in a subprocess on a free
loopback port, and drives it over HTTP with streamed completions from an asyncio load generator:

1. Throughput and latency against concurrency C: output tokens/s, time to first token (TTFT) and inter-token
   latency (ITL, the gaps between streamed chunks), p50 / p99. Baseline, in the same run: the same prompts through
   `HybridForCausalLM.generate` (transformers' `generate` entry point) in static batches of C (left-padded; a batch
   ends when its longest row ends); the ratio column is the server's output tokens/s over the baseline's.
2. Prefix cache: requests sharing a `--system-tokens` system prompt (distinct user suffixes), one at a time: the
   share of their prompt tokens served from the prefix cache (`usage.prompt_tokens_details.cached_tokens`) and the
   median TTFT of cold requests (distinct system prompts) over warm ones.
3. The offline API (`Engine.generate` in this process, no HTTP) over the same prompts at each concurrency: the
   engine's own output tokens/s, beside the server's (which adds HTTP, streaming and the event loop's share of
   the interpreter).
4. 8 requests at once against the same 8 one after the other, through the engine in this process (`Engine.generate`,
   no HTTP: the load generator would share the CPU with the server): the median time ratio over 3 repeats (the CPU
   target: <= 0.5).

Every measurement is printed (and flushed) as soon as it is made, with each phase's wall time, then the tables at the
end. `--quick`: 64 requests of 128 prompt + 32 output tokens at concurrency 8 and 64, a 2K-token system prompt for 4
requests, 4 repeats of the 8 requests: the targets' numbers in a few minutes on an H200 (`--quick` sets the defaults;
flags given after it still apply).

Targets (the serving issue): >= 5x the static-batch output tokens/s at 64 concurrent requests; >= 90% of a repeated
2K-token system prompt from the cache and >= 5x lower TTFT than cold; 8 concurrent <= 0.5x the time of 8 sequential.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from gpu_model import config_of  # benchmarks/ is on the path when this script runs

from hybridlm.data.tokenizer import CHAT_TEMPLATE
from hybridlm.models.model import HybridForCausalLM

REPO = Path(__file__).resolve().parents[1]
SPECIALS = ("<|pad|>", "<|begin_of_text|>", "<|end_of_text|>")


def save_model(preset: str, variant: str, directory: Path, dtype: torch.dtype) -> int:
    """A random model of `variant` and a word-level tokenizer over its vocabulary in `directory`; its vocab size."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    config = config_of(preset, variant)
    torch.manual_seed(0)
    HybridForCausalLM(config).to(dtype).save_pretrained(directory)
    vocab = {token: i for i, token in enumerate(SPECIALS)} | {f"w{i}": i for i in range(len(SPECIALS),
                                                                                          config.vocab_size)}
    raw = Tokenizer(models.WordLevel(vocab, unk_token=SPECIALS[0]))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=raw, pad_token=SPECIALS[0], bos_token=SPECIALS[1],
                            eos_token=SPECIALS[2], chat_template=CHAT_TEMPLATE).save_pretrained(directory)
    return config.vocab_size


def words(count: int, vocab: int, rng: random.Random) -> str:
    """A prompt of exactly `count` tokens."""
    return " ".join(f"w{rng.randrange(len(SPECIALS), vocab)}" for _ in range(count))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`hybridlm serve` in a subprocess, stopped on exit. Its log (a line per request) goes to a temporary file: a
    pipe nobody reads would fill up and stop the server mid-run."""

    def __init__(self, directory: Path, args: argparse.Namespace, *, max_num_seqs: int, prefix_cache_gb: float,
                 flags: tuple[str, ...] = (), compile_step: bool = False):
        self.port = free_port()
        command = [sys.executable, "-m", "hybridlm.cli", "serve", "--model", str(directory), "--port",
                   str(self.port), "--max-num-seqs", str(max_num_seqs), "--max-model-len", str(args.max_model_len),
                   "--dtype", args.dtype, "--device", args.device, "--prefix-cache-gb", str(prefix_cache_gb),
                   "--block-size", str(args.block_size), "--served-model-name", "bench"]
        if args.max_prefill_tokens is not None:
            command += ["--max-prefill-tokens", str(args.max_prefill_tokens)]
        if args.threads is not None:
            command += ["--threads", str(args.threads)]
        if compile_step:
            command.append("--compile")
        command += flags
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=self.log)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Server:
        import httpx

        start = time.monotonic()
        while time.monotonic() < start + 600:
            if self.process.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"the server exited: {self.log.read().decode()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    log(f"  [server started: {time.monotonic() - start:.1f} s]")
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("the server did not start within 10 minutes")

    def steps(self) -> dict:
        """The engine's step counters (`hybridlm.serving.engine.StepCounters`) as /health reports them."""
        import httpx

        return httpx.get(f"{self.url}/health", timeout=10).json()["steps"]

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)
        self.log.close()


async def one_request(client, prompt: str, max_tokens: int) -> dict:
    """Stream one completion: {"ttft", "gaps" (seconds between chunks), "tokens", "cached", "prompt", "total"}."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    arrivals, usage = [], None
    async with client.stream("POST", "/v1/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                arrivals.append(time.perf_counter())
    return {"ttft": arrivals[0] - start, "gaps": [b - a for a, b in zip(arrivals, arrivals[1:])],
            "tokens": usage["completion_tokens"], "prompt": usage["prompt_tokens"],
            "cached": usage["prompt_tokens_details"]["cached_tokens"], "total": time.perf_counter() - start}


async def load(url: str, prompts: list[str], max_tokens: int, concurrency: int) -> tuple[list[dict], float]:
    """All prompts, at most `concurrency` in flight: the per-request results and the wall time."""
    import httpx

    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        async def gated(prompt: str) -> dict:
            async with gate:
                return await one_request(client, prompt, max_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(gated(p) for p in prompts))
        return results, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def log(message: str) -> None:
    """A partial result or a phase's time, printed at once (a long run shows what it has measured so far)."""
    print(message, flush=True)


class Phase:
    """`with Phase("name"):` prints how long the block took."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> Phase:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        log(f"  [{self.name}: {time.perf_counter() - self.start:.1f} s]")


def load_local(directory: Path, args: argparse.Namespace):
    """The saved model (on the benchmark's device and dtype) and its tokenizer, in this process."""
    from transformers import AutoTokenizer

    from hybridlm.models.hf import load_model

    model = load_model(directory, dtype=getattr(torch, args.dtype)).to(torch.device(args.device)).eval()
    return model, AutoTokenizer.from_pretrained(directory)


def static_generate(model, ids: list[list[int]], args: argparse.Namespace, batch: int) -> float:
    """Output tokens/s of `generate` over the prompts `ids` in static batches of `batch` (left-padded); one batch
    first as warm-up."""
    device = next(model.parameters()).device

    def run(rows_of: list[list[int]]) -> None:
        for i in range(0, len(rows_of), batch):
            rows = rows_of[i : i + batch]
            width = max(map(len, rows))
            tokens = torch.tensor([[0] * (width - len(r)) + r for r in rows], device=device)
            mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
            model.generate(tokens, attention_mask=mask, max_new_tokens=args.output_tokens, do_sample=False,
                           eos_token_id=None)

    run(ids[:batch])  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    run(ids)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return len(ids) * args.output_tokens / (time.perf_counter() - start)


def eight_in_process(model, tokenizer, prompts: list[str], args: argparse.Namespace) -> tuple[float, float]:
    """Median seconds of 8 requests through one engine at once and of the same 8 one after the other (`--repeats`
    pairs, after a warm-up)."""
    from hybridlm.serving import Engine, SamplingParams

    engine = Engine(model, tokenizer, max_num_seqs=8, max_model_len=args.max_model_len, block_size=args.block_size,
                    prefix_cache_bytes=0)
    params = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True)
    eight = prompts[:8]
    engine.generate(eight, params)  # warm-up
    together, alone = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        engine.generate(eight, params)
        together.append(time.perf_counter() - start)
        start = time.perf_counter()
        for prompt in eight:
            engine.generate([prompt], params)
        alone.append(time.perf_counter() - start)
    return statistics.median(together), statistics.median(alone)


def sweep(directory: Path, prompts: list[str], args: argparse.Namespace, *, flag: str | None = None) -> list[dict]:
    """The prompts through one server at each concurrency: a row of throughput and latency figures per level."""
    rows = []
    name = f"server --{flag}" if flag else "server"
    with Server(directory, args, max_num_seqs=max(args.concurrency), prefix_cache_gb=0,
                flags=(f"--{flag}",) if flag else (), compile_step=args.compile and flag != "enforce-eager") as server:
        with Phase("warm-up load"):
            asyncio.run(load(server.url, prompts[: max(args.concurrency)], args.output_tokens, max(args.concurrency)))
        for concurrency in args.concurrency:
            before = server.steps()
            with Phase(f"{name} load at concurrency {concurrency}"):
                results, wall = asyncio.run(load(server.url, prompts, args.output_tokens, concurrency))
            work = {key: value - before[key] for key, value in server.steps().items()}
            gaps = [g for r in results for g in r["gaps"]]
            row = {"concurrency": concurrency, "tokens_per_s": sum(r["tokens"] for r in results) / wall,
                   "ttft_p50": percentile([r["ttft"] for r in results], 0.5),
                   "ttft_p99": percentile([r["ttft"] for r in results], 0.99),
                   "itl_p50": percentile(gaps, 0.5), "itl_p99": percentile(gaps, 0.99), "engine_steps": work}
            rows.append(row)
            log(f"  {name}, concurrency {concurrency}: {row['tokens_per_s']:.0f} output tok/s, TTFT p50 "
                f"{1e3 * row['ttft_p50']:.1f} ms, ITL p50 {1e3 * row['itl_p50']:.1f} ms; the engine: "
                f"{work['prefill_steps']} prefill steps ({work['prefill_tokens']} tokens) in {work['prefill_s']:.2f} s, "
                f"{work['decode_steps']} decoding steps ({work['decode_rows']} rows) in {work['decode_s']:.2f} s "
                f"of the {wall:.2f} s")
    return rows


def engine_in_process(model, tokenizer, prompts: list[str], args: argparse.Namespace, concurrency: int) -> float:
    """Output tokens/s of `Engine.generate` (the offline API: no HTTP) over all prompts with `concurrency` rows."""
    from hybridlm.serving import Engine, SamplingParams

    engine = Engine(model, tokenizer, max_num_seqs=concurrency, max_model_len=args.max_model_len,
                    block_size=args.block_size, max_prefill_tokens=args.max_prefill_tokens, prefix_cache_bytes=0,
                    compile_step="inductor" if args.compile else None)
    engine.warm_up()
    params = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True)
    engine.generate(prompts[:concurrency], params)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    engine.generate(prompts, params)
    return len(prompts) * args.output_tokens / (time.perf_counter() - start)


def bench_variant(variant: str, args: argparse.Namespace) -> dict:
    rng = random.Random(0)
    out: dict = {"variant": variant, "rows": []}
    log(f"# {variant}")
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        with Phase("model saved"):
            vocab = save_model(args.preset, variant, directory, getattr(torch, args.dtype))
        prompts = [words(args.prompt_tokens, vocab, rng) for _ in range(args.requests)]
        out["rows"] = sweep(directory, prompts, args)
        for flag in args.compare:  # the same sweep with one of the server's defaults turned off
            for row, other in zip(out["rows"], sweep(directory, prompts, args, flag=flag)):
                row[flag] = other["tokens_per_s"]
        with Server(directory, args, max_num_seqs=8, prefix_cache_gb=args.prefix_cache_gb) as server:
            with Phase("prefix-cache requests"):
                system = words(args.system_tokens, vocab, rng)
                warm = [f"{system} {words(32, vocab, rng)}" for _ in range(args.prefix_requests)]
                cold = [f"{words(args.system_tokens, vocab, rng)} {words(32, vocab, rng)}"
                        for _ in range(args.prefix_requests)]
                cold_results, _ = asyncio.run(load(server.url, cold, 8, 1))
                warm_results, _ = asyncio.run(load(server.url, warm, 8, 1))
            hits = warm_results[1:]  # the first one fills the cache
            out["prefix_cached_share"] = sum(r["cached"] for r in hits) / sum(r["prompt"] for r in hits)
            out["prefix_ttft_cold_over_warm"] = (statistics.median(r["ttft"] for r in cold_results[1:])
                                                 / statistics.median(r["ttft"] for r in hits))
            log(f"  prefix cache: {100 * out['prefix_cached_share']:.1f}% of prompt tokens cached, TTFT cold / warm "
                f"{out['prefix_ttft_cold_over_warm']:.2f}x")
        model, tokenizer = load_local(directory, args)
        if not args.server_only:
            with Phase("8 concurrent / 8 sequential (engine in process)"):
                together, alone = eight_in_process(model, tokenizer, prompts, args)
            out["eight_concurrent_over_sequential"] = together / alone
            log(f"  8 requests: {together:.2f} s at once, {alone:.2f} s one after the other: {together / alone:.2f}")
        ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        for row in out["rows"]:
            if not args.server_only:
                with Phase(f"engine in process at concurrency {row['concurrency']}"):
                    row["engine_tokens_per_s"] = engine_in_process(model, tokenizer, prompts, args, row["concurrency"])
                log(f"  engine in process, concurrency {row['concurrency']}: {row['engine_tokens_per_s']:.0f} "
                    "output tok/s")
            with Phase(f"static generate in batches of {row['concurrency']}"):
                row["static_tokens_per_s"] = static_generate(model, ids, args, row["concurrency"])
            row["ratio"] = row["tokens_per_s"] / row["static_tokens_per_s"]
            log(f"  static generate, batch {row['concurrency']}: {row['static_tokens_per_s']:.0f} output tok/s "
                f"(server / static {row['ratio']:.2f}x)")
        del model
    return out


def print_results(results: list[dict], args: argparse.Namespace) -> None:
    print(f"## serving: {args.requests} requests of {args.prompt_tokens} prompt + {args.output_tokens} output "
          f"tokens, {args.dtype} on {args.device} ({torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'})")
    print("| variant | concurrency | server tok/s | static generate tok/s | ratio | TTFT p50 / p99 ms | "
          f"ITL p50 / p99 ms | {''.join(f'server --{flag} tok/s | ' for flag in args.compare)}"
          "engine in process tok/s (ratio) |")
    print("|---" * (8 + len(args.compare)) + "|")
    for result in results:
        for row in result["rows"]:
            others = "".join(f"{row[flag]:.0f} | " for flag in args.compare)
            engine = row.get("engine_tokens_per_s")
            engine = f"{engine:.0f} ({engine / row['static_tokens_per_s']:.2f}x)" if engine else "-"
            print(f"| {result['variant']} | {row['concurrency']} | {row['tokens_per_s']:.0f} | "
                  f"{row['static_tokens_per_s']:.0f} | {row['ratio']:.2f}x | {1e3 * row['ttft_p50']:.1f} / "
                  f"{1e3 * row['ttft_p99']:.1f} | {1e3 * row['itl_p50']:.1f} / {1e3 * row['itl_p99']:.1f} | {others}"
                  f"{engine} |")
    print(f"\n## prefix cache: a {args.system_tokens}-token system prompt, {args.prefix_requests} requests each\n")
    print("| variant | prompt tokens from the cache | TTFT cold / warm | 8 concurrent / 8 sequential time |")
    print("|---|---|---|---|")
    for result in results:
        eight = result.get("eight_concurrent_over_sequential")
        eight = "-" if eight is None else f"{eight:.2f}"
        print(f"| {result['variant']} | {100 * result['prefix_cached_share']:.1f}% | "
              f"{result['prefix_ttft_cold_over_warm']:.2f}x | {eight} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--cpu", action="store_true", help="run on the CPU in float32 (a smoke run)")
    parser.add_argument("--preset", default="125m", help="125m (the gpu_model.py shape) or a preset name (tiny)")
    parser.add_argument("--variants", nargs="+", default=["h1 fw-1A", "h1 mamba2", "transformer matched"])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32, 64])
    parser.add_argument("--requests", type=int, default=128, help="requests per concurrency level")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--system-tokens", type=int, default=2048, help="the shared system prompt's tokens")
    parser.add_argument("--prefix-requests", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--prefix-cache-gb", type=float, default=8.0)
    parser.add_argument("--max-prefill-tokens", type=int, default=None,
                        help="the engines' prefill tokens per step (default: the engine's, 8192 on a GPU, 2048 on a CPU)")
    parser.add_argument("--threads", type=int, metavar="N",
                        help="CPU threads of this process and of the server (`hybridlm serve --threads`); on a shared "
                             "CPU 1 avoids waits for descheduled threads in every batched matmul")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of the 8 concurrent / 8 sequential timing")
    parser.add_argument("--quick", action="store_true",
                        help="64 requests of 128 + 32 tokens at concurrency 8 and 64, 4 prefix requests (minutes)")
    parser.add_argument("--compare", nargs="*", default=[], choices=("enforce-eager", "engine-thread"),
                        help="also sweep a server started with --enforce-eager (no CUDA graphs: the graphs' gain) and "
                             "/ or --engine-thread (the engine on the server's thread: the engine process's gain)")
    parser.add_argument("--compile", action="store_true",
                        help="the throughput sweeps' servers with --compile, the engines with compile_step='inductor' "
                             "(the step compiled before its graphs are captured; the prefix-cache phase, which times "
                             "prefills, keeps the plain server)")
    parser.add_argument("--server-only", action="store_true",
                        help="skip the engine-in-process phases (3 and 4 above): the HTTP sweep against static "
                             "generate and the prefix cache only")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args()
    if args.quick:
        parser.set_defaults(concurrency=[8, 64], requests=64, prompt_tokens=128, output_tokens=32, prefix_requests=4)
        args = parser.parse_args()  # flags given on the command line still win over the preset's defaults
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    args.device = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda"
    args.dtype = "float32" if args.device == "cpu" else "bfloat16"
    args.max_model_len = max(args.prompt_tokens, args.system_tokens + 32) + args.output_tokens + 8
    results = [bench_variant(variant, args) for variant in args.variants]
    print_results(results, args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
