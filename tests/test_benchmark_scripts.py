"""The benchmark scripts run: the CPU ones (and the GPU ones' `--cpu` smoke modes) on tiny shapes, and every GPU
script's command line parses. Timings are not checked (they belong in benchmarks/RESULTS.md, not in tests); a
script that a refactor broke is."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridlm.models.presets import get_preset

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
HAS_TRITON = importlib.util.find_spec("triton") is not None


def run(*args: str, timeout: int = 300) -> str:
    """stdout of `python args...` in benchmarks/ (the scripts import their neighbours from there); fails on a
    non-zero exit with the error output. Without TRITON_INTERPRET, which the interpreted kernel tests set in this
    process (tests/ops/triton_modes.py) and under which `ptxas_spills.py` cannot compile."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, *args], cwd=BENCHMARKS, capture_output=True, text=True, timeout=timeout,
                            env=env, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def table_rows(text: str, first_cell: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(f"| {first_cell} ")]


def test_fast_weight_cpu_sequences_and_decoding():
    out = run("fast_weight_cpu.py", "--T", "32", "--rules", "1", "3A", "--repeats", "1", "--D", "16")
    assert len(table_rows(out, "1")) == 2 and len(table_rows(out, "3A")) == 2  # fwd, fwd+bwd
    out = run("fast_weight_cpu.py", "--decode", "--B", "2", "--rules", "1A", "--repeats", "1", "--D", "16")
    assert len(table_rows(out, "1A")) == 1


def test_packed_attention_cpu():
    out = run("packed_attention_cpu.py", "--docs", "1", "3", "--length", "16", "--cached", "0", "8", "--repeats", "1")
    assert len(table_rows(out, "1")) == 4 and len(table_rows(out, "3")) == 4  # fwd, fwd+bwd at 2 cache sizes


def test_model_cpu():
    out = run("model_cpu.py", "--batch", "1", "--length", "64", "--repeats", "1", "--contexts", "32", "64",
              "--decode-steps", "2")
    assert "decoding step" in out


def test_gpu_model_on_the_cpu_with_decoding_and_training_profiles():
    out = run("gpu_model.py", "--cpu", "--preset", "tiny", "--lengths", "64", "--contexts", "32", "--variants",
              "transformer", "fw-1A", "--repeats", "1", "--decode-steps", "2", "--decode-batches", "1",
              "--profile-decode", "--profile-train")
    assert len(table_rows(out, "transformer")) == 2 and len(table_rows(out, "fw-1A")) == 2  # training, decoding
    assert out.count("### decoding profile") == 2 and out.count("### training profile") == 2
    assert out.count("kernel launches per call") == 4


def test_gpu_model_on_the_cpu_compiled_and_static_decoding():
    out = run("gpu_model.py", "--cpu", "--preset", "tiny", "--lengths", "64", "--contexts", "32", "--variants",
              "hybrid fw-1A", "--repeats", "1", "--decode-steps", "3", "--compile", "--graph", "--decode-batches",
              "1", "2", "--prefill-tokens", "32", "--compile-decode")  # batch 2: the prefill in 2 pieces of 16 per row
    assert "training through torch.compile" in out and len(table_rows(out, "hybrid fw-1A")) == 3  # 1 + 2 batches
    assert "decoding through CUDA graphs of the compiled step" in out  # on the CPU: the static step, aot_eager


def test_gpu_model_on_the_cpu_decoding_a_bf16_copy(tmp_path):
    out = run("gpu_model.py", "--cpu", "--preset", "tiny", "--lengths", "--contexts", "32", "--variants", "transformer",
              "hybrid fw-1A", "--decode-steps", "2", "--decode-batches", "1", "--graph", "--decode-dtype", "bfloat16",
              "--json", str(tmp_path / "rows.json"))
    assert "decoding a bf16 copy of each model" in out
    assert len(table_rows(out, "transformer")) == 1 and len(table_rows(out, "hybrid fw-1A")) == 1
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert [row["weights"] for row in rows] == ["bfloat16", "bfloat16"]


def test_gpu_model_on_the_cpu_packed_documents_through_compiled_blocks():
    out = run("gpu_model.py", "--cpu", "--preset", "tiny", "--lengths", "48", "--train-rows", "2", "--documents", "3",
              "--contexts", "--variants", "transformer", "hybrid mamba2", "hybrid fw-1A", "--repeats", "1", "--compile")
    assert all(len(table_rows(out, name)) == 1 for name in ("transformer", "hybrid mamba2", "hybrid fw-1A"))
    assert "2 x 48 (3 documents per row)" in out


