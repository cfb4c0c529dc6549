"""configs/sft-falcon-h1.yaml and configs/dpo-falcon-h1.yaml load for a Falcon-H1-sized model and hold the report's
values."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridlm.models.configuration import transformers_config
from hybridlm.models.presets import get_preset
from hybridlm.training.config import load_config
from hybridlm.training.plan import plan_steps

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("falcon-h1-0.5b")
    transformers_config(get_preset("falcon-h1-0.5b"), model="hybridlm").save_pretrained(directory)
    return directory


def test_sft_recipe(model_dir, tmp_path):
    config = load_config(CONFIGS / "sft-falcon-h1.yaml", [f"model.init={model_dir}", f"data.chat={tmp_path}",
                                                          f"train.out_dir={tmp_path}/out"], task="sft")
    assert config.train.task == "sft" and config.optim.lr == 128e-6 and config.optim.weight_decay == 0.0
    s = config.schedule
    assert (s.kind, s.unit, s.warmup, s.decay_fraction, s.decay_shape, s.min_lr_ratio) == (
        "wsd", "tokens", 50e6, 0.5, "exponential", 0.125)
    steps, tokens = plan_steps(config, 8)  # 8 data-parallel GPUs: 1 MT per update
    assert config.batch.seq_len * config.batch.grad_accum * 8 == 2**20 and tokens >= 3e9 and steps == 2862


def test_dpo_recipe(model_dir, tmp_path):
    config = load_config(CONFIGS / "dpo-falcon-h1.yaml", [f"model.init={model_dir}", f"data.chat={tmp_path}",
                                                          f"train.out_dir={tmp_path}/out"], task="dpo")
    assert (config.dpo.beta, config.dpo.loss, config.optim.lr) == (5.0, "norm", 5e-6)
    assert config.batch.micro_batch * config.batch.grad_accum * 8 == 256
