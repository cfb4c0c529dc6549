"""`hybridlm train`, `hybridlm checkpoint export` and `hybridlm mup-check`.

    hybridlm train                                   # the built-in demo: tiny preset, Python stdlib bytes
    hybridlm train --set train.steps=60 --out runs/quick
    hybridlm train --config configs/demo.yaml --set optim.lr=2e-3 --set model.overrides.ssm_multiplier_dt=0.5
    hybridlm train --resume --out runs/demo --set train.steps=600     # continue (and extend) a run
    torchrun --nproc_per_node 2 -m hybridlm.cli train --set train.device=cpu        # 2 CPU ranks, gloo, FSDP2
    torchrun --nproc_per_node 8 -m hybridlm.cli train --config configs/hybrid-125m.yaml   # FSDP2 over 8 GPUs
    torchrun --nproc_per_node 8 -m hybridlm.cli train --config configs/hybrid-125m.yaml --set parallel.tp=2
    torchrun --nproc_per_node 2 -m hybridlm.cli train --set parallel.dp_replicate=-1 --set parallel.dp_shard=1  # replicas
    hybridlm checkpoint export --run runs/demo --out models/demo    # newest checkpoint -> a model directory
    hybridlm mup-check --out runs/mup                # coordinate check: mup_check.png + mup_check.json

`--set key=value` (repeatable) addresses nested config keys with dots (train.steps, batch.micro_batch,
model.overrides.hidden_size, optim.elr.ssm_in, ...); values are YAML (numbers, true/false, null,
[lists]) and are checked against the key's type; a `--set` of schedule.kind drops the schedule settings inherited
from the config file that the new kind does not read, and one of schedule.decay or schedule.decay_fraction drops
the other. `--resume` without `--config` continues with the run's own `config.yaml`. An output directory that
holds a run (checkpoints/, final/, metrics.jsonl, ...) is refused unless `--resume` continues it or `--overwrite`
replaces it (only once every check has passed), and so is one another `train` is running in. Keep your
own config files outside the output directory: the run writes its resolved config to <out>/config.yaml
(marked by its first line), and a config.yaml there that a run did not write is refused, never replaced. Exit status:
0 done, 1 training failed (diverged, data ran out, bad checkpoint), 2 configuration error (reported
before anything runs or is deleted), 128 + signal number when stopped by SIGINT / SIGTERM (a checkpoint
was saved after the first signal; a second one, or one while writing samples or final/, stops at once).

Wire into the CLI with `add_commands(subparsers)`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hybridlm.argtypes import at_least


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    train = subparsers.add_parser(
        "train",
        help="train a hybrid LM (no --config: the built-in demo on the Python standard library)",
        description="\n\n".join(__doc__.split("\n\n")[1:3]),  # the examples, `--set`, `--resume`, exit status
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_run_arguments(train, "default: the built-in demo")
    train.set_defaults(func=run_train)

    for task in ("sft", "dpo"):
        _add_post_training_command(subparsers, task)
    checkpoint = subparsers.add_parser("checkpoint", help="work with a run's training checkpoints",
                                       description="Work with the training checkpoints of a `hybridlm train` run.")
    actions = checkpoint.add_subparsers(dest="action", metavar="ACTION", required=True)
    export = actions.add_parser(
        "export", help="a checkpoint (sharded or full) as a model directory for load_model / transformers",
        description="Consolidate a training checkpoint of a run (the newest complete one, or --step) into a model "
        "directory that hybridlm.load_model and transformers' Auto classes load: config.json, safetensors shards "
        "and the run's tokenizer. A sharded (dcp) checkpoint is read one tensor at a time, so models larger than "
        "memory export; no torchrun needed.",
    )
    export.add_argument("--run", type=Path, required=True, help="the run's output directory (holds config.yaml)")
    export.add_argument("--out", type=Path, required=True,
                        help="the model directory to write (not inside the run; an existing one with --overwrite)")
    export.add_argument("--overwrite", action="store_true",
                        help="replace an existing --out, if it is a model directory (config.json, safetensors)")
    export.add_argument("--step", type=at_least(0),
                        help="the checkpoint's step (default: the newest complete checkpoint, refused while a newer "
                        "one is damaged)")
    export.add_argument("--format", choices=("hybridlm", "falcon_h1"), default="hybridlm",
                        help="hybridlm (default) or an official falcon_h1 checkpoint (Mamba-2 SA_M models with an MLP)")
    export.set_defaults(func=run_checkpoint_export)

    mup = subparsers.add_parser(
        "mup-check",
        help="muP coordinate check: activation RMS per layer type across widths (PNG + JSON)",
        description="Train models of several widths a few steps with the muP multipliers transferred from "
        "--base-width and record the RMS of each layer type's output (hybridlm.training.mup_check).",
    )
    mup.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256, 512], help="hidden sizes (multiples of 64)")
    mup.add_argument("--base-width", type=int, default=128, help="width the multipliers were tuned at")
    mup.add_argument("--steps", type=int, default=6, help="AdamW updates per width")
    mup.add_argument("--lr", type=float, default=1e-2, help="the same lr for every width")
    mup.add_argument("--layers", type=int, default=2,
                     help="decoder layers of every model (num_hidden_layers; the RMS is combined over them)")
    mup.add_argument("--seed", type=int, default=0,
                     help="seed of the initialization and of the random token batch (the same for every width)")
    mup.add_argument("--no-scale", action="store_true",
                     help="leave the multipliers at 1 (standard parametrization): the control that should blow up")
    mup.add_argument("--out", type=Path, required=True, help="directory for mup_check.png and mup_check.json")
    mup.set_defaults(func=run_mup_check)


_POST_TRAINING = {
    "sft": """Supervised fine-tuning of a trained model on chat records, on the training loop of `hybridlm train`
