"""Evaluation and the papers' experiments (README.md in this folder has the commands and the choices).

    addition.py     variable-digit addition, length generalization (fast-weight paper 5.2, Table 3)
    recall.py       MQAR and single / multi-needle retrieval at long context
    perplexity.py   token-weighted NLL, perplexity, bits per byte on prepared shards
    allocation.py   channel-allocation sweep of hybrid blocks (Falcon-H1 Figure 2)
    harness.py      lm-evaluation-harness adapter (export for `lm_eval --model hf`, loglikelihood)
    corpus.py       a built-in synthetic language for the allocation sweep
    models.py       model names ("fw-3A", "hybrid-mamba2", ...) -> small HybridConfigs
    train_task.py   `train_on_task`: the small training loop of the synthetic benchmarks (resumable)
    scoring.py      teacher-forced hits / NLL of target tokens
    bench.py        resumable runs over devices, mean ± std, markdown tables
    commands.py     `hybridlm bench ...` and `hybridlm eval ...`

Nothing is imported here, so `import hybridlm.eval` stays cheap.
"""
