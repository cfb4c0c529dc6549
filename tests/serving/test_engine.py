"""The engine: batching and prefix caching do not change results; sampling settings, stopping, aborts, slots.

Greedy outputs are compared token for token with `hybridlm.inference.generate` on each request alone, in float64
(the engine prefills in blocks and decodes rows together, which changes float rounding only)."""

from __future__ import annotations

import pytest
import torch

from hybridlm.inference import generate
from hybridlm.serving import Engine, SamplingParams
from hybridlm.serving.graphed import SlotStepGraphs, row_buckets, span_buckets
from hybridlm.serving.prefix_cache import PrefixCache
from tests.inference.helpers import fast_weight, ids, make_model

MODELS = {
    "mamba2": dict(),
    "fast_weight-1": fast_weight("1"),
    "fast_weight-3A-window-attention": dict(**fast_weight("3A"), attention_window=5),
}


def alone(model, prompt: list[int], max_tokens: int) -> list[int]:
    return generate(model, torch.tensor([prompt]), max_new_tokens=max_tokens).sequences[0, len(prompt):].tolist()


def run_staggered(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    """Add one request per step (later ones join a running batch), step until done; each request's tokens."""
    final = {}

    def keep(out):
        if out.finished:
            final[out.request_id] = out.token_ids

    request_ids = []
    for prompt, p in zip(prompts, params):
        request_ids.append(engine.add_request(prompt, p, on_output=keep))
        engine.step()
    while engine.has_work():
        engine.step()
    return [final[r] for r in request_ids]


@pytest.mark.parametrize("changes", MODELS.values(), ids=MODELS.keys())
def test_concurrent_greedy_requests_equal_each_alone(changes):
    model = make_model(**changes).double()
    prompts = [ids(1, n, seed=n)[0].tolist() for n in (3, 13, 6, 21)]
    lengths = [6, 9, 4, 7]
    # 3 rows for 4 requests: the last waits for a slot; 21 tokens prefill over 3 steps of 8 while others decode
    engine = Engine(model, max_num_seqs=3, max_model_len=40, block_size=4, max_prefill_tokens=8)
    got = run_staggered(engine, prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths])
    assert got == [alone(model, p, n) for p, n in zip(prompts, lengths)]
    assert engine.slots.rows == 0 and not engine.has_work()


def count_packed_forwards(model) -> list[int]:
    """The documents of each packed forward of `model` from now on (its forward wrapped on the instance)."""
    calls, forward = [], model.forward

    def counted(*args, cu_seqlens=None, **kwargs):
        if cu_seqlens is not None:
            calls.append(len(cu_seqlens) - 1)
        return forward(*args, cu_seqlens=cu_seqlens, **kwargs)

    model.forward = counted
    return calls


@pytest.mark.parametrize("changes", MODELS.values(), ids=MODELS.keys())
def test_requests_admitted_together_prefill_packed_and_equal_each_alone(changes):
    """Four requests admitted in one step: one continues a prefix-cache hit at its prompt's end (a filled cache),
    three start fresh. Their pieces run as packed forwards (the hit apart from the fresh ones in the first wave), and
    every output equals the request alone."""
    model = make_model(**changes).double()
    engine = Engine(model, max_num_seqs=4, max_model_len=40, block_size=4, max_prefill_tokens=64)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    first = ids(1, 9, seed=2)[0].tolist()
    engine.generate([first], params)
    prompts = [first + ids(1, 6, seed=3)[0].tolist()] + [ids(1, n, seed=n)[0].tolist() for n in (13, 6, 3)]
    calls = count_packed_forwards(model)
    outputs = engine.generate(prompts, params)
    # pieces [9:12 12:15], [0:4 4:8 8:12 12:13], [0:4 4:6], [0:3]: the first wave packs the 3 fresh ones (the hit runs
    # alone), the second the 3 that have one more, the last two are one piece each
    assert calls == [3, 3]
    assert [o.cached_tokens for o in outputs] == [9, 0, 0, 0]
    assert [o.token_ids for o in outputs] == [alone(model, p, 5) for p in prompts]


