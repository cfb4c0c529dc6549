"""Activation memory of a training forward, per layer type: the bytes autograd keeps for the backward, per token.

    python benchmarks/saved_activations.py                      # CPU: the 125m shape's Transformer and two hybrids
    python benchmarks/saved_activations.py --device cuda        # the same on a GPU (its kernels, CUDA autocast)
    python benchmarks/saved_activations.py --variants "h1 fw-1A" --lengths 256 512 --json saved.json
    python benchmarks/saved_activations.py --documents 4      # each row packed as 4 documents (cu_seqlens)

Every tensor the forward saves for the backward (`torch.autograd.graph.saved_tensors_hooks`) that the graph still holds
when the forward returns is counted once per storage (a saved view keeps its whole storage alive, so a slice of a
projection's output costs the whole output), charged to the innermost module whose forward saved it first, and grouped
by that module's path inside its block (`ssm.conv`, `attn`, `mlp.up_proj`; `norm` is the block's input norm). Parameters
are left out, and so is everything that does not grow with the sequence (autocast's bf16 copies of the weights, carried
states): each figure is the slope between the two `--lengths`, in bytes per token. One block of each variant is built
(`benchmarks/gpu_model.py`'s variants and shapes; every block of a variant is the same), so a whole model keeps blocks x
the block's figure plus the embedding, final norm, LM head and loss.

Under bf16 autocast (float32 weights), as `hybridlm train` runs on a GPU. The norms and the mixers (their ops, short
conv, QK and gated norms) take the Triton kernels a GPU's `backend="auto"` takes: on the CPU they run under Triton's
interpreter (TRITON_INTERPRET=1 is set here when triton is importable; without it the torch paths run, and keep more),
so the CPU counts what a GPU keeps. Peak memory adds the weights, gradients and optimizer state, and the backward's
transients.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
import weakref
from collections import Counter
from dataclasses import replace


def _device_argument(argv: list[str]) -> str:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--device", default="cpu")
    return parser.parse_known_args(argv)[0].device


if __name__ == "__main__" and _device_argument(sys.argv[1:]) == "cpu" and importlib.util.find_spec("triton"):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton reads it as its kernels are defined: set before any is

import torch  # noqa: E402
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook  # noqa: E402
from gpu_model import SHAPE_125M, config_of  # noqa: E402  (benchmarks/ is on the path when this script runs)

from hybridlm.layers.fast_weight import FastWeightMixer  # noqa: E402
from hybridlm.layers.mamba2 import Mamba2Mixer  # noqa: E402
from hybridlm.models.model import HybridForCausalLM  # noqa: E402
from hybridlm.modules import GatedRMSNorm, RMSNorm, ShortConvolution  # noqa: E402
from hybridlm.ops.utils import triton_interpreting  # noqa: E402

DEFAULT_VARIANTS = ("transformer matched", "h1 fw-1A", "h1 mamba2")
KERNEL_MODULES = (FastWeightMixer, Mamba2Mixer, ShortConvolution, GatedRMSNorm, RMSNorm)


def build(variant: str, device: torch.device, *, preset: str = "125m") -> HybridForCausalLM:
    """One block of `variant` (gpu_model.py's config at `preset`), float32, its mixers on the kernels a GPU's "auto"
    takes (the interpreter's on the CPU when triton is there)."""
    config = replace(config_of(preset, variant), num_hidden_layers=1)
    torch.manual_seed(0)
    model = HybridForCausalLM(config).to(device)
    if device.type == "cpu" and triton_interpreting():
        for module in model.modules():
            if isinstance(module, KERNEL_MODULES):
                module.backend = "triton"
    return model


def group_of(path: str) -> str:
    """A module path -> its place inside a block ("model.layers.0.ssm.conv" -> "ssm.conv"), or outside one."""
    if path == "":
        return "loss"
    return re.sub(r"^model\.layers\.\d+\.", "", path)


def document_offsets(length: int, documents: int) -> torch.Tensor:
    """cu_seqlens (int32, host) of one row of `length` tokens cut into `documents` documents of lengths in the ratio
    1 : 2 : ... : D (the last takes the rounding), so that every document, the longest too, grows with the row."""
    weights = torch.arange(1, documents + 1, dtype=torch.float64)
    cuts = (weights.cumsum(0) / weights.sum() * length).floor().to(torch.int32)
    cuts[-1] = length
    offsets = torch.cat([torch.zeros(1, dtype=torch.int32), cuts])
    if bool((offsets.diff() < 1).any()):
        raise ValueError(f"{length} tokens cannot be cut into {documents} documents of lengths 1 : 2 : ... : D")
    return offsets


def saved_bytes(model: HybridForCausalLM, length: int, device: torch.device, *, documents: int = 1,
                logits: bool = False) -> Counter:
    """{group: bytes of the distinct storages its modules saved} for one autocast forward of one row of `length`
    (packed as `documents` documents with cu_seqlens when more than one), its loss as `hybridlm train` computes it
    (the LM head and cross entropy over row chunks) or, with `logits`, from the whole logits."""
    names = {module: name for name, module in model.named_modules()}
    stack = [""]  # the paths of the modules whose forward is running, innermost last

    def enter(module, args):
        if module in names:
            stack.append(names[module])

    def leave(module, args, out):
        if module in names:
            stack.pop()

    # Global hooks: a hook on a module of the model would make it take its plain path (`is_plain`).
    hooks = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave, always_call=True)]
    packed: list[weakref.ref] = []

    def pack(t: torch.Tensor) -> _Kept:
        handle = _Kept(t, group_of(stack[-1]))
        packed.append(weakref.ref(handle))
        return handle

    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda handle: handle.tensor), \
                torch.autocast(device.type, dtype=torch.bfloat16):
            rows = {"cu_seqlens": document_offsets(length, documents)} if documents > 1 else {}
            loss = model(ids, labels=ids, return_logits=logits, **rows).loss
    finally:
        for hook in hooks:
            hook.remove()
    # The graph of `loss` holds the handles of what its backward needs; the others (a branch whose graph was dropped)
    # are gone. Live storages have distinct addresses, so their data pointers tell them apart.
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    totals, seen = Counter(), set(params)
    for ref in packed:
        handle = ref()
        if handle is None or handle.tensor.untyped_storage().data_ptr() in seen:
            continue
        storage = handle.tensor.untyped_storage()
        seen.add(storage.data_ptr())
        totals[handle.group] += storage.nbytes()
    del loss
    return totals


