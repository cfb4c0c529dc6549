"""The `hybrid-1b` preset (the long-context scaling runs): ~1B parameters, built on the meta device (no memory), and
every head count splits over tp=8, over mixer parallelism's halves of tp=8 and over the smaller tp sizes."""

import pytest
import torch

from hybridlm.models.model import HybridForCausalLM
from hybridlm.models.presets import get_preset
from hybridlm.parallel import check_mixer_parallel, check_tensor_parallel


@pytest.fixture(scope="module")
def meta_model() -> HybridForCausalLM:
    with torch.device("meta"):
        return HybridForCausalLM(get_preset("hybrid-1b"))


def test_about_one_billion_parameters(meta_model):
    total = sum(p.numel() for p in meta_model.parameters())
    embeddings = meta_model.model.embed_tokens.weight.numel() + meta_model.lm_head.weight.numel()
    assert abs(total / 1e9 - 1) < 0.15, f"{total / 1e9:.3f}B"
    assert abs((total - embeddings) / 1e9 - 1) < 0.05, f"{(total - embeddings) / 1e9:.3f}B without embeddings"


def test_shape_for_long_context(meta_model):
    config = get_preset("hybrid-1b")
    assert config.max_position_embeddings == 32768 and config.mamba_chunk_size == 128
    assert config.block_arrangement == "SA_M" and config.hidden_size == 2048 and config.num_hidden_layers == 24
    block = meta_model.model.layers[0]
    assert block.attn.head_dim == 128 and block.attn.num_heads > block.attn.num_kv_heads  # GQA
    assert (block.ssm.num_heads, block.ssm.groups) == (32, 8)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_tensor_and_mixer_parallel_divisibility(meta_model, tp):
    check_tensor_parallel(meta_model, tp)  # SSM heads split too (ssm_heads=True)
    if tp > 1:
        for mode in ("on", "interleaved"):
            check_mixer_parallel(meta_model, tp, mode=mode)


def test_tp16_is_refused_by_name(meta_model):
    with pytest.raises(ValueError, match="num_key_value_heads=8"):
        check_tensor_parallel(meta_model, 16)