def test_gpu_model_on_the_cpu_interleaved_rounds(tmp_path):
    out = run("gpu_model.py", "--cpu", "--preset", "tiny", "--lengths", "32", "48", "--contexts", "--variants",
              "transformer", "fw-1A", "--repeats", "1", "--rounds", "2", "--json", str(tmp_path / "rows.json"))
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    # A B A B: every round measures every variant and length before the next round starts
    assert [(r["round"], r["variant"], r["T"]) for r in rows] == [
        (k, v, t) for k in (0, 1) for v in ("transformer", "fw-1A") for t in (32, 48)]
    table = table_rows(out, "fw-1A")
    assert len(table) == 2 and all("| 2 |" in line for line in table)
    for line, length in zip(table, (32, 48)):  # the median of the two rounds' ratios, then their range
        ratios = sorted(r["tokens_per_s"] / b["tokens_per_s"] for r in rows for b in rows
                        if r["variant"] == "fw-1A" and b["variant"] == "transformer" and r["T"] == b["T"] == length
                        and r["round"] == b["round"])
        assert f"| {sum(ratios) / 2:.2f}x ({ratios[0]:.2f}-{ratios[1]:.2f}) |" in line


def test_gpu_model_on_the_cpu_kept_mixers_beside_each_variant(tmp_path):
    out = run("gpu_model.py", "--cpu", "--preset", "tiny", "--lengths", "32", "--contexts", "--variants", "transformer",
              "hybrid mamba2", "--repeats", "1", "--rounds", "2", "--kept-mixers",
              "--json", str(tmp_path / "rows.json"))
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    # The Transformer has no SSM mixer: no "(kept)" run; the hybrid's runs beside it in each round, one baseline.
    assert [(r["round"], r["variant"]) for r in rows] == [
        (k, v) for k in (0, 1) for v in ("transformer", "hybrid mamba2", "hybrid mamba2 (kept)")]
    assert {r["baseline"] for r in rows} == {"transformer"}
    kept = table_rows(out, "hybrid mamba2 (kept)")
    assert len(kept) == 1 and "| 1 x 32 |" in kept[0] and "x (" in kept[0]  # a ratio to the Transformer's rounds


def test_gpu_model_on_the_cpu_torch_steps_beside_each_hybrid(tmp_path):
    run("gpu_model.py", "--cpu", "--preset", "tiny", "--lengths", "--contexts", "32", "--variants", "transformer",
        "hybrid fw-1A", "--decode-batches", "1", "--decode-steps", "2", "--torch-steps",
        "--json", str(tmp_path / "rows.json"))
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == ["transformer", "hybrid fw-1A", "hybrid fw-1A (torch steps)"]
    assert all(r["decode_ms"] > 0 for r in rows)


def test_torch_steps_puts_the_mixers_on_their_loops_and_back():
    sys.path.insert(0, str(BENCHMARKS))
    from gpu_model import build, torch_steps

    from hybridlm.layers.fast_weight import FastWeightMixer
    from hybridlm.layers.mamba2 import Mamba2Mixer
    from hybridlm.modules import ShortConvolution

    loops = {FastWeightMixer: "recurrent", Mamba2Mixer: "naive", ShortConvolution: "torch"}
    for variant in ("hybrid fw-1A", "hybrid mamba2"):
        model = build("tiny", variant, torch.device("cpu"))
        stepping = [m for m in model.modules() if type(m) in loops]
        assert {type(m) for m in stepping} == {ShortConvolution, FastWeightMixer if "fw" in variant else Mamba2Mixer}
        with torch_steps(model):
            assert all(m.backend == loops[type(m)] for m in stepping)
        with torch_steps(model, enabled=False):
            assert all(m.backend == "auto" for m in stepping)
        assert all(m.backend == "auto" for m in stepping)


