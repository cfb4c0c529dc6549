"""README.md's Python block runs as written, at tiny sizes: the official checkpoint it loads is a tiny
`falcon_h1` directory written here (weights, config and tokenizer files, as a downloaded one has), and its
training run is a few updates on a slice of the demo corpus. Every substitution must find its text, so an edit
of the README that drops or rewrites one fails here instead of going untested."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OFFICIAL_PATH = 'path = "Falcon-H1-0.5B-Base"'
TRAIN_OVERRIDES = '["train.steps=50", "train.out_dir=runs/python-demo"]'


def readme_python() -> str:
    """The README's one ```python block."""
    blocks = re.findall(r"^```python\n(.*?)^```", (REPO / "README.md").read_text(encoding="utf-8"), re.M | re.S)
    assert len(blocks) == 1, f"README.md has {len(blocks)} python blocks; this test runs exactly one"
    return blocks[0]


def write_tiny_falcon_h1(path: Path) -> None:
    """A tiny official-format checkpoint directory: config.json and safetensors in the falcon_h1 layout, plus the
    tokenizer files transformers' AutoTokenizer reads (the demo's byte-level tokenizer)."""
    import torch
    from transformers import PreTrainedTokenizerFast

    from hybridlm import HybridForCausalLM, get_preset
    from hybridlm.training.demo import build_byte_tokenizer

    torch.manual_seed(0)
    HybridForCausalLM(get_preset("tiny")).save_pretrained(path, format="falcon_h1")
    PreTrainedTokenizerFast(
        tokenizer_object=build_byte_tokenizer().tokenizer,
        bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>", pad_token="<|pad|>",
    ).save_pretrained(path)


def substitute(code: str, old: str, new: str) -> str:
    assert code.count(old) == 1, f"README.md's python block no longer contains {old!r} once"
    return code.replace(old, new)


def test_readme_python_block_runs(tmp_path, monkeypatch):
    official = tmp_path / "falcon-h1-tiny"
    write_tiny_falcon_h1(official)
    code = substitute(readme_python(), OFFICIAL_PATH, f"path = {str(official)!r}")
    tiny_run = [
        f"train.out_dir={tmp_path / 'run'}", f"data.demo_dir={tmp_path / 'demo'}", "data.demo_max_bytes=400000",
        "data.demo_heldout_every=4", "batch.micro_batch=2", "batch.seq_len=32", "train.steps=2",
        "train.eval_every=0", "train.eval_batches=1", "train.save_every=0", "train.samples=0",
        "train.progress=false", "schedule.warmup=1",
    ]
    code = substitute(code, TRAIN_OVERRIDES, repr(tiny_run))
    monkeypatch.chdir(REPO)  # the block names configs/demo.yaml relative to the repository
    namespace: dict = {"__name__": "readme"}
    exec(compile(code, "README.md", "exec"), namespace)

    assert namespace["logits"].shape == (2, 16, namespace["config"].vocab_size)
    assert namespace["out"].shape == (1, 64, 2, 32)
    assert namespace["continuation"].shape[1] > namespace["prompt"]["input_ids"].shape[1]
    assert namespace["result"].status == "completed" and namespace["result"].step == 2


def test_readme_stays_under_ten_thousand_characters():
    assert len((REPO / "README.md").read_text(encoding="utf-8")) <= 10_000
