"""`backend="auto"` never takes a torch path on CUDA silently: where the fast-weight op or the SSD would run the
Triton kernels but for a head or state size, rule, window, dtype or a missing triton, it issues one
`SlowPathWarning` per reason and process, naming it; where it takes the kernels, or the torch path is its own choice
(decoding steps, float64, the SSD's float32 and seq_idx), it says nothing. The backend choice reads only the
tensors' shapes, dtypes and devices, so these tests hand it stand-ins that claim to be on CUDA (no GPU needed), and
the availability of triton is patched in either way.

    GPU:  python -m pytest -q tests/ops/test_slow_path.py   (the front-door test runs on CUDA tensors)
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

import hybridlm.ops.fast_weight.op as fw_op
import hybridlm.ops.ssd as ssd_op
import hybridlm.ops.utils as ops_utils
from hybridlm.modules import gated_norm, short_conv
from hybridlm.ops import SlowPathWarning, fast_weight_attention
from hybridlm.ops.utils import warn_slow_path
from tests.ops.triton_modes import gpu_only


def on_cuda(*shape: int, dtype: torch.dtype = torch.bfloat16) -> SimpleNamespace:
    """A stand-in for a CUDA tensor of this shape and dtype: all the backend choice reads."""
    return SimpleNamespace(shape=torch.Size(shape), dtype=dtype, is_cuda=True)


def on_cpu(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


@pytest.fixture
def caught(monkeypatch):
    """The SlowPathWarnings issued in the test, as a fresh process would issue them (none warned before)."""
    monkeypatch.setattr(ops_utils, "_SLOW_PATHS_WARNED", set())
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        yield records


def slow_paths(records) -> list[str]:
    return [str(r.message) for r in records if issubclass(r.category, SlowPathWarning)]


@pytest.fixture
def with_triton(monkeypatch):
    """Triton installed and a CUDA device present, as on a GPU machine."""
    monkeypatch.setattr(fw_op, "triton_available", lambda: True)
    monkeypatch.setattr(ssd_op, "triton_is_available", lambda: True)


def fw_backend(K: int = 64, *, V: int | None = None, T: int = 64, rule: str = "1A", window: int = 1,
               dtype: torch.dtype = torch.bfloat16, backend: str = "auto", device=on_cuda) -> str:
    q = device(2, T, 4, K, dtype=dtype)
    v = device(2, T, 4, K if V is None else V, dtype=dtype)
    return fw_op._backend(q, v, rule=rule, window=window, packed=False, backend=backend)


def ssd_backend(P: int = 64, N: int = 128, *, dtype: torch.dtype = torch.bfloat16, seq_idx=None,
                backend: str = "auto") -> str:
    x, B = on_cuda(2, 64, 8, P, dtype=dtype), on_cuda(2, 64, 1, N, dtype=dtype)
    return ssd_op._backend(x, B, B, seq_idx=seq_idx, backend=backend)


# (call, what the warning says) for every reason the fast-weight op's "auto" leaves CUDA on the chunk path
FW_REASONS = [
    ({"K": 192}, "fast-weight heads of 192 dims exceed the Triton kernels' 128"),
    ({"K": 64, "V": 256}, "fast-weight heads of K = 64, V = 256 dims exceed the Triton kernels' 128"),
    ({"rule": "3", "window": 65}, "fast-weight rule '3' with window 65: the Triton kernels take windows of at most 64"),
    ({"dtype": torch.float8_e4m3fn}, "fast-weight inputs in torch.float8_e4m3fn are not among the Triton kernels'"),
]


def test_fast_weight_auto_warns_once_per_reason(caught, with_triton):
    for _ in range(3):  # every layer of every step asks again
        for call, _ in FW_REASONS:
            assert fw_backend(**call) == "chunk"
    messages = slow_paths(caught)
    assert len(messages) == len(FW_REASONS) == len(set(messages))
    for message, (_, start) in zip(messages, FW_REASONS):
        assert message.startswith(start), message
    assert "fw_head_dim <= 128" in messages[0] and "backend='auto' runs the torch chunk path" in messages[0]
    assert "backend='auto' runs the torch chunk path" in messages[2]


def test_fast_weight_auto_is_silent_where_it_takes_the_kernels_or_chooses_the_torch_path(caught, with_triton):
    for rule in ("1A", "1", "2A", "2"):
        assert fw_backend(K=128, rule=rule) == "triton"
    assert fw_backend(K=128, rule="3", window=64) == "triton"
    assert fw_backend(K=128, rule="3A", window=200, dtype=torch.float32) == "triton"
    assert fw_backend(K=192, T=1) == "recurrent"  # a decoding step: the step loop whatever the shape
    assert fw_backend(K=64, dtype=torch.float64) == "chunk"  # float64: the exact path, the caller's choice
    assert fw_backend(K=192, backend="chunk") == "chunk"  # asked for
    assert fw_backend(K=192, device=on_cpu) == "chunk"  # no GPU: nothing faster to miss
    assert slow_paths(caught) == []


def test_fast_weight_auto_without_triton_says_so(caught, monkeypatch):
    monkeypatch.setattr(fw_op, "triton_available", lambda: False)
    assert fw_backend(K=64) == fw_backend(K=64) == "chunk"
    assert fw_backend(K=192) == "chunk"  # installing triton would not help here: the head width is named instead
    messages = slow_paths(caught)
    assert len(messages) == 2
    assert messages[0].startswith("triton is not installed: backend='auto' runs the fast-weight op on CUDA")
    assert messages[1].startswith("fast-weight heads of 192 dims")


def test_ssd_auto_warns_once_per_reason_and_not_for_its_own_choices(caught, with_triton):
    for _ in range(3):
        assert ssd_backend(P=192) == ssd_backend(N=512) == ssd_backend(P=160, dtype=torch.float16) == "chunk"
    assert ssd_backend(P=128, N=256) == ssd_backend(dtype=torch.float16) == "triton"
    assert ssd_backend(P=192, dtype=torch.float32) == "chunk"  # float32 stays on the chunk path by design
    assert ssd_backend(P=192, dtype=torch.float64) == "chunk"
    assert ssd_backend(P=192, seq_idx=object()) == "chunk"  # only the torch backends take seq_idx
    assert ssd_backend(P=192, backend="chunk") == "chunk"
    heads = ("Mamba-2 heads of {} dims exceed the SSD Triton kernels' 128: backend='auto' runs the torch chunk path "
             "(slower, more memory). Use heads of at most 128 dims: HybridConfig mamba_d_head <= 128 (mamba_d_ssm / "
             "mamba_n_heads); left unset, mamba_n_heads is derived within it")
    state = ("a Mamba-2 state of 512 dims exceeds the SSD Triton kernels' 256: backend='auto' runs the torch chunk "
             "path (slower, more memory). Use mamba_d_state <= 256")
    assert slow_paths(caught) == [heads.format(192), state, heads.format(160)]


def test_ssd_auto_without_triton_says_so(caught, monkeypatch):
    monkeypatch.setattr(ssd_op, "triton_is_available", lambda: False)
    assert ssd_backend() == ssd_backend() == "chunk"
    missing = ("triton is not installed: backend='auto' runs the Mamba-2 SSD on CUDA through the torch chunk path "
               "(slower, more memory); install triton for its Triton kernels")
    assert slow_paths(caught) == [missing]


def test_the_warning_is_issued_while_compiling_without_breaking_the_graph(caught, with_triton):
    """Under torch.compile the choice is traced: the warning comes once, at trace time, and fullgraph holds."""
    q = on_cuda(2, 64, 4, 192)

    def step(x: torch.Tensor) -> torch.Tensor:
        warn_slow_path("a reason seen while tracing")
        name = fw_op._backend(q, q, rule="1A", window=1, packed=False, backend="auto")
        return x + 1 if name == "chunk" else x

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    for _ in range(3):
        assert torch.equal(compiled(torch.zeros(3)), torch.ones(3))
    step(torch.zeros(3))  # eager after compiled: the same reasons, not warned again
    messages = slow_paths(caught)
    assert messages[0] == "a reason seen while tracing" and len(messages) == 2
    assert messages[1].startswith("fast-weight heads of 192 dims exceed the Triton kernels' 128")


@gpu_only
def test_front_door_on_cuda_warns_once(caught):
    """The real thing: CUDA tensors of 192-dim heads through `fast_weight_attention`, twice, and 128-dim ones."""
    q, k, v = (torch.randn(1, 32, 2, 192, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    beta = torch.rand(1, 32, 2, device="cuda")
    for _ in range(2):
        fast_weight_attention(q, k, v, beta, rule="1A")
    fast_weight_attention(q[..., :128], k[..., :128], v[..., :128], beta, rule="1A")
    messages = slow_paths(caught)
    assert len(messages) == 1 and messages[0].startswith("fast-weight heads of 192 dims")


def test_short_conv_warns_once_without_triton(caught, monkeypatch):
    """The short conv's "auto" on a CUDA training call (no state, 32- or 16-bit) without triton says so once; its own
    choices of the torch form (a state in or out, float64) say nothing; with triton it takes the kernels."""
    monkeypatch.setattr(short_conv, "triton_available", lambda: False)
    x = on_cuda(2, 64, 96)
    assert not short_conv._takes_kernels("auto", x, stateless=False)
    assert not short_conv._takes_kernels("auto", on_cuda(2, 64, 96, dtype=torch.float64), stateless=True)
    assert not short_conv._takes_kernels("torch", x, stateless=True)
    assert slow_paths(caught) == []
    for _ in range(3):
        assert not short_conv._takes_kernels("auto", x, stateless=True)
    assert slow_paths(caught) == [short_conv.NO_TRITON]
    monkeypatch.setattr(short_conv, "triton_available", lambda: True)
    assert short_conv._takes_kernels("auto", x, stateless=True)
    assert slow_paths(caught) == [short_conv.NO_TRITON]


def test_gated_norm_auto_choices_and_warnings(caught, monkeypatch):
    """The gated norm's "auto" on CUDA: the kernels for 32- or 16-bit x and gate of one shape with groups of at most
    MAX_GROUP channels; silently the torch form for float64, a broadcast gate, no channels or under compile (its own
    choices); the torch form with one warning per reason for a missing triton or too wide a group."""
    monkeypatch.setattr(gated_norm, "triton_available", lambda: True)
    x = on_cuda(2, 64, 96)
    assert gated_norm._takes_kernels("auto", x, on_cuda(2, 64, 96, dtype=torch.float32), 48)
    assert gated_norm._takes_kernels("auto", x, None, gated_norm.MAX_GROUP)
    assert not gated_norm._takes_kernels("torch", x, x, 48)
    assert not gated_norm._takes_kernels("auto", on_cuda(2, 64, 96, dtype=torch.float64), x, 48)
    assert not gated_norm._takes_kernels("auto", x, on_cuda(2, 64, 96, dtype=torch.float64), 48)
    assert not gated_norm._takes_kernels("auto", x, on_cuda(1, 64, 96), 48)  # broadcasts over the batch
    assert not gated_norm._takes_kernels("auto", on_cuda(2, 64, 0), None, 0)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not gated_norm._takes_kernels("auto", x, x, 48)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    assert slow_paths(caught) == []
    wide = gated_norm.WIDE_GROUP.format(group=2 * gated_norm.MAX_GROUP)
    for _ in range(2):
        assert not gated_norm._takes_kernels("auto", x, x, 2 * gated_norm.MAX_GROUP)
    monkeypatch.setattr(gated_norm, "triton_available", lambda: False)
    for _ in range(2):
        assert not gated_norm._takes_kernels("auto", x, x, 48)
    assert slow_paths(caught) == [wide, gated_norm.NO_TRITON]