@pytest.mark.skipif(not HAS_TRITON, reason="runs the step kernels under Triton's interpreter")
def test_decode_ops_counts_the_step_kernels(tmp_path):
    """Each SSM layer's op is one launch (the fast-weight mixer's with its QK norm and gains) where the torch loops
    run a dozen and more; attention and the rest count the same either way."""
    run("decode_ops.py", "--preset", "tiny", "--variants", "transformer", "hybrid fw-1A", "hybrid mamba2",
        "--torch-norms", "--json", str(tmp_path / "ops.json"), timeout=600)  # the norms apart: their CPU forms
    rows = {(r["variant"], r["steps"]): r for r in json.loads((tmp_path / "ops.json").read_text())["rows"]}
    transformer = rows[("transformer", "-")]
    layers = get_preset("tiny").num_hidden_layers
    assert transformer["launches"] == layers  # the rotation of queries and keys, one launch per layer
    for variant in ("hybrid fw-1A", "hybrid mamba2"):
        loops, kernels = rows[(variant, "torch loops")], rows[(variant, "triton")]
        assert kernels["op"] == 1 and loops["op"] > 10
        assert kernels["total"] < loops["total"] and kernels["launches"] > loops["launches"] == transformer["launches"]
        assert kernels["attention"] == loops["attention"] == transformer["attention"]
    run("decode_ops.py", "--preset", "tiny", "--variants", "transformer", "--torch-rotary", "--torch-norms",
        "--json", str(tmp_path / "torch.json"), timeout=600)
    (torch_rotary,) = json.loads((tmp_path / "torch.json").read_text())["rows"]
    # the torch form's casts of the two tables, then its negation, concatenation, two products and the sum for q and
    # for k: 12 operators -> 1 launch (which rounds the tables itself)
    assert torch_rotary["launches"] == 0 and torch_rotary["attention"] == transformer["attention"] + 11


def test_gpu_model_on_the_cpu_sliding_window_hybrid_keeps_constant_cache(tmp_path):
    out = run("gpu_model.py", "--cpu", "--preset", "tiny", "--lengths", "--contexts", "32", "96", "--variants",
              "transformer", "hybrid swa fw-1A", "--window", "8", "--decode-batches", "1", "--decode-steps", "2",
              "--json", str(tmp_path / "rows.json"))
    assert len(table_rows(out, "hybrid swa fw-1A")) == 2
    cache = {(r["variant"], r["context"]): r["cache_mib_per_row"]
             for r in json.loads((tmp_path / "rows.json").read_text())["rows"]}
    assert cache[("hybrid swa fw-1A", 32)] == cache[("hybrid swa fw-1A", 96)]  # O(window) keys at any context
    assert cache[("transformer", 96)] > 2 * cache[("transformer", 32)]  # every key kept


def test_saved_activations_per_token(tmp_path):
    """The activation account of one block: per-token slopes that follow the shapes (each projection keeps a bf16 copy
    of its [T, hidden] input, the chunked loss the bf16 gradient of its [T, hidden] input and no logits, no SSM group
    in the Transformer), and the fast-weight hybrid's SSM half accounted."""
    out = run("saved_activations.py", "--variants", "transformer matched", "h1 fw-1A", "--lengths", "128", "256",
              "--json", str(tmp_path / "saved.json"), timeout=600)
    assert len(table_rows(out, "transformer matched")) == 1 and len(table_rows(out, "h1 fw-1A")) == 1
    report = json.loads((tmp_path / "saved.json").read_text())
    sys.path.insert(0, str(BENCHMARKS))
    from gpu_model import config_of

    config = config_of("125m", "transformer matched")
    transformer, hybrid = (report["results"][v]["groups"] for v in ("transformer matched", "h1 fw-1A"))
    for groups in (transformer, hybrid):
        assert groups["attn.q_proj"] == groups["attn.k_proj"] == 2 * config.hidden_size  # bf16 inputs
        assert groups["loss"] == 2 * config.hidden_size  # dh in bf16, no [T, V] logits
    assert not [g for g, b in transformer.items() if g.startswith("ssm") and b]
    assert hybrid["ssm.in_proj"] == 2 * config.hidden_size and hybrid["ssm"] > 0
    assert report["results"]["h1 fw-1A"]["model"] == 12 * report["results"]["h1 fw-1A"]["block"] + \
        report["results"]["h1 fw-1A"]["outside"]
    # Packed as three documents (lengths 1 : 2 : 3), the fast-weight half restarts them in place: no copies padded to
    # the longest, which would keep 1.5x. The kernels keep what they keep for plain rows but the document index (4
    # bytes per token where kept); the chunk path (torch only) keeps its per-chunk restart terms too.
    run("saved_activations.py", "--variants", "h1 fw-1A", "--lengths", "128", "256", "--documents", "3",
        "--json", str(tmp_path / "packed.json"), timeout=600)
    run("saved_activations.py", "--variants", "transformer matched", "--lengths", "128", "256", "--logits-loss",
        "--json", str(tmp_path / "logits.json"), timeout=600)
    logits = json.loads((tmp_path / "logits.json").read_text())["results"]["transformer matched"]["groups"]
    assert abs(logits["loss"] - 4 * config.vocab_size) <= 4 * config.vocab_size / 100  # the float32 logits
    packed_report = json.loads((tmp_path / "packed.json").read_text())
    packed = packed_report["results"]["h1 fw-1A"]["groups"]
    # (no "ssm.conv" group where the mixer recomputes its conv: the Triton paths)
    assert packed["ssm"] < 1.25 * hybrid["ssm"] and abs(packed.get("ssm.conv", 0) - hybrid.get("ssm.conv", 0)) <= 16
    if packed_report["kernels"] != "torch paths":
        assert abs(packed["ssm"] - hybrid["ssm"]) <= 16


