"""Cached generation: cached logits == full forward for every SSM mixer and rule, a left-padded batch ==
each prompt alone (tokens, logits and recurrent states), per-row eos and stop callbacks, seeded sampling, the sampling
filters and their checks, decoding past max_position_embeddings."""

from __future__ import annotations

import re

import pytest
import torch

from hybridlm.inference import generate, sample_next, top_k_filter, top_p_filter
from tests.helpers import rel_err
from tests.inference.helpers import MIXERS, VOCAB, count_decoder_steps, ids, make_model

TOL = 1e-4  # max abs logit difference, float32


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("mixer", list(MIXERS))
def test_cached_logits_equal_the_full_forward(mixer):
    model = make_model(seed=1, **MIXERS[mixer])
    tokens = ids(2, 15, seed=1)
    with torch.no_grad():
        full = model(tokens).logits
        cache = model.new_cache()
        pieces = [model(tokens[:, :5], cache=cache).logits]  # prefill (chunked paths)
        pieces.append(model(tokens[:, 5:8], cache=cache).logits)  # a chunk continuing from the cache
        for t in range(8, 15):  # one token at a time (recurrent steps)
            pieces.append(model(tokens[:, t : t + 1], cache=cache).logits)
    stepped = torch.cat(pieces, dim=1)
    assert full.abs().max() > 0.5  # not a degenerate comparison
    for t in range(15):
        assert max_diff(stepped[:, t], full[:, t]) < TOL, f"position {t}"
    assert cache.seq_len == 15 and cache.lengths is None


PROMPT_LENGTHS = (5, 1, 8, 2)  # 1 and 2: shorter than the conv window


def padded_batch(seed: int = 2) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    prompts = [ids(1, n, seed=seed + i) for i, n in enumerate(PROMPT_LENGTHS)]
    width = max(PROMPT_LENGTHS)
    batch = torch.zeros(len(prompts), width, dtype=torch.long)  # pad id 0
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        batch[row, width - prompt.shape[1] :] = prompt[0]
        mask[row, width - prompt.shape[1] :] = 1
    return prompts, batch, mask


@pytest.mark.parametrize("mixer", ["mamba2", "fast_weight-1", "fast_weight-2A", "fast_weight-3", "none",
                                   "fast_weight-3-ssm_only"])
def test_padded_batch_equals_each_prompt_alone(mixer):
    model = make_model(seed=3, **MIXERS[mixer])
    prompts, batch, mask = padded_batch()
    out = generate(model, batch, attention_mask=mask, max_new_tokens=6, output_logits=True)
    assert out.sequences.shape == (4, 8 + 6) and out.logits.shape == (4, 6, VOCAB)
    assert torch.equal(out.attention_mask[:, :8], mask) and bool(out.attention_mask[:, 8:].all())
    for row, prompt in enumerate(prompts):
        alone = generate(model, prompt, max_new_tokens=6, output_logits=True)
        assert torch.equal(out.sequences[row, 8:], alone.sequences[0, prompt.shape[1] :]), f"row {row}"
        assert max_diff(out.logits[row], alone.logits[0]) < TOL, f"row {row}"
    # The prefill's logits at every real position equal the prompt's own full forward; pads give zeros.
    with torch.no_grad():
        logits = model(batch, attention_mask=mask).logits
        for row, prompt in enumerate(prompts):
            n = prompt.shape[1]
            assert max_diff(logits[row, 8 - n :], model(prompt).logits[0]) < TOL
            assert not logits[row, : 8 - n].any()
        # Without the mask the pads would be read as tokens: the comparison above can tell.
        unmasked = model(batch).logits
    assert max_diff(unmasked[0, -1], logits[0, -1]) > 1e-3


@pytest.mark.parametrize("mixer", ["mamba2", "fast_weight-3A", "fast_weight-2"])
def test_padding_never_enters_a_recurrent_state(mixer):
    """After the padded prefill, every SSM state of row b (conv tail, SSD state / S, last key, sliding tail)
    equals the state its prompt leaves alone, and attention's keys of row b are the prompt's own."""
    model = make_model(seed=4, **MIXERS[mixer])
    prompts, batch, mask = padded_batch(seed=5)
    with torch.no_grad():
        cache = model.new_cache()
        model(batch, attention_mask=mask, cache=cache)
        assert cache.seq_len == 8 and cache.lengths.tolist() == list(PROMPT_LENGTHS)
        for row, prompt in enumerate(prompts):
            alone = model.new_cache()
            model(prompt, cache=alone)
            n = prompt.shape[1]
            for layer, layer_alone in zip(cache.layers, alone.layers):
                assert set(layer.ssm) == set(layer_alone.ssm) and layer_alone.ssm
                for name, value in layer_alone.ssm.items():
                    got = layer.ssm[name][row : row + 1]
                    if value.dtype == torch.int64:
                        assert torch.equal(got, value), name
                    else:
                        assert rel_err(got, value) < 1e-5, (row, name)
                assert rel_err(layer.key[row, 8 - n :], layer_alone.key[0]) < 1e-5
                assert int(layer.pad[row]) == 8 - n