(same --config / --set keys, checkpoints, --resume, metrics.jsonl, loss.png, final/).

    hybridlm sft --model runs/demo/final --out runs/sft                       # the generated demo conversations
    hybridlm sft --model runs/demo/final --data chats.jsonl --out runs/sft --set train.steps=500
    hybridlm sft --model M --data chats.jsonl --out runs/sft-lora --set lora.r=16 --set lora.alpha=32
    hybridlm sft --config configs/sft-falcon-h1.yaml --model M --data chats/ --out runs/sft
    hybridlm sft --resume --out runs/sft

--data: a .jsonl / .parquet file or directory of records in TRL's formats: {"messages": [{"role", "content"},
...]} or {"prompt", "completion"} (strings, or message lists). Conversations are rendered with the model
directory's chat template (--chat-template FILE for another). The loss trains on the assistant's tokens
(data.train_on=all: every token). Samples are packed into rows of batch.seq_len tokens, each its own document;
longer ones are cut (counted), and those left with nothing to train on are skipped (counted). final/ holds the model,
its tokenizer and chat template: `hybridlm chat --model <out>/final`.""",
    "dpo": """Direct preference optimization of a trained model, on the training loop of `hybridlm train`.

    hybridlm dpo --model runs/sft/final --out runs/dpo                        # demo pairs from the demo conversations
    hybridlm dpo --model M --data prefs.jsonl --out runs/dpo --set dpo.beta=0.1 --set dpo.loss=sigmoid
    hybridlm dpo --config configs/dpo-falcon-h1.yaml --model M --data prefs.jsonl --out runs/dpo