def test_saved_activations_document_offsets():
    sys.path.insert(0, str(BENCHMARKS))
    from saved_activations import document_offsets

    assert document_offsets(100, 4).tolist() == [0, 10, 30, 60, 100]  # lengths 1 : 2 : 3 : 4
    assert document_offsets(7, 1).tolist() == [0, 7]
    with pytest.raises(ValueError, match="cannot be cut"):
        document_offsets(5, 3)


def test_packed_documents_layout():
    sys.path.insert(0, str(BENCHMARKS))
    import torch
    from gpu_model import packed_documents

    offsets = packed_documents(3, 10, 4)
    lengths = offsets.diff()
    assert offsets[0] == 0 and offsets[-1] == 30 and len(lengths) == 12 and bool((lengths > 0).all())
    assert {10, 20} <= set(offsets.tolist())  # documents never cross a row
    assert torch.equal(offsets, packed_documents(3, 10, 4))  # the same layout for every variant


@pytest.mark.parametrize("script,args", [
    ("gpu_parallel.py", ["--cpu", "--seq-len", "64", "--steps", "2"]),
    ("gpu_scaling.py", ["--cpu", "--preset", "tiny", "--seq-len", "64", "--set", "num_key_value_heads=2", "--set",
                        "mamba_n_groups=2", "--layouts", "1", "tp=2", "cp=2", "--steps", "2", "--warmup", "1"]),
])
def test_distributed_scripts_on_two_cpu_processes(script, args):
    out = run("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script, *args, timeout=600)
    assert ("tp=2" in out) and ("cp=2" in out)


def test_gpu_ssd_on_the_cpu():
    out = run("gpu_ssd.py", "--cpu", "--B", "1", "--H", "2", "--P", "16", "--N", "16", "--T", "48", "80")
    assert len(table_rows(out, "48")) == 2 and len(table_rows(out, "80")) == 2  # fwd, fwd+bwd
    assert "naive (ms)" in out and "chunk (ms)" in out


@pytest.mark.skipif(not HAS_TRITON, reason="runs the SSD kernels under Triton's interpreter (needs triton)")
def test_gpu_ssd_pass_checks_every_launch_against_the_load_in_step_walk():
    """One to four chunks (the loads ahead run past the walk's end), blocks wider and narrower than P and N."""
    out = run("gpu_ssd_pass.py", "--cpu", "--shapes", "2x16x32", "3x64x16", "--T", "16", "64", "--chunk", "16")
    rows = table_rows(out, "2x16x32") + table_rows(out, "3x64x16")
    assert len(rows) == 2 * 2 * 2 * 6 and all(row.endswith("| equal |") for row in rows)


@pytest.mark.skipif(not HAS_TRITON, reason="runs the SSD kernels under Triton's interpreter (needs triton)")
def test_gpu_ssd_check_runs_the_kernels_and_compares_every_gradient():
    """The benchmark's agreement check, on CPU tensors under the interpreter: it passes on the real kernels and
    stops on a wrong one (the chunk path's output scaled by 1.001 stands in)."""
    code = """
import torch, gpu_ssd
print(gpu_ssd.check(device=torch.device("cpu"), chunk_size=16, B=1, T=40, H=2, P=16, N=16, G=1, half=torch.float16))
real = gpu_ssd.run_ssd
gpu_ssd.run_ssd = lambda *a, backend, **k: (lambda y, s: (y * (1.001 if backend == "chunk" else 1.0), s))(
    *real(*a, backend=backend, **k))
gpu_ssd.check(device=torch.device("cpu"), chunk_size=16, B=1, T=40, H=2, P=16, N=16, G=1, half=torch.float16)
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=BENCHMARKS, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"}, check=False)
    assert "triton vs chunk, worst" in result.stdout and "check fla" in result.stdout  # the first check passed
    assert result.returncode != 0 and "disagrees with the chunk path in torch.float32" in result.stderr


@pytest.mark.skipif(not HAS_TRITON, reason="runs the Triton kernels under the interpreter (needs triton)")
def test_gpu_fast_weight_triton_times_documents_in_place():
    """`gpu_fast_weight_triton.py --documents`'s row (on the CPU under Triton's interpreter, a stand-in timer): both
    forms run, agree, and land in the table."""
    code = """
