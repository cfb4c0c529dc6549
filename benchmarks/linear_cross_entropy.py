"""The LM head's loss two ways, in one run: from the whole logits (`F.linear`, then `F.cross_entropy` on float32
logits) against `hybridlm.modules.linear_cross_entropy` (row chunks, no [N, V] logits kept).

    python benchmarks/linear_cross_entropy.py                       # CPU, float32, a short row
    python benchmarks/linear_cross_entropy.py --device cuda         # bf16 autocast, 4K and 16K tokens

Times forward + backward (median of `--repeats` after one warm-up; CUDA: synchronized) and, on CUDA, the peak memory
each adds over its inputs (`torch.cuda.max_memory_allocated`). The values are checked against each other first.
Prints a markdown table with the ratio chunked / logits.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from gpu_model import timed  # benchmarks/ is on the path when this script runs

from hybridlm.modules.linear_cross_entropy import linear_cross_entropy


def logits_loss(hidden, weight, targets):
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")


def chunked_loss(hidden, weight, targets):
    return linear_cross_entropy(hidden, weight, targets)


def measure(fn, hidden, weight, targets, *, device: torch.device, repeats: int) -> tuple[float, float | None]:
    """(median ms of forward + backward, peak MiB above the inputs or None off CUDA)."""
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step():
        with autocast:
            loss = fn(hidden, weight, targets)
        loss.backward()
        hidden.grad = weight.grad = None

    ms = timed(step, device, warmup=1, repeats=repeats) * 1e3
    peak = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return ms, peak


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, nargs="+", default=None, help="rows N (default: 1024 CPU, 4K 16K CUDA)")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    tokens = args.tokens or ([4096, 16384] if device.type == "cuda" else [1024])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    precision = "bf16 autocast, float32 weights" if device.type == "cuda" else "float32"
    print(f"# {time.strftime('%Y-%m-%d')} | {name} | torch {torch.__version__} | D={args.hidden} V={args.vocab} | "
          f"{precision}")
    print("| tokens | logits ms | chunked ms | chunked / logits | logits peak MiB | chunked peak MiB |")
    print("|---|---|---|---|---|---|")
    rows = []
    g = torch.Generator().manual_seed(0)
    for n in tokens:
        hidden = torch.randn(n, args.hidden, generator=g).to(device).requires_grad_(True)
        weight = (torch.randn(args.vocab, args.hidden, generator=g) / args.hidden**0.5).to(device).requires_grad_(True)
        targets = torch.randint(0, args.vocab, (n,), generator=g).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            a, b = logits_loss(hidden, weight, targets), chunked_loss(hidden, weight, targets)
        if not torch.allclose(a, b, rtol=1e-4, atol=1e-3):
            raise SystemExit(f"the two losses differ at {n} tokens: {a.item()} vs {b.item()}")
        (ms_a, peak_a), (ms_b, peak_b) = (measure(fn, hidden, weight, targets, device=device, repeats=args.repeats)
                                          for fn in (logits_loss, chunked_loss))
        row = {"tokens": n, "logits_ms": ms_a, "chunked_ms": ms_b, "logits_peak_mib": peak_a,
               "chunked_peak_mib": peak_b}
        rows.append(row)
        peaks = ("-", "-") if peak_a is None else (f"{peak_a:.0f}", f"{peak_b:.0f}")
        print(f"| {n} | {ms_a:.2f} | {ms_b:.2f} | {ms_b / ms_a:.2f}x | {peaks[0]} | {peaks[1]} |", flush=True)
    return rows


if __name__ == "__main__":
    main()
