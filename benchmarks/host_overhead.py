"""Host time of one training update on the CPU, with the GPU's launch path emulated and the GPU work taken away.

    python benchmarks/host_overhead.py                                  # the three 125m-shaped rows, 4 layers
    python benchmarks/host_overhead.py --variants "h1 fw-1A" --layers 2 --repeats 60

At a few thousand tokens per row an eager update of the hybrids is bound by its host: the Python around each
kernel (wrappers, argument checks, custom-op dispatch, autograd, checkpointing, Triton's launcher) takes longer
than the kernels. This script measures that host time alone, per layer. Every path a CUDA run with backend "auto"
takes is forced (the Triton norms, gate, conv and SSM kernels, AlignedLinear's padding), on CPU tensors, and
Triton's own launch path runs for real (`JITFunction.run`: argument binding, specialization, the kernel cache;
`CallTimeAutotuner` with tuning on, tuned keys cached) against a stand-in driver: the compile returns a kernel whose
launch does nothing. So a kernel costs what it costs the host, not the GPU, and the outputs are garbage (the
fast-weight mixer calls its op without the lam >= 0 check, which would read them).

Left out, so a GPU host spends more (about 2x on the H100 host that measured 74 / 213 / 157 ms per 4K update for
the three rows, against 39 / 94 / 79 ms emulated at 12 layers): the CUDA driver's launch, Triton's C launcher,
device guards, the caching allocator. Widths are small (d_model 128) so the CPU's own arithmetic on the tensors is
negligible; the structure (rules, allocation, multipliers, chunk sizes, fused widths) is the 125m shape's, and the
number of launches per layer is the same.

Prints the median wall time of forward + backward (bf16 autocast, the chunked loss) per update and per layer.
Needs triton (3.6); reaches into Triton's runtime (`driver.set_active`, `JITFunction._do_compile`), so other Triton
versions may need changes here.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

os.environ.pop("TRITON_INTERPRET", None)  # real JITFunctions: the interpreter's launch path is another one
os.environ.pop("HYBRIDLM_TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from gpu_model import config_of  # noqa: E402  benchmarks/ is on the path
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import jit  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

KERNEL_MODULES = ("hybridlm.ops.ssd.triton.kernels", "hybridlm.ops.ssd.triton.step",
                  "hybridlm.ops.fast_weight.triton.prepare", "hybridlm.ops.fast_weight.triton.inner_product",
                  "hybridlm.ops.fast_weight.triton.regression", "hybridlm.ops.fast_weight.triton.band",
                  "hybridlm.ops.fast_weight.triton.step", "hybridlm.ops.fast_weight.triton.chunk_output",
                  "hybridlm.ops.fast_weight.triton.chunk_state", "hybridlm.ops.fast_weight.triton.decays",
                  "hybridlm.ops.fast_weight.triton.wy", "hybridlm.ops.rms_norm.kernels",
                  "hybridlm.ops.gated_norm.kernels", "hybridlm.ops.short_conv.kernels",
                  "hybridlm.ops.short_conv.step", "hybridlm.ops.silu_gate.kernels", "hybridlm.ops.rotary.kernels")
SMALL = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_d_ssm=96,
             mamba_n_heads=6, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2)
MLP = {"transformer matched": 448}  # the matched Transformer's wider MLP; the hybrids' 256


class _StandInDriver:
    """Device 0, stream 0, an sm_90 target: what `JITFunction.run` asks the driver before a launch."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def is_active(self):
        return True


class _NoOpKernel:
    """A compiled kernel whose launch does nothing."""

    function = 0
    packed_metadata = None

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, *args):
        return None


def _compile_nothing(self, key, signature, device, constexprs, options, attrs, warmup):
    kernel = _NoOpKernel()
    self.device_caches[device][0][key] = kernel
    return kernel


def _tune_without_timing(self, key, configs, bench):
    bench()  # picks by `_bench` below; nothing read from or written to the disk cache
    return False


