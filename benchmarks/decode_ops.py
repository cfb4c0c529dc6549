"""Operators per decoding step, counted on the CPU: what a CUDA-graphed step's kernels are made of, by layer, with the
SSM mixers' single steps (the op and the short conv) on their torch loops and as one Triton kernel each (run here
under Triton's interpreter).

    python benchmarks/decode_ops.py                       # the 125m shape of gpu_model.py, batch 1
    python benchmarks/decode_ops.py --batch 64 --variants "h1 mamba2" --json ops.json
    python benchmarks/decode_ops.py --static              # the step a CUDA graph captures, its state copies counted

A replayed CUDA graph of a decoding step at a small batch costs about one kernel's launch and latency per operator
(benchmarks/RESULTS.md, "Serving on an H200"), so the number of operators that compute is the step's time there.
Counted: every dispatched aten operator except views and empty allocations, and every Triton launch, in one step
after a prefill of 64 tokens (no gradient, bf16 autocast as on the GPU), the short conv's torch form as CUDA runs it
in eager mode (`F.conv1d`; the CPU's own is a shifted sum of more operators). The norms run their Triton kernels, as
"auto" does on CUDA (with a residual add or a scale inside the launch where no gradient is recorded); `--torch-norms`
counts their CPU forms instead (several operators each). CUDA's own count is `gpu_model.py --profile-decode`'s; the
models' ratios carry over (benchmarks/RESULTS.md, "Decoding on an H100"). With the step kernels the fast-weight
mixer runs its conv, QK norms, gains, step and gated norm as one kernel (`fast_weight_mixer_decoding_step`) and the
Mamba-2 mixer hands its discretization to the SSD's step kernel (`ssd_decoding_step`), as "auto" does on CUDA: the
"SSM op" column is that one launch, and the "SSM conv" and "rest of the SSM mixer" columns lose what it took in (the
CPU's form of the gated norm counts several operators there, one kernel on CUDA). "steps": the mixers' and their
short convolutions' `backend` for the step ("recurrent" / "naive" / "torch": the torch loops; "triton":
`hybridlm/ops/fast_weight/triton/mixer_step.py`, `hybridlm/ops/ssd/triton/step.py`, `hybridlm/ops/short_conv/step.py`).
Inside the custom ops (`hybridlm::`) only their Triton launches are counted.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the step kernels run on CPU tensors

import argparse  # noqa: E402
import collections  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402

import torch  # noqa: E402
from gpu_model import BASELINE, VARIANTS, build, torch_steps  # noqa: E402  benchmarks/ is on the path
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from hybridlm.inference import GraphedDecoder  # noqa: E402
from hybridlm.layers import attention as attention_layer  # noqa: E402
from hybridlm.layers import cache as cache_module  # noqa: E402
from hybridlm.layers import fast_weight as fast_weight_layer  # noqa: E402
from hybridlm.layers import mamba2 as mamba2_layer  # noqa: E402
from hybridlm.layers.block import HybridBlock  # noqa: E402
from hybridlm.layers.fast_weight import FastWeightMixer  # noqa: E402
from hybridlm.layers.mamba2 import Mamba2Mixer  # noqa: E402
from hybridlm.models.fold import fold_multipliers  # noqa: E402
from hybridlm.models.fuse import fuse_projections  # noqa: E402
from hybridlm.modules import GatedRMSNorm, RMSNorm, ShortConvolution, short_conv  # noqa: E402
from hybridlm.ops.rotary import rotary_qk_triton  # noqa: E402

# Operators that launch no kernel (allocations, host reads, dtype arithmetic, which the dispatch mode sees too).
NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_local_scalar_dense",
             "lift_fresh", "promote_types", "_unsafe_view"}


class OperatorCount(TorchDispatchMode):
    """Counts the dispatched operators that compute (not views or allocations), by the innermost module running;
    not the custom ops (`hybridlm::`, whose Triton launches are counted instead), nor what the interpreter runs to
    move a launch's tensors (`launching`)."""

    def __init__(self, where: list[str]):
        super().__init__()
        self.where = where
        self.launching = False
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not (self.launching or func.is_view or name in NO_KERNEL or func.namespace == "hybridlm"):
            self.counts[self.where[-1]] += 1
        return func(*args, **(kwargs or {}))


def kind(module: torch.nn.Module) -> str | None:
    """The layer kind an operator is counted under: the SSM mixers and attention by name, the rest of a block as
    "block", the embedding, final norm and head as "model"."""
    name = type(module).__name__
    if isinstance(module, (FastWeightMixer, Mamba2Mixer)):
        return "ssm mixer"
    if isinstance(module, ShortConvolution):
        return "ssm conv"
    return {"Attention": "attention", "HybridBlock": "block", "HybridForCausalLM": "model"}.get(name)


