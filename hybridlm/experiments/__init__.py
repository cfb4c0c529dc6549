"""The papers' experiments: train small models on synthetic tasks and score them (README.md in this folder has the
commands, the recipes and how to reproduce the recorded runs).

    addition.py     variable-digit addition, length generalization (fast-weight paper 5.2, Table 3)
    recall.py       MQAR and needle retrieval at long context (the tasks and their scoring: hybridlm.eval.recall)
    allocation.py   channel-allocation sweep of hybrid blocks (Falcon-H1 Figure 2)
    corpus.py       a built-in synthetic language for the allocation sweep
    models.py       model names ("fw-3A", "hybrid-mamba2", ...) -> small HybridConfigs
    train.py        `train_on_task`: the experiments' training run (resumable, best-weights selection)
    bench.py        resumable runs over devices, mean ± std, markdown tables
    commands.py     `hybridlm bench ...`

Nothing is imported here, so `import hybridlm.experiments` stays cheap.
"""
