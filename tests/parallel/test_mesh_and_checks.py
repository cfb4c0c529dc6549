"""Mesh config validation and tensor-parallel divisibility errors (no processes needed)."""

from __future__ import annotations

import pytest

from hybridlm.parallel import ParallelConfig, check_tensor_parallel
from hybridlm.parallel.mixer_parallel import check_mixer_parallel
from tests.parallel.harness import tiny_model


def test_dp_shard_takes_the_rest_of_the_world():
    assert ParallelConfig(tp=2, cp=2).resolved(8).shape == (1, 2, 2, 2)
    assert ParallelConfig(dp_replicate=2, dp_shard=2, tp=2).resolved(8).shape == (2, 2, 1, 2)


@pytest.mark.parametrize(
    ("config", "world", "message"),
    [
        (ParallelConfig(tp=3), 4, "not divisible by dp_replicate \\* cp \\* tp"),
        (ParallelConfig(dp_shard=3, tp=2), 4, "must equal it"),
        (ParallelConfig(tp=0), 4, "ParallelConfig.tp must be an integer >= 1"),
        (ParallelConfig(dp_shard=0), 4, "ParallelConfig.dp_shard"),
        (ParallelConfig(tp=1, mixer_parallel="on"), 4, "tp must be even, got tp=1"),
        (ParallelConfig(tp=2, mixer_parallel="yes"), 4, "ParallelConfig.mixer_parallel must be one of"),
    ],
    ids=["tp-does-not-divide", "product-mismatch", "tp-zero", "dp-shard-zero", "mixer-parallel-odd-tp",
         "mixer-parallel-mode"],
)
def test_bad_mesh_sizes_raise(config, world, message):
    with pytest.raises(ValueError, match=message):
        config.resolved(world)


@pytest.mark.parametrize(
    ("overrides", "tp", "field"),
    [
        ({"num_key_value_heads": 1}, 2, "num_key_value_heads=1"),
        ({"num_attention_heads": 3, "num_key_value_heads": 3}, 2, "num_attention_heads=3"),
        ({"num_attention_heads": 4, "num_key_value_heads": 4, "mamba_n_groups": 4, "intermediate_size": 322}, 4,
         "intermediate_size=322"),
        ({}, 2, "mamba_n_groups=1"),  # the tiny preset's B/C: one group cannot split over 2 ranks
        ({"use_attention": False, "mamba_n_heads": 6, "mamba_d_ssm": 384, "mamba_n_groups": 2}, 4, "mamba_n_heads=6"),
        ({"ssm_mixer": "fast_weight", "fw_heads": 3, "fw_head_dim": 32}, 2, "fw_heads .*=3"),
    ],
    ids=["kv-heads", "query-heads", "mlp-width", "mamba-groups", "mamba-heads", "fast-weight-heads"],
)
def test_tensor_parallel_divisibility_errors_name_the_field(overrides, tp, field):
    model = tiny_model(**overrides)
    with pytest.raises(ValueError, match=field):
        check_tensor_parallel(model, tp)


def test_divisible_shapes_pass():
    check_tensor_parallel(tiny_model(mamba_n_groups=2), 2)  # 2 query heads, 2 KV heads, MLP 320, 4 SSM heads
    check_tensor_parallel(tiny_model(), 2, ssm_heads=False)  # 1 B/C group: the SSM mixers stay replicated


@pytest.mark.parametrize(
    ("overrides", "tp", "message"),
    [
        ({"block_arrangement": "S_A_M"}, 2, "block_arrangement='S_A_M'"),
        ({}, 4, "mamba_n_groups=1"),  # tp=4: SSM TP=2 inside its half needs 2 B/C groups
        ({"num_key_value_heads": 1}, 4, "num_key_value_heads=1"),  # attention TP=2 inside its half
        ({}, 3, "even tp"),
    ],
    ids=["sequential-arrangement", "ssm-groups-in-half", "kv-heads-in-half", "odd-tp"],
)
def test_mixer_parallel_errors_name_the_field(overrides, tp, message):
    with pytest.raises(ValueError, match=message):
        check_mixer_parallel(tiny_model(**overrides), tp, mode="interleaved")


def test_mixer_parallel_halves_of_one_rank_need_no_split():
    check_mixer_parallel(tiny_model(num_key_value_heads=1), 2, mode="on")  # each half: 1 rank, whole mixers


def test_checkpointed_compiled_blocks_compile_on_packed_documents():
    """wrap_blocks puts the checkpoint around the compiled block: on packed documents (graph breaks around attention)
    the blocks still run compiled graphs, where a compiled checkpointed block would run wholly eager; the losses and
    gradients are eager's."""
    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters

    from hybridlm.parallel.parallelize import wrap_blocks

    eager, wrapped = tiny_model(), tiny_model()
    torch._dynamo.reset()
    counters.clear()
    wrap_blocks(wrapped, activation_checkpointing=True, compile=True)
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    cu_seqlens = torch.tensor([0, 7, 19, 30])
    losses = [model(ids, labels=ids, cu_seqlens=cu_seqlens).loss for model in (eager, wrapped)]
    for loss in losses:
        loss.backward()
    assert counters["stats"]["unique_graphs"] > 0
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
    for (name, a), b in zip(eager.named_parameters(), wrapped.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5, msg=name)
    torch._dynamo.reset()


@pytest.mark.parametrize("ssm_mixer", ["mamba2", "fast_weight"])
def test_wrap_blocks_sets_the_mixers_own_recomputation(ssm_mixer):
    """By default the fast-weight mixers recompute and Mamba-2's keep their activations; "all" / "none" when asked;
    none under activation checkpointing (which recomputes the whole block); an unknown setting is refused."""
    from hybridlm.parallel.parallelize import wrap_blocks

    def flags(model):
        return [block.ssm.recompute for block in model.model.layers if block.ssm is not None]

    default = ssm_mixer == "fast_weight"
    model = tiny_model(ssm_mixer=ssm_mixer)
    assert flags(model) == [default, default]
    wrap_blocks(model, activation_checkpointing=False, compile=False, recompute_mixers="all")
    assert flags(model) == [True, True]
    wrap_blocks(model, activation_checkpointing=False, compile=False, recompute_mixers="none")
    assert flags(model) == [False, False]
    wrap_blocks(model, activation_checkpointing=False, compile=False)
    assert flags(model) == [default, default]
    wrap_blocks(model, activation_checkpointing=True, compile=False, recompute_mixers="all")
    assert flags(model) == [False, False]
    with pytest.raises(ValueError, match="recompute_mixers must be one of"):
        wrap_blocks(model, activation_checkpointing=False, compile=False, recompute_mixers=True)


def test_recompute_mixers_choices_agree():
    """The config check (torch-free) and the layers name the same settings."""
    from hybridlm.layers.block import RECOMPUTE_MIXERS
    from hybridlm.training import validate

    assert validate.RECOMPUTE_MIXERS == RECOMPUTE_MIXERS
