"""`fuse_projections`: the projections that read one input as one GEMM give the same logits (float64) in every
generation path, with fewer GEMMs per step; training, gradients and the checkpoint are unchanged; a moved, cast or
adapter-wrapped part is noticed and run apart."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from hybridlm import fold_multipliers, fuse_projections
from hybridlm.inference import generate
from hybridlm.models.fuse import prepare_for_generation
from hybridlm.models.model import HybridForCausalLM
from hybridlm.modules import FusedLinear
from tests.helpers import rel_err
from tests.models.helpers import VOCAB, make_model
from tests.models.test_fold import MODELS, MULTIPLIERS, _decode

GEMMS = {"mm", "addmm", "bmm"}


class Gemms(TorchDispatchMode):
    """Counts the matrix products dispatched."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket.__name__ in GEMMS
        return func(*args, **(kwargs or {}))


def _step_gemms(model, ids) -> int:
    """Matrix products of one cached decoding step after a prefill of `ids`."""
    with torch.no_grad():
        cache = model(ids, cache=model.new_cache()).cache
        with Gemms() as gemms:
            model(ids[:, -1:], cache=cache)
    return gemms.count


@pytest.mark.parametrize("name", list(MODELS))
def test_fused_projections_give_the_same_logits_with_fewer_gemms(name):
    """Float64, multipliers folded: a cached decode (prefill + 3 steps), greedy `generate` and its static step agree
    with the separate projections to float64 rounding; a step runs as many GEMMs fewer as `fuse_projections` says,
    and the parallel blocks' SSM in_proj shares q, k, v's."""
    torch.manual_seed(0)
    model = make_model(seed=1, **{**MULTIPLIERS, **MODELS[name]}).double()
    ids = torch.randint(0, VOCAB, (2, 7))
    fold_multipliers(model)
    with torch.no_grad():
        reference = _decode(model, ids)
    generated = generate(model, ids, max_new_tokens=5, output_logits=True)
    gemms = _step_gemms(model, ids)
    saved = fuse_projections(model)
    with torch.no_grad():
        fused = _decode(model, ids)
    assert rel_err(fused, reference) < 1e-12
    for graph in (False, True):
        out = generate(model, ids, max_new_tokens=5, output_logits=True, graph=graph)
        assert torch.equal(out.sequences, generated.sequences) and rel_err(out.logits, generated.logits) < 1e-12
    assert saved > 0 and _step_gemms(model, ids) == gemms - saved
    block = model.model.layers[0]
    parallel = block.ssm is not None and block.attn is not None and block.arrangement != "S_A_M"
    assert ("ssm.in_proj" in block.fused_input.names) == parallel if block.attn is not None else (
        block.fused_input is None)


def test_training_takes_the_projections_apart_and_their_gradients_are_unchanged():
    """With a gradient to record, the blocks run each projection (the fused tensors are buffers): the loss and every
    parameter's gradient equal the unfused model's; an optimizer's update of a part reaches the fused weight (a view),
    so generation after it reads the updated weights."""
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 9))
    models = [make_model(seed=2).double() for _ in range(2)]
    fuse_projections(models[1])
    for model in models:
        model.train()
        model(ids, labels=ids).loss.backward()
    grads = [{name: p.grad for name, p in model.named_parameters()} for model in models]
    assert grads[0].keys() == grads[1].keys()
    assert all(torch.equal(grads[0][name], grads[1][name]) for name in grads[0])
    for model in models:
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        model.eval()
    with torch.no_grad():
        assert rel_err(_decode(models[1], ids), _decode(models[0], ids)) < 1e-12
    layer = models[1].model.layers[0]
    assert torch.equal(layer.fused_input.weight[: layer.ssm.in_proj.out_features], layer.ssm.in_proj.weight)


def test_checkpoint_is_unchanged_and_reloads(tmp_path):
    """The state dict keeps each projection under its own name (the fused buffers are not saved), save_pretrained /
    from_pretrained give the same tensors back, and nothing is stored twice (the parts are views)."""
    model = make_model(seed=3)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    fuse_projections(model)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    block = model.model.layers[0]
    assert block.attn.k_proj.weight.untyped_storage().data_ptr() == block.fused_input.weight.untyped_storage(
        ).data_ptr()
    model.save_pretrained(tmp_path)
    loaded = HybridForCausalLM.from_pretrained(tmp_path)
    assert all(torch.equal(loaded.state_dict()[k], before[k]) for k in before)