def test_prefix_cache_hits_equal_cold_prefills_and_are_counted():
    model = make_model(**fast_weight("1A")).double()
    system = ids(1, 12, seed=1)[0].tolist()  # a shared "system prompt": 3 blocks of 4
    prompts = [system + ids(1, n, seed=10 + n)[0].tolist() for n in (2, 5, 3)]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    cold = Engine(model, max_num_seqs=2, max_model_len=40, block_size=4, prefix_cache_bytes=0)
    cold_out = [o.token_ids for o in cold.generate(prompts, params)]
    warm = Engine(model, max_num_seqs=2, max_model_len=40, block_size=4)
    first = warm.generate(prompts[:1], params)[0]
    rest = warm.generate(prompts[1:], params)
    assert [first.token_ids] + [o.token_ids for o in rest] == cold_out
    assert first.cached_tokens == 0 and [o.cached_tokens for o in rest] == [12, 12]
    stats = warm.prefix_cache.stats
    assert (stats.lookups, stats.hits, stats.tokens_saved) == (3, 2, 24)
    steps = warm.stats()["steps"]  # the prompts' uncached tokens prefilled; every token but the first decoded
    assert (steps["prefill_tokens"], steps["decode_rows"]) == (14 + 5 + 3, 3 * 4)
    assert cold.stats()["steps"]["prefill_tokens"] == sum(map(len, prompts))
    assert cold_out == [alone(model, p, 5) for p in prompts]


@pytest.mark.parametrize("changes", MODELS.values(), ids=MODELS.keys())
def test_a_growing_chat_restores_the_previous_reply_and_a_repeated_prompt_prefills_nothing(changes):
    """The state at a reply's end is stored: turn 2 (turn 1's prompt + reply + a new message) prefills only the
    reply's last token and the new message (a windowed layer's ring row comes back as its last W - 1 slots)."""
    model = make_model(**changes).double()
    engine = Engine(model, max_num_seqs=2, max_model_len=48, block_size=8)
    turn1 = ids(1, 11, seed=3)[0].tolist()
    reply = engine.generate([turn1], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
    turn2 = turn1 + reply + ids(1, 3, seed=4)[0].tolist()
    before, prefilled = engine.prefix_cache.stats.tokens_saved, engine.stats()["steps"]["prefill_tokens"]
    second = engine.generate([turn2, turn1], SamplingParams(max_tokens=4, ignore_eos=True))
    assert [o.cached_tokens for o in second] == [11 + 5, 11]  # after the reply but its last token; all of turn 1
    assert engine.prefix_cache.stats.tokens_saved - before == 16 + 11
    assert engine.stats()["steps"]["prefill_tokens"] - prefilled == len(turn2) - 16  # turn 1's: none
    assert second[1].token_ids == reply[:4]
    assert second[0].token_ids == alone(model, turn2, 4)


def test_prefix_cache_stays_under_its_memory_bound():
    model = make_model().double()
    engine = Engine(model, max_num_seqs=1, max_model_len=48, block_size=4)
    engine.generate([ids(1, 9, seed=5)[0].tolist()], SamplingParams(max_tokens=1))
    entry = engine.prefix_cache.bytes // len(engine.prefix_cache)  # ~ one snapshot
    small = PrefixCache(block_size=4, max_bytes=3 * entry)
    engine.prefix_cache = small
    engine.generate([ids(1, 30, seed=6)[0].tolist()], SamplingParams(max_tokens=1))
    assert 0 < len(small) < 8 and small.bytes <= 3 * entry


def test_seeded_sampling_is_the_same_alone_and_batched():
    model = make_model(**fast_weight("2")).double()
    prompts = [ids(1, n, seed=n)[0].tolist() for n in (4, 7, 5)]
    params = [SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, top_k=20, seed=i, ignore_eos=True)
              for i in range(3)]
    together = run_staggered(Engine(model, max_num_seqs=3, max_model_len=32, block_size=4), prompts, params)
    one_by_one = [Engine(model, max_num_seqs=1, max_model_len=32, block_size=4).generate([p], q)[0].token_ids
                  for p, q in zip(prompts, params)]
    assert together == one_by_one
    assert len({tuple(t) for t in together}) == 3


def test_eos_max_tokens_and_abort_finish_requests_and_free_their_rows():
    model = make_model().double()
    prompt = ids(1, 5, seed=7)[0].tolist()
    free = alone(model, prompt, 6)
    engine = Engine(model, max_num_seqs=2, max_model_len=32, block_size=4)
    engine.eos_ids = frozenset({free[2]})  # the third token is an "eos": the request stops there
    stopped, = engine.generate([prompt], SamplingParams(max_tokens=6))
    assert (stopped.token_ids, stopped.finish_reason) == (free[: free.index(free[2]) + 1], "stop")
    ignored, = engine.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))
    assert (ignored.token_ids, ignored.finish_reason) == (free, "length")
    assert ignored.usage == dict(prompt_tokens=5, completion_tokens=6, total_tokens=11)

    outputs = []
    kept = engine.add_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True), on_output=outputs.append)
    dropped = engine.add_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True), on_output=outputs.append)
    engine.step()
    engine.step()
    assert engine.slots.rows == 2
    engine.abort(dropped)
    engine.step()
    assert engine.slots.rows == 1
    while engine.has_work():
        engine.step()
    last = {o.request_id: o for o in outputs if o.finished}
    assert (last[dropped].finish_reason, last[kept].finish_reason) == ("abort", "length")
    assert last[kept].token_ids == alone(model, prompt, 8)


