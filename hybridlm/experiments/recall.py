"""The recall experiment: train small models on MQAR and needle retrieval, score them at long context.

    hybridlm bench recall --models fw-3A,mamba2,transformer --seeds 1 --out runs/recall --device cuda

The tasks and their scoring are `hybridlm.eval.recall`. Training (`RecallRecipe`): by default each task trains a model
of its own (`separate_tasks`; the report joins the three runs of a model and seed), 4000 updates of 64 sequences,
AdamW lr 3e-3; `separate_tasks=False` (`--mixed-tasks`) trains one model on every task, a task per batch round
robin. Each batch has one length, uniform in [train_min_len, train_max_len], right-padded to train_max_len (one
shape: a compiled model neither recompiles nor records a CUDA graph per length). An optional length curriculum
(`curriculum_steps` > 0, off by default) grows the longest training length linearly from `curriculum_start_len` to
train_max_len, MQAR holding min(mqar_pairs, (length - 1) // 4) pairs at each length. The best checkpoint is picked
on the "val" sequences at train_max_len; then every task is evaluated at each of `eval_lens` (default
512 .. 16384) on the "test" sequences, so everything past `train_max_len` tests length generalization (a sequence
longer than any training sequence cannot be one of them, and at the training lengths a repeat has probability
below 128^-16). Reported: answer-token accuracy per task and length, and the exact rate. Results:
benchmarks/RESULTS.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from hybridlm.eval.recall import TASKS, RecallTasks, evaluate
from hybridlm.experiments.train import TrainRecipe, check_counts_and_size, check_non_negative

# A save every 250 updates (runs are 4000 by default) bounds what a kill past the time budget loses.
RECALL_CHECKPOINT_EVERY = 250


@dataclass(frozen=True)
class RecallRecipe(TrainRecipe):
    steps: int = 4000
    batch_size: int = 64
    lr: float = 3e-3
    warmup: int = 400
    size: str = "small"
    tasks: tuple[str, ...] = TASKS
    train_min_len: int = 128
    train_max_len: int = 512
    eval_lens: tuple[int, ...] = (512, 1024, 2048, 4096, 8192, 16384)
    eval_count: int = 64
    val_count: int = 32
    eval_every: int = 250
    eval_tokens_per_batch: int = 1 << 16
    mqar_pairs: int = 16
    needles: int = 4
    curriculum_steps: int = 0
    curriculum_start_len: int = 32
    separate_tasks: bool = True  # a model per task (False: one model trained on every task, round robin)

    def lengths_at(self, step: int) -> tuple[int, int]:
        """The (shortest, longest) training length at `step`. During the curriculum (the first `curriculum_steps`
        updates) the longest grows linearly from `curriculum_start_len` to `train_max_len` and the shortest is
        min(train_min_len, curriculum_start_len); then (train_min_len, train_max_len)."""
        if step >= self.curriculum_steps:
            return self.train_min_len, self.train_max_len
        start = min(self.curriculum_start_len, self.train_max_len)
        longest = start + (self.train_max_len - start) * step // self.curriculum_steps
        return min(self.train_min_len, start), longest

    def to_dict(self) -> dict:
        d = super().to_dict()
        d["tasks"], d["eval_lens"] = list(self.tasks), list(self.eval_lens)
        if self.curriculum_steps == 0:  # its fields stay out of the spec while it is off: stored runs stay reusable
            del d["curriculum_steps"], d["curriculum_start_len"]
        if not self.separate_tasks:  # likewise for the tasks trained together
            del d["separate_tasks"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> RecallRecipe:
        return cls(**{"separate_tasks": False, **d, "tasks": tuple(d["tasks"]), "eval_lens": tuple(d["eval_lens"])})

    def per_task(self) -> dict[str, RecallRecipe]:
        """The recipe of each training run by its task, or {"": the recipe} for one run (tasks trained together, or
        a single task: trained alone either way, so it keeps the mixed form's spec and run names)."""
        if not self.separate_tasks or len(self.tasks) == 1:
            return {"": replace(self, separate_tasks=False)}
        return {task: replace(self, tasks=(task,)) for task in self.tasks}

    def task_params(self) -> RecallTasks:
        return RecallTasks(mqar_pairs=self.mqar_pairs, needles=self.needles)


def training_batch(recipe: RecallRecipe, tasks: RecallTasks, rng: np.random.Generator, step: int) -> dict:
    """Training batch `step`: its task round robin, one length uniform in `recipe.lengths_at(step)`, padded to
    train_max_len (MQAR with as many pairs as the length holds)."""
    task = recipe.tasks[step % len(recipe.tasks)]
    shortest, longest = recipe.lengths_at(step)
    length = int(rng.integers(shortest, longest + 1))
    return tasks.for_length(length).batch(task, rng, recipe.batch_size, length, pad_to=recipe.train_max_len)


def _check_once(flag: str, what: str, values: Sequence) -> None:
    """A list option that names an item twice (a task trained twice, an evaluation column twice): a ValueError."""
    repeated = sorted({v for v in values if values.count(v) > 1})
    if repeated:
        raise ValueError(f"{flag} repeats a {what}: {', '.join(map(str, repeated))}; give each once")


def check_recipe(recipe: RecallRecipe, tasks: RecallTasks) -> None:
    """Clear errors for recipes that cannot run: unknown tasks, lengths too short for a task, a curriculum that
    would not end before training does, evaluation lengths and counts that cannot be evaluated."""
    if not recipe.tasks:
        raise ValueError(f"--tasks names no task; give some of {','.join(TASKS)}, comma-separated")
    for task in recipe.tasks:
        if task not in TASKS:
            raise ValueError(f"unknown recall task {task!r}; choose from {TASKS}")
    _check_once("--tasks", "task", recipe.tasks)
    if not recipe.eval_lens:
        raise ValueError("--eval-lens names no length; give context lengths, comma-separated, e.g. 512,1024")
    _check_once("--eval-lens", "length", recipe.eval_lens)
    for name, task in (("mqar_pairs", "mqar"), ("needles", "multi_needle")):  # each needs that many distinct keys
        n = getattr(recipe, name)
        if task in recipe.tasks and not 1 <= n <= tasks.vocab.keys:
            raise ValueError(f"--{name.replace('_', '-')} must be between 1 and {tasks.vocab.keys} (the distinct keys "
                             f"of the vocabulary), got {n}")
    if not 1 <= recipe.train_min_len <= recipe.train_max_len:
        raise ValueError(f"need 1 <= --train-min-len ({recipe.train_min_len}) <= --train-max-len "
                         f"({recipe.train_max_len})")
    shortest = max(tasks.shortest(t) for t in recipe.tasks)
    first = recipe.lengths_at(0)[0]
    if first < shortest:
        raise ValueError(f"training sequences of {first} tokens are too short for the tasks {list(recipe.tasks)} "
                         f"(at least {shortest}): raise --train-min-len"
                         + (" / --curriculum-start-len" if recipe.curriculum_steps > 0 else ""))
    if "mqar" in recipe.tasks and recipe.train_max_len < tasks.full_length("mqar"):
        raise ValueError(f"--train-max-len {recipe.train_max_len} is too short for {tasks.mqar_pairs} MQAR pairs and "
                         f"their queries (at least {tasks.full_length('mqar')}): raise it or lower --mqar-pairs")
    if recipe.curriculum_steps and recipe.curriculum_start_len > recipe.train_max_len:
        raise ValueError(f"--curriculum-start-len {recipe.curriculum_start_len} is longer than --train-max-len "
                         f"{recipe.train_max_len}: the curriculum grows the longest sequences up to it")
    if recipe.curriculum_steps >= recipe.steps > 1:
        raise ValueError(f"the length curriculum ({recipe.curriculum_steps} steps) must end before training does "
                         f"({recipe.steps} steps); lower --curriculum-steps (0 turns it off)")
    for length in recipe.eval_lens:  # evaluation lays every task out at full size
        for task in recipe.tasks:
            if length < tasks.full_length(task):
                raise ValueError(f"--eval-lens {length} is too short for {task} (at least {tasks.full_length(task)} "
                                 "tokens): drop it or lower --mqar-pairs / --needles")
    check_non_negative(recipe, "eval_every", "curriculum_steps")  # 0: validate only at the end / no curriculum
    check_counts_and_size(recipe, "steps", "batch_size", "eval_count", "val_count", "eval_tokens_per_batch")


def run_recall(model_name: str, seed: int, recipe: RecallRecipe, *, device: str = "cpu", log_fn=None,
               checkpoint=None, should_stop=None) -> dict:
    """Train `model_name` on the recall tasks from `seed`; evaluate every task at every length. `checkpoint`
    and `should_stop`: resumable training, as in `addition.run_addition`."""
    from hybridlm.experiments.models import build_model, run_record, task_config
    from hybridlm.experiments.train import generator_state, train_on_task

    tasks = recipe.task_params()
    check_recipe(recipe, tasks)
    config = task_config(model_name, vocab_size=tasks.vocab.size, size=recipe.size)
    model = build_model(config, seed=seed)
    rng = np.random.default_rng([seed, 11])

    def batch_fn(step: int) -> dict:
        return training_batch(recipe, tasks, rng, step)

    def val_fn(m) -> tuple[float, float]:  # in-distribution: the longest training length, validation sequences
        res = evaluate(m, tasks, recipe.tasks, [recipe.train_max_len], count=recipe.val_count, device=device,
                       tokens_per_batch=recipe.eval_tokens_per_batch, split="val")
        rows = [r[recipe.train_max_len] for r in res.values()]
        return float(np.mean([r["token_acc"] for r in rows])), float(np.mean([r["loss"] for r in rows]))

    trained = train_on_task(model, batch_fn, device=device, eval_fn=val_fn, eval_every=recipe.eval_every,
                            log_fn=log_fn, checkpoint=checkpoint, batch_state=generator_state(rng),
                            fingerprint={"task": "recall", "model": model_name, "seed": seed,
                                         "recipe": recipe.to_dict()},
                            should_stop=should_stop, checkpoint_every=RECALL_CHECKPOINT_EVERY,
                            **recipe.train_options())
    res = evaluate(model, tasks, recipe.tasks, recipe.eval_lens, count=recipe.eval_count, device=device,
                   tokens_per_batch=recipe.eval_tokens_per_batch)
    return {
        **run_record(model_name, seed, model, trained),
        "results": {task: {str(length): r for length, r in by_len.items()} for task, by_len in res.items()},
    }


# --- the benchmark ---------------------------------------------------------------------------------

RUNNER = "hybridlm.experiments.recall:run_job"


def run_job(spec: dict, *, device: str, log_fn=None, checkpoint=None, should_stop=None) -> dict:
    return run_recall(spec["model"], spec["seed"], RecallRecipe.from_dict(spec["recipe"]), device=device,
                      log_fn=log_fn, checkpoint=checkpoint, should_stop=should_stop)


def bench_recall(models: Sequence[str], seeds: Sequence[int], recipe: RecallRecipe, out_dir, **run_options) -> dict:
    """Train every model with every seed and write the report; `run_options` go to `bench.run_jobs`
    (devices, per_device, time_budget, echo). Finished runs in out_dir/runs are reused."""
    from hybridlm.experiments import bench

    check_recipe(recipe, recipe.task_params())  # before any worker starts: one clear error, not one per run

    runs = recipe.per_task()
    one = runs.get("")  # one run per model and seed (tasks together, or a single task)
    parts = None if one else {task: r.to_dict() for task, r in runs.items()}
    return bench.bench_model_seeds(
        "recall", RUNNER, models, seeds, one.to_dict() if one else None, out_dir,
        lambda by_model, out, missing: write_report(by_model, recipe, out, missing=missing),
        parts=parts, merge=merge_task_runs if parts else None, **run_options,
    )


def merge_task_runs(runs: list[dict]) -> dict:
    """One model-and-seed record from its finished runs of single tasks: "results" as a run of every task has
    them; "train", "best_step", "seconds" and "device" become {task: that run's value}."""
    merged = {key: runs[0][key] for key in ("model", "seed", "parameters")}
    merged["results"] = {task: by_len for r in runs for task, by_len in r["results"].items()}
    for key in ("train", "best_step", "seconds", "device"):
        merged[key] = {task: r.get(key) for r in runs for task in r["results"]}
    return merged


def write_report(by_model: dict[str, list[dict]], recipe: RecallRecipe, out_dir: Path, *, missing=()) -> dict:
    """results.json, results.md (one table per task: accuracy by length) and accuracy_vs_length.png."""
    from hybridlm.experiments import bench
    from hybridlm.experiments.models import describe

    def stat(rs: list[dict], task: str, metric: str) -> dict:
        done = [r["results"][task] for r in rs if task in r["results"]]  # a stopped task run leaves a gap
        return {n: bench.mean_std([d[str(n)][metric] for d in done]) for n in recipe.eval_lens}

    stats = {
        m: {
            "seeds": [r["seed"] for r in rs],
            "parameters": rs[0]["parameters"] if rs else None,
            "runs": {t: sum(t in r["results"] for r in rs) for t in recipe.tasks},
            "acc": {t: stat(rs, t, "token_acc") for t in recipe.tasks},
            "exact": {t: stat(rs, t, "exact_match") for t in recipe.tasks},
        }
        for m, rs in by_model.items()
    }
    text = [
        "# Recall at long context (MQAR, single and multi-needle retrieval)",
        "",
        f"Command: `{bench.command_line()}`",
        "",
        (f"Recipe: size `{recipe.size}`, {recipe.steps} steps x batch {recipe.batch_size}, lengths "
         f"{recipe.train_min_len}..{recipe.train_max_len} ("
         + (f"{recipe.tasks[0]} only" if len(recipe.tasks) == 1 else
            "a model trained per task" if recipe.separate_tasks else "one task per batch, round robin")
         + (f"; the longest grows from {recipe.curriculum_start_len} over the first {recipe.curriculum_steps} steps, "
            "MQAR pairs as the length allows" if recipe.curriculum_steps > 0 else "")
         + f"), AdamW lr {recipe.lr:g} "
         f"(warmup {recipe.warmup}, cosine to {recipe.min_lr_ratio:g}x), wd {recipe.weight_decay:g}; MQAR "
         f"{recipe.mqar_pairs} pairs, multi-needle {recipe.needles} needles; {recipe.eval_count} held-out sequences "
         "per task and length. Answer-token accuracy in % (mean ± sample std over seeds)."),
        "",
    ]
    for task in recipe.tasks:
        for key, what in (("acc", "answer-token accuracy"), ("exact", "exact: every answer of a sequence right")):
            rows = [[f"{describe(m)} `{m}`", bench.human_count(s["parameters"]) if s["seeds"] else "–",
                     *(bench.pm(s[key][task][n]) for n in recipe.eval_lens), str(s["runs"][task])]
                    for m, s in stats.items()]
            text += [f"## {task}, {what}", "",
                     bench.markdown_table(["Model", "Params", *(f"L={n}" for n in recipe.eval_lens), "Seeds"], rows),
                     ""]
    files = bench.write_outputs(
        out_dir, lines=text, missing=missing, png="accuracy_vs_length.png",
        payload={"task": "recall", "recipe": recipe.to_dict(), "aggregate": stats, "runs": by_model},
        plot=lambda path: _plot(stats, recipe, path),
    )
    return {"files": files, "aggregate": stats}


def _plot(stats: dict, recipe: RecallRecipe, path: Path) -> None:
    from hybridlm.experiments.bench import plot_percent_with_std, pyplot
    from hybridlm.experiments.models import describe
    from hybridlm.fileio import save_figure_atomic

    plt = pyplot()
    fig, axes = plt.subplots(1, len(recipe.tasks), figsize=(4.5 * len(recipe.tasks), 4), squeeze=False)
    lengths = np.array(recipe.eval_lens)
    for ax, task in zip(axes[0], recipe.tasks):
        for m, s in stats.items():
            if not s["seeds"]:
                continue
            mean = np.array([s["acc"][task][n]["mean"] for n in lengths]) * 100
            std = np.array([s["acc"][task][n]["std"] for n in lengths]) * 100
            plot_percent_with_std(ax, lengths, mean, std, label=describe(m), marker="o", markersize=3)
        ax.set_xscale("log", base=2)
        ax.axvline(recipe.train_max_len, color="0.6", linestyle="--", linewidth=1)
        ax.set_title(task)
        ax.set_xlabel("context length (dashed: longest training length)")
        ax.set_ylim(-2, 102)
    axes[0][0].set_ylabel("answer accuracy (%)")
    if any(s["seeds"] for s in stats.values()):
        axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    try:
        save_figure_atomic(fig, path, dpi=110)  # a crash mid-write keeps the previous PNG
    finally:
        plt.close(fig)