def _fuses_on_cpu(q, k, v, cos, sin, keys) -> bool:
    """`rotate_into_cache_fuses` as CUDA answers it, for the interpreter's CPU tensors."""
    return (keys is not None and q.shape[1] == 1 and v.dtype == q.dtype == k.dtype == keys.dtype
            and not torch.is_grad_enabled())


def _in_place(where: list[str], label: str, fn):
    """fn, with `label` on `where` while it runs."""
    def run(*args, **kwargs):
        where.append(label)
        try:
            return fn(*args, **kwargs)
        finally:
            where.pop()
    return run


def count_step(model, *, batch: int, kernels: bool, rotary_kernel: bool, static: bool = False,
               kernel_norms: bool = True) -> tuple[collections.Counter, int]:
    """(operators per layer kind, Triton launches) of one decoding step after a prefill of 64 tokens; the SSM ops
    themselves (`fast_weight_attention` and `ssd`, or with the step kernels `fast_weight_decoding_step` and
    `ssd_decoding_step`) counted apart from the rest of their mixers, as "ssm op".
    `rotary_kernel`: attention's queries and keys rotated by the Triton kernel, as `rotate_qk` does on CUDA.
    `static`: the step a CUDA graph captures (`GraphedDecoder`'s, on a `StaticCache`), whose copies of new SSM states
    into the buffers the step reads count as "state copies". `kernel_norms`: the norms on their Triton kernels (CUDA's
    "auto"), else their torch forms."""
    import triton.runtime.interpreter as interpreter

    where = ["state copies"] if static else ["model"]
    ops_in_layers = [(fast_weight_layer, "fast_weight_attention"), (fast_weight_layer, "fast_weight_decoding_step"),
                     (fast_weight_layer, "fast_weight_mixer_decoding_step"), (mamba2_layer, "ssd"),
                     (mamba2_layer, "ssd_decoding_step")]
    saved = {(module, name): getattr(module, name) for module, name in ops_in_layers}
    depthwise, rotate = short_conv._depthwise, attention_layer.rotate_qk
    into_cache = cache_module.rotate_into_cache_fuses
    conv_forward, block_deferred = ShortConvolution.forward, HybridBlock.deferred
    hooks = []
    for module in model.modules():
        label = kind(module)
        # the conv and the blocks: their class's methods labelled instead (below)
        if label is not None and label not in ("ssm conv", "block"):
            hooks.append(module.register_forward_pre_hook(lambda m, a, label=label: where.append(label)))
            hooks.append(module.register_forward_hook(lambda m, a, o: where.pop() and None))
    launches = collections.Counter()
    launch = interpreter.InterpretedFunction.run
    ops = OperatorCount(where)

    def counted(self, *args, **kwargs):
        launches[where[-1]] += 1
        ops.launching = True
        try:
            return launch(self, *args, **kwargs)
        finally:
            ops.launching = False

    ids = torch.randint(0, model.config.vocab_size, (batch, 65))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # as the GPU runs it: casts included
        cache = model(ids[:, :64], cache=model.new_cache()).cache
        with torch_steps(model, not kernels):
            stepping = [m for m in model.modules() if isinstance(m, (FastWeightMixer, Mamba2Mixer, ShortConvolution))]
            saved_backends = [m.backend for m in stepping]
            for module in stepping if kernels else []:
                module.backend = "triton"
            interpreter.InterpretedFunction.run = counted
            for module, name in ops_in_layers:
                setattr(module, name, _in_place(where, "ssm op", saved[module, name]))
            short_conv._depthwise = short_conv._conv1d  # the conv's torch form as CUDA runs it in eager mode
            # A hook on the conv would make the fast-weight mixer run it apart (a module with hooks is run as a call,
            # never folded into the mixer's whole-step kernel): its class's forward carries the label instead.
            ShortConvolution.forward = _in_place(where, "ssm conv", conv_forward)
            # A hook on a block would keep the model from chaining its blocks (a block with hooks runs as a call):
            # HybridBlock.deferred, which its forward calls too, carries the label.
            HybridBlock.deferred = _in_place(where, "block", block_deferred)
            norms = [m for m in model.modules() if isinstance(m, (RMSNorm, GatedRMSNorm))]
            saved_norms = [m.backend for m in norms]
            for module in norms if kernel_norms else []:
                module.backend = "triton"  # as "auto" runs them on CUDA
            if rotary_kernel:
                attention_layer.rotate_qk = rotary_qk_triton
                # a static cache's step rotates into the storage on CUDA: here on the interpreter's CPU tensors
                cache_module.rotate_into_cache_fuses = _fuses_on_cpu
            if static:
                decoder = GraphedDecoder(model, cache, capacity=65, batch_size=batch, use_graph=False)
                decoder.token.copy_(ids[:, 64:])
                step = decoder._forward  # the model's step on the static cache, then the states copied back
            else:
                step = functools.partial(model, ids[:, 64:], cache=cache, logits_to_keep=1)
            try:
                with ops:
                    step()
            finally:
                interpreter.InterpretedFunction.run = launch
                for module, name in ops_in_layers:
                    setattr(module, name, saved[module, name])
                short_conv._depthwise, attention_layer.rotate_qk = depthwise, rotate
                cache_module.rotate_into_cache_fuses = into_cache
                ShortConvolution.forward, HybridBlock.deferred = conv_forward, block_deferred
                for module, backend in zip(norms, saved_norms):
                    module.backend = backend
                for module, backend in zip(stepping, saved_backends):
                    module.backend = backend
    for hook in hooks:
        hook.remove()
    return ops.counts + launches, sum(launches.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=["transformer matched", "h1 fw-1A", "h1 mamba2"],
                        choices=list(VARIANTS))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--preset", default="125m", help="'125m' (gpu_model.py's shape) or any preset name")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--torch-rotary", action="store_true",
                        help="rotate queries and keys on the torch form (the CPU's and a recorded gradient's) instead "
                             "of the Triton kernel that CUDA's inference runs")
    parser.add_argument("--fold-multipliers", action="store_true",
                        help="fold each model's muP multipliers into its weights first (`hybridlm.models.fold`, what "
                             "serve, generate and chat do at load); a preset like falcon-h1-0.5b has them")
    parser.add_argument("--fuse-projections", action="store_true",
                        help="fuse the projections that read one input into one GEMM each (`hybridlm.models.fuse`, "
                             "what serve, generate and chat do at load)")
    parser.add_argument("--torch-norms", action="store_true",
                        help="run the norms on the CPU's torch forms instead of the Triton kernels CUDA runs")
    parser.add_argument("--static", action="store_true",
                        help="count the step a CUDA graph captures (`GraphedDecoder` on a `StaticCache`: the static "
                             "attention and the copies of new SSM states into the buffers the step reads)")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for variant in args.variants:
        model = build(args.preset, variant, torch.device("cpu")).eval()
        if args.fold_multipliers:
            fold_multipliers(model)
        if args.fuse_projections:
            fuse_projections(model)
        layers = len(model.model.layers)
        has_mixers = any(isinstance(m, (FastWeightMixer, Mamba2Mixer)) for m in model.modules())
        for kernels in ([False, True] if has_mixers else [False]):
            counts, launches = count_step(model, batch=args.batch, kernels=kernels,
                                          rotary_kernel=not args.torch_rotary, static=args.static,
                                          kernel_norms=not args.torch_norms)
            steps = "triton" if kernels else ("torch loops" if has_mixers else "-")
            rows.append(dict(variant=variant, steps=steps, total=sum(counts.values()), launches=launches,
                             op=counts["ssm op"] / layers, conv=counts["ssm conv"] / layers,
                             ssm=counts["ssm mixer"] / layers,
                             attention=counts["attention"] / layers,
                             block=counts["block"] / layers, model=counts["model"], copies=counts["state copies"],
                             baseline=BASELINE.get(variant, "transformer")))
    totals = {r["variant"]: r["total"] for r in rows if r["steps"] in ("-",)}
    step = "the static step a CUDA graph captures" if args.static else "decoding step"
    folded = (", multipliers folded" if args.fold_multipliers else "") + (
        ", projections fused" if args.fuse_projections else "")
    print(f"operators per {step}, {args.preset}{folded}, batch {args.batch} "
          f"(CPU; views and allocations not counted; queries and keys "
          f"rotated on the {'torch form' if args.torch_rotary else 'Triton kernel'})\n")
    print("| model | SSM steps | per step | of them Triton launches | / baseline | per layer: SSM op | SSM conv | "
          "rest of the SSM mixer | attention | rest of the block | embedding, final norm, head | state copies |\n"
          + "|---" * 12 + "|")
    for r in rows:
        base = totals.get(r["baseline"])
        ratio = f"{r['total'] / base:.2f}x" if base else "-"
        print(f"| {r['variant']} | {r['steps']} | {r['total']} | {r['launches']} | {ratio} | {r['op']:.0f} | "
              f"{r['conv']:.0f} | {r['ssm']:.0f} | {r['attention']:.0f} | {r['block']:.0f} | {r['model']} | "
              f"{r['copies']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"batch": args.batch, "preset": args.preset, "torch_rotary": args.torch_rotary,
                       "static": args.static, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