import torch, gpu_fast_weight_triton as g
g.make_inputs = lambda B, T, H, D, dtype, rule="1A": [t.requires_grad_(True) for t in (
    torch.randn(B, T, H, D), torch.nn.functional.normalize(torch.randn(B, T, H, D), dim=-1), torch.randn(B, T, H, D),
    torch.rand(B, T, H), 0.1 * torch.rand(B, T, H))]
g.bench = lambda fn, backward, inputs: (fn().float().sum().backward(), 1.0)[1]
print(g.time_documents("1A", 2, 40, 2, 16, 3, chunk_size=16))
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=BENCHMARKS, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"}, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "| 1A | 40 | 3 | 1.00 | 1.00 | 1.00x |" in result.stdout


@pytest.mark.skipif(not HAS_TRITON, reason="runs the Triton kernels under the interpreter (needs triton)")
def test_gpu_fast_weight_triton_times_pass_configs():
    """`gpu_fast_weight_triton.py --pass-configs`'s rows (on the CPU under Triton's interpreter, a stand-in timer):
    every launch of rule 1's passes runs, matches the default one, lands in the table, and the settings are put back;
    a launch that changed the numbers would stop the run."""
    code = """
import torch, gpu_fast_weight_triton as g
from hybridlm.ops.fast_weight.triton import regression
g.make_inputs = lambda B, T, H, D, dtype, rule="1A": [t.requires_grad_(True) for t in (
    torch.randn(B, T, H, D), torch.nn.functional.normalize(torch.randn(B, T, H, D), dim=-1), torch.randn(B, T, H, D),
    torch.rand(B, T, H), 0.1 * torch.rand(B, T, H))]
g.bench = lambda fn, backward, inputs: (fn().float().sum().backward(), 1.0)[1]
print("\\n".join(g.time_pass_configs(1, 20, 1, 128, chunk_size=16)))
print("restored", regression.pass_launch(128, 128, 1) == regression.NARROW_PASSES,
      regression.pass_launch(128, 128, 128) == regression.WIDE_PASSES)
g.PASS_CONFIGS["broken"] = regression.PassLaunch(32, (4, 1), (4, 1))
real = g.run_triton
g.run_triton = lambda *a, **k: (lambda o, s: (o * (1.1 if regression.pass_launch(128, 128, 1).forward[0] == 4 else 1.0),
                                              s))(*real(*a, **k))
g.time_pass_configs(1, 20, 1, 128, chunk_size=16, configs=("default", "broken"))
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=BENCHMARKS, capture_output=True, text=True,
                            timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"}, check=False)
    lines = result.stdout.splitlines()
    labels = ["default (narrow)", "narrow", "wide", "BV32 8w1s", "BV64 8w1s", "BV32 4w1s", "BV64 4w1s / 8w1s",
              "BV128 8w1s"]
    assert lines[:8] == [f"| 1 | 20 | {label} | 1.00 | 1.00x | 1.00 | 1.00x |" for label in labels], \
        result.stderr[-2000:]
    assert lines[8] == "restored True True"
    assert result.returncode != 0 and "under 'broken' disagrees with 'default'" in result.stderr


@pytest.mark.skipif(not HAS_TRITON, reason="runs the Triton kernels under the interpreter (needs triton)")
def test_gpu_fast_weight_triton_times_walk_configs():
    """`gpu_fast_weight_triton.py --walk-configs`'s rows (under Triton's interpreter, a stand-in timer, float16 rows
    of 128 heads so that the forward walk is taken): every config runs, matches the chunk-parallel form, lands in the
    table, and the settings are put back."""
    code = """