def test_requests_are_checked():
    engine = Engine(make_model(), max_num_seqs=1, max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len 16"):
        engine.add_request(list(range(3, 13)), SamplingParams(max_tokens=7))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([3, 999], SamplingParams())
    with pytest.raises(ValueError, match="no tokenizer"):
        engine.add_request("text", SamplingParams())
    for bad, match in [(dict(max_tokens=0), "max_tokens"), (dict(temperature=-1), "temperature"),
                       (dict(top_p=0), "top_p"), (dict(stop=[""]), "stop")]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(**bad)


def test_windowed_layers_keep_a_ring_of_window_slots():
    model = make_model(attention_window=5).double()
    engine = Engine(model, max_num_seqs=2, max_model_len=40, block_size=4)
    prompt = ids(1, 17, seed=8)[0].tolist()
    engine.add_request(prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    engine.step()
    keys = [layer._key for layer in engine.slots.layers if layer._key is not None]
    assert keys and all(k.shape[1] == 5 for k in keys)  # W slots per row, not max_model_len


@pytest.mark.parametrize("changes", [{}, dict(attention_window=5)], ids=["full", "window"])
def test_a_decoding_step_builds_its_attention_mask_once_for_every_layer(changes, monkeypatch):
    """The slots' layers share one additive mask per step (`SlotLayerCache.static_mask`): as many masks as decoding
    steps, not one per layer, and the outputs still equal each request alone (a stale mask would change them)."""
    import hybridlm.serving.slots as slots_module

    built = []
    monkeypatch.setattr(slots_module, "additive_mask",
                        lambda attendable, dtype, make=slots_module.additive_mask: built.append(dtype) or make(
                            attendable, dtype))
    model = make_model(num_hidden_layers=3, **changes).double()
    steps, forward = [], model.forward

    def counted(*args, cache=None, **kwargs):
        if cache is not None and cache is engine.slots:
            steps.append(1)
        return forward(*args, cache=cache, **kwargs)

    model.forward = counted
    engine = Engine(model, max_num_seqs=2, max_model_len=40, block_size=4)
    prompts = [ids(1, n, seed=n)[0].tolist() for n in (3, 9)]
    got = run_staggered(engine, prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in (5, 4)])
    model.forward = forward
    assert got == [alone(model, p, n) for p, n in zip(prompts, (5, 4))]
    assert len(steps) >= 4 and built == [torch.float64] * len(steps)


def test_step_buckets():
    assert row_buckets(1) == [1]
    assert row_buckets(5) == [1, 2, 4, 5]
    assert row_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert row_buckets(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100]
    assert row_buckets(64, smallest=2) == [2, 4, 8, 16, 24, 32, 48, 64]
    assert row_buckets(1, smallest=2) == [1]
    assert span_buckets(40, 4) == [4, 8, 16, 32, 40]
    assert span_buckets(256, 256) == [256]


@pytest.mark.parametrize("changes", MODELS.values(), ids=MODELS.keys())
def test_fixed_shape_steps_equal_each_request_alone(changes):
    """The step CUDA graphs replay, run eagerly: padded rows and key spans change nothing."""
    model = make_model(**changes).double()
    prompts = [ids(1, n, seed=n)[0].tolist() for n in (3, 13, 6, 21, 2)]
    lengths = [6, 9, 4, 7, 12]
    engine = Engine(model, max_num_seqs=5, max_model_len=40, block_size=4, max_prefill_tokens=8, decode_step="fixed")
    engine.step_graphs = SlotStepGraphs(model, engine.slots, use_graph=False, min_span=4)
    got = run_staggered(engine, prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths])
    assert got == [alone(model, p, n) for p, n in zip(prompts, lengths)]
    shapes = engine.step_graphs.shapes
    assert (4, 32) in shapes and {span for _, span in shapes} >= {8, 16, 32}  # 3 rows padded to 4; spans grew


