"""Data: tokenizer training, corpora -> token shards, and the packing loader for training.

    tokenizer.py   byte-level BPE (digits and punctuation split, LaTeX tokens, stable special ids), stats
    corpus.py      find and read .txt / .jsonl / .parquet inputs, counting bad input
    shards.py      `prepare` (parallel, resumable, atomic) and `TokenDataset` (verified, memory-mapped)
    augment.py     fill-in-the-middle and section reordering on token ids
    loader.py      `PackedLoader`: packing, weighted mixtures with schedules and epoch limits, exact resume
    commands.py    `hybridlm tokenizer train|stats` and `hybridlm data prepare|verify`

Nothing is imported here, so `import hybridlm.data` stays cheap (loader.py imports torch).
See README.md in this folder for the file formats and commands.
"""