import torch, gpu_fast_weight_triton as g
from hybridlm.ops.fast_weight.triton import inner_product, whole_state
walks = []
kernel = whole_state.output_walk_kernel
class Recorder:
    def __getitem__(self, grid):
        return lambda *a, **k: (walks.append(k["num_warps"]), kernel[grid](*a, **k))[1]
whole_state.output_walk_kernel = Recorder()
g.make_inputs = lambda B, T, H, D, dtype, rule="1A": [t.requires_grad_(True) for t in (
    torch.randn(B, T, H, D, dtype=torch.float16), torch.nn.functional.normalize(torch.randn(B, T, H, D), dim=-1).half(),
    torch.randn(B, T, H, D, dtype=torch.float16), torch.rand(B, T, H), 0.1 * torch.rand(B, T, H))]
g.bench = lambda fn, backward, inputs: (fn().float().sum().backward(), 1.0)[1]
print("\\n".join(g.time_walk_configs(1, 20, 128, 16, chunk_size=16)))
print("walks", walks, inner_product.WALK_MIN_PROGRAMS, inner_product.WALK_WARPS)
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=BENCHMARKS, capture_output=True, text=True,
                            timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"}, check=False)
    lines = result.stdout.splitlines()
    labels = ["chunk-parallel", "default", "walk, 4 warps", "walk, 16 warps"]
    assert lines[:4] == [f"| 1A | 20 | {label} | 1.00 | 1.00x | 1.00 | 1.00x |" for label in labels], \
        result.stderr[-2000:]
    # each walking config: its check against the chunk-parallel outputs, then its two timings (fwd, fwd+bwd)
    assert lines[4] == f"walks {[8] * 3 + [4] * 3 + [16] * 3} 128 8", lines[4]


def test_fla_accuracy_reference_is_rule_1_without_decay():
    """`gpu_fla_accuracy.py`'s float64 reference is rule 1 with lam = 0 (the front door's chunk backend, its raw
    inputs made from the prepared writes), and its error pipeline (rounding, the projected loss, the gradients) reads
    ~0 for a side that computes that function in float64 and clearly more for one computing another."""
    sys.path.insert(0, str(BENCHMARKS))
    import torch.nn.functional as F
    from gpu_fla_accuracy import NAMES, errors, make_writes, reference

    from hybridlm.ops import fast_weight_attention

    def front_door(q, x, v, eta, lam_scale=0.0):
        # raw inputs whose preparation gives back x and eta: k_t = x_{t+1}, beta_t = eta_t (|x_t|^2 + lam_t + eps)
        k = torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], dim=1)
        lam = torch.full_like(eta, lam_scale)
        beta = eta * (x.pow(2).sum(-1) + lam + 1e-6)
        o, state = fast_weight_attention(q, k, v, beta, lam, rule="1", backend="chunk", read="after",
                                         output_final_state=True, chunk_size=16)
        return o, state.S

    q, x, v, eta = make_writes(1, 37, 2, 8, unit_keys=False, device="cpu")
    x, eta = F.pad(x[:, 1:], (0, 0, 0, 0, 1, 0)), F.pad(eta[:, 1:], (0, 0, 1, 0))  # x_1 = 0, eta_1 = 0: no write
    o, S = front_door(q, x, v, eta)
    o_ref, S_ref = reference(q, x, v, eta)
    assert torch.allclose(o, o_ref, rtol=0, atol=1e-12) and torch.allclose(S, S_ref, rtol=0, atol=1e-12)
    same = errors(front_door, q, x, v, eta, torch.float64, torch.float64)
    assert set(same) == set(NAMES) and max(same.values()) < 1e-12, same
    decayed = errors(lambda *w: front_door(*w, lam_scale=0.5), q, x, v, eta, torch.float64, torch.float64)
    assert min(decayed[n] for n in ("o", "S")) > 1e-3, decayed