def test_rows_stop_at_their_own_eos():
    model = make_model(seed=6)
    prompts, batch, mask = padded_batch(seed=7)
    free = generate(model, batch, attention_mask=mask, max_new_tokens=8).sequences[:, 8:]
    # An eos that row 0 produces at step 2 and that no other row produces in the first 4 steps.
    eos = int(free[0, 2])
    assert all(eos not in free[row, :4].tolist() for row in (1, 2, 3)) and eos not in free[0, :2].tolist()
    out = generate(model, batch, attention_mask=mask, max_new_tokens=8, eos_token_id=[eos, VOCAB + 5],
                   pad_token_id=0)
    new = out.sequences[:, 8:]
    assert new[0, :3].tolist() == free[0, :3].tolist() and new[0, 3:].eq(0).all()
    assert out.attention_mask[0, 8:].tolist() == [1, 1, 1] + [0] * (new.shape[1] - 3)
    for row in (1, 2, 3):  # the others go on as if nothing happened, until their own eos
        stop = free[row].tolist().index(eos) + 1 if eos in free[row].tolist() else new.shape[1]
        assert new[row, :stop].tolist() == free[row, :stop].tolist()
    # Decoding ends once every row is done.
    short = generate(model, prompts[0], max_new_tokens=8, eos_token_id=int(free[0, 1]))
    assert short.sequences.shape[1] == prompts[0].shape[1] + 2


def test_stop_callback_ends_the_rows_it_marks_done():
    """`stop(sequences, logits)` after every token: row r says done after r + 1 new tokens; each row keeps its tokens
    up to then (the same as decoding freely) and gets filler after, and decoding ends when the last row is done."""
    model = make_model(seed=6)
    _, batch, mask = padded_batch(seed=7)
    free = generate(model, batch, attention_mask=mask, max_new_tokens=8, output_logits=True)
    calls = []

    def stop(sequences, logits):
        calls.append((sequences.clone(), logits.clone()))
        made = sequences.shape[1] - 8
        return torch.tensor([made >= row + 1 for row in range(4)])

    out = generate(model, batch, attention_mask=mask, max_new_tokens=8, pad_token_id=0, stop=stop)
    assert out.sequences.shape == (4, 8 + 4)  # not 8 + 8: every row was done after 4 tokens
    for row in range(4):
        kept = 8 + row + 1
        assert torch.equal(out.sequences[row, :kept], free.sequences[row, :kept])
        assert out.sequences[row, kept:].eq(0).all()
        assert out.attention_mask[row, 8:].tolist() == [1] * (row + 1) + [0] * (3 - row)
    # the callback saw the sequences so far (filler of done rows included) and the logits of the token just chosen
    assert [c[0].shape[1] for c in calls] == [9, 10, 11, 12]
    for i, (sequences, logits) in enumerate(calls):
        assert torch.equal(sequences, out.sequences[:, : 9 + i])
        assert max_diff(logits[i:], free.logits[i:, i]) < TOL  # (rows before i read filler: other logits)
    # a plain bool: every row at once
    out = generate(model, batch, attention_mask=mask, max_new_tokens=8, stop=lambda seqs, logits: seqs.shape[1] >= 11)
    assert torch.equal(out.sequences, free.sequences[:, :11])
    assert torch.equal(generate(model, batch, attention_mask=mask, max_new_tokens=8,
                                stop=lambda seqs, logits: False).sequences, free.sequences)


@pytest.mark.parametrize(
    "answer", [[True, False], torch.tensor([1, 0, 0, 1]), torch.ones(3, dtype=torch.bool), "no", None]
)
def test_stop_callback_answers_are_checked(answer):
    model = make_model()
    with pytest.raises(ValueError, match=r"stop\(sequences, logits\) must return a bool"):
        generate(model, ids(4, 3), max_new_tokens=3, stop=lambda seqs, logits: answer)
    with pytest.raises(ValueError, match="stop must be a callable"):
        generate(model, ids(4, 3), max_new_tokens=3, stop=True)


def test_decoding_past_max_position_embeddings_equals_the_full_forward():
    """max_position_embeddings is informational (RoPE has no table; generate.py's "Length"): a 10-token prompt and 6 new
    tokens on a model configured for 8 positions decode exactly as the full forward over the 16 tokens reads them."""
    model = make_model(seed=4, max_position_embeddings=8)
    prompt = ids(2, 10, seed=4)
    for graph in (False, True):
        out = generate(model, prompt, max_new_tokens=6, output_logits=True, graph=graph)
        assert out.sequences.shape == (2, 16)
        with torch.no_grad():
            full = model(out.sequences).logits[:, 9:15]  # the positions that chose the 6 new tokens
        assert max_diff(out.logits, full) < TOL
        assert torch.equal(out.sequences[:, 10:], full.argmax(-1))


def test_sampling_is_reproducible_and_top_k_1_is_greedy():
    model = make_model(seed=8, **MIXERS["fast_weight-1A"])
    _, batch, mask = padded_batch(seed=9)
    options = dict(attention_mask=mask, max_new_tokens=10, temperature=1.5)
    first = generate(model, batch, seed=123, **options).sequences
    again = generate(model, batch, generator=torch.Generator().manual_seed(123), **options).sequences
    other = generate(model, batch, seed=124, **options).sequences
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    greedy = generate(model, batch, attention_mask=mask, max_new_tokens=10).sequences
    assert not torch.equal(first, greedy)
    top1 = generate(model, batch, seed=5, top_k=1, **options).sequences
    assert torch.equal(top1, greedy)
    assert torch.equal(model.generate(batch, attention_mask=mask, max_new_tokens=10, eos_token_id=None), greedy)


