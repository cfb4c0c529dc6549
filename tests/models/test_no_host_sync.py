"""A training step of every model kind asks the device nothing (no `.item()`, `bool(tensor)`, `nonzero`): a host
synchronization per layer stalls the GPU behind the Python launches and makes the step impossible to capture as a
CUDA graph. Counted on the CPU with a dispatch mode: the same Python code runs there."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hybridlm.models.model as model_module
import hybridlm.ops.fast_weight.op as fast_weight_op
from hybridlm.experiments.addition import MODEL_VOCAB_SIZE, train_batch
from hybridlm.experiments.models import build_model, task_config

SYNCING_OPS = ("aten._local_scalar_dense", "aten.nonzero", "aten.is_nonzero", "aten.equal")


class _CountSyncs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith(SYNCING_OPS):
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def device_path(monkeypatch):
    """The checks that read CPU tensors only (a sync on the CPU, never made on a GPU) take their device path, so that
    everything else is what gets counted: the op's lam >= 0 check (a ValueError on CPU tensors, a device-side assert
    on CUDA ones) and the model's token-id range check."""
    monkeypatch.setattr(fast_weight_op, "_tracing", lambda: True)
    monkeypatch.setattr(model_module, "_ids_checked_on_host", lambda ids: False)


@pytest.mark.parametrize("with_positions", [False, True], ids=["no-position-ids", "trainer-position-ids"])
@pytest.mark.parametrize("name", ["transformer", "mamba2", "hybrid-mamba2", "fw-1A", "fw-3A", "fw-1", "fw-2A",
                                  "hybrid-fw-3A"])
def test_training_step_has_no_host_sync(name, with_positions, device_path):
    model = build_model(task_config(name, vocab_size=MODEL_VOCAB_SIZE, size="tiny"), seed=0)
    batch = train_batch(np.random.default_rng(0), 4, max_width=6)
    if with_positions:  # as the trainer passes them: the model must look for document restarts, once
        batch["position_ids"] = torch.arange(batch["input_ids"].shape[1]).expand_as(batch["input_ids"])
    with _CountSyncs() as counter:
        model(**batch).loss.backward()
    assert sum(counter.calls.values()) == (1 if with_positions else 0), dict(counter.calls)


@pytest.mark.parametrize("name", ["transformer", "hybrid-fw-3A"])
def test_the_chunked_loss_has_no_host_sync(name, device_path):
    """The loss `hybridlm train` computes (the LM head and cross entropy over row chunks, the trainer's shifted labels
    and a sum) asks the device nothing either."""
    model = build_model(task_config(name, vocab_size=MODEL_VOCAB_SIZE, size="tiny"), seed=0)
    batch = train_batch(np.random.default_rng(0), 4, max_width=6)
    ids = batch["input_ids"]
    shifted = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    with _CountSyncs() as counter:
        model(ids, shift_labels=shifted, num_items_in_batch=1, return_logits=False).loss.backward()
    assert not counter.calls, dict(counter.calls)


def test_cached_steps_have_no_host_sync(device_path):
    model = build_model(task_config("hybrid-fw-3A", vocab_size=MODEL_VOCAB_SIZE, size="tiny"), seed=0).eval()
    prompt = train_batch(np.random.default_rng(0), 2, max_width=3)["input_ids"][:, :6]
    with torch.no_grad():
        cache = model(prompt, cache=model.new_cache()).cache
        with _CountSyncs() as counter:
            cache = model(prompt[:, -1:], cache=cache).cache  # one decoding step
            model(prompt[:, -3:], cache=cache)  # a chunk of 3 tokens on a cache (the positions come from it)
    assert not counter.calls, dict(counter.calls)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.set_sync_debug_mode)")
@pytest.mark.parametrize("name", ["hybrid-mamba2", "hybrid-fw-3A", "fw-1A", "fw-1"])
def test_packed_training_step_on_cuda_waits_for_nothing_in_our_code(name):
    """Packed documents (cu_seqlens on the host, as the model keeps them): no line of hybridlm synchronizes with the
    device in a forward with its loss and backward: the offsets are checked on the host and copied without waiting.
    A warning names the Python line that called the synchronizing op, so torch's own internals (a C++ backward
    node's, reported against torch/autograd) are not judged."""
    import os
    import warnings

    import hybridlm

    model = build_model(task_config(name, vocab_size=MODEL_VOCAB_SIZE, size="tiny"), seed=0).cuda()
    batch = train_batch(np.random.default_rng(0), 4, max_width=6)
    rows, length = batch["input_ids"].shape
    packed = {key: batch[key].reshape(1, rows * length).cuda() for key in ("input_ids", "labels")}
    cu_seqlens = torch.tensor([0, 7, length, 2 * length + 3, rows * length])  # documents across the rows
    model(**packed, cu_seqlens=cu_seqlens).loss.backward()  # compiles and autotunes the kernels (those wait)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(**packed, cu_seqlens=cu_seqlens).loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    package = os.path.dirname(hybridlm.__file__)
    ours = [f"{w.filename}:{w.lineno}" for w in caught
            if "synchroniz" in str(w.message) and w.filename.startswith(package)]
    assert not ours, ours
