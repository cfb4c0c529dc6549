"""Checkpoints: exact resume (weights, AdamW, schedule, RNG), corruption and partial saves, keep-last-K."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridlm.training.checkpoint import (
    MANIFEST_FILE,
    CheckpointError,
    CheckpointMismatchError,
    incomplete_reason,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from hybridlm.training.guard import StepGuard
from hybridlm.training.optim import apply_schedule, build_param_groups
from hybridlm.training.rng import capture_rng_state, restore_rng_state
from hybridlm.training.schedules import ScheduleConfig, lr_wd_factors
from hybridlm.training.tensor_tree import flatten_tree, unflatten_tree
from tests.training.toys import ToyLM

VOCAB, TOTAL = 32, 12
SCHEDULE = ScheduleConfig(kind="effective_power", warmup=2, decay=4, power_t0=3, min_lr_ratio=0.1)


class Run:
    """A toy training run whose every step draws from torch (data, dropout), numpy and python RNGs."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        np.random.seed(seed)
        random.seed(seed)
        self.model = ToyLM(VOCAB, 16)
        self.optimizer = torch.optim.AdamW(
            build_param_groups(self.model.named_parameters(), lr=3e-3, weight_decay=0.1,
                               matrix_multipliers={"ssm_in": (2.0, 0.5)}, vector_lr_multipliers={"D": 0.3}),
            betas=(0.9, 0.95),
        )
        self.guard = StepGuard(3)
        self.step = 0
        self.tokens = 0

    def train(self, steps: int) -> list[float]:
        losses = []
        self.model.train()
        for _ in range(steps):
            apply_schedule(self.optimizer, *lr_wd_factors(SCHEDULE, self.step + 1, TOTAL))
            length = 6 + random.randrange(3)  # python RNG
            tokens = torch.randint(0, VOCAB, (2, length))  # torch RNG
            noise = float(np.random.uniform(0.9, 1.1))  # numpy RNG
            logits = self.model(tokens[:, :-1])  # dropout: torch RNG
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)) * noise
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            if self.guard.check(loss, norm, optimizer=self.optimizer, step=self.step):
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            self.step += 1
            self.tokens += tokens.numel()
        return losses

    def train_state(self) -> dict:
        return {"tokens": self.tokens, "schedule": SCHEDULE.to_dict(), "guard": self.guard.state_dict(),
                "data": {"epoch": 0, "offset": self.tokens}}

    def save(self, directory: Path, **kwargs) -> Path:
        return save_checkpoint(directory, self.step, model=self.model, optimizer=self.optimizer,
                               train_state=self.train_state(), **kwargs)

    def resume(self, path: Path, **kwargs) -> None:
        loaded = load_checkpoint(path, model=self.model, optimizer=self.optimizer, **kwargs)
        self.step = loaded.step
        self.tokens = loaded.train_state["tokens"]
        self.guard.load_state_dict(loaded.train_state["guard"])
        assert ScheduleConfig.from_dict(loaded.train_state["schedule"]) == SCHEDULE


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    run = Run(seed=0)
    losses = run.train(TOTAL)
    return losses, {k: v.clone() for k, v in run.model.state_dict().items()}