def test_temperature_scales_the_sampled_distribution():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    g = torch.Generator().manual_seed(0)
    for temperature in (0.5, 2.0):
        draws = sample_next(logits.expand(40000, 4), temperature=temperature, generator=g)
        freq = torch.bincount(draws, minlength=4).float() / draws.numel()
        assert max_diff(freq, torch.softmax(logits / temperature, -1)) < 0.01, temperature
    assert sample_next(logits[None], temperature=0.0).item() == 0


def test_top_k_and_top_p_filters():
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.15, 0.3]]))

    def kept(filtered: torch.Tensor) -> list[bool]:
        return torch.isfinite(filtered)[0].tolist()

    assert kept(top_k_filter(logits, 2)) == [False, True, False, True]
    assert kept(top_k_filter(logits, 4)) == [True] * 4
    assert kept(top_p_filter(logits, 0.5)) == [False, True, False, False]  # the top token alone reaches p
    assert kept(top_p_filter(logits, 0.79)) == [False, True, False, True]
    assert kept(top_p_filter(logits, 0.81)) == [False, True, True, True]
    assert kept(top_p_filter(logits, 1.0)) == [True] * 4
    g = torch.Generator().manual_seed(1)
    draws = sample_next(logits.expand(2000, 4), temperature=1.0, top_p=0.79, generator=g)
    assert set(draws.tolist()) == {1, 3}


@pytest.mark.parametrize("top_p", [1e-9, 1e-12, 5e-324])
def test_a_tiny_top_p_keeps_the_most_likely_token(top_p):
    """p at or under the running sums' tolerance: the top token alone, in every row, and sampling draws it."""
    logits = torch.tensor([[2.0, 1.0, 0.5], [0.0, 3.0, 3.5]])
    assert torch.isfinite(top_p_filter(logits, top_p)).tolist() == [[True, False, False], [False, False, True]]
    draws = sample_next(logits, temperature=1.0, top_p=top_p, generator=torch.Generator().manual_seed(0))
    assert draws.tolist() == [0, 2]


@pytest.mark.parametrize("top_k", [0, -1, 2.5, True])
def test_sample_next_and_top_k_filter_check_top_k(top_k):
    """top_k=0 is an error here, as in generate() (None turns the filter off; transformers' 0 is mapped to None by
    `HybridForCausalLM.generate` only)."""
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    with pytest.raises(ValueError, match="top_k must be an int >= 1, or None"):
        sample_next(logits, temperature=1.0, top_k=top_k)
    with pytest.raises(ValueError, match="top_k"):
        sample_next(logits, temperature=0.0, top_k=top_k)  # checked when greedy too
    with pytest.raises(ValueError, match="top_k"):
        top_k_filter(logits, top_k)


@pytest.mark.parametrize("top_p", [0, 0.0, -0.5, 1.5, float("nan"), True])
def test_sample_next_and_top_p_filter_check_top_p(top_p):
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        sample_next(logits, temperature=1.0, top_p=top_p)
    with pytest.raises(ValueError, match="top_p"):
        top_p_filter(logits, top_p)
    for temperature in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="temperature"):
            sample_next(logits, temperature=temperature)


@pytest.mark.parametrize("vocab", [3, 7, 10, 20, 100])
def test_top_p_keeps_exact_boundaries(vocab):
    """Equal probabilities 1/V: top_p = i/V is reached by exactly i tokens (float32 sums kept 7 of 10 at p = 0.6;
    float64 sums without the tolerance 9 of 10 at p = 0.8)."""
    logits = torch.zeros(1, vocab)
    for i in range(1, vocab):
        assert int(torch.isfinite(top_p_filter(logits, i / vocab)).sum()) == i, (vocab, i)
    if vocab == 10:
        g = torch.Generator().manual_seed(0)
        draws = sample_next(logits.expand(4000, vocab), temperature=1.0, top_p=0.6, generator=g)
        assert set(draws.tolist()) == set(range(6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_temperatures_sample_the_argmax_without_nan(dtype):
    """logits / 1e-30 overflowed float32 (inf - inf = NaN in the softmax, and multinomial failed): the row's largest
    logit is subtracted first, so a tiny temperature draws the argmax, or one of tied maxima."""
    logits = torch.tensor([[1.0, 2.0, 3.0], [5.0, 5.0, 1.0]], dtype=dtype).repeat(200, 1)
    g = torch.Generator().manual_seed(0)
    for temperature in (1e-30, 1e-45, 1e-300, 5e-324):
        draws = sample_next(logits, temperature=temperature, generator=g)
        assert draws[0::2].eq(2).all(), temperature
        assert set(draws[1::2].tolist()) == {0, 1}, temperature  # the two tied maxima, both drawn


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_k=0), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(seed=1, generator=torch.Generator()), "generator or a seed"),
        (dict(eos_token_id=[]), "eos_token_id"),
        (dict(eos_token_id=5, pad_token_id=VOCAB), "pad_token_id=.* vocabulary"),  # fed to finished rows
        (dict(eos_token_id=5, pad_token_id="0"), "pad_token_id"),
    ],
)
def test_bad_options_raise(options, message):
    model = make_model()
    with pytest.raises(ValueError, match=message):
        generate(model, ids(1, 3), **{"max_new_tokens": 2, **options})


