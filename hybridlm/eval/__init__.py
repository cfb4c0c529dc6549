"""Evaluating a given model (README.md in this folder has the commands and what each number counts).

    perplexity.py   token-weighted NLL, perplexity, bits per byte on prepared shards
    recall.py       MQAR and single / multi-needle retrieval tasks, answer accuracy of a model on them
    scoring.py      teacher-forced hits / NLL of target tokens
    harness.py      lm-evaluation-harness adapter (export for `lm_eval --model hf`, loglikelihood)
    commands.py     `hybridlm eval ...`

The papers' experiments, which train models and then score them, are `hybridlm.experiments`.
Nothing is imported here, so `import hybridlm.eval` stays cheap.
"""
