"""Decoding steps replayed as CUDA graphs give what the eager steps give (CUDA only; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from hybridlm.serving import Engine, SamplingParams
from tests.inference.helpers import fast_weight, ids, make_model
from hybridlm.inference import generate
from tests.serving.test_engine import MODELS, run_staggered

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def alone(model, prompt: list[int], max_tokens: int) -> list[int]:
    tokens = torch.tensor([prompt], device="cuda")
    return generate(model, tokens, max_new_tokens=max_tokens).sequences[0, len(prompt):].tolist()


def engines(model, **kwargs) -> tuple[Engine, Engine]:
    settings = dict(max_num_seqs=5, max_model_len=300, block_size=4, max_prefill_tokens=8, **kwargs)
    return Engine(model, decode_step="graph", **settings), Engine(model, decode_step="eager", **settings)


@pytest.mark.parametrize("concurrent", [False, True], ids=["one_stream", "concurrent_mixers"])
@pytest.mark.parametrize("changes", MODELS.values(), ids=MODELS.keys())
def test_graphed_steps_equal_each_request_alone(changes, concurrent):
    """Also with each parallel block's SSM half on a side stream (`concurrent_mixers`, as a model loaded from a
    directory onto CUDA runs): the graphs capture both streams."""
    from hybridlm.models.fuse import set_concurrent_mixers

    model = make_model(**changes).double().cuda()
    set_concurrent_mixers(model, concurrent)
    prompts = [ids(1, n, seed=n)[0].tolist() for n in (3, 13, 6, 250, 2)]
    lengths = [6, 9, 4, 20, 12]
    graphed, eager = engines(model)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    got = run_staggered(graphed, prompts, params)
    assert got == run_staggered(eager, prompts, params)
    assert got == [alone(model, p, n) for p, n in zip(prompts, lengths)]
    shapes = graphed.step_graphs.shapes
    assert len(shapes) >= 3 and {span for _, span in shapes} == {256, 300}  # a 250-token prompt crossed 256


def test_warm_up_captures_every_shape_and_changes_no_result():
    model = make_model(**fast_weight("1A")).double().cuda()
    graphed, eager = engines(model)
    assert graphed.warm_up() == len(graphed.step_graphs.rows) * len(graphed.step_graphs.spans) - 1  # one was used
    assert not graphed.finished and graphed.prefix_cache.stats.as_dict()["hits"] == 0
    prompts = [ids(1, n, seed=n)[0].tolist() for n in (5, 8, 3)]
    params = [SamplingParams(max_tokens=7, temperature=0.9, top_k=20, seed=i) for i in range(3)]
    assert run_staggered(graphed, prompts, params) == run_staggered(eager, prompts, params)


def test_bfloat16_graphed_logits_match_the_fixed_shape_step():
    """Same kernels replayed: the graph's logits equal the eager fixed-shape step's on the same state."""
    model = make_model(**fast_weight("1A")).to(torch.bfloat16).cuda()
    prompts = [ids(1, n, seed=n)[0].tolist() for n in (5, 8, 3)]
    outs = []
    for step in ("graph", "fixed"):
        engine = Engine(model, decode_step=step, max_num_seqs=4, max_model_len=64)
        captured = []
        real = engine.step_graphs.step
        engine.step_graphs.step = lambda tokens: captured.append(real(tokens).float().clone()) or captured[-1]
        engine.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
        outs.append(captured)
    assert len(outs[0]) == len(outs[1]) > 0
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("changes", MODELS.values(), ids=MODELS.keys())
def test_compiled_graphed_steps_equal_each_request_alone_in_few_compilations(changes):
    """Inductor's kernels captured in the graphs: the same tokens as the eager steps (float64), every shape (6 here)
    from at most two compilations (the CPU trace needs one: test_engine.py)."""
    from torch._inductor.compile_fx import compile_fx

    compilations = []

    def inductor(graph_module, example_inputs):
        compilations.append(graph_module)
        return compile_fx(graph_module, example_inputs)

    torch._dynamo.reset()
    model = make_model(**changes).double().cuda()
    prompts = [ids(1, n, seed=n)[0].tolist() for n in (3, 13, 6, 250, 2)]
    lengths = [6, 9, 4, 20, 12]
    settings = dict(max_num_seqs=5, max_model_len=300, block_size=4, max_prefill_tokens=8)
    compiled = Engine(model, decode_step="graph", compile_step=inductor, **settings)
    eager = Engine(model, decode_step="eager", **settings)
    assert compiled.warm_up() == len(compiled.step_graphs.rows) * len(compiled.step_graphs.spans) - 1
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    got = run_staggered(compiled, prompts, params)
    assert got == run_staggered(eager, prompts, params)
    assert got == [alone(model, p, n) for p, n in zip(prompts, lengths)]
    assert len(compilations) <= 2
    torch._dynamo.reset()


def test_the_prefill_budget_defaults_to_8192_tokens_on_a_cuda_device():
    assert Engine(make_model().cuda(), decode_step="eager").max_prefill_tokens == 8192
