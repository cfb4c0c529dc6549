"""GPU timing of the fast-weight rules: the Triton kernels vs the torch chunk path vs causal SDPA, in one run.

    python benchmarks/gpu_fast_weight_triton.py                          # 1A, B=8 H=16 D=128 bf16, T 2048 4096 16384
    python benchmarks/gpu_fast_weight_triton.py --rules 1A 3A --T 2048 4096
    python benchmarks/gpu_fast_weight_triton.py --rules 1A 3A --T 4096 16384 --triton-only --cuda-graph  # A/B of trees
    python benchmarks/gpu_fast_weight_triton.py --rules 2A 3 2 --T 4096 16384   # rules that "auto" sends to chunk

First checks the Triton backend against the chunk backend at one shape for each rule (float32 and bf16; outputs,
final state and every gradient) and stops if they disagree. Then times (median of `triton.testing.do_bench`)
forward and forward+backward of:
- SDPA: causal `F.scaled_dot_product_attention` on the same q, k, v (flash / cuDNN backend);
- chunk: `fast_weight_attention(..., backend="chunk")` (the torch chunk path; window 3 for 3A and 3); with
  `--compiled-chunk` also the same under `torch.compile` (inductor; compiling per shape takes minutes);
- triton: the same op through the Triton backend (raw q, k, v, beta, lam -> prepared writes -> kernels);
  with `--compiled-triton` also the same under `torch.compile` (inductor fuses the torch preparation around the
  kernels' custom ops, as it does in a compiled model: rule 3A's windows, statistic, steps and band coefficients);
- kernels (1A): `fast_weight_1a_triton` alone on prepared writes (the kernels without the preparation);
- torch preparation (1A, 1, 3A): the triton op again with `fused_preparation=False` (the write events from chunk.py's
  torch `prepare_writes` instead of the fused Triton kernel);
- fixed scan blocks (1A, 3A): the triton op again with `inner_product.SCAN_MIN_PROGRAMS` = 0 (the state scan's fixed
  [64, 32] blocks; by default they narrow when fewer than 264 programs would cover the rows x heads, which "triton"
  times). Only timed where the blocks narrow, i.e. not at the default shape: compare at a model's shape, e.g.
  `--B 1 --H 10 --D 64`.
- chunk-parallel (1A, 3A): the triton op again with `inner_product.WALK_MIN_PROGRAMS` out of reach (the
  chunk-parallel forward instead of the whole-state walk); only timed where the walk is taken.
`--documents D` times packed documents instead (D per row, equal lengths), forward + backward of the triton op: the
documents restarted in place (`seq_idx`, the rows' shapes, what a compiled model runs) against the same documents
through `cu_seqlens` (the rows laid end to end, then padded per document by the backend). It skips the main table,
whose rule-1 rows alone take minutes.
`--pass-configs` times rule 1's triton op instead under other launches of its two sequential passes
(`regression.PassLaunch`: value columns per program, warps and pipeline stages; `PASS_CONFIGS` below), each checked
against the launch the op picks (`regression.pass_launch`) first, with the ratio to it.
`--walk-configs` times rule 1A's triton op instead with and without its whole-state forward walk, and the walk at
other warps (`WALK_CONFIGS` below), each checked against the chunk-parallel form first.
`--profile` then prints, per rule at the longest T, the kernels of one forward + backward of the triton op with their
GPU time (torch.profiler): which stage to work on. Prints a markdown table with the ratios triton / SDPA and
chunk / triton, and what the triton op's time means against
the H200's measured ceilings (`roofline.py`: matmul TFLOP/s and the unavoidable bytes' TB/s, with the fractions
of 716 TFLOP/s and 4.3 TB/s).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import time

import torch
import torch.nn.functional as F
from gpu_ops import (  # benchmarks/ is on the path when this script runs
    add_timing_args,
    bench,
    causal_sdpa,
    rel_err,
    set_timing,
)
from roofline import fast_weight_counts, utilization

from hybridlm.ops import FastWeightState, fast_weight_attention
from hybridlm.ops.fast_weight import FastWeightOptions
from hybridlm.ops.fast_weight.triton import (
    backend,
    fast_weight_1a_triton,
    fast_weight_triton,
    inner_product,
    regression,
)

WINDOW = {"1A": 1, "3A": 3, "1": 1, "2A": 1, "3": 3, "2": 1}
PER_COLUMN = ("2A", "2")  # step sizes per value column: beta [B, T, H, V]
PREPARED_RULES = (*backend.FUSED_RULES, "3A")  # the rules with a fused Triton preparation at these windows
# Launches of rule 1's passes (`regression.PassLaunch`: value columns per program, (warps, stages) of the forward pass
# and of the reverse pass) timed against what `regression.pass_launch` picks for the shape ("default"): both of its
# launches, the ones that spill least at 8 warps x 1 stage (benchmarks/ptxas_spills.py), two programs per SM at 4
# warps, and wider value blocks.
PASS_CONFIGS = {
    "default": None,
    "narrow": regression.NARROW_PASSES,
    "wide": regression.WIDE_PASSES,
    "BV32 8w1s": regression.PassLaunch(32, (8, 1), (8, 1)),
    "BV64 8w1s": regression.PassLaunch(64, (8, 1), (8, 1)),
    "BV32 4w1s": regression.PassLaunch(32, (4, 1), (4, 1)),
    "BV64 4w1s / 8w1s": regression.PassLaunch(64, (4, 1), (8, 1)),
    "BV128 8w1s": regression.PassLaunch(128, (8, 1), (8, 1)),
}

# Rule 1A's whole-state forward walk (`inner_product` settings) against the chunk-parallel forward (the baseline):
# the default, and the walk at other warps.
WALK_CONFIGS = {
    "chunk-parallel": {"WALK_MIN_PROGRAMS": 10**9},
    "default": {},
    "walk, 4 warps": {"WALK_WARPS": 4},
    "walk, 16 warps": {"WALK_WARPS": 16},
}


def run_triton(q, k, v, beta, lam, *, rule, chunk_size, initial_state=None, output_final_state=False,
               fused_preparation=True):
    """The rule through the Triton backend with the op's defaults (what backend="triton" will run)."""
    B, _, H, K = q.shape
    state = initial_state or FastWeightState(S=q.new_zeros(B, H, K, v.shape[-1], dtype=torch.float32))
    options = FastWeightOptions(rule=rule, window=WINDOW[rule], chunk_size=chunk_size)
    return fast_weight_triton(q, k, v, beta, lam, options, initial_state=state, offsets=None,
                              fused_preparation=fused_preparation, final_state=output_final_state)


