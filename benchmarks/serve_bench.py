"""`hybridlm serve` under load, against static-batch `generate` on the same model in the same run.

    python benchmarks/serve_bench.py                                   # H200: 125m shape, 3 variants, bf16
    python benchmarks/serve_bench.py --variants "h1 fw-1A" --concurrency 1 16 64 --requests 128
    python benchmarks/serve_bench.py --cpu --preset tiny --concurrency 1 8 --requests 8 --output-tokens 16 \\
        --prompt-tokens 32 --system-tokens 256                           # smoke run (minutes on 2 cores)

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
3. 8 requests at concurrency 8 against the same 8 one after the other: the time ratio (the CPU target: <= 0.5).

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
    """`hybridlm serve` in a subprocess, stopped on exit."""

    def __init__(self, directory: Path, args: argparse.Namespace, *, max_num_seqs: int, prefix_cache_gb: float):
        self.port = free_port()
        command = [sys.executable, "-m", "hybridlm.cli", "serve", "--model", str(directory), "--port",
                   str(self.port), "--max-num-seqs", str(max_num_seqs), "--max-model-len", str(args.max_model_len),
                   "--dtype", args.dtype, "--device", args.device, "--prefix-cache-gb", str(prefix_cache_gb),
                   "--block-size", str(args.block_size), "--served-model-name", "bench"]
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Server:
        import httpx

        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited: {self.process.stderr.read().decode()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("the server did not start within 10 minutes")

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)


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


def static_generate(directory: Path, prompts: list[str], args: argparse.Namespace, batch: int) -> float:
    """Output tokens/s of `generate` over `prompts` in static batches of `batch` (left-padded)."""
    from transformers import AutoTokenizer

    from hybridlm.models.hf import load_model

    device = torch.device(args.device)
    model = load_model(directory, dtype=getattr(torch, args.dtype)).to(device)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]

    def run() -> None:
        for i in range(0, len(ids), batch):
            rows = ids[i : i + batch]
            width = max(map(len, rows))
            tokens = torch.tensor([[0] * (width - len(r)) + r for r in rows], device=device)
            mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
            model.generate(tokens, attention_mask=mask, max_new_tokens=args.output_tokens, do_sample=False,
                           eos_token_id=None)

    run()  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    del model
    return len(ids) * args.output_tokens / elapsed


def bench_variant(variant: str, args: argparse.Namespace) -> dict:
    rng = random.Random(0)
    out: dict = {"variant": variant, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        vocab = save_model(args.preset, variant, directory, getattr(torch, args.dtype))
        prompts = [words(args.prompt_tokens, vocab, rng) for _ in range(args.requests)]
        with Server(directory, args, max_num_seqs=max(args.concurrency), prefix_cache_gb=0) as server:
            asyncio.run(load(server.url, prompts[: max(args.concurrency)], args.output_tokens, max(args.concurrency)))
            for concurrency in args.concurrency:
                results, wall = asyncio.run(load(server.url, prompts, args.output_tokens, concurrency))
                gaps = [g for r in results for g in r["gaps"]]
                out["rows"].append({"concurrency": concurrency, "tokens_per_s": sum(r["tokens"] for r in results) / wall,
                                    "ttft_p50": percentile([r["ttft"] for r in results], 0.5),
                                    "ttft_p99": percentile([r["ttft"] for r in results], 0.99),
                                    "itl_p50": percentile(gaps, 0.5), "itl_p99": percentile(gaps, 0.99)})
            eight = prompts[:8]
            _, together = asyncio.run(load(server.url, eight, args.output_tokens, 8))
            _, alone = asyncio.run(load(server.url, eight, args.output_tokens, 1))
            out["eight_concurrent_over_sequential"] = together / alone
        with Server(directory, args, max_num_seqs=8, prefix_cache_gb=args.prefix_cache_gb) as server:
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
        for row in out["rows"]:
            row["static_tokens_per_s"] = static_generate(directory, prompts, args, row["concurrency"])
            row["ratio"] = row["tokens_per_s"] / row["static_tokens_per_s"]
    return out


def print_results(results: list[dict], args: argparse.Namespace) -> None:
    print(f"## serving: {args.requests} requests of {args.prompt_tokens} prompt + {args.output_tokens} output "
          f"tokens, {args.dtype} on {args.device} ({torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'})")
    print("| variant | concurrency | server tok/s | static generate tok/s | ratio | TTFT p50 / p99 ms | "
          "ITL p50 / p99 ms |")
    print("|---|---|---|---|---|---|---|")
    for result in results:
        for row in result["rows"]:
            print(f"| {result['variant']} | {row['concurrency']} | {row['tokens_per_s']:.0f} | "
                  f"{row['static_tokens_per_s']:.0f} | {row['ratio']:.2f}x | {1e3 * row['ttft_p50']:.1f} / "
                  f"{1e3 * row['ttft_p99']:.1f} | {1e3 * row['itl_p50']:.1f} / {1e3 * row['itl_p99']:.1f} |")
    print(f"\n## prefix cache: a {args.system_tokens}-token system prompt, {args.prefix_requests} requests each\n")
    print("| variant | prompt tokens from the cache | TTFT cold / warm | 8 concurrent / 8 sequential time |")
    print("|---|---|---|---|")
    for result in results:
        print(f"| {result['variant']} | {100 * result['prefix_cached_share']:.1f}% | "
              f"{result['prefix_ttft_cold_over_warm']:.2f}x | {result['eight_concurrent_over_sequential']:.2f} |")


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
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args()
    args.device = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda"
    args.dtype = "float32" if args.device == "cpu" else "bfloat16"
    args.max_model_len = max(args.prompt_tokens, args.system_tokens + 32) + args.output_tokens + 8
    results = [bench_variant(variant, args) for variant in args.variants]
    print_results(results, args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
