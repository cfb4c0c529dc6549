"""Chat records, templates and masks (hybridlm.data.chat); packed SFT rows and DPO pairs (training.posttraining)."""

from __future__ import annotations

import json

import pytest
import torch

from hybridlm.data.chat import ChatEncoder, ReadCounts, demo_conversations, load_tokenizer, read_records
from hybridlm.data.errors import DataError
from hybridlm.data.tokenizer import SPECIAL_TOKENS
from hybridlm.training.loop import IGNORE_INDEX
from hybridlm.training.posttraining import ChatRows, Pair, PreferencePairs
from tests.posttraining.helpers import make_model_dir

SPECIAL = dict(SPECIAL_TOKENS)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def encoder(model_dir):
    return ChatEncoder.from_model_dir(model_dir)


def _write_jsonl(path, lines):
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def test_assistant_mask_marks_exactly_the_assistant_tokens_of_the_shipped_template(encoder):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Spell cat."},
                {"role": "assistant", "content": "C-A-T."}, {"role": "user", "content": "And dog?"},
                {"role": "assistant", "content": "D-O-G."}]
    ids, mask = encoder.encode_sft({"messages": messages})
    tok = encoder.tokenizer
    assert ids == tok(encoder.render(messages), add_special_tokens=False)["input_ids"]  # what inference sees
    trained = [ids[i] for i in range(len(ids)) if mask[i]]
    eot = tok.convert_tokens_to_ids(SPECIAL["end_of_turn"])
    expected = (tok("C-A-T.", add_special_tokens=False)["input_ids"] + [eot]
                + tok("D-O-G.", add_special_tokens=False)["input_ids"] + [eot])
    assert trained == expected
    # the trained tokens are two contiguous runs, each right after an <|assistant|> marker
    assistant = tok.convert_tokens_to_ids(SPECIAL["assistant"])
    starts = [i for i in range(1, len(ids)) if mask[i] and not mask[i - 1]]
    assert len(starts) == 2 and all(ids[i - 1] == assistant for i in starts)


def test_train_on_all_and_prompt_completion_records(model_dir):
    enc = ChatEncoder.from_model_dir(model_dir, train_on="all")
    ids, mask = enc.encode_sft({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    assert mask == [1] * len(ids)
    enc = ChatEncoder.from_model_dir(model_dir)
    ids, mask = enc.encode_sft({"prompt": "2 + 2 =", "completion": " 4"})
    prompt = enc.encode_text("2 + 2 =")
    assert ids[:len(prompt)] == prompt and ids[-1] == enc.eos_id
    assert mask == [0] * len(prompt) + [1] * (len(ids) - len(prompt))
    # conversational prompt-completion: the completion's messages train, the prompt's do not
    record = {"prompt": [{"role": "user", "content": "Spell cat."}],
              "completion": [{"role": "assistant", "content": "C-A-T."}]}
    both = enc.encode_sft(record)
    assert both == enc.encode_sft({"messages": record["prompt"] + record["completion"]})


def test_a_template_that_renders_no_assistant_span_is_refused(model_dir):
    # the assistant's message is rendered before the user's: prefixes are not prefixes of the whole
    odd = ("{% for m in messages|reverse %}<|{{ m['role'] }}|>{{ m['content'] }}<|end_of_turn|>{% endfor %}"
           "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    enc = ChatEncoder(load_tokenizer(model_dir), odd, source="odd")
    with pytest.raises(DataError, match="renders no span for message 1"):
        enc.encode_sft({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})


def test_a_template_that_does_not_parse_or_refuses_the_messages_is_a_data_error(model_dir):
    conversation = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "a"},
                                 {"role": "assistant", "content": "b"}]}
    broken = ChatEncoder(load_tokenizer(model_dir), "{% for m in messages %}{{ m.content }{% endfor %}", source="x")
    with pytest.raises(DataError, match=r"the chat template of x does not parse: .* \(its line 1\)"):
        broken.encode_sft(conversation)
    strict = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
              "{{ m.content }}{% endfor %}")
    with pytest.raises(DataError, match="the chat template of y refused the messages: no system role"):
        ChatEncoder(load_tokenizer(model_dir), strict, source="y").encode_sft(conversation)


