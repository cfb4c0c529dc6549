"""`hybridlm models`: list the presets with their shapes and parameter counts.

    hybridlm models             # table of presets (counts from a meta-device build: no memory used)

Wire into the CLI with `add_commands(subparsers)`.
"""

from __future__ import annotations

import argparse


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    text = "list model presets with parameter counts"
    parser = subparsers.add_parser("models", help=text, description=text)
    parser.set_defaults(func=run_models)


def add_generation_flags(parser: argparse.ArgumentParser) -> None:
    """`--no-fold-multipliers`, `--no-fuse-projections` and `--no-concurrent-mixers` for the commands that load a
    model for inference (generate, chat, serve), which by default fold its muP multipliers into its weights, fuse the
    projections that read one input and decode a parallel block's two mixers on two streams
    (`hybridlm.models.fuse.prepare_for_generation`)."""
    parser.add_argument("--no-fold-multipliers", action="store_true",
                        help="keep the muP multipliers as separate scalings (default: folded into the weights at load, "
                             "hybridlm/models/fold.py: the same function with fewer kernels per decoding step)")
    parser.add_argument("--no-fuse-projections", action="store_true",
                        help="run each projection apart (default on CUDA: those that read one input, q/k/v with a "
                             "parallel block's SSM in_proj and the MLP's up/gate, as one GEMM each; "
                             "hybridlm/models/fuse.py)")
    parser.add_argument("--no-concurrent-mixers", action="store_true",
                        help="decode a parallel block's attention and SSM halves one after the other on one stream "
                             "(default on CUDA: in the steps CUDA graphs replay, the SSM half on a second stream "
                             "beside attention, the same values; hybridlm/layers/block.py)")


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    """--temperature, --top-k, --top-p and --seed, checked as the command line is parsed (exit status 2)."""
    from hybridlm.argtypes import non_negative_float, positive_int, probability

    parser.add_argument("--temperature", type=non_negative_float, default=0.0, metavar="T",
                        help="0 = greedy (default); > 0 samples from softmax(logits / T)")
    parser.add_argument("--top-k", type=positive_int, default=None, metavar="K",
                        help="sample among the K most likely tokens (with --temperature > 0)")
    parser.add_argument("--top-p", type=probability, default=None, metavar="P",
                        help="sample among the most likely tokens that cover probability P (with --temperature > 0)")
    parser.add_argument("--seed", type=int, default=None, metavar="S",
                        help="seed of the sampling, for reproducible output (with --temperature > 0)")


def sampling_flags_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with `add_sampling_flags`' values together: sampling options given for greedy decoding, where
    they would be silently ignored."""
    given = [flag for flag, value in (("--top-k", args.top_k), ("--top-p", args.top_p), ("--seed", args.seed))
             if value is not None]
    if given and args.temperature == 0:
        acts, them = ("act", "them") if len(given) > 1 else ("acts", "it")
        return f"{', '.join(given)} only {acts} when sampling: pass --temperature > 0 with {them} (0, the default, " \
               "decodes greedily)"
    return None


def generation_options(args: argparse.Namespace) -> dict[str, bool]:
    """`prepare_for_generation`'s fold, fuse and concurrent as `add_generation_flags` set them."""
    return dict(fold=not getattr(args, "no_fold_multipliers", False),
                fuse=not getattr(args, "no_fuse_projections", False),
                concurrent=not getattr(args, "no_concurrent_mixers", False))


def count_parameters(config) -> int:
    """Parameters of a HybridForCausalLM built from `config` (a HybridConfig) on the meta device."""
    import torch

    from hybridlm.models.model import HybridForCausalLM

    with torch.device("meta"):
        model = HybridForCausalLM(config)
    return sum(p.numel() for p in model.parameters())


def run_models(args: argparse.Namespace) -> int:
    from hybridlm.models.presets import get_preset, list_presets

    header = (
        f"{'preset':<22}{'params':>10}  {'layers':>6} {'d_model':>7} {'attn Q/KV':>9} {'ssm heads':>9} "
        f"{'d_state':>7} {'mlp':>6} {'vocab':>7}"
    )
    print(header)
    for name in list_presets():
        c = get_preset(name)
        params = count_parameters(c)
        print(
            f"{name:<22}{_human(params):>10}  {c.num_hidden_layers:>6} {c.hidden_size:>7} "
            f"{f'{c.num_attention_heads}/{c.num_key_value_heads}':>9} {c.mamba_n_heads:>9} {c.mamba_d_state:>7} "
            f"{c.intermediate_size:>6} {c.vocab_size:>7}"
        )
    return 0


def _human(count: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.2f}{unit}"
    return str(count)