@pytest.mark.parametrize("script", ["gpu_ops.py", "gpu_train_step.py", "gpu_fla_compare.py", "gpu_short_conv.py",
                                    "gpu_gated_norm.py", "gpu_fast_weight_triton.py", "gpu_ssd.py", "serve_bench.py",
                                    "sft_bench.py", "serve_step_profile.py", "gpu_row_norms.py", "gpu_fla_accuracy.py"])
def test_gpu_scripts_parse_their_command_line(script):
    if script in ("gpu_fast_weight_triton.py", "gpu_row_norms.py") and not HAS_TRITON:
        pytest.skip("imports the Triton launchers (needs triton)")
    assert "usage:" in run(script, "--help")


@pytest.mark.parametrize("preset", ["125m", "tiny"])
def test_gpu_model_same_size_variants(preset):
    """The "h1" hybrids take Falcon-H1's 2 : 1 : 5 allocation of the shape's width, and "transformer matched" is the
    Transformer whose MLP width brings it within one MLP width step (64 channels) of "h1 fw-1A"'s parameters."""
    sys.path.insert(0, str(BENCHMARKS))
    from gpu_model import config_of, parameters

    from hybridlm.models.allocation import channel_allocation

    h1, matched, plain = (config_of(preset, v) for v in ("h1 fw-1A", "transformer matched", "transformer"))
    allocation = channel_allocation(hidden_size=plain.hidden_size, alpha_S=2 / 8, alpha_A=1 / 8, alpha_M=5 / 8,
                                    num_key_value_heads=plain.num_key_value_heads, head_dim=plain.head_dim,
                                    mamba_d_head=plain.mamba_d_head)
    assert all(getattr(h1, name) == value for name, value in allocation.items())
    assert h1.ssm_mixer == "fast_weight" and matched.ssm_mixer == "none"
    step = 3 * plain.hidden_size * 64 * plain.num_hidden_layers  # the parameters of 64 more MLP channels
    assert abs(parameters(matched) - parameters(h1)) <= step / 2
    assert parameters(plain) < parameters(h1) - step  # the plain Transformer is the smaller one


@pytest.mark.skipif(not HAS_TRITON or importlib.util.find_spec("triton.backends.nvidia") is None,
                    reason="compiles with triton's CUDA backend and ptxas (no GPU needed)")
def test_ptxas_spills():
    from hybridlm.ops.fast_weight.triton.regression import NARROW_PASSES

    launched = "{}x{}".format(*NARROW_PASSES.forward)  # the forward pass's launch at K <= 64
    out = run("ptxas_spills.py", "--K", "16", "--V", "16", "--chunk", "16", "--configs", launched)
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| ") and "_kernel |" in line]
    assert [row[0] for row in rows] == ["| tinv_kernel", "| wu_kernel", "| delta_pass_kernel",
                                        "| delta_grad_pass_kernel", "| delta_grad_state_kernel", "| delta_grad_kernel"]
    assert all(int(row[3]) > 0 and int(row[4]) >= 0 for row in rows)  # registers, spill stores
    assert all(float(row[6]) >= 0 and int(row[7].rstrip(" |")) >= 1 for row in rows)  # shared KB, programs per SM
    assert rows[2][2].endswith("*")  # the forward pass's launch configuration is marked
    out = run("ptxas_spills.py", "--K", "16", "--V", "32", "--chunk", "16", "--configs", launched,
              "--pass-block-v", "16", "32")
    passes = [line.split(" | ")[:3] for line in out.splitlines() if "pass_kernel |" in line]
    assert passes == [["| delta_pass_kernel", "BV=16", launched.replace("x", " x ")],
                      ["| delta_pass_kernel", "BV=32", launched.replace("x", " x ") + " *"],
                      ["| delta_grad_pass_kernel", "BV=16", launched.replace("x", " x ")],
                      ["| delta_grad_pass_kernel", "BV=32", launched.replace("x", " x ")]]


@pytest.mark.skipif(not HAS_TRITON, reason="imports triton's compiler (ptxas_spills.py)")
def test_programs_per_sm_by_registers_and_shared_memory():
    sys.path.insert(0, str(BENCHMARKS))
    from ptxas_spills import programs_per_sm

    assert programs_per_sm(255, 115 * 1024, 8) == 1  # 256 registers x 256 threads fill the register file
    assert programs_per_sm(255, 57 * 1024, 4) == 2
    assert programs_per_sm(64, 100 * 1024, 4) == 2  # by shared memory: 2 x 101 KB of 228
    assert programs_per_sm(32, 0, 4) == 16


