"""PackedLoader: packing, document boundaries, exact resume, mixtures, schedules, epochs, augmentations."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hybridlm.data.augment import AugmentConfig
from hybridlm.data.loader import PackedLoader, Source
from hybridlm.data.shards import TokenDataset, prepare
from tests.data.corpora import documents, write_jsonl


@pytest.fixture(scope="module")
def data(tmp_path_factory, tokenizer_dir):
    """Two prepared datasets: "web" (long documents) and "math" (short ones)."""
    root = tmp_path_factory.mktemp("loader_data")
    out = {}
    for name, seed, n, lo, hi in [("web", 11, 30, 20, 120), ("math", 12, 60, 1, 6)]:
        src = write_jsonl(root / f"{name}.jsonl", documents(seed=seed, n_docs=n, lo=lo, hi=hi))
        prepare([src], tokenizer_dir, root / name, shard_tokens=500, workers=1, progress=False)
        out[name] = root / name
    return out


def _stream(ds: TokenDataset) -> np.ndarray:
    return np.concatenate([ds.doc(i) for i in range(ds.num_docs)])


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def test_packing_follows_the_document_stream(data):
    ds = TokenDataset(data["web"])
    B, L = 2, 16
    batches = list(PackedLoader([Source("web", data["web"], max_epochs=1)], batch_size=B, seq_len=L, shuffle=False))
    stream = _stream(ds)
    assert len(batches) == (len(stream) - 1) // (B * L)
    doc_starts = set(np.cumsum([0] + [len(ds.doc(i)) for i in range(ds.num_docs)]).tolist())
    for k, b in enumerate(batches):
        base = k * B * L
        assert b["input_ids"].shape == b["labels"].shape == b["position_ids"].shape == (B, L)
        assert b["input_ids"].flatten().tolist() == stream[base:base + B * L].tolist()
        assert b["labels"].flatten().tolist() == stream[base + 1:base + B * L + 1].tolist()
        for r in range(B):
            pos = 0
            for j in range(L):
                g = base + r * L + j
                pos = 0 if (j == 0 or g in doc_starts) else pos + 1
                assert b["position_ids"][r, j] == pos
        flat_starts = (b["position_ids"].flatten() == 0).nonzero().flatten().tolist()
        assert b["cu_seqlens"].tolist() == flat_starts + [B * L] and b["cu_seqlens"].dtype == torch.int32
        assert b["max_seqlen"] == int(np.diff(b["cu_seqlens"].numpy()).max())


def test_labels_can_stop_at_document_ends(data):
    ds = TokenDataset(data["math"])
    sources = [Source("m", data["math"], max_epochs=1)]
    n_masked = 0
    for b, full in zip(PackedLoader(sources, batch_size=2, seq_len=64, cross_doc_labels=False),
                       PackedLoader(sources, batch_size=2, seq_len=64), strict=True):
        masked = b["labels"] == -100
        assert torch.equal(masked, b["input_ids"] == ds.eos_id)  # EOS only ever ends a document
        assert torch.equal(b["input_ids"], full["input_ids"])
        assert torch.equal(b["labels"][~masked], full["labels"][~masked])
        n_masked += int(masked.sum())
    assert n_masked > 10


def _mixture(data, **kw):
    args = dict(batch_size=2, seq_len=32, seed=5,
                schedule=[(0, {"web": 0.6, "math": 0.4}), (1500, {"web": 0.2, "math": 0.8})],
                augment=AugmentConfig(fim_rate=0.3, reorder_rate=0.2, reorder_min_tokens=16))
    args.update(kw)
    return PackedLoader([Source("web", data["web"]), Source("math", data["math"], max_epochs=1.25)], **args)


def test_resume_continues_exactly(data):
    reference = [b for _, b in zip(range(50), _mixture(data))]
    end = _mixture_after(data, 50).state_dict()
    assert end["phase"] == 1 and end["docs_drawn"][1] == 75  # the run crosses the schedule and exhausts "math"
    offsets = []
    for k in (1, 6, 17, 33, 45):
        first = _mixture(data)
        for _ in range(k):
            next(first)
        state = json.loads(json.dumps(first.state_dict()))  # as stored in a checkpoint
        offsets.append(state["carry"]["offset"])
        resumed = _mixture(data)
        resumed.load_state_dict(state)
        for expected in reference[k:]:
            assert _same(next(resumed), expected)
        assert resumed.state_dict() == end
    assert any(o > 0 for o in offsets)  # some checkpoints fall inside a document


def _mixture_after(data, n):
    loader = _mixture(data)
    for _ in range(n):
        next(loader)
    return loader


def test_state_from_another_configuration_is_refused(data):
    state = _mixture(data).state_dict()
    with pytest.raises(ValueError, match="different configuration.*seq_len"):
        _mixture(data, seq_len=64).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        _mixture(data, seed=6).load_state_dict(state)


def test_mixture_shares_follow_the_weights(data):
    loader = PackedLoader([Source("web", data["web"], weight=3.0), Source("math", data["math"], weight=1.0)],
                          batch_size=4, seq_len=64, seed=0)
    for _ in range(40):
        next(loader)
    report = loader.report()
    total = sum(r["tokens"] for r in report.values())
    max_len = max(len(TokenDataset(data[n]).doc(i)) for n in data for i in range(TokenDataset(data[n]).num_docs))
    # The next source is the one furthest behind, so shares stay within one document of the weights.
    assert abs(report["web"]["share"] - 0.75) <= max_len / total
    assert abs(report["math"]["share"] - 0.25) <= max_len / total
    assert report["math"]["epochs"] > 1  # the short source repeats


def test_epoch_limit_exhausts_a_source_and_the_rest_continue(data):
    math = TokenDataset(data["math"])
    loader = PackedLoader([Source("web", data["web"]), Source("math", data["math"], max_epochs=2)],
                          batch_size=2, seq_len=64, seed=1)
    for _ in range(60):
        next(loader)
    report = loader.report()
    assert report["math"]["exhausted"] and report["math"]["docs"] == 2 * math.num_docs
    assert report["math"]["tokens"] == 2 * math.num_tokens  # every document exactly twice
    assert not report["web"]["exhausted"] and report["web"]["tokens"] > report["math"]["tokens"]


def test_loader_stops_when_every_source_is_exhausted(data):
    web, math = TokenDataset(data["web"]), TokenDataset(data["math"])
    B, L = 2, 32
    loader = PackedLoader([Source("web", data["web"], max_epochs=1), Source("math", data["math"], max_epochs=0.5)],
                          batch_size=B, seq_len=L, seed=2)
    n = sum(1 for _ in loader)
    report = loader.report()
    assert report["web"]["tokens"] == web.num_tokens and report["math"]["docs"] == math.num_docs // 2
    assert n == (web.num_tokens + report["math"]["tokens"] - 1) // (B * L)
    with pytest.raises(StopIteration):
        next(loader)
    state = json.loads(json.dumps(loader.state_dict()))
    assert state["finished"] and state["batches"] == n
    again = PackedLoader([Source("web", data["web"], max_epochs=1), Source("math", data["math"], max_epochs=0.5)],
                         batch_size=B, seq_len=L, seed=2)
    again.load_state_dict(state)
    with pytest.raises(StopIteration):
        next(again)


def test_most_tokens_bounds_what_the_stream_can_hold(data):
    web, math = TokenDataset(data["web"]), TokenDataset(data["math"])
    assert np.array_equal(np.cumsum(web.doc_lengths()), [web.doc_start(i + 1) for i in range(web.num_docs)])
    for seed in (0, 1, 2):
        sources = [Source("web", data["web"], max_epochs=2), Source("math", data["math"], max_epochs=0.5)]
        loader = PackedLoader(sources, batch_size=2, seq_len=32, seed=seed)
        for _ in loader:
            pass
        drawn = sum(loader.tokens_per_source.values())
        most = loader.most_tokens()
        longest = np.sort(math.doc_lengths())[-round(0.5 * math.num_docs):].sum()
        assert most == 2 * web.num_tokens + longest and drawn <= most  # whole epochs exactly, half of one at most
    assert PackedLoader([Source("web", data["web"])], batch_size=1, seq_len=8).most_tokens() is None
    with_fim = PackedLoader([Source("web", data["web"], max_epochs=1)], batch_size=1, seq_len=8,
                            augment=AugmentConfig(fim_rate=0.5))
    assert with_fim.most_tokens() is None  # augmentations add tokens


def test_schedule_switches_weights_at_a_token_count(data):
    web = TokenDataset(data["web"])
    switch = 1000
    loader = PackedLoader([Source("web", data["web"]), Source("math", data["math"])], batch_size=2, seq_len=32,
                          schedule=[(0, {"web": 1.0}), (switch, {"math": 1.0})])
    for _ in range(10):
        next(loader)
    before = loader.report()
    assert before["math"]["tokens"] == 0 and before["web"]["tokens"] < switch
    for _ in range(40):
        next(loader)
    after = loader.report()
    longest = max(len(web.doc(i)) for i in range(web.num_docs))
    assert switch <= after["web"]["tokens"] < switch + longest
    assert after["math"]["tokens"] > 1000


def test_every_epoch_is_a_permutation_and_depends_on_the_seed(data):
    ds = TokenDataset(data["math"])
    docs = {tuple(ds.doc(i).tolist()) for i in range(ds.num_docs)}
    orders = []
    for seed in (0, 0, 1):
        loader = PackedLoader([Source("m", data["math"])], batch_size=1, seq_len=8, seed=seed)
        drawn = [tuple(loader._document(0, n).tolist()) for n in range(2 * ds.num_docs)]
        assert set(drawn[: ds.num_docs]) == set(drawn[ds.num_docs:]) == docs
        assert drawn[: ds.num_docs] != drawn[ds.num_docs:]  # a new order each epoch
        orders.append(drawn)
    assert orders[0] == orders[1] != orders[2]


def test_augmentations_are_off_by_default_and_deterministic(data):
    ds = TokenDataset(data["web"])
    sentinels = [ds.special_tokens[k] for k in ("fim_prefix", "fim_middle", "fim_suffix", "section", "original_order")]
    plain = torch.cat([b["input_ids"] for _, b in zip(range(30), PackedLoader(data["web"], batch_size=2, seq_len=32))])
    assert not torch.isin(plain, torch.tensor(sentinels)).any()
    cfg = AugmentConfig(fim_rate=0.5, reorder_rate=0.5, reorder_min_tokens=16)

    def run(seed):
        loader = PackedLoader(data["web"], batch_size=2, seq_len=32, seed=seed, augment=cfg)
        return torch.cat([b["input_ids"] for _, b in zip(range(30), loader)])

    a, b, c = run(0), run(0), run(1)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.isin(a, torch.tensor(sentinels)).any()


def test_fim_documents_in_the_stream_reassemble(data):
    ds = TokenDataset(data["web"])
    ids = ds.special_tokens
    loader = PackedLoader([Source("web", data["web"], max_epochs=1)], batch_size=1, seq_len=256, shuffle=False,
                          augment=AugmentConfig(fim_rate=1.0))
    stream = torch.cat([b["input_ids"].flatten() for b in loader]).numpy()
    docs = np.split(stream, np.flatnonzero(stream == ds.eos_id) + 1)[:-1]  # whole documents only
    assert len(docs) > 20
    for i, doc in enumerate(docs):
        (s,), (m,) = np.flatnonzero(doc == ids["fim_suffix"]), np.flatnonzero(doc == ids["fim_middle"])
        assert doc[0] == ids["fim_prefix"]
        original = np.concatenate([doc[1:s], doc[m + 1:-1], doc[s + 1:m], doc[-1:]])
        assert np.array_equal(original, ds.doc(i))


def test_ranks_split_the_global_batch(data):
    whole = [b for _, b in zip(range(5), PackedLoader(data["web"], batch_size=4, seq_len=16, seed=3))]
    parts = [[b for _, b in zip(range(5), PackedLoader(data["web"], batch_size=2, seq_len=16, seed=3, rank=r,
                                                         world_size=2))] for r in range(2)]
    for k in range(5):
        for key in ("input_ids", "labels", "position_ids"):
            assert torch.equal(torch.cat([parts[0][k][key], parts[1][k][key]]), whole[k][key])
    state = PackedLoader(data["web"], batch_size=2, seq_len=16, seed=3, rank=1, world_size=2).state_dict()
    PackedLoader(data["web"], batch_size=2, seq_len=16, seed=3, rank=0, world_size=2).load_state_dict(state)


def test_invalid_arguments(data):
    with pytest.raises(ValueError, match="unknown sources"):
        PackedLoader(data["web"], batch_size=1, seq_len=8, schedule=[(0, {"nope": 1.0})])
    with pytest.raises(ValueError, match="start at token 0"):
        PackedLoader(data["web"], batch_size=1, seq_len=8, schedule=[(5, {"data": 1.0})])
    with pytest.raises(ValueError, match="not all 0"):
        PackedLoader(data["web"], batch_size=1, seq_len=8, schedule=[(0, {"data": 0.0})])
    with pytest.raises(ValueError, match="unique names"):
        PackedLoader([Source("a", data["web"]), Source("a", data["math"])], batch_size=1, seq_len=8)
    with pytest.raises(ValueError, match="max_epochs"):
        PackedLoader([Source("a", data["web"], max_epochs=0)], batch_size=1, seq_len=8)