def test_a_moved_or_wrapped_part_runs_apart_with_a_warning():
    """After `.to()` (each weight its own storage again) or an adapter replacing q_proj, the fused GEMM would read
    stale or bypassed weights: the blocks notice, warn, and run the projections apart, with the new module's output."""
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (1, 6))
    model = make_model(seed=4)
    fuse_projections(model)
    model.double()
    with torch.no_grad():
        model.model.layers[0].attn.q_proj.weight.mul_(2.0)  # only the moved part sees it
    reference = make_model(seed=4).double()
    with torch.no_grad():
        reference.model.layers[0].attn.q_proj.weight.mul_(2.0)
        expected = _decode(reference, ids)
        with pytest.warns(UserWarning, match="fuse again"):
            got = _decode(model, ids)
    assert rel_err(got, expected) < 1e-12

    model = make_model(seed=4).double()
    fuse_projections(model)

    class Doubled(nn.Module):  # an adapter-like wrapper: the base projection's output, doubled
        def __init__(self, base):
            super().__init__()
            self.base = base

        def forward(self, x):
            return 2 * self.base(x)

    attn = model.model.layers[1].attn
    attn.v_proj = Doubled(attn.v_proj)
    reference = make_model(seed=4).double()
    reference.model.layers[1].attn.v_proj = Doubled(reference.model.layers[1].attn.v_proj)
    with torch.no_grad(), pytest.warns(UserWarning, match="fuse again"):
        assert rel_err(_decode(model, ids), _decode(reference, ids)) < 1e-12


def test_unfolded_input_multipliers_keep_the_ssm_projection_apart():
    """Input multipliers that are not 1 scale N(x) differently for each mixer: q, k, v fuse alone, and the logits
    still equal the unfused model's; `prepare_for_generation` folds first, so the SSM's in_proj then joins them."""
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 7))
    model = make_model(seed=5, **MULTIPLIERS).double()
    with torch.no_grad():
        reference = _decode(model, ids)
    fuse_projections(model)
    assert model.model.layers[0].fused_input.names == ["attn.q_proj", "attn.k_proj", "attn.v_proj"]
    with torch.no_grad():
        assert rel_err(_decode(model, ids), reference) < 1e-12
    model = make_model(seed=5, **MULTIPLIERS).double()
    prepare_for_generation(model)
    assert model.model.layers[0].fused_input is None  # a CPU model keeps its projections apart
    fuse_projections(model)  # what prepare_for_generation does on CUDA after folding
    assert model.model.layers[0].fused_input.names[0] == "ssm.in_proj"
    with torch.no_grad():
        assert rel_err(_decode(model, ids), reference) < 1e-12


@pytest.mark.parametrize("arrangement, blocks", [("SA_M", 2), ("SAM", 2), ("S_A_M", 0)])
def test_concurrent_mixers_are_set_on_parallel_blocks_and_only_act_on_cuda(arrangement, blocks):
    """`set_concurrent_mixers` marks the blocks whose two mixers read one N(x) (the parallel arrangements), and
    `prepare_for_generation` does it on CUDA only. On the CPU a marked block steps on its one stream (no side stream
    taken) and gives the same logits."""
    from hybridlm.layers import block as block_module
    from hybridlm.models.fuse import set_concurrent_mixers

    model = make_model(seed=7, block_arrangement=arrangement).double()
    prepare_for_generation(model)
    assert not any(block.concurrent_mixers for block in model.model.layers)
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        reference = _decode(model, ids)
    assert set_concurrent_mixers(model, True) == blocks
    assert sum(block.concurrent_mixers for block in model.model.layers) == blocks
    assert set_concurrent_mixers(make_model(seed=7, ssm_mixer="none"), True) == 0  # attention alone
    block_module._SIDE_STREAMS.clear()
    with torch.no_grad():
        assert torch.equal(_decode(model, ids), reference)
    assert not block_module._SIDE_STREAMS


def test_side_stream_is_joined_whatever_a_mixer_raises(monkeypatch):
    """`HybridBlock._mixers_side_by_side` with the CUDA stream calls stood in for on the CPU: the caller's stream waits
    for the side stream when attention raises (a capture left with unjoined work would hide the error), and the side
    stream first waits for the caller's."""
    import contextlib

    from hybridlm.layers import block as block_module

    waits = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            waits.append((self.name, other.name))

    main, side = Stream("main"), Stream("side")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(block_module, "_side_stream", lambda device: side)
    block = make_model(seed=8).model.layers[0]

    def failing_attention(*args, **kwargs):
        raise RuntimeError("attention failed")

    monkeypatch.setattr(block, "_attn", failing_attention)
    mix = dict(cu_seqlens=None, position_ids=None, cache=None, restarts_resolved=False)
    with torch.no_grad(), pytest.raises(RuntimeError, match="attention failed"):
        block._mixers_side_by_side(torch.randn(1, 1, block.norm.weight.shape[0]), mix, None, False, {})
    assert waits == [("side", "main"), ("main", "side")]


