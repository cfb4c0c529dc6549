"""`hybridlm sft` / `dpo` on two gloo processes (FSDP2) train like one process with the same global batch: the
ranks take slices of one stream of packed rows (SFT) or pairs (DPO), and the loss is the mean over the global batch.
(Each run is `torch.multiprocessing.spawn` of `_worker`, with the environment torchrun would set.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from hybridlm.data.chat import demo_conversations, demo_preferences
from hybridlm.training.config import load_config
from hybridlm.training.trainer import Trainer
from tests.helpers import free_port
from tests.posttraining.helpers import make_model_dir

KEYS = ("loss", "grad_norm")


def _config(task: str, model_dir: str, data: str, out: str, *sets: str):
    return load_config(None, [f"model.init={model_dir}", f"data.chat={data}", "data.demo=false", f"train.out_dir={out}",
                              "train.steps=4", "train.progress=false", "train.samples=0", "train.save_every=0",
                              "train.log_every=1", "batch.seq_len=128", "optim.lr=3e-3", *sets], task=task)


def _worker(rank: int, world: int, port: int, task: str, model_dir: str, data: str, out: str, result: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    trainer = Trainer(_config(task, model_dir, data, out, "batch.micro_batch=2", "train.device=cpu"))
    try:
        trainer.train()
        if rank == 0:
            Path(result).write_text(json.dumps([{k: r[k] for k in KEYS} for r in trainer.history]))
    finally:
        trainer.close()


@pytest.mark.parametrize("task", ["sft", "dpo"])
def test_two_ranks_match_one_process(task, tmp_path):
    model_dir = make_model_dir(tmp_path / "m")
    records = demo_preferences(16) if task == "dpo" else demo_conversations(24)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    one = Trainer(_config(task, str(model_dir), str(data), str(tmp_path / "one"), "batch.micro_batch=2",
                          "batch.grad_accum=2"))
    one.train()
    one.close()
    expected = [{k: r[k] for k in KEYS} for r in one.history]
    result = tmp_path / "two.json"
    mp.spawn(_worker, args=(2, free_port(), task, str(model_dir), str(data), str(tmp_path / "two"), str(result)),
             nprocs=2, join=True)
    got = json.loads(result.read_text())
    assert len(got) == len(expected) == 4
    for a, b in zip(got, expected):
        assert abs(a["loss"] - b["loss"]) < 1e-5 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-5 * b["grad_norm"]
    # the model moved (DPO's first loss is ln 2, policy = reference), so equality means something
    assert all(abs(r["loss"] - expected[0]["loss"]) > 1e-3 for r in expected[1:])