def test_addition_pretrained_probe_carries_the_byte_model_over():
    """The probe's addition model is the byte model: every block weight equal, and each addition token's embedding
    and output row the row of its character's byte (the digits, '+', '=', newline for <bos>)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import addition_pretrained_probe as probe
    finally:
        sys.path.remove(str(BENCHMARKS))
    from hybridlm.experiments import addition, models

    byte_model = models.build_model(models.task_config("transformer", vocab_size=probe.BYTES_BOS + 1, size="tiny"),
                                    seed=3)
    config = models.task_config("transformer", vocab_size=addition.MODEL_VOCAB_SIZE, size="tiny")
    model = probe.addition_model_from(byte_model, seed=0, config=config)
    source, carried = byte_model.state_dict(), model.state_dict()
    embedding_rows = [name for name, value in source.items() if value.shape[0] == probe.BYTES_BOS + 1]
    assert embedding_rows  # the embedding (and the output head, untied)
    for name, value in carried.items():
        if name in embedding_rows:
            assert torch.equal(value[addition.DIGIT0 + 7], source[name][ord("7")])
            assert torch.equal(value[addition.PLUS], source[name][ord("+")])
            assert torch.equal(value[addition.BOS], source[name][ord("\n")])
        else:
            assert torch.equal(value, source[name]), name
    assert probe.probe_recipe(1500).train_max_width == 4


def test_linear_cross_entropy_benchmark_on_cpu():
    out = run("linear_cross_entropy.py", "--tokens", "64", "96", "--hidden", "16", "--vocab", "100", "--repeats", "1")
    rows = [line.split("|")[1:-1] for n in ("64", "96") for line in table_rows(out, n)]
    assert len(rows) == 2 and all(float(cells[1]) > 0 and float(cells[2]) > 0 for cells in rows)


def test_gpu_model_training_table_gives_the_peak_ratio(capsys):
    """The peak memory (the highest over the rounds) beside its ratio to the baseline's, both from the same run."""
    sys.path.insert(0, str(BENCHMARKS))
    from gpu_model import print_training_table

    def row(variant, round_, tokens_per_s, peak):
        return {"variant": variant, "T": 4096, "round": round_, "rows": 1, "documents": 1, "params": 144e6,
                "tokens_per_s": tokens_per_s, "peak_gib": peak}

    print_training_table([row("transformer", 0, 100.0, 10.0), row("fw-1A", 0, 50.0, 11.25),
                          row("transformer", 1, 200.0, 10.0), row("fw-1A", 1, 150.0, 11.0)])
    out = capsys.readouterr().out
    assert table_rows(out, "fw-1A") == ["| fw-1A | 144M | 1 x 4096 | 100 | 0.62x (0.50-0.75) | 2 | 11.25 | 1.125x |"]
    assert table_rows(out, "transformer") == [
        "| transformer | 144M | 1 x 4096 | 150 | 1.00x (1.00-1.00) | 2 | 10.00 | 1.000x |"]


@pytest.mark.skipif(not HAS_TRITON, reason="emulates Triton's launch path (needs triton)")
def test_host_overhead_emulates_the_launches_and_times_each_model():
    out = run("host_overhead.py", "--variants", "transformer matched", "h1 mamba2", "--layers", "1", "--repeats", "2")
    rows = {name: table_rows(out, name) for name in ("transformer matched", "h1 mamba2")}
    assert all(len(found) == 1 for found in rows.values()), out
    assert all(float(found[0].split("|")[2]) > 0 for found in rows.values())
    assert "GPU launches emulated, no kernel runs" in out


def test_chat_turns():
    out = run("chat_turns.py", "--turns", "2", "--repeats", "1", "--message-chars", "20", "--max-new-tokens", "2",
              "--variants", "fw-1A")
    rows = [[cell.strip() for cell in row.split("|")[1:-1]] for row in table_rows(out, "1") + table_rows(out, "2")]
    assert len(rows) == 2 and "differ" not in out
    (first, _), (second, prefilled) = ((int(row[1]), int(row[2])) for row in rows)
    assert prefilled == second - first + 1  # only what follows the first prompt, and that prompt's last token