def test_a_model_without_a_chat_template_gets_a_clear_error(model_dir, tmp_path):
    tok = load_tokenizer(model_dir)
    tok.chat_template = None
    enc = ChatEncoder(tok, None, source="that model")
    with pytest.raises(DataError, match="has no chat template.*--chat-template"):
        enc.encode_sft({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
    assert enc.encode_sft({"prompt": "a", "completion": "b"})[0]  # plain strings need none
    with pytest.raises(DataError, match="has no tokenizer"):
        ChatEncoder.from_model_dir(tmp_path)


def test_bad_records_name_file_and_line_or_are_skipped_and_counted(tmp_path):
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    path = _write_jsonl(tmp_path / "d.jsonl", [good, "{not json", good, {"text": "x"}, "",
                                               {"messages": [{"role": "user", "content": "only a question"}]},
                                               {"prompt": "p", "completion": 3}])
    with pytest.raises(DataError, match=r"d.jsonl:2: not valid JSON"):
        read_records(path, kind="sft")
    counts = ReadCounts()
    records = read_records(path, kind="sft", skip_bad=True, counts=counts)
    assert [r.where.rsplit(":", 1)[1] for r in records] == ["1", "3"]
    assert sum(counts.skipped.values()) == 4 and counts.records == 2
    with pytest.raises(DataError, match="no usable records"):
        read_records(_write_jsonl(tmp_path / "e.jsonl", ["{}"]), kind="preference", skip_bad=True)
    with pytest.raises(DataError, match="without 'chosen'"):
        read_records(_write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "rejected": "b"}]), kind="preference")
    answer = [{"role": "assistant", "content": "b"}]
    question = [{"role": "user", "content": "q"}]
    for kind, record, name in (("preference", {"prompt": question, "chosen": answer, "rejected": question}, "rejected"),
                               ("sft", {"prompt": question, "completion": question}, "completion")):
        path = _write_jsonl(tmp_path / "r.jsonl", [record])
        with pytest.raises(DataError, match=rf"r\.jsonl:1: '{name}' must end with an assistant message \(its last is "
                                            r"'user'\)"):
            read_records(path, kind=kind)
        with pytest.raises(DataError, match="no usable records"):  # a bad record: skipped when asked
            read_records(path, kind=kind, skip_bad=True)
    for kind, record in (("preference", {"prompt": [], "chosen": answer, "rejected": answer}),
                         ("sft", {"prompt": [], "completion": answer})):
        with pytest.raises(DataError, match=r"e\.jsonl:1: 'prompt' is an empty list of messages"):
            read_records(_write_jsonl(tmp_path / "e.jsonl", [record]), kind=kind)
    with pytest.raises(DataError, match="does not exist"):
        read_records(tmp_path / "missing.jsonl", kind="sft")
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "chat.txt").write_text("user: a\nassistant: b\n")
    for given in (texts / "chat.txt", tmp_path / "prefs.csv"):  # the formats named are the ones records take
        given.touch()
        with pytest.raises(DataError, match=rf"unsupported file type '{given.suffix}'; expected one of .jsonl, "
                                            r"\.parquet$"):
            read_records(given, kind="sft")
    with pytest.raises(DataError, match=r"holds no \.jsonl, \.parquet files"):
        read_records(texts, kind="sft")