def test_zero_new_tokens_returns_the_prompt():
    model = make_model()
    prompt = ids(2, 4)
    out = generate(model, prompt, max_new_tokens=0, output_logits=True)
    assert torch.equal(out.sequences, prompt) and out.logits is None


@pytest.mark.parametrize("mixer", ["mamba2", "fast_weight-1A", "fast_weight-3A", "fast_weight-3A-same_step-read_before",
                                   "fast_weight-1", "none", "fast_weight-3-ssm_only"])
@pytest.mark.parametrize("padded", [False, True], ids=["equal", "left-padded"])
def test_static_decoding_step_equals_the_dynamic_cache(mixer, padded, monkeypatch):
    """`generate(graph=True)` on the CPU: the fixed-shape step of `GraphedDecoder` (static key/value storage written
    at a device-side slot, masks over the whole storage, states copied back into their buffers) gives the dynamic
    cache's tokens and logits, for every mixer, with and without left padding."""
    model = make_model(seed=6, **MIXERS[mixer])
    if padded:
        _, batch, mask = padded_batch(seed=7)
    else:
        batch, mask = ids(3, 6, seed=7), None
    dynamic = generate(model, batch, attention_mask=mask, max_new_tokens=7, output_logits=True)
    steps = count_decoder_steps(monkeypatch)
    static = generate(model, batch, attention_mask=mask, max_new_tokens=7, output_logits=True, graph=True)
    assert steps.count == 6  # every token after the prefill's came from the static step
    assert torch.equal(static.sequences, dynamic.sequences)
    assert max_diff(static.logits, dynamic.logits) < 1e-5


@pytest.mark.parametrize("padded", [False, True], ids=["equal", "left-padded"])
def test_static_step_computes_its_attention_mask_once_for_every_layer(padded, monkeypatch):
    """The static step's layers share one additive mask per step (`StaticLayerCache.static_mask`): built once per
    step however many attention layers read it, and rebuilt after the slot advances (the logits' equality with the
    dynamic cache, above, fails if a stale one is read)."""
    import hybridlm.layers.cache as cache_module

    built = []
    monkeypatch.setattr(cache_module, "additive_mask",
                        lambda attendable, dtype, make=cache_module.additive_mask: built.append(dtype) or make(
                            attendable, dtype))
    model = make_model(seed=6, num_hidden_layers=3, **MIXERS["mamba2"])
    batch, mask = padded_batch(seed=7)[1:] if padded else (ids(3, 6, seed=7), None)
    generate(model, batch, attention_mask=mask, max_new_tokens=5, graph=True)
    assert built == [torch.float32] * 4  # the four steps after the prefill's token, one mask each


