"""Whole models on one GPU: training tokens/s at long context, prefill time and per-token decoding vs context.

    python benchmarks/gpu_model.py       # ~125M shape: training at T 4096 16384, decoding 4K-128K at batch 1 and 32
    python benchmarks/gpu_model.py --rounds 3 --contexts --variants transformer "h1 fw-1A"   # training only, A B A B
    python benchmarks/gpu_model.py --lengths 4096 --contexts 1024 8192 32768 --json out.json
    python benchmarks/gpu_model.py --cpu --preset tiny --lengths 256 --contexts 128 512   # smoke run
    python benchmarks/gpu_model.py --lengths --contexts 4096 --profile-decode               # where a step's time goes
    python benchmarks/gpu_model.py --compile --contexts 4096                                 # training through inductor
    python benchmarks/gpu_model.py --compile reduce-overhead --train-rows 4 --contexts       # + CUDA graphs, 4 rows
    python benchmarks/gpu_model.py --compile reduce-overhead --train-rows 8 --lengths 2048 --documents 4 --contexts
                                                                  # packed documents, as `hybridlm train` runs them

Variants of one shape (`configs/hybrid-125m.yaml`'s model: d 768, 12 blocks, 12 query / 4 KV heads, SSM 1024
channels = 16 heads x 64; or `--preset`), each measured in this one process:
    transformer        attention + MLP (ssm_mixer "none")
    hybrid mamba2      Falcon-H1 block: attention and Mamba-2 side by side (SSD Triton kernels on CUDA, "auto")
    hybrid mamba2-chunk    the same with the SSD torch chunk path (`Mamba2Mixer.backend = "chunk"`)
    hybrid fw-1A       attention and Falcon-1A (Triton on CUDA, "auto")
    hybrid fw-3A       attention and Falcon-3A, window 3
    fw-1A              Falcon-1A alone (no attention)
and, sized against each other (to compare a hybrid with a same-size Transformer; the hybrids above keep all
the Transformer's attention and MLP and add the SSM half: 143-159M parameters against its 112M):
    h1 fw-1A           Falcon-H1's channel allocation of the shape's width (SSM : attention : MLP = 2 : 1 : 5,
                       `channel_allocation`) with a Falcon-1A SSM half (144M at the 125m shape)
    h1 mamba2          the same allocation with Mamba-2 (134M); h1 mamba2-chunk on the SSD torch chunk path
    h1 swa fw-1A       "h1 fw-1A" with sliding-window attention (`attention_window`, `--window`, default 2048): its
                       decoding cache stays at 2W - 1 key slots per layer at any context, so its memory per sequence is
                       constant (the long-context target; the Falcon-H1 hybrid keeps every key); "hybrid swa fw-1A"
                       the same for "hybrid fw-1A"
    transformer matched  the Transformer with its MLP widened to "h1 fw-1A"'s parameter count (144M): the baseline
                       of the two "h1" rows' ratio column (the others' is "transformer"; h1 mamba2 is the smaller
                       of the two by 10M, measured against the same 144M baseline)
1. Training: a full update (forward, backward, AdamW; bf16 autocast, fp32 master weights) on `--train-rows` rows
   (default 1) of T tokens:
   tokens/s and peak memory, and the ratio to the transformer's tokens/s at the same T. `--compile` runs the
   training forward through `torch.compile` (inductor; `--compile reduce-overhead` also replays the forward and
   backward as CUDA graphs, which the hybrids need at 4K: their compiled update is host-bound without them; the
   compiled update is warmed up before timing), every variant alike.
   `--rounds R` measures every training row R times with the variants interleaved (A B A B ...: a shared host's
   drift lands on baseline and variant alike) and reports the median tokens/s and the median of the per-round
   ratios with their range. The SSM mixers recompute as `parallel.recompute_mixers` says (`--recompute-mixers`,
   default the library's "fast_weight": the fast-weight mixers recompute, Mamba-2's keep their activations).
   `--kept-mixers` also trains each variant with SSM mixers with none recomputing (`parallel.recompute_mixers=none`:
   they keep their conv output, QK norms and write events for the backward), as "<variant> (kept)" beside it in
   every round: the memory the recomputation saves and the time it costs.
   `--documents D` packs the rows into one row of rows x T tokens with `cu_seqlens` (each row cut into D documents
   at fixed random places, the same for every variant), as the trainer runs `data.document_boundaries`; compiled,
   each block compiles on its own, as in the trainer (`HybridBlock`'s packed-document paths), with a CUDA-graph
   step begun before each forward under reduce-overhead.
2. Prefill (no grad, with a decoding cache) of C tokens in each of `--decode-batches` rows, in pieces of at most
   `--prefill-tokens` tokens in all (`hybridlm.inference.prefill`, as `generate(prefill_chunk=...)`: 32 rows of 64K
   tokens at once ran out of the H200's memory), and the median time of one decoding step after it: decode tokens/s
   (rows / step time), its ratio to the Transformer's at the same context and batch, and the cache's size per row
   (keys / values and SSM states: a pure SSM's stays constant, a Falcon-H1 hybrid keeps attention in every block,
   so its KV cache grows with the context).
   `--graph` times the steps of `GraphedDecoder` instead (one replayed CUDA graph per token; the static cache
   attends over all its slots, here context + decode steps); `--compile-decode` captures the step compiled by
   inductor (fused kernels: fewer per replay; aot_eager on the CPU, which only checks the path).
   `--torch-steps` also decodes each variant with SSM mixers with its mixers' single steps on their torch loops
   (`FastWeightMixer.backend = "recurrent"`, `Mamba2Mixer.backend = "naive"`, `ShortConvolution.backend = "torch"`
   after the prefill) instead of the one-kernel steps "auto" takes on CUDA, as "<variant> (torch steps)": what the
   step kernels save per token. The fast-weight mixer's QK norms follow its backend: those rows also run them on
   torch's `rms_norm` (float32 math: a fused norm and the casts around it) instead of their Triton kernels.
   `--concurrent-mixers` also decodes each variant with parallel blocks of both mixers with their SSM half on a
   second stream beside attention (`concurrent_mixers`, as serve / generate / chat load a model on CUDA), as
   "<variant> (concurrent)" right after the same variant one stream only.
   `--decode-dtype bfloat16` decodes a bf16 copy of each model instead (the weights cast once, no autocast: what
   `hybridlm serve --dtype bfloat16` runs); under autocast every step casts the float32 weights it multiplies.
3. `--profile-decode`: `torch.profiler` over 3 decoding steps at the first context, per variant: the operators with
   the most device (or CPU) time and the number of kernel launches, to tell per-step overhead from the math;
   `--profile-train` the same for one training update per variant and length.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch
from gpu_ops import kernel_launches  # benchmarks/ is on the path when this script runs

from hybridlm.inference import GraphedDecoder, prefill
from hybridlm.layers.block import RECOMPUTE_MIXERS, set_mixers_recompute
from hybridlm.layers.fast_weight import FastWeightMixer
from hybridlm.layers.mamba2 import Mamba2Mixer
from hybridlm.models.allocation import channel_allocation
from hybridlm.models.fold import fold_multipliers
from hybridlm.models.fuse import fuse_projections, set_concurrent_mixers
from hybridlm.models.model import HybridForCausalLM
from hybridlm.models.presets import get_preset
from hybridlm.modules import ShortConvolution

SHAPE_125M = dict(vocab_size=32768, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                  num_key_value_heads=4, head_dim=64, mamba_d_ssm=1024, mamba_n_heads=16, mamba_d_head=64,
                  mamba_d_state=64, mamba_n_groups=2, mamba_chunk_size=128, intermediate_size=1536,
                  max_position_embeddings=131072)
VARIANTS = {
    "transformer": dict(ssm_mixer="none"),
    "hybrid mamba2": dict(),
    "hybrid mamba2-chunk": dict(),
    "hybrid fw-1A": dict(ssm_mixer="fast_weight", fw_rule="1A"),
    "hybrid fw-3A": dict(ssm_mixer="fast_weight", fw_rule="3A", fw_window=3),
    "fw-1A": dict(ssm_mixer="fast_weight", fw_rule="1A", use_attention=False),
    "h1 fw-1A": dict(ssm_mixer="fast_weight", fw_rule="1A"),
    "h1 mamba2": dict(),
    "h1 mamba2-chunk": dict(),
    "h1 swa fw-1A": dict(ssm_mixer="fast_weight", fw_rule="1A", attention_window=None),  # --window fills it in
    "hybrid swa fw-1A": dict(ssm_mixer="fast_weight", fw_rule="1A", attention_window=None),
    "transformer matched": dict(ssm_mixer="none"),
}
# Variants whose Mamba-2 mixers run another SSD backend than "auto"'s (the Triton kernels on CUDA).
SSD_BACKEND = {"hybrid mamba2-chunk": "chunk", "h1 mamba2-chunk": "chunk"}
FALCON_H1_ALLOCATION = dict(alpha_S=2 / 8, alpha_A=1 / 8, alpha_M=5 / 8)  # the report's SA_M optimum (Figure 2)
BASELINE = {name: "transformer matched" for name in VARIANTS if name.startswith("h1 ")}  # default: "transformer"


def config_of(preset: str, variant: str, *, window: int = 2048):
    """The HybridConfig of `variant` at `preset` (module docstring); `window`: the "swa" variants' attention window."""
    base = SHAPE_125M if preset == "125m" else {}
    fields = {**base, **VARIANTS[variant]}
    if "attention_window" in fields:
        fields["attention_window"] = window

    def config(**changes):
        return get_preset("tiny" if preset == "125m" else preset, **{**fields, **changes})

    if variant.startswith("h1 "):
        shape = config()
        return config(**channel_allocation(hidden_size=shape.hidden_size, num_key_value_heads=shape.num_key_value_heads,
                                           head_dim=shape.head_dim, mamba_d_head=shape.mamba_d_head,
                                           **FALCON_H1_ALLOCATION))
    if variant == "transformer matched":  # parameters grow linearly with the MLP width: two points give the width
        target = parameters(config_of(preset, "h1 fw-1A"))
        narrow, wide = (parameters(config(intermediate_size=width)) for width in (64, 128))
        width = 64 + round((target - narrow) / (wide - narrow)) * 64
        return config(intermediate_size=max(64, width))
    return config()