def test_parquet_records(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = demo_conversations(5)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")
    assert [r.data for r in read_records(tmp_path, kind="sft")] == rows


def _samples(rng: torch.Generator, count: int, vocab: int = 50) -> list[tuple[list[int], list[int]]]:
    out = []
    for _ in range(count):
        n = int(torch.randint(2, 12, (1,), generator=rng))
        ids = torch.randint(3, vocab, (n,), generator=rng).tolist()
        mask = [0] * (n // 2) + [1] * (n - n // 2)
        out.append((ids, mask))
    return out


def test_chat_rows_pack_every_sample_once_per_epoch_as_its_own_document():
    samples = _samples(torch.Generator().manual_seed(0), 37)
    rows = ChatRows(samples, batch_size=3, seq_len=16, seed=1, pad_id=0)
    seen = []
    for epoch_row in rows.epoch_rows(0):
        assert sum(len(samples[i][0]) for i in epoch_row) <= 16
        seen += epoch_row
    assert sorted(seen) == list(range(37))
    batch = next(rows)
    assert batch["input_ids"].shape == (3, 16)
    cu = batch["cu_seqlens"].tolist()
    flat_ids, flat_labels = batch["input_ids"].flatten().tolist(), batch["labels"].flatten().tolist()
    flat_pos = batch["position_ids"].flatten().tolist()
    lookup = {tuple(s[0]): s for s in samples}
    for a, b in zip(cu[:-1], cu[1:]):
        assert flat_pos[a:b] == list(range(b - a))  # positions restart: each segment is a document
        segment = tuple(flat_ids[a:b])
        if segment in lookup:  # a sample: labels are its next tokens where they train
            ids, mask = lookup[segment]
            assert flat_labels[a:b] == [ids[t + 1] if mask[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)] + [-100]
        else:  # the padding at a row's end scores nothing
            assert set(segment) == {0} and set(flat_labels[a:b]) == {IGNORE_INDEX}


def test_chat_rows_state_resumes_the_same_stream_and_splits_it_over_ranks():
    samples = _samples(torch.Generator().manual_seed(1), 23)
    one = ChatRows(samples, batch_size=4, seq_len=16, seed=3, pad_id=0)
    batches = [next(one) for _ in range(9)]  # several epochs
    again = ChatRows(samples, batch_size=4, seq_len=16, seed=3, pad_id=0)
    for _ in range(4):
        next(again)
    state = json.loads(json.dumps(again.state_dict()))
    resumed = ChatRows(samples, batch_size=4, seq_len=16, seed=3, pad_id=0)
    resumed.load_state_dict(state)
    for expected in batches[4:]:
        assert torch.equal(next(resumed)["input_ids"], expected["input_ids"])
    # two ranks of 2 rows each draw, together, the rows one rank of 4 draws
    ranks = [ChatRows(samples, batch_size=2, seq_len=16, seed=3, pad_id=0, rank=r, world_size=2) for r in (0, 1)]
    for expected in batches[:3]:
        got = torch.cat([next(r)["input_ids"] for r in ranks])
        assert torch.equal(got, expected["input_ids"])
    with pytest.raises(ValueError, match="keep the global batch"):
        ChatRows(samples, batch_size=2, seq_len=16, seed=3, pad_id=0).load_state_dict(state)


def test_preference_pairs_pack_chosen_then_rejected_and_score_the_responses():
    pairs = [Pair([5, 6, 7], [8, 9], [10]), Pair([11], [12, 13, 14], [15, 16])]
    source = PreferencePairs(pairs, batch_size=2, seed=0, shuffle=False)
    source.reference = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]], dtype=torch.float64)
    batch = next(source)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 5, 6, 7, 10, 11, 12, 13, 14, 11, 15, 16]]
    assert batch["cu_seqlens"].tolist() == [0, 5, 9, 13, 16]
    assert batch["labels"].tolist() == [[-100, -100, 8, 9, -100, -100, -100, 10, -100, 12, 13, 14, -100, 15, 16, -100]]
    assert batch["reference"].tolist() == [[-1.0, -2.0], [-3.0, -4.0]]


def test_best_fit_packing_fills_rows_and_keeps_every_item_once():
    import random

    from hybridlm.training.posttraining import best_fit_rows

    rng = random.Random(0)
    lengths = [rng.randint(1, 70) for _ in range(500)]
    rows = best_fit_rows(lengths, list(range(500)), 100)
    assert sorted(i for row in rows for i in row) == list(range(500))
    assert all(sum(lengths[i] for i in row) <= 100 for row in rows)
    assert sum(lengths) / (100 * len(rows)) > 0.95  # greedy packing in this order fills ~0.7
    # best fit: an item goes to the open row with the least room that holds it
    assert best_fit_rows([5, 4, 3, 2], [0, 1, 2, 3], 7) == [[0, 3], [1, 2]]
    assert best_fit_rows([8], [0], 7) == [[0]]  # an item longer than a row gets a row of its own