def run_chunk(q, k, v, beta, lam, *, rule, chunk_size, initial_state=None, output_final_state=False):
    return fast_weight_attention(q, k, v, beta, lam, rule=rule, window=WINDOW[rule], backend="chunk",
                                 chunk_size=chunk_size, initial_state=initial_state,
                                 output_final_state=output_final_state)


def make_inputs(B, T, H, D, dtype, *, rule="1A", seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, D, device="cuda", generator=g) for _ in range(3))
    k = F.normalize(k, dim=-1)
    beta = 1.9 * torch.rand(B, T, H, *([D] if rule in PER_COLUMN else []), device="cuda", generator=g)
    lam = 0.1 * torch.rand(B, T, H, device="cuda", generator=g)
    return [t.to(dtype).requires_grad_(True) for t in (q, k, v, beta, lam)]


@contextlib.contextmanager
def module_settings(module, **settings):
    """Module settings (`inner_product.SCAN_MIN_PROGRAMS`, `WALK_MIN_PROGRAMS`) changed for the block, then put back."""
    previous = {name: getattr(module, name) for name in settings}
    try:
        for name, value in settings.items():
            setattr(module, name, value)
        yield
    finally:
        for name, value in previous.items():
            setattr(module, name, value)


def check(rule, *, B=2, T=1000, H=4, D=128, chunk_size=64) -> None:
    """Triton vs chunk backend: float32 (< 1e-4) and bf16 against the float32 chunk path (< 2e-2), with the fused
    preparation and (rules 1A, 1) with the torch one. Stops the run when the op disagrees."""
    W = WINDOW[rule]
    ref_in = make_inputs(B, T, H, D, torch.float32, rule=rule)
    state = FastWeightState(S=0.3 * torch.randn(B, H, D, D, device="cuda"), last_k=torch.randn(B, H, D, device="cuda"))
    if W > 1:
        state.tail_x = torch.randn(B, H, W - 1, D, device="cuda")
        state.tail_v = torch.randn(B, H, W - 1, D, device="cuda")
        state.tail_len = torch.tensor([W - 1, 1][:B], device="cuda")
    state.S.requires_grad_(True)
    o_ref, s_ref = run_chunk(*ref_in, rule=rule, chunk_size=chunk_size, initial_state=state, output_final_state=True)
    w_o, w_s = torch.randn_like(o_ref), torch.randn_like(s_ref.S)
    g_ref = torch.autograd.grad((o_ref * w_o).sum() + (s_ref.S * w_s).sum(), ref_in + [state.S])
    variants = [("", True)]  # (label, fused_preparation)
    if rule in PREPARED_RULES:
        variants = [("", False), (" fused preparation", True)]
    cases = list(itertools.product(((torch.float32, 1e-4), (torch.bfloat16, 2e-2)), variants))
    for (dtype, tol), (variant, fused) in cases:
        ins = [t.detach().to(dtype).requires_grad_(True) for t in ref_in]
        start = state.detach()
        start.S.requires_grad_(True)
        o, s = run_triton(*ins, rule=rule, chunk_size=chunk_size, initial_state=start, output_final_state=True,
                          fused_preparation=fused)
        grads = torch.autograd.grad((o.float() * w_o).sum() + (s.S * w_s).sum(), ins + [start.S])
        errors = {"o": rel_err(o, o_ref), "S": rel_err(s.S, s_ref.S)}
        errors.update({f"d{n}": rel_err(a, b) for n, a, b in zip(("q", "k", "v", "beta", "lam", "S0"), grads, g_ref)})
        worst = max(errors.values())
        label = f"{rule}{variant} {str(dtype)[6:]}"
        print(f"check {label} B={B} T={T} H={H} D={D}: max rel err {worst:.1e} "
              f"({', '.join(f'{k} {v:.1e}' for k, v in errors.items())})", flush=True)
        if not worst < tol:
            raise SystemExit(f"Triton and chunk backends disagree for {rule} in {dtype} (tolerance {tol}); not timing")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=int, nargs="+", default=[2048, 4096, 16384])
    parser.add_argument("--rules", nargs="+", default=["1A"], choices=sorted(WINDOW))
    parser.add_argument("--B", type=int, default=8)
    parser.add_argument("--H", type=int, default=16)
    parser.add_argument("--D", type=int, default=128)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--compiled-chunk", action="store_true", help="also time the chunk path under torch.compile")
    parser.add_argument("--compiled-triton", action="store_true",
                        help="also time the triton op under torch.compile (its torch preparation fused by inductor)")
    parser.add_argument("--no-chunk", action="store_true", help="skip the (slow) eager torch chunk path")
    parser.add_argument("--triton-only", action="store_true",
                        help="time SDPA and the triton op alone (no chunk path, kernels, torch preparation, scan "
                             "or walk variants): an A/B of two trees compiles and runs in a fraction of the time")
    parser.add_argument("--documents", type=int, default=0,
                        help="time D packed documents per row instead: seq_idx in place vs cu_seqlens")
    parser.add_argument("--profile", action="store_true", help="per-kernel GPU time of the triton op at the longest T")
    parser.add_argument("--walk-configs", action="store_true",
                        help="time rule 1A with and without its whole-state forward walk (WALK_CONFIGS) instead")
    parser.add_argument("--pass-configs", action="store_true",
                        help="time rule 1 under each launch of its sequential passes (PASS_CONFIGS) instead")
    add_timing_args(parser)
    args = parser.parse_args()
    timing = set_timing(args)
    if args.walk_configs:
        print(f"# {time.strftime('%Y-%m-%d')} | {torch.cuda.get_device_name()} | torch {torch.__version__} | "
              f"B={args.B} H={args.H} D={args.D} bf16 chunk={args.chunk_size} | {timing} | "
              "rule 1A's whole-state forward walk")
        print("| rule | T | kernels | fwd (ms) | fwd / chunk-parallel | fwd+bwd (ms) | fwd+bwd / chunk-parallel |")
        print("|---|---|---|---|---|---|---|")
        for T in args.T:
            for line in time_walk_configs(args.B, T, args.H, args.D, chunk_size=args.chunk_size):
                print(line, flush=True)
            torch.cuda.empty_cache()
        return
    if args.pass_configs:
        print(f"# {time.strftime('%Y-%m-%d')} | {torch.cuda.get_device_name()} | torch {torch.__version__} | "
              f"B={args.B} H={args.H} D={args.D} bf16 chunk={args.chunk_size} | {timing} | rule 1's pass launches")
        print("| rule | T | passes (BV, warps/stages fwd, bwd) | fwd (ms) | fwd / default | fwd+bwd (ms) "
              "| fwd+bwd / default |")
        print("|---|---|---|---|---|---|---|")
        for T in args.T:
            for line in time_pass_configs(args.B, T, args.H, args.D, chunk_size=args.chunk_size):
                print(line, flush=True)
            torch.cuda.empty_cache()
        if args.profile:
            print(f"\n### 1, T={max(args.T)}: kernels of one forward + backward\n"
                  + profile_one("1", args.B, max(args.T), args.H, args.D, chunk_size=args.chunk_size), flush=True)
        return
    for rule in args.rules:
        check(rule, chunk_size=args.chunk_size)
    print(f"\n# {time.strftime('%Y-%m-%d')} | {torch.cuda.get_device_name()} | torch {torch.__version__} | "
          f"B={args.B} H={args.H} D={args.D} bf16 chunk={args.chunk_size} | {timing} | window 3 for 3A and 3")
    if not args.documents:
        print("| rule | T | pass | SDPA (ms) | chunk (ms) | chunk compiled (ms) | triton (ms) | kernels (ms) "
              "| torch preparation (ms) | fixed scan blocks (ms) | chunk-parallel (ms) | triton compiled (ms) "
              "| triton / SDPA | triton compiled / SDPA | chunk / triton | triton TFLOP/s | triton TB/s (min. bytes) |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for T in args.T:
            for rule in args.rules:
                for line in time_one(rule, args.B, T, args.H, args.D, torch.bfloat16, chunk_size=args.chunk_size,
                                     compiled_chunk=args.compiled_chunk, compiled_triton=args.compiled_triton,
                                     eager_chunk=not (args.no_chunk or args.triton_only),
                                     variants=not args.triton_only):
                    print(line, flush=True)
                torch.cuda.empty_cache()
    else:
        print("\n| rule | T | documents per row | seq_idx in place (ms) | cu_seqlens (ms) | in place / cu_seqlens |")
        print("|---|---|---|---|---|---|")
        for T in args.T:
            for rule in args.rules:
                print(time_documents(rule, args.B, T, args.H, args.D, args.documents, chunk_size=args.chunk_size),
                      flush=True)
                torch.cuda.empty_cache()
    if args.profile:
        for rule in args.rules:
            print(f"\n### {rule}, T={max(args.T)}: kernels of one forward + backward\n"
                  + profile_one(rule, args.B, max(args.T), args.H, args.D, chunk_size=args.chunk_size), flush=True)


def pass_settings(config: str):
    """Settings under which rule 1's passes launch as `config` of PASS_CONFIGS ("default": as the op picks)."""
    launch = PASS_CONFIGS[config]
    if launch is None:
        return contextlib.nullcontext()
    return module_settings(regression, pass_launch=lambda K, V, NH: launch)


def time_launches(rule, B, T, H, D, *, chunk_size, configs, settings) -> dict[str, list[float]]:
    """The rule's triton op (bf16), forward and forward + backward in ms, under `settings(config)` for each config
    (the first is the baseline), each checked first against the baseline's outputs and gradients (the launches
    change no arithmetic beyond the order of a few sums)."""
    inputs = make_inputs(B, T, H, D, torch.bfloat16, rule=rule)

    def run():
        return run_triton(*inputs, rule=rule, chunk_size=chunk_size)[0]

    def outputs_and_grads():
        o = run()
        return [o.detach(), *torch.autograd.grad(o.float().square().sum(), inputs)]

    with settings(configs[0]):
        reference = outputs_and_grads()
    times = {}
    for config in configs:
        with settings(config):
            error = max(rel_err(a, b) for a, b in zip(outputs_and_grads(), reference))
            if not error < 1e-2:
                raise SystemExit(f"rule {rule} under {config!r} disagrees with {configs[0]!r} (rel err {error:.1e})")
            times[config] = [bench(run, backward=backward, inputs=inputs) for backward in (False, True)]
    return times


def ratio_rows(rule, T, times, label) -> list[str]:
    """Table rows of `time_launches`' times with their ratios to the first config's."""
    base = next(iter(times.values()))
    return [f"| {rule} | {T} | {label(config)} | {fwd:.2f} | {fwd / base[0]:.2f}x | {both:.2f} | "
            f"{both / base[1]:.2f}x |" for config, (fwd, both) in times.items()]


def time_pass_configs(B, T, H, D, *, chunk_size, configs=tuple(PASS_CONFIGS)) -> list[str]:
    """Table rows: rule 1 under each pass launch of `configs` (the first is the baseline)."""
    times = time_launches("1", B, T, H, D, chunk_size=chunk_size, configs=configs, settings=pass_settings)
    picked = {regression.NARROW_PASSES: "narrow", regression.WIDE_PASSES: "wide"}.get(
        regression.pass_launch(D, D, B * H), "other")
    return ratio_rows("1", T, times, lambda config: config if PASS_CONFIGS[config] else f"{config} ({picked})")


def walk_settings(config: str):
    """Settings under which rule 1A runs as `config` of WALK_CONFIGS."""
    return module_settings(inner_product, **WALK_CONFIGS[config])


def time_walk_configs(B, T, H, D, *, chunk_size) -> list[str]:
    """Table rows: rule 1A under each config of WALK_CONFIGS, against the chunk-parallel form."""
    times = time_launches("1A", B, T, H, D, chunk_size=chunk_size, configs=tuple(WALK_CONFIGS),
                          settings=walk_settings)
    return ratio_rows("1A", T, times, lambda config: config)


def profile_one(rule, B, T, H, D, *, chunk_size, rows=20) -> str:
    """torch.profiler table (self GPU time per kernel) of one forward + backward of the triton op, after a warm-up."""
    from torch.profiler import ProfilerActivity, profile

    inputs = make_inputs(B, T, H, D, torch.bfloat16, rule=rule)

    def step():
        o = run_triton(*inputs, rule=rule, chunk_size=chunk_size)[0]
        o.backward(torch.ones_like(o))
        for t in inputs:  # as `bench` times it: no accumulation into the warm-up's gradients
            t.grad = None

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows)