def test_static_decoder_reads_its_states_from_fixed_buffers():
    """Every step reads the same state tensors (what a replayed graph needs), the write slot advances on the device,
    and the decoder refuses to run past its capacity."""
    from hybridlm.inference import GraphedDecoder

    model = make_model(seed=8, **MIXERS["fast_weight-3A"])
    tokens = ids(2, 5, seed=8)
    with torch.no_grad():
        cache = model.new_cache()
        model(tokens, cache=cache)
        decoder = GraphedDecoder(model, cache, capacity=7, batch_size=2)
        buffers = [{name: t.data_ptr() for name, t in layer.ssm.items()} for layer in decoder.cache.layers]
        storage = [layer._key.data_ptr() for layer in decoder.cache.layers if layer._key is not None]
        assert storage and all(buffers)
        for _ in range(2):
            decoder.step(tokens[:, 0])
        assert [{name: t.data_ptr() for name, t in layer.ssm.items()} for layer in decoder.cache.layers] == buffers
        assert [layer._key.data_ptr() for layer in decoder.cache.layers if layer._key is not None] == storage
        assert int(decoder.cache.slot) == 7 and decoder.cache.free == 0
        assert [layer.length for layer in decoder.cache.layers if layer._key is not None] == [7, 7]
        assert decoder.cache.lengths.tolist() == [7, 7]
        config = model.config
        kv = 2 * 2 * 7 * config.num_key_value_heads * config.head_dim * 4  # keys + values [2, 7, H_kv, D] float32
        fw = (2 * config.fw_heads * config.fw_head_dim ** 2  # S [2, H, K, V]
              + 2 * config.fw_heads * config.fw_head_dim  # the last key [2, H, K]
              + 2 * 2 * 2 * config.fw_heads * config.fw_head_dim) * 4 + 2 * 8  # the window's tail: 2 pairs, its length
        layer = next(layer for layer in decoder.cache.layers if layer._key is not None)
        conv = layer.state_bytes() - kv - fw
        assert conv > 0 and conv == sum(t.numel() * 4 for name, t in layer.ssm.items() if "conv" in name)
        with pytest.raises(ValueError, match="cache is full"):
            decoder.step(tokens[:, 0])
        with pytest.raises(ValueError, match="one integer token per row"):
            decoder.step(tokens[:1, 0])
    with pytest.raises(ValueError, match="batch_size 3 does not match the cache's 2 rows"):
        GraphedDecoder(model, cache, capacity=9, batch_size=3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (graph capture)")
@pytest.mark.parametrize("mixer", ["mamba2", "fast_weight-1A", "fast_weight-3A", "none"])
def test_cuda_graph_decoding_equals_eager(mixer):
    """On a GPU: the replayed CUDA graph of the step gives the eager dynamic cache's tokens and logits."""
    model = make_model(seed=9, **MIXERS[mixer]).cuda()
    _, batch, mask = padded_batch(seed=9)
    batch, mask = batch.cuda(), mask.cuda()
    dynamic = generate(model, batch, attention_mask=mask, max_new_tokens=9, output_logits=True)
    graphed = generate(model, batch, attention_mask=mask, max_new_tokens=9, output_logits=True, graph=True)
    assert torch.equal(graphed.sequences, dynamic.sequences)
    assert max_diff(graphed.logits, dynamic.logits) < 1e-4
    # bf16 (the capture must not keep autocast's cached casts): both paths fed the same tokens, since a near-tie
    # rounded differently would send two free-running generations apart.
    from hybridlm.inference import GraphedDecoder

    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        cache = model.new_cache()
        logits = model(batch, attention_mask=mask, cache=cache, logits_to_keep=1).logits[:, -1]
        decoder = GraphedDecoder(model, cache, capacity=cache.seq_len + 8, batch_size=batch.shape[0])
        for _ in range(8):
            token = logits.argmax(-1)
            logits = model(token[:, None], cache=cache, logits_to_keep=1).logits[:, -1]
            assert max_diff(decoder.step(token).float(), logits.float()) < 5e-2
    assert decoder.graph is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (graph capture)")
@pytest.mark.parametrize("mixer", ["mamba2", "fast_weight-1A", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_of_fused_projections_equals_the_projections_apart(mixer, dtype):
    """On a GPU, a model in `dtype`: with its projections fused (`prepare_for_generation`: multipliers folded, then
    one GEMM per input; strided slices into the conv, the SSM step kernels, the rotation into the cache and the SiLU
    gate), the replayed graph's logits equal the separate projections' within a rounding of the dtype, fed the same
    tokens."""
    from hybridlm.inference import GraphedDecoder
    from hybridlm.models.fuse import prepare_for_generation

    _, batch, mask = padded_batch(seed=10)
    batch, mask = batch.cuda(), mask.cuda()
    apart = make_model(seed=10, **MIXERS[mixer]).cuda().to(dtype)
    prepare_for_generation(apart, fuse=False)
    fused = make_model(seed=10, **MIXERS[mixer]).cuda().to(dtype)
    prepare_for_generation(fused)
    assert fused.model.layers[0].fused_mlp is not None
    with torch.no_grad():
        caches = [model.new_cache() for model in (apart, fused)]
        logits = [model(batch, attention_mask=mask, cache=cache, logits_to_keep=1).logits[:, -1]
                  for model, cache in zip((apart, fused), caches)]
        tolerance = 1e-4 if dtype == torch.float32 else 5e-2
        assert max_diff(logits[1].float(), logits[0].float()) < tolerance  # the prefill's fused GEMMs
        decoder = GraphedDecoder(fused, caches[1], capacity=caches[1].seq_len + 8, batch_size=batch.shape[0])
        for _ in range(8):
            token = logits[0].argmax(-1)
            logits[0] = apart(token[:, None], cache=caches[0], logits_to_keep=1).logits[:, -1]
            assert max_diff(decoder.step(token).float(), logits[0].float()) < tolerance
    assert decoder.graph is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (streams, graph capture)")
@pytest.mark.parametrize("mixer", ["mamba2", "fast_weight-1A", "fast_weight-3A-same_step-read_before",
                                   "fast_weight-1"])
@pytest.mark.parametrize("arrangement", ["SA_M", "SAM"])
@pytest.mark.parametrize("graph", [False, True])
def test_cuda_concurrent_mixers_decode_bit_for_bit_as_one_stream(mixer, arrangement, graph):
    """On a GPU, a parallel block's SSM half on a side stream beside attention (`concurrent_mixers`): the static
    decoding steps' logits and states equal one stream's bit for bit, run eagerly and replayed from a CUDA graph (bf16
    weights, the projections fused), every block of the capture and of its warm-up taking the side stream; the
    prefill, the eager steps over the growing cache and the static steps run without a graph stay on one stream."""
    from hybridlm.inference import GraphedDecoder
    from hybridlm.layers import block as block_module
    from hybridlm.models.fuse import prepare_for_generation, set_concurrent_mixers

    _, batch, mask = padded_batch(seed=12)
    batch, mask = batch.cuda(), mask.cuda()
    models = [make_model(seed=12, block_arrangement=arrangement, **MIXERS[mixer]).cuda().to(torch.bfloat16)
              for _ in range(2)]
    for model, concurrent in zip(models, (False, True)):
        prepare_for_generation(model, concurrent=concurrent)
        assert set_concurrent_mixers(model, concurrent) == model.config.num_hidden_layers
    taken = []
    side_stream = block_module._side_stream
    block_module._side_stream = lambda device: taken.append(device) or side_stream(device)
    try:
        with torch.no_grad():
            caches = [model.new_cache() for model in models]
            logits = [model(batch, attention_mask=mask, cache=cache, logits_to_keep=1).logits[:, -1]
                      for model, cache in zip(models, caches)]
            token = logits[0].argmax(-1)
            logits = [model(token[:, None], cache=cache, logits_to_keep=1).logits[:, -1]
                      for model, cache in zip(models, caches)]
            assert torch.equal(logits[0], logits[1]) and not taken  # the prefill, an eager step: one stream
            decoders = [GraphedDecoder(m, c, capacity=c.seq_len + 8, batch_size=batch.shape[0], use_graph=graph)
                        for m, c in zip(models, caches)]
            for _ in range(8):
                token = logits[0].argmax(-1)
                logits = [decoder.step(token).clone() for decoder in decoders]
                assert torch.equal(logits[0], logits[1])
            for first, second in zip(decoders[0].cache.layers, decoders[1].cache.layers):
                for name in first.ssm:
                    assert torch.equal(first.ssm[name], second.ssm[name]), name
    finally:
        block_module._side_stream = side_stream
    if graph:  # every block of the warm-up step and of the captured step, once each
        assert len(taken) == 2 * models[1].config.num_hidden_layers
    else:
        assert not taken  # eager static steps: one stream
    assert all((decoder.graph is not None) == graph for decoder in decoders)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("mixer", ["mamba2", "fast_weight-1A"])
def test_cuda_graph_on_a_device_that_is_not_the_current_one(mixer):
    """A model on cuda:1 while cuda:0 is current: the graphed steps (captured on a stream of the model's device) give
    the eager steps' tokens; a capture on the current device's stream would record an empty graph."""
    from hybridlm.models.fuse import prepare_for_generation

    model = make_model(seed=13, **MIXERS[mixer]).to("cuda:1")
    prepare_for_generation(model)
    _, batch, mask = padded_batch(seed=13)
    batch, mask = batch.to("cuda:1"), mask.to("cuda:1")
    torch.cuda.set_device(0)
    eager = generate(model, batch, attention_mask=mask, max_new_tokens=6, output_logits=True)
    graphed = generate(model, batch, attention_mask=mask, max_new_tokens=6, output_logits=True, graph=True)
    assert torch.equal(graphed.sequences, eager.sequences)
    assert max_diff(graphed.logits, eager.logits) < TOL


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the inference norm's kernel)")
@pytest.mark.parametrize("arrangement", ["SA_M", "SAM", "S_A_M"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_inference_norms_equal_the_recorded_forward(arrangement, dtype):
    """On a GPU, a model in `dtype`: a cached forward without a gradient (norms in one launch with their residual
    adds, the blocks chained) gives the logits of the same forward recording a gradient (each operator apart)."""
    model = make_model(seed=11, block_arrangement=arrangement).cuda().to(dtype)
    batch = ids(2, 9, seed=11).cuda()
    with torch.no_grad():
        fast = model(batch, cache=model.new_cache()).logits
    recorded = model(batch, cache=model.new_cache()).logits
    assert recorded.requires_grad
    assert max_diff(fast.float(), recorded.detach().float()) < (1e-5 if dtype == torch.float32 else 5e-2)


@pytest.mark.parametrize("mixer", ["mamba2", "fast_weight-1A", "fast_weight-3A-same_step-read_before", "none"])
def test_compiled_static_step_equals_the_static_step(mixer):
    """`GraphedDecoder(compile_step=...)`: the model's step through torch.compile (aot_eager here; inductor on a GPU,
    where the compiled kernels are what the graph captures) gives the plain static step's logits, step after step."""
    from hybridlm.inference import GraphedDecoder

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # (reset leaves the counters)
    model = make_model(seed=8, **MIXERS[mixer]).eval()
    prompt = ids(2, 11, seed=9)
    with torch.no_grad():
        caches = [model.new_cache(), model.new_cache()]
        for cache in caches:
            model(prompt, cache=cache)
        plain, compiled = (GraphedDecoder(model, cache, capacity=16, batch_size=2, use_graph=False,
                                          compile_step=backend) for cache, backend in zip(caches, (None, "aot_eager")))
        token = prompt[:, -1]
        for _ in range(4):
            expected = plain.step(token).clone()
            assert max_diff(compiled.step(token), expected) < 1e-5
            token = expected.argmax(-1)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # dynamo traced the step (it was not eager)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (graph capture)")
@pytest.mark.parametrize("mixer", ["mamba2", "fast_weight-1A", "fast_weight-3A", "none"])
def test_cuda_graph_of_the_compiled_step_equals_eager(mixer):
    """On a GPU: the captured inductor-compiled step gives the eager dynamic cache's logits (float32, teacher
    forced)."""
    from hybridlm.inference import GraphedDecoder

    torch._dynamo.reset()
    model = make_model(seed=9, **MIXERS[mixer]).cuda().eval()
    prompt = ids(2, 11, seed=9).cuda()
    with torch.no_grad():
        cache = model.new_cache()
        logits = model(prompt, cache=cache, logits_to_keep=1).logits[:, -1]
        fresh = model.new_cache()
        model(prompt, cache=fresh)
        decoder = GraphedDecoder(model, fresh, capacity=cache.seq_len + 6, batch_size=2, compile_step="inductor")
        for _ in range(6):
            token = logits.argmax(-1)
            logits = model(token[:, None], cache=cache, logits_to_keep=1).logits[:, -1]
            assert max_diff(decoder.step(token), logits) < 1e-4
    assert decoder.graph is not None


def test_a_failed_capture_leaves_no_graph_and_the_states_as_they_were(monkeypatch):
    """`GraphedDecoder._capture` with the CUDA calls stood in for on the CPU and the capture failing: the error
    propagates, no graph is kept to replay, and the states, slot, positions and host counts are the ones before."""
    import contextlib

    from hybridlm.inference import GraphedDecoder

    class Stream:
        def wait_stream(self, other) -> None:
            pass

    @contextlib.contextmanager
    def failing_capture(graph, **options):
        raise RuntimeError("capture failed")
        yield

    model = make_model(seed=8, **MIXERS["fast_weight-3A"])
    tokens = ids(2, 5, seed=8)
    with torch.no_grad():
        cache = model.new_cache()
        model(tokens, cache=cache)
    decoder = GraphedDecoder(model, cache, capacity=9, batch_size=2, use_graph=False)
    decoder.use_graph = True
    for name, stand_in in [("Stream", lambda device=None: Stream()), ("current_stream", lambda device=None: Stream()),
                           ("stream", lambda s: contextlib.nullcontext()), ("CUDAGraph", object),
                           ("device", lambda device: contextlib.nullcontext()),
                           ("graph", failing_capture)]:
        monkeypatch.setattr(torch.cuda, name, stand_in)
    before = decoder._snapshot()
    with pytest.raises(RuntimeError, match="capture failed"):
        decoder.step(tokens[:, 0])
    after = decoder._snapshot()
    assert decoder.graph is None and decoder.logits is None
    assert after["seq_len"] == before["seq_len"] and after["lengths"] == before["lengths"]
    assert torch.equal(after["slot"], before["slot"]) and torch.equal(after["positions"], before["positions"])
    for old, new in zip(before["states"], after["states"]):
        assert old.keys() == new.keys() and all(torch.equal(old[k], new[k]) for k in old)


@pytest.mark.parametrize("mixer", ["mamba2", "fast_weight-1A", "fast_weight-3A-same_step-read_before", "fast_weight-1",
                                   "fast_weight-2", "none", "fast_weight-3-ssm_only"])
@pytest.mark.parametrize("piece", [1, 4, 7])
def test_prefill_in_pieces_equals_one_prefill(mixer, piece):
    """`prefill_chunk`: the prompt (11 tokens: pieces that end inside fast-weight chunks and windows, and a last piece
    shorter than the others) prefilled piece by piece gives the whole prefill's tokens and logits."""
    model = make_model(seed=8, **MIXERS[mixer])
    prompt = ids(2, 11, seed=9)
    whole = generate(model, prompt, max_new_tokens=5, output_logits=True)
    widths = []  # the token count of every model call: the pieces, then one per decoding step
    hook = model.register_forward_pre_hook(lambda module, args: widths.append(args[0].shape[1]))
    pieces = generate(model, prompt, max_new_tokens=5, output_logits=True, prefill_chunk=piece)
    hook.remove()
    assert widths == [min(piece, 11 - start) for start in range(0, 11, piece)] + [1] * 4
    assert torch.equal(pieces.sequences, whole.sequences)
    assert max_diff(pieces.logits, whole.logits) < TOL
    assert whole.logits.abs().max() > 0.5  # not a degenerate comparison
    # the static decoder starts from the cache the pieces filled (its keys in storage that grew piece by piece)
    graphed = generate(model, prompt, max_new_tokens=5, output_logits=True, prefill_chunk=piece, graph=True)
    assert torch.equal(graphed.sequences, whole.sequences)
    assert max_diff(graphed.logits, whole.logits) < TOL


@pytest.mark.parametrize("mixer", ["mamba2", "fast_weight-1A", "fast_weight-3A", "none"])
def test_prefill_in_pieces_of_a_left_padded_batch(mixer):
    """A left-padded batch (prompts of 9, 6 and 12 tokens): the first piece is the packed prefill of all the padding
    and a token of every row (6 + 1 columns, longer than the pieces of 3 asked for), the rest continue unpadded in
    pieces of 3 and 2; the tokens and logits are those of one padded prefill."""
    model = make_model(seed=8, **MIXERS[mixer])
    lengths, width = (9, 6, 12), 12
    batch, mask = torch.zeros(3, width, dtype=torch.long), torch.zeros(3, width, dtype=torch.long)
    for row, n in enumerate(lengths):
        batch[row, width - n:], mask[row, width - n:] = ids(1, n, seed=row)[0], 1
    whole = generate(model, batch, attention_mask=mask, max_new_tokens=5, output_logits=True)
    widths = []
    hook = model.register_forward_pre_hook(lambda module, args: widths.append(args[0].shape[1]))
    pieces = generate(model, batch, attention_mask=mask, max_new_tokens=5, output_logits=True, prefill_chunk=3)
    hook.remove()
    assert widths == [7, 3, 2] + [1] * 4
    assert torch.equal(pieces.sequences, whole.sequences)
    assert max_diff(pieces.logits, whole.logits) < TOL


def test_prefill_in_pieces_refuses_bad_sizes():
    model = make_model()
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="prefill_chunk"):
            generate(model, ids(1, 5), max_new_tokens=2, prefill_chunk=bad)


@pytest.mark.parametrize("piece", [None, 2])
def test_right_or_inner_padding_is_refused_with_or_without_pieces(piece):
    model = make_model()
    for row in ([1, 1, 1, 1, 0, 0], [1, 1, 0, 1, 1, 1]):  # right padding; a gap inside the prompt
        mask = torch.tensor([[1] * 6, row])
        with pytest.raises(ValueError, match="LEFT padding"):
            generate(model, ids(2, 6), attention_mask=mask, max_new_tokens=2, prefill_chunk=piece)


def test_prefill_function_feeds_pieces_and_fills_the_whole_prompts_cache():
    """`prefill(chunk=8)` of 23 tokens: the model sees pieces of 8, 8 and 7 tokens and ends with the cache of one
    whole prefill (the decoding step after either gives the same logits), and the same last-position logits."""
    from hybridlm.experiments.models import build_model, task_config
    from hybridlm.inference import prefill

    model = build_model(task_config("hybrid-fw-1A", vocab_size=40, size="tiny"), seed=0).double().eval()
    prompt = torch.randint(0, 40, (2, 23), generator=torch.Generator().manual_seed(0))
    widths = []
    hook = model.register_forward_pre_hook(lambda module, args: widths.append(args[0].shape[1]))
    with torch.no_grad():
        pieces, last_pieces = prefill(model, prompt, chunk=8)
        hook.remove()
        whole, last_whole = prefill(model, prompt)
        token = prompt[:, -1:]
        step_pieces, step_whole = model(token, cache=pieces).logits, model(token, cache=whole).logits
    assert widths == [8, 8, 7]
    assert (step_pieces - step_whole).abs().max() < 1e-10 and (last_pieces - last_whole).abs().max() < 1e-10


@pytest.mark.parametrize("mixer", ["mamba2", "fast_weight-1", "fast_weight-3A", "fast_weight-1A", "none"])
@pytest.mark.parametrize("graph", [False, True])
def test_a_continued_cache_gives_the_whole_prompts_tokens_and_logits(mixer, graph):
    """`generate(cache=...)` with a cache of the prompt's first 6 tokens (a separate earlier prefill, ending inside a
    fast-weight chunk): the model reads only the other 5 tokens (then 1 per step), and the tokens and logits are those
    of a prefill of all 11; pieces of 2 continue it too. The cache goes on in place; its copy is left as it was."""
    from hybridlm.inference import prefill

    model = make_model(seed=8, **MIXERS[mixer])
    prompt = ids(2, 11, seed=9)
    whole = generate(model, prompt, max_new_tokens=5, output_logits=True, graph=graph)
    for chunk, widths_then in ((None, [5]), (2, [2, 2, 1])):
        kept, _ = prefill(model, prompt[:, :6])
        snapshot = kept.copy()
        widths = []
        hook = model.register_forward_pre_hook(lambda module, args: widths.append(args[0].shape[1]))
        continued = generate(model, prompt, max_new_tokens=5, output_logits=True, graph=graph, cache=kept,
                             prefill_chunk=chunk)
        hook.remove()
        assert widths == widths_then + [1] * 4
        assert torch.equal(continued.sequences, whole.sequences)
        assert max_diff(continued.logits, whole.logits) < TOL
        assert kept.seq_len == (11 if graph else 15)  # the graphed decoder steps a static copy instead
        assert snapshot.seq_len == 6
    assert whole.logits.abs().max() > 0.5  # not a degenerate comparison


def test_a_continued_cache_is_refused_where_it_cannot_hold_the_prompts_start():
    from hybridlm.inference import prefill
    from hybridlm.layers.cache import StaticCache

    model = make_model()
    prompt = ids(2, 6)
    kept, _ = prefill(model, prompt[:, :4])
    cases = [
        (dict(cache=kept.copy(), attention_mask=torch.ones(2, 6, dtype=torch.long)), "without left padding"),
        (dict(cache=prefill(model, prompt)[0]), "the cache holds 6 tokens and the prompt has 6"),
        (dict(cache=prefill(model, prompt[:1, :4])[0]), "the cache holds 1 rows and input_ids has 2"),
        (dict(cache=StaticCache(kept, capacity=8, batch_size=2, device=torch.device("cpu"))), "got StaticCache"),
        (dict(cache=[]), "got list"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            generate(model, prompt, max_new_tokens=2, **kwargs)
    padded = model.new_cache()
    model(prompt, attention_mask=torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]]), cache=padded)
    with pytest.raises(ValueError, match="same number of tokens"):
        generate(model, torch.cat([prompt, prompt], dim=1), max_new_tokens=2, cache=padded)
