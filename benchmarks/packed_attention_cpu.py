"""Packed-document attention without a varlen kernel (CPU, float32): the documents attended in groups of equal
(query, key) counts (`_grouped_attention`, what an eager call runs) against the block-diagonal mask over the whole
packed row (`_attention_mask` + SDPA, what a traced call runs), side by side in this process.

    python benchmarks/packed_attention_cpu.py                       # defaults below, a markdown table
    python benchmarks/packed_attention_cpu.py --docs 1 8 32 --length 256 --cached 0 256 --threads 1

Each row: N documents of `--length` queries each (a trainer's packed row when --cached is 0; a serving engine's
packed prefill of N requests' next pieces, each after `cached` keys, otherwise), heads 8 queries / 2 keys of 64
dims, forward (no grad) and forward + backward, median of `--repeats` after a warm-up. The ratio is grouped / mask.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from hybridlm.layers.attention import _attention_mask, _grouped_attention


def inputs(docs: int, length: int, cached: int, grad: bool):
    offsets = torch.arange(0, (docs + 1) * length, length)  # [N + 1]
    key_offsets = None if cached == 0 else torch.arange(0, (docs + 1) * (length + cached), length + cached)
    T, S = docs * length, docs * (length + cached)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, T, 8, 64, generator=g).requires_grad_(grad)
    k, v = (torch.randn(1, S, 2, 64, generator=g).requires_grad_(grad) for _ in range(2))
    return q, k, v, offsets, key_offsets


def grouped(q, k, v, offsets, key_offsets):
    return _grouped_attention(q, k, v, offsets, key_offsets, window=None, dropout=0.0, gqa=True)


def masked(q, k, v, offsets, key_offsets):
    T, S = q.shape[1], k.shape[1]
    mask, causal = _attention_mask(offsets, length=T, past=S - T, pad=None, device=q.device, key_offsets=key_offsets)
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                          is_causal=causal, enable_gqa=True).transpose(1, 2)[0]


def timed(fn, args, backward: bool, repeats: int) -> float:
    def once():
        if backward:
            fn(*args).sum().backward()
        else:
            with torch.no_grad():
                fn(*args)

    once()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--cached", type=int, nargs="+", default=[0, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"# {time.strftime('%Y-%m-%d')} | {platform.processor() or platform.machine()} | torch {torch.__version__} "
          f"| {torch.get_num_threads()} threads | float32, queries of {args.length} per document")
    print("| documents | cached keys each | pass | grouped ms | mask ms | grouped / mask |")
    print("|---|---|---|---|---|---|")
    for cached in args.cached:
        for docs in args.docs:
            for backward in (False, True):
                tensors = inputs(docs, args.length, cached, grad=backward)
                a = timed(grouped, tensors, backward, args.repeats)
                b = timed(masked, tensors, backward, args.repeats)
                print(f"| {docs} | {cached} | {'fwd+bwd' if backward else 'fwd'} | {1e3 * a:.1f} | {1e3 * b:.1f} | "
                      f"{a / b:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