class _Kept:
    """What the pack hook hands autograd: the saved tensor and the group of the module that saved it."""

    __slots__ = ("tensor", "group", "__weakref__")

    def __init__(self, tensor: torch.Tensor, group: str) -> None:
        self.tensor, self.group = tensor, group


def per_token(model: HybridForCausalLM, lengths: tuple[int, int], device: torch.device, *,
              documents: int = 1, logits: bool = False) -> dict[str, float]:
    """{group: bytes per token}: the slope of `saved_bytes` between the two lengths."""
    short, long = (saved_bytes(model, n, device, documents=documents, logits=logits) for n in lengths)
    span = lengths[1] - lengths[0]
    return {group: (long[group] - short[group]) / span for group in sorted(set(short) | set(long))}


OUTSIDE = ("model.embed_tokens", "model.norm", "lm_head", "loss")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), help="gpu_model.py's variant names")
    parser.add_argument("--lengths", nargs=2, type=int, default=[256, 512], metavar=("T1", "T2"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--documents", type=int, default=1,
                        help="documents per row, lengths in the ratio 1 : 2 : ... : D, packed with cu_seqlens")
    parser.add_argument("--logits-loss", action="store_true",
                        help="the loss from the whole logits, not the chunked one `hybridlm train` uses")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args(argv)
    if args.lengths[1] <= args.lengths[0]:
        parser.error("--lengths: the second length must be the longer")
    if args.documents < 1:
        parser.error(f"--documents must be at least 1, got {args.documents}")
    try:
        document_offsets(args.lengths[0], args.documents)
    except ValueError as err:
        parser.error(f"--documents: {err}")
    device = torch.device(args.device)
    blocks = SHAPE_125M["num_hidden_layers"]
    kernels = "cuda" if device.type == "cuda" else "triton interpreter" if triton_interpreting() else "torch paths"
    print(f"bytes kept for the backward per token, one block (125m shape), bf16 autocast, device {device.type}, "
          f"kernels: {kernels}, lengths {args.lengths[0]} -> {args.lengths[1]}"
          + (f", {args.documents} documents per row" if args.documents > 1 else "")
          + (", loss from the whole logits" if args.logits_loss else ", chunked loss"))
    results = {}
    for variant in args.variants:
        model = build(variant, device)
        figures = per_token(model, tuple(args.lengths), device, documents=args.documents, logits=args.logits_loss)
        block = {g: b for g, b in figures.items() if g not in OUTSIDE and b}
        outside = sum(b for g, b in figures.items() if g in OUTSIDE)
        results[variant] = {"groups": figures, "block": sum(block.values()), "outside": outside,
                            "model": blocks * sum(block.values()) + outside}
        print(f"\n{variant}")
        for group, nbytes in sorted(block.items(), key=lambda kv: -kv[1]):
            print(f"  {group:24s} {nbytes:10.0f}")
        print(f"  {'block':24s} {results[variant]['block']:10.0f}")
        print(f"  {'outside the blocks':24s} {outside:10.0f}")
    base = args.variants[0]
    print(f"\n| model | per block | {blocks} blocks + the rest | / {base} |")
    print("|---|---|---|---|")
    for variant, r in results.items():
        print(f"| {variant} | {r['block']:.0f} | {r['model']:.0f} | {r['model'] / results[base]['model']:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device.type, "kernels": kernels, "lengths": args.lengths, "blocks": blocks,
                       "documents": args.documents, "logits_loss": args.logits_loss,
                       "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