--data: records {"prompt", "chosen", "rejected"} (strings, or message lists rendered with the chat template).
dpo.loss: sigmoid (DPO) or norm (length-normalized, the Falcon-H1 report's); dpo.reference: precomputed (the
starting model's log-probabilities, one pass before training) or frozen (a copy of the starting model in memory).
metrics.jsonl adds rewards/chosen, rewards/rejected, rewards/margin and rewards/accuracy.""",
}


def _add_post_training_command(subparsers: argparse._SubParsersAction, task: str) -> None:
    doc = _POST_TRAINING[task]
    short = {"sft": "fine-tune a trained model on chat records (SFT, LoRA)",
             "dpo": "preference-tune a model on chosen / rejected pairs (DPO, LoRA)"}
    p = subparsers.add_parser(task, help=short[task], description=doc,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="the model directory to start from (sets model.init)")
    p.add_argument("--data", type=Path, help="records file or directory (sets data.chat); default: demo data")
    p.add_argument("--chat-template", type=Path, metavar="FILE",
                   help="a Jinja chat template to use instead of the model's (sets data.chat_template)")
    _add_run_arguments(p, f"e.g. configs/{task}-falcon-h1.yaml; default: a short fine-tune")
    p.set_defaults(func=run_train, task=task)


def _add_run_arguments(parser: argparse.ArgumentParser, config_default: str) -> None:
    """What every training command takes: --config, --set, --resume | --overwrite, --out, --print-config."""
    parser.add_argument("--config", type=Path, help=f"YAML run config (see configs/); {config_default}")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one config value, e.g. --set train.steps=12 (repeatable)")
    start = parser.add_mutually_exclusive_group()
    start.add_argument("--resume", action="store_true",
                       help="continue from the newest complete checkpoint in the output directory, with its "
                       "config.yaml unless --config is given (none there yet: start the run)")
    start.add_argument("--overwrite", action="store_true",
                       help="start a new run even if the output directory holds one: deletes its checkpoints/, "
                       "final/, metrics, config.yaml, loss.png and samples.txt first (without it, that is refused)")
    parser.add_argument("--out", type=Path, help="output directory (sets train.out_dir)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")


def _resolve_config(args: argparse.Namespace):
    """(the config, the file it was read from or None for the built-in demo)."""
    from hybridlm.training.config import ConfigError, command_of, load_config

    task = getattr(args, "task", "pretrain")
    overrides = [f"train.task={task}"] if task != "pretrain" else []
    for flag, key in (("model", "model.init"), ("data", "data.chat"), ("chat_template", "data.chat_template")):
        value = getattr(args, flag, None)
        if value is not None:
            overrides.append(f"{key}={json.dumps(str(value))}")  # quoted: a path is not YAML ("#", "2024")
    if getattr(args, "data", None) is not None:
        overrides.append("data.demo=false")
    config_path = args.config
    if args.out is not None:  # before the user's --set, so that an error in one of those names it, not this one
        if any(item.split("=", 1)[0].strip() == "train.out_dir" for item in args.overrides):
            raise ConfigError("--out and --set train.out_dir both set the output directory; pass one of them")
        overrides.append(f"train.out_dir={json.dumps(str(args.out))}")  # quoted: a path is not YAML ("#", "2024")
    overrides += list(args.overrides)
    if config_path is None and args.resume:
        # continue the run with its own settings (the --out dir's, else the demo's default out dir)
        out = args.out
        if out is None:
            out = Path(load_config(None, overrides, task=task).train.out_dir)
        saved = Path(out) / "config.yaml"
        if saved.is_file():
            config_path = saved
        elif (Path(out) / "checkpoints").is_dir():  # a run without its config: the defaults would not fit it
            raise ConfigError(f"--resume: {saved} is missing, so the run's settings are unknown; pass the config it "
                              f"was started with (--config FILE)")
        else:  # a new run, as a job that always passes --resume needs; said, in case --out is mistyped
            print(f"--resume: {out} holds no run (no config.yaml); starting a new one from `hybridlm "
                  f"{command_of(task)}`'s defaults and the options given", file=sys.stderr)
    return load_config(config_path, overrides, task=task), config_path


def run_train(args: argparse.Namespace) -> int:
    import logging

    from hybridlm.data.errors import DataError
    from hybridlm.training.checkpoint import CheckpointError
    from hybridlm.training.config import ConfigError, dump_config
    from hybridlm.training.guard import TrainingDivergedError

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        config, config_path = _resolve_config(args)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    if args.print_config:
        print(dump_config(config), end="")
        return 0
    from hybridlm.training.trainer import Trainer

    trainer, finished = None, False
    try:
        trainer = Trainer(config, resume=args.resume, overwrite=args.overwrite, config_path=config_path)
        result = trainer.train()
        finished = True
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    except (TrainingDivergedError, CheckpointError, DataError, RuntimeError, OSError) as err:
        print(f"training failed: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as err:  # a second signal, or one outside the training loop (samples, final/)
        return _stopped_at_once(err, trainer)
    finally:
        if trainer is not None:  # on an error, without waiting for ranks that may be inside a collective
            trainer.close(together=finished)
    if trainer.ctx.is_main:
        loss = f"{result.loss:.4f}" if result.loss is not None else "n/a"
        held = f", held-out loss {result.eval_loss:.4f}" if result.eval_loss is not None else ""
        print(f"{result.status}: {result.step} updates, {result.tokens:,} tokens, loss {loss}{held}; "
              f"outputs in {result.out_dir} ({', '.join(_outputs(result.out_dir)) or 'none'})")
    if result.status == "interrupted":
        import signal

        reason = trainer.stop_reason or ""
        return 128 + int(getattr(signal, reason)) if reason in ("SIGINT", "SIGTERM") else 1
    return 0


def _stopped_at_once(err: KeyboardInterrupt, trainer) -> int:
    """One line instead of a traceback for a run stopped at once (unsaved); 128 + the signal's number."""
    import signal

    from hybridlm.training.checkpoint import latest_checkpoint
    from hybridlm.training.config import command_of

    signum = getattr(err, "signum", signal.SIGINT)  # hybridlm.training.stop.SecondSignal, or Ctrl-C's default
    name = signal.Signals(signum).name
    if trainer is None:
        print(f"stopped ({name}) before training started; nothing was trained", file=sys.stderr)
    elif trainer.ctx.is_main:
        out = trainer.out_dir
        latest = latest_checkpoint(trainer.checkpoint_dir)
        command = command_of(trainer.config.train.task)
        saved = (f"the newest checkpoint is {latest.name} (continue with `hybridlm {command} --resume --out {out}`)"
                 if latest is not None else "no checkpoint was saved")
        print(f"stopped at once ({name}) at update {trainer.step}; {saved}", file=sys.stderr)
    return 128 + int(signum)


def run_checkpoint_export(args: argparse.Namespace) -> int:
    import logging

    from hybridlm.training.checkpoint import CheckpointError
    from hybridlm.training.config import ConfigError
    from hybridlm.training.export import export_checkpoint

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")  # (a missing tokenizer)
    try:
        out = export_checkpoint(args.run, args.out, step=args.step, format=args.format, overwrite=args.overwrite)
    except ConfigError as err:
        print(f"checkpoint export: {err}", file=sys.stderr)
        return 2
    except CheckpointError as err:
        print(f"checkpoint export: {err}", file=sys.stderr)
        return 1
    print(f"wrote {out} ({args.format} format)")
    return 0


def _outputs(out_dir: Path) -> list[str]:
    """The run outputs that exist in `out_dir` (an interrupted run has no final/, a run without matplotlib no
    loss.png), as the summary line lists them."""
    names = ("metrics.jsonl", "eval.jsonl", "loss.png", "samples.txt", "checkpoints", "final")
    return [name + ("/" if (out_dir / name).is_dir() else "") for name in names if (out_dir / name).exists()]


def _mup_check_argument_error(args: argparse.Namespace) -> str | None:
    """What is wrong with mup-check's arguments, or None; checked before any model is built or file written
    (a negative --steps or a NaN --lr would otherwise fail inside matplotlib, after mup_check.json is written)."""
    import math

    from hybridlm.training.mup_check import HEAD_DIM

    bad = [w for w in args.widths if w < HEAD_DIM or w % HEAD_DIM]
    if bad:
        return f"--widths: every width must be a positive multiple of {HEAD_DIM} (the head dim), got {bad}"
    repeated = sorted({w for w in args.widths if args.widths.count(w) > 1})
    if repeated:
        return f"--widths repeats {', '.join(map(str, repeated))}; give each width once"
    if args.base_width not in args.widths:
        return f"--base-width {args.base_width} must be one of --widths {args.widths}"
    if args.steps < 1:
        return f"--steps: must be >= 1 (AdamW updates per width), got {args.steps}"
    if not (math.isfinite(args.lr) and args.lr > 0):
        return f"--lr: must be a finite number > 0, got {args.lr}"
    if args.layers < 1:
        return f"--layers: must be >= 1, got {args.layers}"
    if args.seed < 0:
        return f"--seed: must be >= 0, got {args.seed}"
    return None


def run_mup_check(args: argparse.Namespace) -> int:
    from hybridlm.training.mup_check import coordinate_check, spread, write_report

    problem = _mup_check_argument_error(args)
    if problem:
        print(f"mup-check: {problem}", file=sys.stderr)
        return 2
    try:
        result = coordinate_check(args.widths, base_width=args.base_width, steps=args.steps, lr=args.lr,
                                  layers=args.layers, seed=args.seed, scale=not args.no_scale)
    except ValueError as err:
        print(f"mup-check: {err}", file=sys.stderr)
        return 2
    json_path, png_path = write_report(result, args.out)
    print(f"RMS after {args.steps} updates, per width {result['widths']} "
          f"({'muP multipliers' if not args.no_scale else 'multipliers not scaled'}):")
    factors = spread(result, "rms")
    for kind, by_width in result["rms"].items():
        values = " ".join(f"{by_width[str(w)][-1]:9.4f}" for w in result["widths"])
        print(f"  {kind:<10} {values}   max factor vs base width: {factors[kind]:.2f}")
    print(f"wrote {png_path} and {json_path}")
    return 0