@pytest.mark.parametrize("changes", MODELS.values(), ids=MODELS.keys())
def test_compiled_fixed_shape_steps_equal_each_request_alone_in_one_compilation(changes):
    """compile_step: dynamo traces the fixed-shape step once, with dynamic shapes, for every rows and span bucket (the
    graphs a backend gets run as traced: the trace is what this checks; inductor's kernels: the GPU tests)."""
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    model = make_model(**changes).double()
    prompts = [ids(1, n, seed=n)[0].tolist() for n in (3, 13, 6, 21, 2)]
    lengths = [6, 9, 4, 7, 12]
    engine = Engine(model, max_num_seqs=5, max_model_len=40, block_size=4, max_prefill_tokens=8,
                    compile_step=backend)
    assert engine.decode_step == "fixed"  # "auto" on a CPU with compile_step
    engine.step_graphs = SlotStepGraphs(model, engine.slots, use_graph=False, min_span=4, compile_step=backend)
    got = run_staggered(engine, prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths])
    assert got == [alone(model, p, n) for p, n in zip(prompts, lengths)]
    shapes = engine.step_graphs.shapes
    assert {rows for rows, _ in shapes} >= {2, 4} and {span for _, span in shapes} >= {8, 16, 32}
    assert len(graphs) == 1
    torch._dynamo.reset()


def test_decode_step_is_checked():
    model = make_model()
    with pytest.raises(ValueError, match="compile_step compiles the fixed-shape step"):
        Engine(model, decode_step="eager", compile_step="inductor")
    with pytest.raises(ValueError, match="decode_step must be"):
        Engine(model, decode_step="graphs")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        Engine(model, decode_step="graph")
    assert Engine(model).step_graphs is None  # eager on the CPU


def test_engine_settings_are_checked_and_the_prefill_budget_follows_the_device():
    model = make_model()
    for name in ("max_num_seqs", "block_size", "max_prefill_tokens"):
        for bad in (0, 2.5, True):
            with pytest.raises(ValueError, match=f"{name} must be an int >= 1"):
                Engine(model, **{name: bad})
    assert Engine(model).max_prefill_tokens == 2048  # on a CPU; 8192 on a CUDA device
    assert Engine(model, max_prefill_tokens=300).max_prefill_tokens == 300


def test_an_engine_loading_a_checkpoint_folds_its_multipliers(model_dir):
    """A checkpoint directory's model comes with its muP multipliers folded into its weights (`fold_multipliers`; its
    projections fused on a CUDA device only, `prepare_for_generation`): the logits of the model as saved, to float32
    rounding; `fold_multipliers=False` keeps the multipliers, and a model given as an object is used as it is."""
    settings = dict(max_num_seqs=1, max_model_len=40, device="cpu")
    folded = Engine(model_dir, **settings)
    kept = Engine(model_dir, **settings, fold_multipliers=False, fuse_projections=False)
    assert folded.model.model.layers[0].fused_mlp is None  # the CPU's projections stay apart
    assert (folded.model.config.key_multiplier, kept.model.config.key_multiplier) == (1.0, 0.5)
    assert (folded.model.config.embedding_multiplier, kept.model.config.embedding_multiplier) == (1.0, 2.0)
    ids = torch.tensor([[5, 9, 12, 40, 7]])
    with torch.no_grad():
        a, b = folded.model(ids).logits, kept.model(ids).logits
    assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    with torch.no_grad():
        cache = folded.model.new_cache()
        folded.model(ids, cache=cache)  # generation's call: the blocks chained, the norms taking the adds
        assert (folded.model(ids[:, -1:], cache=cache).logits - kept.model(torch.cat([ids, ids[:, -1:]], 1)).logits[
            :, -1:]).abs().max() <= 1e-5 * b.abs().max()
    model = make_model(seed=2)
    Engine(model, **settings)
    assert model.config.key_multiplier == 0.5 and model.model.embedding_multiplier == 2.0
    assert model.model.layers[0].fused_input is None


def test_the_warm_up_is_logged_under_its_own_name(model_dir, caplog):
    """The warm-up's log line says "warm-up", and the first request is still req-0 (one id, one request)."""
    engine = Engine(model_dir, max_num_seqs=2, max_model_len=64, block_size=8, device="cpu")
    with caplog.at_level("INFO", logger="hybridlm.serving"):
        engine.warm_up()
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))
    names = [r.getMessage().split(":", 1)[0] for r in caplog.records if "completion" in r.getMessage()]
    assert names == ["warm-up", "req-0"]
    assert engine.finished["length"] == 1  # the warm-up is not counted