def test_refusals():
    with pytest.raises(ValueError, match="HybridForCausalLM or HybridModel"):
        fuse_projections(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="input width, dtype and device"):
        FusedLinear({"a": nn.Linear(4, 3), "b": nn.Linear(5, 3)})
    model = make_model(seed=6)
    model.model.layers[0].attn.q_proj = nn.Sequential(model.model.layers[0].attn.q_proj)
    with pytest.raises(ValueError, match=r"layer 0: .*attn.q_proj is a Sequential"):
        fuse_projections(model)


@pytest.mark.parametrize("name", list(MODELS))
def test_generation_chains_the_blocks_residual_adds_into_the_next_norm(name, monkeypatch):
    """Without a gradient the model chains its blocks (`HybridBlock.deferred`): each block's last residual
    add goes to the next block's norm, the last to the final norm; the logits are the unchained forward's bit for bit
    (float64), every block after the first given its predecessor's residual."""
    from hybridlm.layers.block import HybridBlock

    torch.manual_seed(0)
    model = make_model(seed=7, **MODELS[name]).double()
    ids = torch.randint(0, VOCAB, (2, 7))
    handed = []
    deferred = HybridBlock.deferred
    monkeypatch.setattr(HybridBlock, "deferred",
                        lambda self, x, residuals, **kw: handed.append(len(residuals) > 0) or deferred(
                            self, x, residuals, **kw))
    with torch.no_grad():
        chained = model(ids, cache=model.new_cache()).logits
    assert handed == [False] + [True] * (len(model.model.layers) - 1)
    handed.clear()
    apart = model(ids, cache=model.new_cache()).logits  # a gradient to record: each block whole
    assert handed == [False] * len(model.model.layers) and torch.equal(chained, apart.detach())


def test_compiled_step_traces_the_fused_projections_in_as_many_graphs():
    """`GraphedDecoder(compile_step=...)` on a fused model: torch.compile traces the fused GEMMs without breaking the
    step's graph (the address check is left to eager calls): as many graphs as the unfused model's, and the plain
    static step's logits."""
    from hybridlm.inference import GraphedDecoder

    graphs = []
    for fuse in (False, True):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        model = make_model(seed=8).eval()
        prepare_for_generation(model, fuse=False)
        if fuse:
            fuse_projections(model)
        prompt = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(9))
        with torch.no_grad():
            caches = [model.new_cache(), model.new_cache()]
            for cache in caches:
                model(prompt, cache=cache)
            plain, compiled = (GraphedDecoder(model, cache, capacity=16, batch_size=2, use_graph=False,
                                              compile_step=backend)
                               for cache, backend in zip(caches, (None, "aot_eager")))
            token = prompt[:, -1]
            for _ in range(3):
                expected = plain.step(token).clone()
                assert rel_err(compiled.step(token), expected) < 1e-6
                token = expected.argmax(-1)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[1] == graphs[0]


def test_serving_engine_steps_with_fused_projections_equal_each_request_alone(monkeypatch):
    """The serving engine on a fused model (float64): packed prefills, slot steps at fixed shapes (padded rows and
    spans) give each request's tokens alone, as the unfused model generates them."""
    from hybridlm.serving import Engine, SamplingParams
    from hybridlm.serving.graphed import SlotStepGraphs

    model = make_model(seed=9, **MODELS["fast_weight 1A"]).double()
    prompts = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 13, 6)]
    lengths = [6, 5, 4]
    alone = [generate(model, torch.tensor([p]), max_new_tokens=n).sequences[0, len(p):].tolist()
             for p, n in zip(prompts, lengths)]
    fold_multipliers(model)
    fuse_projections(model)
    calls, forward = [], FusedLinear.forward
    monkeypatch.setattr(FusedLinear, "forward", lambda self, *args: calls.append(1) or forward(self, *args))
    engine = Engine(model, max_num_seqs=3, max_model_len=32, block_size=4, max_prefill_tokens=8, decode_step="fixed")
    engine.step_graphs = SlotStepGraphs(model, engine.slots, use_graph=False, min_span=4)
    final = {}
    for prompt, n in zip(prompts, lengths):
        engine.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True),
                           on_output=lambda out: final.__setitem__(out.request_id, out.token_ids) if out.finished
                           else None)
        engine.step()
    while engine.has_work():
        engine.step()
    assert [final[key] for key in sorted(final)] == alone
    assert calls  # the slot steps ran the fused GEMMs