def parameters(config) -> int:
    """The parameter count of a model of `config` (built on the meta device: no memory, no initialization)."""
    with torch.device("meta"):
        return sum(p.numel() for p in HybridForCausalLM(config).parameters())


def build(preset: str, variant: str, device: torch.device, *, window: int = 2048,
          conv_backend: str = "auto") -> HybridForCausalLM:
    config = config_of(preset, variant, window=window)
    torch.manual_seed(0)
    model = HybridForCausalLM(config).to(device)
    for module in model.modules():
        if isinstance(module, Mamba2Mixer) and variant in SSD_BACKEND:
            module.backend = SSD_BACKEND[variant]
        if isinstance(module, ShortConvolution):
            module.backend = conv_backend
    return model


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: torch.device, *, warmup: int, repeats: int) -> float:
    """Median seconds of `fn()` after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def profiled(fn, device: torch.device, *, steps: int, rows: int = 12) -> str:
    """A profiler table of `steps` calls of `fn` (operators by self device time on CUDA, self CPU time on the CPU),
    with the count of kernel launches per call."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        sync(device)
    events = prof.key_averages()
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return f"kernel launches per call: {kernel_launches(events) / steps:.0f}\n" + events.table(sort_by=sort,
                                                                                            row_limit=rows)


def packed_documents(rows: int, length: int, documents: int) -> torch.Tensor:
    """cu_seqlens [rows x documents + 1] (host) of `rows` rows of `length` tokens, each cut into `documents` pieces
    at fixed random places (seed 0: every variant trains on the same layout)."""
    g = torch.Generator().manual_seed(0)
    offsets = [0]
    for row in range(rows):
        cuts = torch.randperm(length - 1, generator=g)[: documents - 1].add(1).sort().values.tolist()
        offsets += [row * length + c for c in cuts] + [(row + 1) * length]
    return torch.tensor(offsets)