def test_resume_is_exact(tmp_path: Path, reference) -> None:
    ref_losses, ref_state = reference
    first = Run(seed=0)
    losses = first.train(TOTAL // 2)
    path = first.save(tmp_path)
    assert path.name == f"step_{TOTAL // 2:08d}"
    second = Run(seed=123)  # different init, RNG streams and optimizer state until the load
    torch.rand(7), np.random.rand(3), random.random()
    second.resume(path)
    losses += second.train(TOTAL // 2)
    assert losses == ref_losses  # bit-identical float32 losses
    for name, value in second.model.state_dict().items():
        assert torch.equal(value, ref_state[name]), name
    saved_groups = json.loads((path / "optimizer.json").read_text())
    assert "base_lr" in json.dumps(saved_groups) and "param_names" in json.dumps(saved_groups)


def test_resume_without_rng_restore_diverges(tmp_path: Path, reference) -> None:
    """The RNG restore above is what makes the resume exact: without it the losses differ."""
    first = Run(seed=0)
    losses = first.train(TOTAL // 2)
    path = first.save(tmp_path)
    second = Run(seed=123)
    second.resume(path, restore_rng=False)
    losses += second.train(TOTAL // 2)
    assert losses[: TOTAL // 2] == reference[0][: TOTAL // 2]
    assert losses[TOTAL // 2:] != reference[0][TOTAL // 2:]


def small_run_dir(tmp_path: Path, steps=(1, 2)) -> tuple[Run, list[Path]]:
    run = Run(seed=1)
    paths = []
    for _ in steps:
        run.train(1)
        paths.append(run.save(tmp_path))
    return run, paths


def test_corrupted_file_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    run, (older, newest) = small_run_dir(tmp_path)
    target = newest / "optimizer.safetensors"
    original = target.read_bytes()
    data = bytearray(original)
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"optimizer\.safetensors fails its checksum.*remove .*step_00000002.*step_00000001"):
        load_checkpoint(newest, model=run.model, optimizer=run.optimizer)
    assert all(torch.equal(v, before[k]) for k, v in run.model.state_dict().items())  # nothing loaded
    verify_checkpoint(older)  # the previous one is intact
    target.write_bytes(original)
    verify_checkpoint(newest)
    # truncated and missing files
    (newest / "train_state.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"train_state\.json has \d+ bytes, the manifest records"):
        verify_checkpoint(newest)
    (newest / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model\.safetensors is listed in the manifest but missing"):
        verify_checkpoint(newest)
    manifest = json.loads((newest / MANIFEST_FILE).read_text())
    del next(iter(manifest["files"].values()))["bytes"]
    (newest / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"not a .* manifest \(the entry of .* needs 'bytes' and 'sha256'\)"):
        verify_checkpoint(newest)
    (newest / MANIFEST_FILE).unlink()
    with pytest.raises(CheckpointError, match="manifest.json is missing: the checkpoint is incomplete"):
        verify_checkpoint(newest)


def test_latest_checkpoint_ignores_partial_saves(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "nowhere") is None
    run, (_, newest) = small_run_dir(tmp_path)
    assert latest_checkpoint(tmp_path) == newest
    # an interrupted save: the .tmp directory of a later step
    partial = tmp_path / "step_00000009.tmp"
    shutil.copytree(newest, partial)
    # a directory with the final name but no manifest (copied by hand, say)
    no_manifest = tmp_path / "step_00000007"
    shutil.copytree(newest, no_manifest)
    (no_manifest / MANIFEST_FILE).unlink()
    # and one whose file was truncated after the manifest was written
    truncated = tmp_path / "step_00000008"
    shutil.copytree(newest, truncated)
    (truncated / "model.safetensors").write_bytes(b"x")
    assert latest_checkpoint(tmp_path) == newest
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "step_00000001", "step_00000002", "step_00000007", "step_00000008"
    ]
    # what a resume says of the newer damaged ones it refuses to train past
    assert incomplete_reason(no_manifest) == "no manifest.json" and incomplete_reason(newest) == ""
    assert re.fullmatch(r"model.safetensors is 1 bytes, its manifest says [\d,]+", incomplete_reason(truncated))
    (no_manifest / MANIFEST_FILE).write_text("garbage{")
    assert incomplete_reason(no_manifest) == "manifest.json is unreadable (JSONDecodeError)"
    # a new save of step 9 replaces the stale .tmp
    run.step = 9
    path = run.save(tmp_path)
    assert not partial.exists() and latest_checkpoint(tmp_path) == path


def test_keep_last_and_overwrite(tmp_path: Path) -> None:
    run = Run(seed=2)
    for _ in range(5):
        run.train(1)
        run.save(tmp_path, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000004", "step_00000005"]
    with pytest.raises(CheckpointError, match="already exists; pass overwrite=True"):
        run.save(tmp_path)
    run.train(1)
    run.step = 5
    path = run.save(tmp_path, overwrite=True)
    verify_checkpoint(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004", "step_00000005"]


def test_keep_last_counts_only_verified_checkpoints(tmp_path: Path) -> None:
    """A newer step directory that cannot be read (garbage, no manifest) is passed over by `latest_checkpoint` (a
    resume refuses to train past it): it must not count toward keep_last either, or rotation deletes the good
    checkpoint and keeps the garbage."""
    run = Run(seed=3)
    run.train(2)
    good = run.save(tmp_path, keep_last=2)
    garbage = tmp_path / "step_00000099"
    garbage.mkdir()
    (garbage / "notes.txt").write_text("not a checkpoint")
    assert latest_checkpoint(tmp_path) == good
    run.train(2)
    second = run.save(tmp_path, keep_last=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000004", "step_00000099"]
    assert (garbage / "notes.txt").is_file()  # never counted, never deleted
    run.train(2)
    run.save(tmp_path, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000004", "step_00000006", "step_00000099"]
    verify_checkpoint(second)


def test_keep_last_never_deletes_for_a_checkpoint_that_fails_its_checksum(tmp_path: Path) -> None:
    """A complete-looking checkpoint whose file is corrupt (same size, other bytes) would fail the resume: it does
    not count toward keep_last, so the older intact one it would have replaced is kept."""
    run = Run(seed=4)
    run.train(1)
    first = run.save(tmp_path)
    run.train(1)
    corrupt = run.save(tmp_path)
    target = corrupt / "model.safetensors"
    data = bytearray(target.read_bytes())
    data[-1] ^= 0xFF
    target.write_bytes(bytes(data))
    run.train(1)
    newest = run.save(tmp_path, keep_last=2)
    assert list_checkpoints(tmp_path) == [first, corrupt, newest]  # first and newest are the two verified
    run.train(1)
    latest = run.save(tmp_path, keep_last=2)
    assert list_checkpoints(tmp_path) == [newest, latest]  # the corrupt one, older than both, goes with first
    for path in (newest, latest):
        verify_checkpoint(path)


def test_rotation_verifies_a_kept_checkpoint_once(tmp_path: Path, monkeypatch) -> None:
    """The checkpoints a process saves count as verified (their checksums were just computed); one it did not
    write (copied in: another process's) is verified when it first counts toward keep_last, then remembered."""
    import hybridlm.training.checkpoint as checkpoint

    run = Run(seed=5)
    run.train(1)
    shutil.copytree(run.save(tmp_path / "elsewhere"), tmp_path / "run" / "step_00000001")
    verified = []
    monkeypatch.setattr(checkpoint, "verify_checkpoint",
                        lambda path: verified.append(Path(path).name) or verify_checkpoint(path))
    for _ in range(3):
        run.train(1)
        run.save(tmp_path / "run", keep_last=4)
    assert verified == ["step_00000001"]
    assert len(list_checkpoints(tmp_path / "run")) == 4


def test_mismatched_model_is_refused(tmp_path: Path) -> None:
    run, (path, _) = small_run_dir(tmp_path)
    other = ToyLM(VOCAB, 8)
    with pytest.raises(CheckpointMismatchError, match=r"model\.safetensors does not fit the model"):
        load_checkpoint(path, model=other, restore_rng=False)
    # same model, optimizer built with other groups
    optimizer = torch.optim.AdamW(
        build_param_groups(run.model.named_parameters(), lr=1e-3, weight_decay=0.1,
                           classifier={r"(proj|lm_head|embed_tokens)\.weight$": "mlp_up", r".": "bias"})
    )
    with pytest.raises(CheckpointMismatchError, match="parameter groups"):
        load_checkpoint(path, model=run.model, optimizer=optimizer, restore_rng=False)
    # same number of groups, other members: caught by the saved param_names
    def two_groups(head_role: str) -> torch.optim.Optimizer:
        classifier = {r"lm_head\.weight$": head_role, r"(proj|embed_tokens)\.weight$": "mlp_up", r".": "bias"}
        return torch.optim.AdamW(build_param_groups(run.model.named_parameters(), lr=1e-3, weight_decay=0.1,
                                                    classifier=classifier))
    saved = save_checkpoint(tmp_path / "other", 0, model=run.model, optimizer=two_groups("mlp_up"))
    with pytest.raises(CheckpointMismatchError,
                       match=r"group 0 \(mlp_up\) was saved for other parameters.*'lm_head\.weight'"):
        load_checkpoint(saved, model=run.model, optimizer=two_groups("bias"), restore_rng=False)


def test_tied_weights_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(3)
    model = ToyLM(VOCAB, 16)
    model.lm_head.weight = model.model.embed_tokens.weight
    path = save_checkpoint(tmp_path, 0, model=model)
    fresh = ToyLM(VOCAB, 16)
    fresh.lm_head.weight = fresh.model.embed_tokens.weight
    load_checkpoint(path, model=fresh, restore_rng=False)
    assert torch.equal(fresh.lm_head.weight, model.lm_head.weight)
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight


def test_rng_state_round_trip() -> None:
    torch.manual_seed(5), np.random.seed(5), random.seed(5)
    np.random.standard_normal()  # leaves a cached gaussian in numpy's state
    random.gauss(0, 1)
    tensors, skeleton = flatten_tree(capture_rng_state())
    expected = (torch.rand(4), np.random.standard_normal(3), random.random(), random.gauss(0, 1))
    restore_rng_state(unflatten_tree(tensors, json.loads(json.dumps(skeleton))))
    again = (torch.rand(4), np.random.standard_normal(3), random.random(), random.gauss(0, 1))
    assert torch.equal(expected[0], again[0]) and np.array_equal(expected[1], again[1])
    assert expected[2:] == again[2:]


def test_tensor_tree_round_trip_keeps_types() -> None:
    base = torch.arange(6.0)
    tree = {"state": {0: {"step": torch.tensor(3.0), "m": base, "view": base[2:]}},
            "groups": [{"betas": (0.9, 0.95), "eps": float("inf"), "nan": float("nan"), "names": ["a"], "x": None}]}
    tensors, skeleton = flatten_tree(tree)
    back = unflatten_tree(tensors, json.loads(json.dumps(skeleton, allow_nan=False)))
    assert list(back["state"]) == [0] and isinstance(back["groups"][0]["betas"], tuple)
    assert torch.equal(back["state"][0]["view"], base[2:]) and back["groups"][0]["eps"] == float("inf")
    assert back["groups"][0]["nan"] != back["groups"][0]["nan"]
    with pytest.raises(TypeError, match="cannot store a object at /bad"):
        flatten_tree({"bad": object()})
