"""Mesh config validation and tensor-parallel divisibility errors (no processes needed)."""

from __future__ import annotations

import pytest

from hybridlm.parallel import ParallelConfig, check_tensor_parallel
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
    ],
    ids=["tp-does-not-divide", "product-mismatch", "tp-zero", "dp-shard-zero"],
)
def test_bad_mesh_sizes_raise(config, world, message):
    with pytest.raises(ValueError, match=message):
        config.resolved(world)


@pytest.mark.parametrize(
    ("overrides", "tp", "field"),
    [
        ({"num_key_value_heads": 1}, 2, "num_key_value_heads=1"),
        ({"num_attention_heads": 3, "num_key_value_heads": 3}, 2, "num_attention_heads=3"),
        ({"num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 322}, 4, "intermediate_size=322"),
    ],
    ids=["kv-heads", "query-heads", "mlp-width"],
)
def test_tensor_parallel_divisibility_errors_name_the_field(overrides, tp, field):
    model = tiny_model(**overrides)
    with pytest.raises(ValueError, match=field):
        check_tensor_parallel(model, tp)


def test_divisible_shapes_pass():
    check_tensor_parallel(tiny_model(), 2)  # 2 query heads, 2 KV heads, MLP 320