def training(model, *, length: int, device: torch.device, repeats: int, rows: int = 1, compile: str | None = None,
             documents: int = 1, profile_label: str | None = None, logits: bool = False) -> dict:
    """Tokens/s and peak memory of one update on `rows` rows of `length` tokens, the forward through torch.compile
    in mode `compile` ("default", "reduce-overhead": also CUDA graphs; None: eager); `documents` > 1: the rows packed
    into one row of documents (`packed_documents`), each block compiled on its own; with `profile_label`, also print
    a `profiled` table of one more update under that name. The loss as `hybridlm train` computes it (the LM head and
    cross entropy over row chunks, no logits held), or with `logits` from the [B, T, V] logits."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    ids = torch.randint(0, model.config.vocab_size, (rows, length), device=device)
    packed = {}
    if documents > 1:
        ids = ids.reshape(1, rows * length)
        packed = {"cu_seqlens": packed_documents(rows, length, documents)}
    options = {"mode": compile} if device.type == "cuda" else {"backend": "aot_eager"}
    blocks = model.model.layers
    graph_steps = compile == "reduce-overhead" and documents > 1 and device.type == "cuda"

    def update():
        if graph_steps:  # the blocks' graphs: a new step, the previous update's outputs are used up
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = forward(ids, labels=ids, return_logits=logits, **packed).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        forward = model
        if compile is not None:
            torch._dynamo.reset()  # each variant and length its own graphs, well under the recompile limit
            if documents > 1:
                model.model.layers = torch.nn.ModuleList(torch.compile(block, **options) for block in blocks)
            else:
                forward = torch.compile(model, **options)
        seconds = timed(update, device, warmup=2, repeats=repeats)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
        if profile_label is not None:
            print(f"\n### training profile: {profile_label}, {rows} x T={length}\n"
                  + profiled(update, device, steps=1, rows=30), flush=True)
    finally:
        model.model.layers = blocks  # decoding runs the blocks themselves
        if compile is not None:
            torch._dynamo.reset()  # frees the CUDA-graph pools of reduce-overhead before decoding runs
    return {"tokens_per_s": rows * length / seconds, "peak_gib": peak}


@torch.no_grad()
def profile_decoding(model, *, context: int, device: torch.device, rows: int = 12, torch_loops: bool = False,
                     autocast: bool = True) -> str:
    """`profiled` over 3 decoding steps after a prefill of `context` tokens (`torch_loops`: through `torch_steps`;
    `autocast`: under bf16 autocast on CUDA, else in the model's dtype)."""
    model.eval()
    ids = torch.randint(0, model.config.vocab_size, (1, context), device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast and device.type == "cuda"):
        cache = model(ids, cache=model.new_cache()).cache
        with torch_steps(model, torch_loops):
            model(ids[:, -1:], cache=cache)  # one step outside the profile (first-call work)
            table = profiled(lambda: model(ids[:, -1:], cache=cache), device, steps=3, rows=rows)
    model.train()
    return table


@contextlib.contextmanager
def torch_steps(model, enabled: bool = True):
    """Within: the SSM mixers' single decoding steps on their torch loops (the step loop vectorized over rows, the
    naive SSD step, the short convs' torch form) instead of the one-kernel steps; their backends restored after."""
    loops = {FastWeightMixer: "recurrent", Mamba2Mixer: "naive", ShortConvolution: "torch"}
    modules = [m for m in model.modules() if type(m) in loops] if enabled else []
    saved = [m.backend for m in modules]
    for m in modules:
        m.backend = loops[type(m)]
    try:
        yield
    finally:
        for m, backend in zip(modules, saved):
            m.backend = backend


@torch.no_grad()
def decoding(model, *, context: int, device: torch.device, steps: int, batch: int = 1, graph: bool = False,
             compile_step: str | None = None, prefill_tokens: int = 1 << 18, torch_loops: bool = False,
             autocast: bool = True) -> dict:
    """Prefill time, decoding step time (median) and cache size per row; `torch_loops`: the steps through
    `torch_steps`; `autocast`: under bf16 autocast on CUDA, else in the model's dtype."""
    model.eval()
    ids = torch.randint(0, model.config.vocab_size, (batch, context), device=device)
    piece = max(1, prefill_tokens // batch)  # tokens per row in one prefill call
    token = ids[:, -1:]
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast and device.type == "cuda"):
        # first-call work (kernel compilation, library set-up) not timed; logits of the last position only
        prefill(model, ids[:, :2 * piece], chunk=piece)  # a first piece and a continuation
        sync(device)
        start = time.perf_counter()
        cache, _ = prefill(model, ids, chunk=piece)
        sync(device)
        prefill_s = time.perf_counter() - start
        with torch_steps(model, torch_loops):
            if graph:  # the first step captures the graph
                if compile_step is not None:
                    torch._dynamo.reset()  # each measurement compiles its own step for its shapes (static)
                decoder = GraphedDecoder(model, cache, capacity=context + steps, batch_size=batch,
                                         compile_step=compile_step)
                cache = decoder.cache
                step = lambda: decoder.step(token[:, 0])
            else:
                step = lambda: model(token, cache=cache, logits_to_keep=1)
            # the first step (the graph's capture, first-call work) left out when there are others
            decode_s = timed(step, device, warmup=1 if steps > 1 else 0, repeats=max(1, steps - 1))
    model.train()
    state_bytes = sum(layer.state_bytes() for layer in cache.layers)
    return {"prefill_s": prefill_s, "decode_ms": 1e3 * decode_s, "tokens_per_s": batch / decode_s,
            "cache_mib_per_row": state_bytes / batch / 2**20,
            "weights": str(next(model.parameters()).dtype).removeprefix("torch.")}


def print_training_table(rows: list[dict]) -> None:
    """The training table: per variant and T the median tokens/s over the rounds, and the median (and range) of the
    per-round ratios to the baseline measured in the same round; the peak memory over the rounds, and its ratio to
    the baseline's."""
    by_key: dict[tuple[str, int], dict[int, dict]] = {}
    for r in rows:
        by_key.setdefault((r["variant"], r["T"]), {})[r["round"]] = r
    print("\n| model | params | rows x T | tokens/s | / baseline | rounds | peak GiB | peak / baseline |\n"
          "|---|---|---|---|---|---|---|---|")
    for (variant, length), rounds in by_key.items():
        first = next(iter(rounds.values()))
        shape = f"{first['rows']} x {length}" + (f" ({first['documents']} documents per row)"
                                                 if first["documents"] > 1 else "")
        measured = [r["tokens_per_s"] for r in rounds.values() if r["tokens_per_s"]]
        if not measured:
            print(f"| {variant} | {first['params'] / 1e6:.0f}M | {shape} | OOM | - | {len(rounds)} | - | - |")
            continue
        base_rounds = by_key.get((first.get("baseline", BASELINE.get(variant, "transformer")), length), {})
        ratios = [r["tokens_per_s"] / base_rounds[k]["tokens_per_s"] for k, r in rounds.items()
                  if r["tokens_per_s"] and base_rounds.get(k, {}).get("tokens_per_s")]
        ratio = "-"
        if ratios:
            ratio = f"{statistics.median(ratios):.2f}x"
            if len(ratios) > 1:
                ratio += f" ({min(ratios):.2f}-{max(ratios):.2f})"
        peaks = [r["peak_gib"] for r in rounds.values() if r.get("peak_gib")]
        base_peaks = [r["peak_gib"] for r in base_rounds.values() if r.get("peak_gib")]
        peak = f"{max(peaks):.2f}" if peaks else "-"
        peak_ratio = f"{max(peaks) / max(base_peaks):.3f}x" if peaks and base_peaks else "-"
        print(f"| {variant} | {first['params'] / 1e6:.0f}M | {shape} | {statistics.median(measured):.0f} | {ratio} "
              f"| {len(rounds)} | {peak} | {peak_ratio} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="125m", help="'125m' (the shape above) or any preset name")
    parser.add_argument("--lengths", type=int, nargs="*", default=[4096, 16384], help="training tokens per row")
    parser.add_argument("--contexts", type=int, nargs="*", default=[4096, 16384, 65536, 131072],
                        help="decoding contexts (none: no decoding); the default is the long-context grid")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--train-rows", type=int, default=1, help="rows of T tokens per training update")
    parser.add_argument("--window", type=int, default=2048, help="the attention window of the 'swa' variants")
    parser.add_argument("--documents", type=int, default=1,
                        help="documents per row, packed into one row with cu_seqlens (1: plain rows)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure training this many times, the variants interleaved (A B A B ...)")
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[1, 32], help="rows decoded together")
    parser.add_argument("--prefill-tokens", type=int, default=1 << 18,
                        help="tokens (all rows together) per prefill call; longer prompts are prefilled in pieces")
    parser.add_argument("--profile-decode", action="store_true", help="print a profile of decoding steps per variant")
    parser.add_argument("--profile-train", action="store_true", help="print a profile of one update per variant and T")
    parser.add_argument("--compile", nargs="?", const="default", default=None,
                        choices=["default", "reduce-overhead", "max-autotune-no-cudagraphs"],
                        help="train through torch.compile (every variant) in this mode (default 'default'; "
                             "'reduce-overhead' adds CUDA graphs)")
    parser.add_argument("--graph", action="store_true", help="decode through GraphedDecoder (a CUDA graph per step)")
    parser.add_argument("--compile-decode", action="store_true",
                        help="with --graph: capture the step compiled by torch.compile (inductor)")
    parser.add_argument("--conv-backend", default="auto", choices=["auto", "torch", "triton"],
                        help="the short convolutions' backend (`causal_conv1d`) in every variant")
    parser.add_argument("--logits-loss", action="store_true",
                        help="train on the loss computed from the whole logits, not the chunked one `hybridlm train` "
                             "uses")
    parser.add_argument("--recompute-mixers", default="fast_weight", choices=RECOMPUTE_MIXERS,
                        help="which SSM mixers recompute what feeds their scans (`parallel.recompute_mixers`)")
    parser.add_argument("--kept-mixers", action="store_true",
                        help="also train every variant with SSM mixers with none recomputing (the mixers keep their "
                             "conv output, norms and write events: `parallel.recompute_mixers=none`), as "
                             "'<variant> (kept)' in the same rounds")
    parser.add_argument("--decode-dtype", default="autocast", choices=["autocast", "bfloat16"],
                        help="decode under bf16 autocast (float32 weights), or a bf16 copy of each model (no autocast)")
    parser.add_argument("--torch-steps", action="store_true",
                        help="also decode every variant with SSM mixers with their single steps on the torch loops "
                             "instead of the step kernels, as '<variant> (torch steps)'")
    parser.add_argument("--fold-multipliers", action="store_true",
                        help="decode with each model's muP multipliers folded into its weights (`fold_multipliers`, "
                             "as serve / generate / chat load a model); a preset like falcon-h1-0.5b has them")
    parser.add_argument("--fuse-projections", action="store_true",
                        help="decode with the projections that read one input fused into one GEMM each "
                             "(`fuse_projections`, as serve / generate / chat load a model)")
    parser.add_argument("--concurrent-mixers", action="store_true",
                        help="also decode with each parallel block's SSM half on a second stream beside attention "
                             "(`set_concurrent_mixers`, as serve / generate / chat load a model on CUDA)")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (a smoke run of this script)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.train_rows < 1:
        parser.error(f"--train-rows must be >= 1 (got {args.train_rows})")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1 (got {args.rounds})")
    if args.documents < 1 or any(args.documents > length for length in args.lengths):
        parser.error(f"--documents must be between 1 and the shortest --lengths (got {args.documents})")
    if args.compile_decode and not args.graph:
        parser.error("--compile-decode compiles the step of --graph's decoder: add --graph")
    device = torch.device("cpu" if args.cpu else "cuda")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"{name} · torch {torch.__version__} · preset {args.preset} · bf16 autocast on CUDA"
          + (" · decoding a bf16 copy of each model" if args.decode_dtype == "bfloat16" else "")
          + (f" · training through torch.compile ({args.compile})" if args.compile else "")
          + (" · decoding through CUDA graphs" if args.graph else "")
          + (" of the compiled step" if args.graph and args.compile_decode else "")
          + f" · short conv backend {args.conv_backend}"
          + (" · decoding with the muP multipliers folded" if args.fold_multipliers else "")
          + (" · decoding with the projections fused" if args.fuse_projections else ""))
    compile_step = ("inductor" if device.type == "cuda" else "aot_eager") if args.compile_decode else None
    rows: list[dict] = []

    def record(row: dict) -> None:
        """Keep `row` and say it at once (and rewrite --json), so a run cut short still shows what it measured."""
        rows.append(row)
        shown = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items() if k != "params"}
        print("measured " + " ".join(f"{k}={v}" for k, v in shown.items()), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": name, "preset": args.preset, "rows": rows}, f, indent=1)

    models = {variant: build(args.preset, variant, device, window=args.window, conv_backend=args.conv_backend)
              for variant in args.variants}
    params = {variant: sum(p.numel() for p in model.parameters()) for variant, model in models.items()}
    for round_ in range(args.rounds):
        for variant, model in models.items():
            mixers = set_mixers_recompute(model, args.recompute_mixers)
            settings = [args.recompute_mixers] + (["none"] if args.kept_mixers and mixers else [])
            for kept, recompute in enumerate(settings):
                set_mixers_recompute(model, recompute)
                label = f"{variant} (kept)" if kept else variant
                for length in args.lengths:
                    row = {"variant": label, "baseline": BASELINE.get(variant, "transformer"),
                           "params": params[variant], "T": length, "rows": args.train_rows,
                           "documents": args.documents, "round": round_}
                    try:
                        record({**row, **training(model, length=length, device=device, repeats=args.repeats,
                                                  rows=args.train_rows, compile=args.compile,
                                                  documents=args.documents, logits=args.logits_loss,
                                                  profile_label=label if args.profile_train and round_ == 0 else None)})
                    except torch.OutOfMemoryError:
                        record({**row, "tokens_per_s": None})
                    model.zero_grad(set_to_none=True)  # the other variants' turns need the memory
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            set_mixers_recompute(model, args.recompute_mixers)
    for variant in args.variants:
        model = models.pop(variant)
        has_mixers = any(isinstance(m, (FastWeightMixer, Mamba2Mixer)) for m in model.modules())
        autocast = args.decode_dtype == "autocast"
        if args.fold_multipliers:
            fold_multipliers(model)  # training is done: the model serves decoding alone from here
        if not autocast:
            model.to(torch.bfloat16)
        if args.fuse_projections:
            fuse_projections(model)  # after the cast: `.to()` gives the fused parts their own storage again
        concurrent = [False] + ([True] if args.concurrent_mixers and set_concurrent_mixers(model, False) else [])
        for context in args.contexts:
            for batch in args.decode_batches:
                for loops, side in [(False, side) for side in concurrent] + (
                        [(True, False)] if args.torch_steps and has_mixers else []):
                    set_concurrent_mixers(model, side)
                    try:
                        measured = decoding(model, context=context, device=device, steps=args.decode_steps,
                                            batch=batch, graph=args.graph, compile_step=compile_step,
                                            prefill_tokens=args.prefill_tokens, torch_loops=loops, autocast=autocast)
                    except torch.OutOfMemoryError:
                        measured = {"prefill_s": None, "decode_ms": None, "tokens_per_s": None,
                                    "cache_mib_per_row": None}
                    label = f"{variant} (torch steps)" if loops else f"{variant} (concurrent)" if side else variant
                    record({"variant": label, "baseline": BASELINE.get(variant, "transformer"), "context": context,
                            "batch": batch, **measured})
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
        if args.profile_decode and args.contexts:
            for loops in [False] + ([True] if args.torch_steps and has_mixers else []):
                label = f"{variant} (torch steps)" if loops else variant
                print(f"\n### decoding profile: {label}, context {args.contexts[0]}\n"
                      + profile_decoding(model, context=args.contexts[0], device=device, torch_loops=loops,
                                         autocast=autocast),
                      flush=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print_training_table([r for r in rows if "T" in r])
    decode = {(r["variant"], r["context"], r["batch"]): r for r in rows if "context" in r}
    print("\n| model | context | batch | prefill s | decode ms/step | decode tokens/s | / baseline | "
          "cache MiB/row |\n|---|---|---|---|---|---|---|---|")
    for (variant, context, batch), r in decode.items():
        if r["decode_ms"] is None:
            print(f"| {variant} | {context} | {batch} | OOM | - | - | - | - |")
            continue
        base = decode.get((r["baseline"], context, batch), {}).get("tokens_per_s")
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        print(f"| {variant} | {context} | {batch} | {r['prefill_s']:.3f} | {r['decode_ms']:.2f} | "
              f"{r['tokens_per_s']:.0f} | {ratio} | {r['cache_mib_per_row']:.1f} |")


if __name__ == "__main__":
    main()