def time_documents(rule, B, T, H, D, documents, *, chunk_size) -> str:
    """One table row: forward + backward (bf16) of `documents` equal documents per row, restarted in place
    (seq_idx) and through cu_seqlens; checks the two outputs agree first."""
    from hybridlm.ops.fast_weight.op import document_offsets

    inputs = make_inputs(B, T, H, D, torch.bfloat16, rule=rule)
    seq_idx = (torch.arange(T, device=inputs[0].device) * documents // T).expand(B, T).contiguous()
    offsets = document_offsets(seq_idx)
    options = {"rule": rule, "window": WINDOW[rule], "chunk_size": chunk_size, "backend": "triton"}

    def in_place():
        return fast_weight_attention(*inputs, seq_idx=seq_idx, **options)[0]

    def packed():
        rows = [t.reshape(1, B * T, *t.shape[2:]) for t in inputs]
        return fast_weight_attention(*rows, cu_seqlens=offsets, **options)[0].reshape(B, T, H, -1)

    error = rel_err(in_place(), packed())
    if not error < 2e-2:
        raise SystemExit(f"{rule}: seq_idx in place and cu_seqlens disagree (rel err {error:.1e}); not timing")
    ms_in_place, ms_packed = (bench(fn, backward=True, inputs=inputs) for fn in (in_place, packed))
    return (f"| {rule} | {T} | {documents} | {ms_in_place:.2f} | {ms_packed:.2f} | "
            f"{ms_in_place / ms_packed:.2f}x |")


def time_one(rule, B, T, H, D, dtype, *, chunk_size, compiled_chunk=False, compiled_triton=False, eager_chunk=True,
             variants=True):
    """The table rows (fwd, fwd+bwd) of one rule and sequence length; without `variants` only SDPA and the triton op
    (and what the flags ask for)."""
    chunk_compiled = torch.compile(run_chunk, dynamic=False) if compiled_chunk else None
    triton_compiled = torch.compile(run_triton, dynamic=False) if compiled_triton else None
    q, k, v, beta, lam = inputs = make_inputs(B, T, H, D, dtype, rule=rule)
    prepared = None
    if rule == "1A":
        with torch.no_grad():  # the prepared writes as the backend makes them (shifted pair, NLMS step, decay)
            x = torch.cat([torch.zeros_like(k[:, :1]), k[:, :-1]], dim=1)
            E = x.float().pow(2).sum(-1)
            eta = beta.float() / (E + lam.float() + 1e-6)
            eta[:, 0] = 0.0
            log_gamma = torch.log1p(-torch.clamp(eta * lam.float(), max=1 - 1e-6))
        prepared = [t.detach().clone().requires_grad_(True) for t in (q, x, v, eta, log_gamma)]
    rows = []
    for backward in (False, True):

        def timed(fn, inputs=inputs, backward=backward):
            """bench(fn) in ms, or None when it runs out of memory."""
            try:
                return bench(fn, backward=backward, inputs=inputs)
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()
                return None

        def cell(ms):
            if isinstance(ms, str):
                return ms
            return "-" if ms is False else "out of memory" if ms is None else f"{ms:.2f}"

        sdpa = timed(lambda: causal_sdpa(q, k, v))
        triton_ms = timed(lambda: run_triton(*inputs, rule=rule, chunk_size=chunk_size)[0])
        torch_prep = kernels = fixed_scan = chunk_parallel = chunk = compiled = compiled_t = False
        if variants and rule in PREPARED_RULES:
            torch_prep = timed(lambda: run_triton(*inputs, rule=rule, chunk_size=chunk_size,
                                                  fused_preparation=False)[0])
        if variants and prepared is not None:
            kernels = timed(lambda: fast_weight_1a_triton(*prepared, None, read_after=True, chunk_size=chunk_size)[0],
                            inputs=prepared)
        narrows = inner_product.scan_blocks(D, D, B * H) != inner_product.scan_blocks(D, D, B * H, min_programs=0)
        if variants and rule in ("1A", "3A") and narrows:
            with module_settings(inner_product, SCAN_MIN_PROGRAMS=0):
                fixed_scan = timed(lambda: run_triton(*inputs, rule=rule, chunk_size=chunk_size)[0])
        if variants and rule in ("1A", "3A") and inner_product.walk_warps(D, D, B * H, dtype):
            with module_settings(inner_product, **WALK_CONFIGS["chunk-parallel"]):
                chunk_parallel = timed(lambda: run_triton(*inputs, rule=rule, chunk_size=chunk_size)[0])
        if eager_chunk:
            chunk = timed(lambda: run_chunk(*inputs, rule=rule, chunk_size=chunk_size)[0])
        if chunk_compiled is not None:
            compiled = timed(lambda: chunk_compiled(*inputs, rule=rule, chunk_size=chunk_size)[0])
        if triton_compiled is not None:
            try:  # a compile failure costs this column, not the table
                if not backward:
                    with torch.no_grad():
                        error = rel_err(triton_compiled(*inputs, rule=rule, chunk_size=chunk_size)[0],
                                        run_triton(*inputs, rule=rule, chunk_size=chunk_size)[0])
                    print(f"check {rule} T={T}: triton compiled vs eager, rel err {error:.1e}", flush=True)
                compiled_t = timed(lambda: triton_compiled(*inputs, rule=rule, chunk_size=chunk_size)[0])
            except Exception as error:  # noqa: BLE001
                print(f"triton compiled, {rule} T={T}: {type(error).__name__}: {error}"[:2000], flush=True)
                compiled_t = "failed"
        name = "fwd+bwd" if backward else "fwd"
        flops, nbytes = fast_weight_counts(rule, B=B, T=T, H=H, K=D, V=D, chunk=chunk_size, backward=backward)
        use = utilization(ms=triton_ms, flops=flops, nbytes=nbytes)
        rows.append(f"| {rule} | {T} | {name} | {cell(sdpa)} | {cell(chunk)} | {cell(compiled)} | {cell(triton_ms)} | "
                    f"{cell(kernels)} | {cell(torch_prep)} | {cell(fixed_scan)} | {cell(chunk_parallel)} | "
                    f"{cell(compiled_t)} | "
                    f"{triton_ms / sdpa:.2f}x | "
                    f"{f'{compiled_t / sdpa:.2f}x' if isinstance(compiled_t, float) else '-'} | "
                    f"{f'{chunk / triton_ms:.1f}x' if chunk else '-'} | "
                    f"{use['tflops']:.0f} ({100 * use['flop_frac']:.1f}%) | "
                    f"{use['tbps']:.2f} ({100 * use['byte_frac']:.0f}%) |")
    return rows


if __name__ == "__main__":
    main()