def emulate_gpu_launches() -> None:
    """Import the kernel modules, then route Triton's launches to the stand-ins; CPU tensors pass hybridlm's device
    checks (`triton_interpreting`), tuning stays on (the GPU's default), a first launch of a key "tunes" at once."""
    import importlib

    for name in KERNEL_MODULES:
        importlib.import_module(name)
    driver.set_active(_StandInDriver())
    jit.JITFunction._do_compile = _compile_nothing
    Autotuner._bench = lambda self, *args, config, **meta: [float(config.num_warps * 10 + config.num_stages)]
    Autotuner.check_disk_cache = _tune_without_timing
    os.environ["TRITON_INTERPRET"] = "1"  # read by hybridlm's checks at each call, after the kernels are defined
    from hybridlm.ops import triton_utils

    triton_utils.autotuning = lambda: True


def build(variant: str, layers: int):
    """The variant at a small width with every module on the path a CUDA run takes."""
    from hybridlm.layers.fast_weight import FastWeightMixer
    from hybridlm.layers.mamba2 import Mamba2Mixer
    from hybridlm.models.model import HybridForCausalLM
    from hybridlm.modules import ShortConvolution
    from hybridlm.modules.gated_norm import GatedRMSNorm
    from hybridlm.modules.norm import RMSNorm

    config = dataclasses.replace(config_of("125m", variant), num_hidden_layers=layers, vocab_size=512,
                                 intermediate_size=MLP.get(variant, 256), **SMALL)
    torch.manual_seed(0)
    model = HybridForCausalLM(config)
    for module in model.modules():
        if isinstance(module, (FastWeightMixer, Mamba2Mixer, ShortConvolution, GatedRMSNorm, RMSNorm)):
            module.backend = "triton"
    return model


def force_cuda_paths() -> None:
    """The SiLU gate's "auto" takes its Triton kernel (as on CUDA), RoPE its kernel (as `rotate_qk` does for CUDA
    tensors), and AlignedLinear pads odd widths as on CUDA at >= 1024 rows (training rows do)."""
    from hybridlm.layers import mlp
    from hybridlm.modules import gate, gated_norm, linear, rotary

    triton_gate = gate.silu_gate
    for module in (gate, mlp, gated_norm):
        module.silu_gate = lambda x, z, *, backend="triton": triton_gate(x, z, backend=backend)
    takes_rotary_kernel = rotary._takes_kernel
    rotary._takes_kernel = lambda q, k, cos, sin: takes_rotary_kernel(*(_OnCuda(t) for t in (q, k, cos, sin)))
    rotary.triton_available = lambda: True
    linear.pads = lambda out_features, in_features, weight, x: (not hasattr(weight, "to_local")
                                                                and out_features % linear.ALIGN_ROWS != 0)


class _OnCuda:
    """A stand-in that answers `is_cuda` with True and everything else as the tensor it wraps."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    is_cuda = True

    def __getattr__(self, name):
        return getattr(self._tensor, name)


def host_ms(model, *, tokens: int, repeats: int) -> float:
    """Median ms of host time of one forward + backward (bf16 autocast, the chunked loss) over `repeats`."""
    ids = torch.randint(0, model.config.vocab_size, (1, tokens))
    times = []
    for i in range(repeats + 3):
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids, labels=ids, return_logits=False).loss
        loss.backward()
        if i >= 3:  # the first updates "tune" and build the kernel caches
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=["transformer matched", "h1 fw-1A", "h1 mamba2"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16, help="tokens in the row (the host time barely depends on it)")
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    emulate_gpu_launches()
    force_cuda_paths()
    print(f"CPU, {os.cpu_count()} cores · torch {torch.__version__} · triton {triton.__version__} · GPU launches "
          f"emulated, no kernel runs · {args.layers} layers, 1 x {args.tokens} tokens, median of {args.repeats}")
    print("\n| model | host ms per update | per layer (update / layers) |\n|---|---|---|")
    for variant in args.variants:
        ms = host_ms(build(variant, args.layers), tokens=args.tokens, repeats=args.repeats)
        print(f"| {variant} | {ms:.2f} | {ms / args.layers:.2f} |", flush=True)


if __name__ == "__main__":
    main()
