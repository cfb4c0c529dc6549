"""CPU timing of whole models of the `tiny` preset, all measured side by side in this one process.

    python benchmarks/model_cpu.py                                  # defaults below, markdown tables
    python benchmarks/model_cpu.py --contexts 256 1024 --decode-steps 16 --threads 2

1. Forward throughput (tokens/s, no grad) of four variants of the same preset: hybrid with Mamba-2 SSM
   heads, hybrid with fast-weight rule 1A heads, pure transformer (ssm_mixer="none"), pure SSM
   (use_attention=False); ratios against the Mamba-2 hybrid.
2. Decoding: time per generated token after a prefill of 256 .. 8192 tokens (median of the steps), for
   the same variants, every (model, context) pair holding its cache at the same time; the ratio to the
   shortest context shows which cost grows with the context.
Every table's entries are measured taking turns (round-robin), so that load from other processes on a
shared machine hits them alike; the ratios are the numbers to read, the absolute times vary with the load.
3. One Mamba-2 decoding step of the SSD op: the chunked algorithm against the recurrence (what the
   mixer uses at T == 1).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from hybridlm.models.model import HybridForCausalLM
from hybridlm.models.presets import get_preset
from hybridlm.ops.ssd import ssd

VARIANTS = {
    "hybrid (mamba2)": dict(),
    "hybrid (fast_weight 1A)": dict(ssm_mixer="fast_weight", fw_rule="1A"),
    "transformer (ssm none)": dict(ssm_mixer="none"),
    "pure SSM (mamba2, no attention)": dict(use_attention=False),
}


def build(changes: dict) -> HybridForCausalLM:
    torch.manual_seed(0)
    return HybridForCausalLM(get_preset("tiny", **changes)).eval()


def interleaved_medians(calls: dict, repeats: int) -> dict:
    """Median seconds of each call, the calls taking turns round by round (so that a slow spell of a shared
    machine hits every entry alike)."""
    for fn in calls.values():
        fn()  # warm-up
    times: dict = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


@torch.no_grad()
def forward_throughput(models: dict, *, batch: int, length: int, repeats: int) -> dict[str, float]:
    ids = torch.randint(0, 512, (batch, length), generator=torch.Generator().manual_seed(0))
    seconds = interleaved_medians({name: (lambda m=model: m(ids)) for name, model in models.items()}, repeats)
    return {name: batch * length / s for name, s in seconds.items()}


@torch.no_grad()
def decode_times(models: dict, *, contexts: list[int], steps: int) -> dict[tuple[str, int], float]:
    """Median seconds per generated token after a prefill of each context length (batch 1), for every
    (model, context) pair; all pairs hold their caches at once and take turns step by step."""
    calls = {}
    for context in contexts:
        ids = torch.randint(0, 512, (1, context), generator=torch.Generator().manual_seed(1))
        for name, model in models.items():
            cache = model.new_cache()
            token = model(ids, cache=cache, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
            calls[(name, context)] = _decode_step(model, cache, token)
    for fn in calls.values():  # the first steps grow the KV storage
        fn()
    return interleaved_medians(calls, steps)


def _decode_step(model, cache, token):
    state = {"token": token}

    def run():
        logits = model(state["token"], cache=cache, logits_to_keep=1).logits
        state["token"] = logits[:, -1].argmax(-1, keepdim=True)

    return run


def ssd_step_times(repeats: int) -> tuple[float, float]:
    """One decoding step of the tiny preset's SSD shapes (H=4, P=64, N=32) with a carried state."""
    g = torch.Generator().manual_seed(2)
    x, B, C = torch.randn(1, 1, 4, 64, generator=g), torch.randn(1, 1, 1, 32, generator=g), torch.randn(1, 1, 1, 32, generator=g)
    dt, A, state = torch.rand(1, 1, 4, generator=g), -torch.rand(4, generator=g), torch.randn(1, 4, 64, 32, generator=g)

    def step(backend):
        return lambda: ssd(x, dt, A, B, C, D=torch.ones(4), chunk_size=64, initial_state=state,
                           output_final_state=True, backend=backend)

    seconds = interleaved_medians({"chunk": step("chunk"), "naive": step("naive")}, repeats)
    return seconds["chunk"], seconds["naive"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=1024, help="forward sequence length")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 8192])
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = {name: build(changes) for name, changes in VARIANTS.items()}
    params = {name: sum(p.numel() for p in model.parameters()) for name, model in models.items()}
    print(f"# {time.strftime('%Y-%m-%d')} | {platform.processor() or platform.machine()} | torch {torch.__version__} "
          f"| {args.threads} threads | preset tiny (d=128, 4 layers, attn 2/1 heads x 64, SSM 4 heads x 64, "
          f"d_state 32) | float32")

    print(f"\n## Forward, B={args.batch} T={args.length} (tokens/s, median of {args.repeats})\n")
    print("| model | params | tokens/s | vs hybrid (mamba2) |")
    print("|---|---|---|---|")
    rates = forward_throughput(models, batch=args.batch, length=args.length, repeats=args.repeats)
    base = rates["hybrid (mamba2)"]
    for name, rate in rates.items():
        print(f"| {name} | {params[name] / 1e6:.2f}M | {rate:,.0f} | {rate / base:.2f}x |", flush=True)

    print(f"\n## Decoding, batch 1 (ms per token, median of {args.decode_steps} steps after the prefill)\n")
    names = list(models)
    print("| context | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    seconds = decode_times(models, contexts=args.contexts, steps=args.decode_steps)
    for context in args.contexts:
        cells = [f"{seconds[name, context] * 1e3:.2f} ({seconds[name, context] / seconds[name, args.contexts[0]]:.2f}x)"
                 for name in names]
        print(f"| {context} | " + " | ".join(cells) + " |", flush=True)
    print("\n(x): time per token relative to the same model at the shortest context")

    chunk, naive = ssd_step_times(repeats=200)
    print(f"\n## One SSD decoding step (H=4 P=64 N=32): chunk {chunk * 1e6:.0f} us, recurrence {naive * 1e6:.0f} us, "
          f"chunk / recurrence {chunk / naive:.2f}x")


if __name__ == "__main__":
    main()
