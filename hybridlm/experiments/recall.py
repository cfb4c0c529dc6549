"""Recall at long context: multi-query associative recall (MQAR) and single / multi-needle retrieval.

Vocabulary (`RecallVocab`, 328 ids by default): <pad> 0, <bos> 1, <eos> 2, <blank> 3, <needle> 4,
<query> 5 (6, 7 unused), then 128 keys, 128 values and 64 haystack words. Every sequence starts with
<bos>; its labels are -100 except at the answers (the value that must follow a queried key), which is
what the loss trains and the accuracy scores (teacher-forced, argmax).

    mqar           <bos> k1 v1 k2 v2 ... kN vN | then N queries ki vi, each key once in random order, at
                   random slots of the rest of the sequence, <blank> everywhere else (Zoology's layout).
                   N = `mqar_pairs` distinct keys; values drawn with replacement.
    needle         a haystack of random words with one "<needle> k v" at a uniformly random depth; the
                   sequence ends with "<query> k v <eos>".
    multi_needle   `needles` needles with distinct keys at random depths; the end queries all of them in
                   random order: "<query> k v" each, then <eos>.

Training: by default each task trains a model of its own (`separate_tasks`; the report joins the three runs of
a model and seed), 4000 updates of 64 sequences, AdamW lr 3e-3. Why: on an H200 (2026-11-30, benchmarks/RESULTS.md)
no attention-free model left the chance plateau when one model trained on all three tasks, round robin (1500 and
6000 updates), while trained on MQAR alone Falcon-1A learned it by ~2000 updates (99.6% validation accuracy;
100% at 512..8K after 6000) and on the single needle alone reached 84% by 3750. `separate_tasks=False`
(`--mixed-tasks`) is the earlier recipe: a task per batch, round robin. Each batch has one length, uniform in
[train_min_len, train_max_len], right-padded to train_max_len (one shape: a compiled model neither
recompiles nor records a CUDA graph per length). An optional length curriculum (`curriculum_steps` > 0, off by
default) grows the longest training length linearly from `curriculum_start_len` to train_max_len, MQAR holding
min(mqar_pairs, (length - 1) // 4) pairs at each length; on MQAR alone it did not speed Falcon-1A up (both at
99% by 2000 updates, 3000 curriculum steps from 64 tokens) and Mamba-2 learned less with it (1.0% vs 6.5%).
Evaluation runs every task at each of `eval_lens`
(default 512 .. 16384), so everything past `train_max_len` tests length generalization. Evaluation
sequences come from fixed seed streams of their own, the same for every model and training seed (held
out: a sequence longer than any training sequence cannot be one of them, and at the training lengths a
repeat has probability below 128^-16); the best checkpoint is picked on a validation stream separate
from the test sequences. Reported: answer-token accuracy per task and length, and the exact rate
(every answer of a sequence right).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from hybridlm.eval import scoring
from hybridlm.eval.scoring import IGNORE_INDEX
from hybridlm.eval.train_task import TrainRecipe, check_counts_and_size, check_non_negative

TASKS = ("mqar", "needle", "multi_needle")
PAD, BOS, EOS, BLANK, NEEDLE, QUERY = 0, 1, 2, 3, 4, 5
_FIRST_FREE = 8
_EVAL_SEED = 3_000_017


@dataclass(frozen=True)
class RecallVocab:
    keys: int = 128
    values: int = 128
    words: int = 64

    @property
    def key0(self) -> int:
        return _FIRST_FREE

    @property
    def value0(self) -> int:
        return _FIRST_FREE + self.keys

    @property
    def word0(self) -> int:
        return _FIRST_FREE + self.keys + self.values

    @property
    def size(self) -> int:
        return self.word0 + self.words


def mqar_example(rng: np.random.Generator, length: int, pairs: int,
                 vocab: RecallVocab) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [length], labels [length]) of one MQAR sequence."""
    if pairs > vocab.keys:
        raise ValueError(f"mqar: {pairs} pairs need as many distinct keys, the vocabulary has {vocab.keys}")
    rest = length - 1 - 2 * pairs
    if rest < 2 * pairs:
        raise ValueError(f"mqar: length {length} is too short for {pairs} pairs and their queries")
    keys = vocab.key0 + rng.choice(vocab.keys, size=pairs, replace=False)
    values = vocab.value0 + rng.integers(0, vocab.values, size=pairs)
    tokens = np.full(length, BLANK, dtype=np.int64)
    labels = np.full(length, IGNORE_INDEX, dtype=np.int64)
    tokens[0] = BOS
    tokens[1:1 + 2 * pairs:2], tokens[2:2 + 2 * pairs:2] = keys, values
    # queries: `pairs` non-overlapping 2-token slots among the rest // 2 slots after the pairs
    slots = np.sort(rng.choice(rest // 2, size=pairs, replace=False))
    starts = 1 + 2 * pairs + 2 * slots
    order = rng.permutation(pairs)
    tokens[starts], tokens[starts + 1] = keys[order], values[order]
    labels[starts + 1] = values[order]
    return tokens, labels


def needle_example(rng: np.random.Generator, length: int, needles: int,
                   vocab: RecallVocab) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, labels) of a haystack with `needles` needles, every one queried at the end."""
    tail = 3 * needles + 1  # "<query> k v" per needle, then <eos>
    hay = length - 1 - tail
    if hay < 3 * needles:
        raise ValueError(f"needle: length {length} is too short for {needles} needle(s)")
    keys = vocab.key0 + rng.choice(vocab.keys, size=needles, replace=False)
    values = vocab.value0 + rng.integers(0, vocab.values, size=needles)
    tokens = np.empty(length, dtype=np.int64)
    labels = np.full(length, IGNORE_INDEX, dtype=np.int64)
    tokens[0] = BOS
    tokens[1:1 + hay] = vocab.word0 + rng.integers(0, vocab.words, size=hay)
    # needles at non-overlapping 3-token slots of the haystack, uniformly random depths
    slots = np.sort(rng.choice(hay // 3, size=needles, replace=False))
    for slot, k, v in zip(slots, keys, values):
        at = 1 + 3 * slot
        tokens[at:at + 3] = (NEEDLE, k, v)
    order = rng.permutation(needles)
    at = 1 + hay
    for i in order:
        tokens[at:at + 3] = (QUERY, keys[i], values[i])
        labels[at + 2] = values[i]
        at += 3
    tokens[at] = EOS
    return tokens, labels


@dataclass(frozen=True)
class RecallTasks:
    """Task parameters shared by training and evaluation."""

    mqar_pairs: int = 16
    needles: int = 4  # multi_needle
    vocab: RecallVocab = field(default_factory=RecallVocab)

    def example(self, task: str, rng: np.random.Generator, length: int) -> tuple[np.ndarray, np.ndarray]:
        if task == "mqar":
            return mqar_example(rng, length, self.mqar_pairs, self.vocab)
        if task == "needle":
            return needle_example(rng, length, 1, self.vocab)
        if task == "multi_needle":
            return needle_example(rng, length, self.needles, self.vocab)
        raise ValueError(f"unknown recall task {task!r}; choose from {TASKS}")

    def shortest(self, task: str) -> int:
        """The shortest sequence `task` can be laid out in (MQAR: one pair and its query)."""
        if task == "mqar":
            return 5
        return 6 * (1 if task == "needle" else self.needles) + 2  # <bos>, haystack >= the needles, the queries, <eos>

    def full_length(self, task: str) -> int:
        """The shortest sequence `task` can be laid out in at full size (MQAR: all `mqar_pairs` and their queries)."""
        return 4 * self.mqar_pairs + 1 if task == "mqar" else self.shortest(task)

    def for_length(self, length: int) -> RecallTasks:
        """These tasks with as many MQAR pairs as a `length`-token sequence holds with room for their queries
        (at most `mqar_pairs`; a training curriculum's short sequences)."""
        pairs = max(1, min(self.mqar_pairs, (length - 1) // 4))
        return self if pairs == self.mqar_pairs else replace(self, mqar_pairs=pairs)

    def batch(self, task: str, rng: np.random.Generator, batch_size: int, length: int, *,
              pad_to: int | None = None) -> dict[str, torch.Tensor]:
        """`batch_size` examples of `length` tokens, right-padded with <pad> (label -100) to `pad_to` tokens: after
        the example, so a causal model's outputs on it are unchanged, and one shape for every training batch (a
        compiled model would otherwise recompile, and record a CUDA graph, per length)."""
        rows = [self.example(task, rng, length) for _ in range(batch_size)]
        ids, labels = np.stack([t for t, _ in rows]), np.stack([lab for _, lab in rows])
        if pad_to is not None and pad_to > length:
            ids = np.pad(ids, ((0, 0), (0, pad_to - length)), constant_values=PAD)
            labels = np.pad(labels, ((0, 0), (0, pad_to - length)), constant_values=IGNORE_INDEX)
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels)}


SPLITS = ("test", "val")
# Runs are short (4000 updates by default): a save every 250 bounds what a kill past the time budget loses.
RECALL_CHECKPOINT_EVERY = 250


def eval_set(tasks: RecallTasks, task: str, length: int, count: int, *, split: str = "test") -> dict[str, torch.Tensor]:
    """The fixed held-out sequences of one task and length: "test" for the reported results, "val" (a seed stream
    of its own) for picking the best checkpoint during training, so the selection never sees the test sequences."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose from {SPLITS}")
    rng = np.random.default_rng([_EVAL_SEED, TASKS.index(task), length, SPLITS.index(split)])
    return tasks.batch(task, rng, count, length)


@torch.no_grad()
def evaluate(model, tasks: RecallTasks, task_names: Sequence[str], lengths: Sequence[int], *, count: int,
             device, tokens_per_batch: int = 1 << 16, split: str = "test") -> dict[str, dict[int, dict[str, float]]]:
    """task -> length -> answer accuracy, exact rate, loss (teacher-forced) on `eval_set`'s `split`."""
    from hybridlm.eval.train_task import autocast_for

    was_training = model.training
    model.eval()
    out: dict[str, dict[int, dict[str, float]]] = {}
    for task in task_names:
        out[task] = {}
        for length in lengths:
            data = eval_set(tasks, task, length, count, split=split)
            per_batch = max(1, tokens_per_batch // length)
            total = None
            for start in range(0, count, per_batch):
                ids = data["input_ids"][start:start + per_batch].to(device)
                labels = data["labels"][start:start + per_batch].to(device)
                with autocast_for(device):
                    logits = model(ids).logits
                total = scoring.accumulate(total, scoring.target_scores(logits, labels))
            out[task][length] = scoring.finish(total)
    model.train(was_training)
    return out


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
        if self.curriculum_steps == 0:  # without a curriculum, the spec its earlier runs were saved under
            del d["curriculum_steps"], d["curriculum_start_len"]
        if not self.separate_tasks:  # likewise for the tasks trained together (the earlier recipe)
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
    from hybridlm.eval.models import build_model, parameter_count, task_config
    from hybridlm.eval.train_task import generator_state, train_on_task

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
        "model": model_name,
        "seed": seed,
        "parameters": parameter_count(model),
        "train": trained.to_dict(),
        "best_step": trained.best_step,
        "results": {task: {str(length): r for length, r in by_len.items()} for task, by_len in res.items()},
    }


# --- the benchmark ---------------------------------------------------------------------------------

RUNNER = "hybridlm.eval.recall:run_job"


def run_job(spec: dict, *, device: str, log_fn=None, checkpoint=None, should_stop=None) -> dict:
    return run_recall(spec["model"], spec["seed"], RecallRecipe.from_dict(spec["recipe"]), device=device,
                      log_fn=log_fn, checkpoint=checkpoint, should_stop=should_stop)


def bench_recall(models: Sequence[str], seeds: Sequence[int], recipe: RecallRecipe, out_dir, **run_options) -> dict:
    """Train every model with every seed and write the report; `run_options` go to `bench.run_jobs`
    (devices, per_device, time_budget, echo). Finished runs in out_dir/runs are reused."""
    from hybridlm.eval import bench

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
    from hybridlm.eval import bench
    from hybridlm.eval.models import describe

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
    from hybridlm.eval.bench import plot_percent_with_std, pyplot
    from hybridlm.eval.models import describe
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
