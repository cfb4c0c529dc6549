"""`hybridlm sft` / `dpo` / `chat` end to end on a tiny model (CPU, float32, seeded): exact resume, a model that
answers what it was fine-tuned on, DPO moving the preference margin, LoRA outputs, and one-line errors."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from hybridlm.cli import main
from hybridlm.data.chat import ChatEncoder, demo_preferences
from hybridlm.inference.chat import ChatSession
from hybridlm.models.hf import load_model
from hybridlm.training.config import ConfigError, load_config
from hybridlm.training.dpo import reference_log_probs
from hybridlm.training.posttraining import FitCounts, PreferencePairs, fit_pair
from hybridlm.training.run_dir import read_jsonl
from hybridlm.training.trainer import Trainer
from tests.helpers import chat_args, type_lines
from tests.inference.helpers import count_decoder_steps
from tests.posttraining.helpers import make_model_dir

QA = [("Spell cat.", "C-A-T."), ("What colour is snow?", "Snow is white."), ("Hello!", "Hello to you."),
      ("Reverse dog.", "god")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("runs"))


def _config(model_dir, out, task="sft", *sets):
    return load_config(None, [f"model.init={model_dir}", f"train.out_dir={out}", "train.progress=false",
                              "train.samples=0", "batch.seq_len=128", "batch.micro_batch=4", *sets], task=task)


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _weights(directory):
    return {k: v.clone() for k, v in load_model(directory).state_dict().items()}


def _whole_and_resumed(model_dir, tmp_path, task: str, stop_at: int, *sets: str) -> tuple[Path, Path]:
    """A run in tmp_path/whole, and the same run in tmp_path/split stopped after update `stop_at` and resumed."""
    whole = Trainer(_config(model_dir, tmp_path / "whole", task, *sets))
    whole.train()
    whole.close()

    def stop(trainer, record):
        if record["step"] == stop_at:
            trainer.request_stop("test")

    first = Trainer(_config(model_dir, tmp_path / "split", task, *sets), callbacks=[stop])
    assert first.train().status == "interrupted"
    first.close()
    second = Trainer(_config(model_dir, tmp_path / "split", task, *sets), resume=True)
    assert second.train().status == "completed"
    second.close()
    return tmp_path / "whole", tmp_path / "split"


def test_resume_of_another_commands_run_is_refused_naming_both(model_dir, tmp_path, capsys):
    out = tmp_path / "sft_run"
    with Trainer(_config(model_dir, out, "sft", "train.steps=2", "train.save_every=1")) as trainer:
        trainer.train()
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(ConfigError, match=rf"holds a `hybridlm sft` run \(step_00000002\), not a `hybridlm dpo` one; "
                                          rf"continue it with `hybridlm sft --resume --out {out}`, or start `hybridlm "
                                          rf"dpo` from its model in a new --out \(--model {out / 'final'}\)"):
        Trainer(_config(model_dir, out, "dpo", "train.steps=3"), resume=True)
    assert sorted(p.name for p in out.iterdir()) == before


def test_sft_resume_reproduces_an_uninterrupted_run(model_dir, tmp_path):
    runs = _whole_and_resumed(model_dir, tmp_path, "sft", 3, "train.steps=6", "train.save_every=2",
                              "train.log_every=1")
    logged = [[r["loss"] for r in read_jsonl(d / "metrics.jsonl")] for d in runs]
    assert len(logged[0]) == 6 and logged[0] == logged[1]
    a, b = (_weights(d / "final") for d in runs)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_sft_teaches_answers_that_chat_gives_back_through_the_template(model_dir, tmp_path, monkeypatch):
    records = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in QA] * 8
    data = _write(tmp_path / "chats.jsonl", records)
    out = tmp_path / "sft"
    code = main(["sft", "--model", str(model_dir), "--data", str(data), "--out", str(out), "--set", "train.steps=120",
                 "--set", "optim.lr=1e-2", "--set", "train.progress=false", "--set", "train.samples=1",
                 "--set", "batch.seq_len=64", "--set", "train.save_every=0"])
    assert code == 0
    final = out / "final"
    assert (final / "tokenizer_config.json").is_file()
    session = ChatSession(load_model(final), ChatEncoder.from_model_dir(final), max_new_tokens=16)
    for question, _ in QA:  # one multi-turn conversation: every turn sees the ones before
        session.reply(question)
    assert [m["role"] for m in session.messages] == ["user", "assistant"] * len(QA)
    for question, answer in QA:
        session.reset()
        streamed = []
        assert session.reply(question, streamed.append) == answer
        assert "".join(streamed) == answer
    # The fixed-shape step (`graph=True`, what chat runs on CUDA: a CUDA graph there, eager here): the same answers.
    steps = count_decoder_steps(monkeypatch)
    graphed = ChatSession(session.model, session.encoder, max_new_tokens=16, graph=True)
    for question, answer in QA:
        graphed.reset()
        assert graphed.reply(question) == answer
    assert steps.count >= len(QA)


def test_dpo_on_swapped_preferences_moves_the_margin_their_way(model_dir, tmp_path):
    pairs = [{"prompt": p["prompt"], "chosen": p["rejected"], "rejected": p["chosen"]} for p in demo_preferences(24)]
    data = _write(tmp_path / "prefs.jsonl", pairs)
    config = _config(model_dir, tmp_path / "dpo", "dpo", f"data.chat={data}", "data.demo=false", "train.steps=15",
                     "optim.lr=3e-3", "train.log_every=5", "dpo.beta=0.5")
    trainer = Trainer(config)
    trainer.train()
    trainer.close()
    records = read_jsonl(tmp_path / "dpo" / "metrics.jsonl")
    assert {"rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy"} <= set(records[-1])

    encoder = ChatEncoder.from_model_dir(model_dir)
    fitted = [fit_pair(*encoder.encode_preference(p), 128, FitCounts()) for p in pairs]
    source = PreferencePairs(fitted, batch_size=8, seed=0, shuffle=False)

    def margin(model):
        table = reference_log_probs(model, source.batch, len(fitted), pairs_per_batch=8)
        return float((table[:, 0] - table[:, 1]).mean())

    before, after = margin(load_model(model_dir)), margin(load_model(tmp_path / "dpo" / "final"))
    assert after > before + 1.0


def test_lora_sft_writes_merged_weights_and_the_adapter(model_dir, tmp_path):
    peft = pytest.importorskip("peft")
    out = tmp_path / "lora"
    trainer = Trainer(_config(model_dir, out, "sft", "train.steps=3", "lora.r=4", "lora.alpha=8",
                              "lora.save_adapter=true", "optim.lr=1e-2"))
    assert trainer.parameters > sum(p.numel() for g in trainer.optimizer.param_groups for p in g["params"])
    trainer.train()
    trainer.close()
    base, merged = _weights(model_dir), _weights(out / "final")
    changed = {k for k in base if not torch.equal(base[k], merged[k])}
    assert changed and all(k.split(".")[-2] in ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "out_proj",
                                                "gate_proj", "up_proj", "down_proj") for k in changed)
    again = peft.PeftModel.from_pretrained(load_model(model_dir), str(out / "final" / "adapter")).merge_and_unload()
    assert all(torch.allclose(again.state_dict()[k], merged[k], atol=1e-6) for k in merged)


def test_bad_input_is_one_line_and_loses_nothing(model_dir, tmp_path, capsys):
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(good) + "\n{oops\n")
    assert main(["sft", "--model", str(model_dir), "--data", str(bad), "--out", str(tmp_path / "r1")]) == 1
    assert "bad.jsonl:2: not valid JSON" in capsys.readouterr().err
    assert not (tmp_path / "r1" / "checkpoints").exists()
    assert main(["sft", "--out", str(tmp_path / "r2")]) == 2
    assert "model.init" in capsys.readouterr().err
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((model_dir / "config.json").read_text())
    assert main(["sft", "--model", str(bare), "--out", str(tmp_path / "r3")]) != 0
    assert "has no tokenizer" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert main(["dpo", "--model", str(model_dir), "--data", str(empty), "--out", str(tmp_path / "r4")]) == 1
    assert "no usable records" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="data.chat / data.demo"):
        _config(model_dir, tmp_path / "r5", "sft", "data.demo=false")
    assert main(["chat", "--model", str(tmp_path / "nowhere"), "--prompt", "hi"]) == 1
    assert f"model directory {tmp_path / 'nowhere'} does not exist" in capsys.readouterr().err
    no_template = tmp_path / "no_template"
    shutil.copytree(model_dir, no_template)
    for name in ("tokenizer_config.json", "hybridlm_tokenizer.json"):
        path = no_template / name
        if path.is_file():
            settings = json.loads(path.read_text())
            settings.pop("chat_template", None)
            path.write_text(json.dumps(settings))
    (no_template / "chat_template.jinja").unlink(missing_ok=True)
    assert main(["chat", "--model", str(no_template), "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert "has no chat template: pass --chat-template FILE" in err and "records" not in err
    bad = tmp_path / "bad.jinja"
    bad.write_text("{{ messages[0].content | no_such_filter }}")
    assert main(["chat", "--model", str(model_dir), "--chat-template", str(bad), "--prompt", "hi"]) == 1
    assert "the chat template does not render a user message" in capsys.readouterr().err
    strict = tmp_path / "strict.jinja"
    strict.write_text("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system role') }}"
                      "{% endif %}<|{{ m.role }}|>{{ m.content }}{% endfor %}")
    assert main(["chat", "--model", str(model_dir), "--chat-template", str(strict), "--system", "be nice",
                 "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert "does not render a system message and a user message" in err and "no system role" in err
    assert main(["chat", "--model", str(model_dir), "--prompt", "hi " * 5000, "--max-new-tokens", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("hybridlm chat: the conversation has ") and err.count("\n") == 1 and "/reset" not in err


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_dpo_resume_reproduces_an_uninterrupted_run(model_dir, tmp_path, lora):
    """The reference log-probabilities travel in the checkpoint (the resumed model is no longer the reference)."""
    data = _write(tmp_path / "prefs.jsonl", demo_preferences(16))
    sets = ("train.steps=4", "train.save_every=2", "train.log_every=1", "optim.lr=3e-3", "dpo.loss=norm",
            f"data.chat={data}", "data.demo=false", *(["lora.r=4"] if lora else []))
    runs = _whole_and_resumed(model_dir, tmp_path, "dpo", 2, *sets)
    keys = ("loss", "rewards/chosen", "rewards/margin", "rewards/accuracy")
    logged = [[[r[k] for k in keys] for r in read_jsonl(d / "metrics.jsonl")] for d in runs]
    assert len(logged[0]) == 4 and logged[0] == logged[1]


def test_a_turn_end_spelled_in_bytes_still_ends_the_answer(tmp_path):
    """The demo's byte tokenizer has no <|end_of_turn|> token: the answer stops at its text, which never shows."""
    from hybridlm.inference.chat import answer
    from hybridlm.training.demo import build_byte_tokenizer

    build_byte_tokenizer().save(tmp_path)
    encoder = ChatEncoder.from_model_dir(tmp_path)
    assert encoder.turn_end() == "<|end_of_turn|>" and encoder.stop_ids() == [encoder.eos_id]
    assert encoder.cut_at_turn_end("C-A-T.<|end_of_turn|>more") == ("C-A-T.", True)
    reply = encoder.encode_text("C-A-T.<|end_of_turn|><|user|>")

    class Scripted(torch.nn.Module):
        """Emits `reply` one token at a time, whatever the input."""

        config = type("C", (), {"pad_token_id": 0})()

        def __init__(self):
            super().__init__()
            self.anchor = torch.nn.Parameter(torch.zeros(1))
            self.calls = 0

        def new_cache(self):
            return None

        def forward(self, ids, cache=None, logits_to_keep=1, **kwargs):
            logits = torch.full((ids.shape[0], 1, 300), -1e9)
            logits[:, -1, reply[min(self.calls, len(reply) - 1)]] = 0.0
            self.calls += 1
            return type("O", (), {"logits": logits})()

    streamed = []
    text = answer(Scripted(), encoder, encoder.encode_text("<|user|>Spell cat."), max_new_tokens=40,
                  on_text=streamed.append)
    assert text == "C-A-T." and "".join(streamed) == "C-A-T."
    assert not any("<" in piece for piece in streamed)  # the marker's start was held back, never printed


def test_ctrl_c_stops_an_answer_and_the_chat_goes_on(monkeypatch, capsys):
    """Ctrl-C while the model answers: back at the prompt, the interrupted exchange left out of the conversation;
    then Ctrl-D leaves with status 0 (Ctrl-C at the prompt: 130, no traceback either way)."""

    from hybridlm.inference import chat

    class Session:
        def __init__(self):
            self.messages, self.calls = [], 0

        def reply(self, text, on_text):
            self.calls += 1
            if self.calls == 1:
                on_text("partial")
                raise KeyboardInterrupt
            on_text("answer")
            self.messages += [text, "answer"]
            return "answer"

    session = Session()
    monkeypatch.setattr(chat, "_session", lambda args: session)
    type_lines(monkeypatch, ["first", "second"])
    assert chat.run_chat(chat_args()) == 0
    out, err = capsys.readouterr()
    assert session.messages == ["second", "answer"] and "answer stopped" in err and "answer" in out

    def interrupted(prompt):
        raise KeyboardInterrupt

    monkeypatch.setattr("builtins.input", interrupted)
    assert chat.run_chat(chat_args()) == 130
    session.calls = 0
    assert chat.run_chat(chat_args("--prompt", "hi")) == 130


@pytest.mark.parametrize("task", ["sft", "dpo"])
def test_data_that_cannot_be_read_is_a_config_error_before_anything_is_created(model_dir, tmp_path, capsys, task):
    """A missing --data path, a directory without record files, a first record of another format and a missing
    --chat-template: exit status 2 with the setting named, before any note is printed or the output directory (or
    its lock) is created."""
    text = _write(tmp_path / "pretraining.jsonl", [{"text": "plain text, no messages"}])
    empty = tmp_path / "no_records"
    empty.mkdir()
    cases = [(["--data", str(tmp_path / "nope.jsonl")], "data.chat: input .*nope.jsonl' does not exist"),
             (["--data", str(empty)], "data.chat: directory .*no_records' holds no .jsonl, .parquet files"),
             (["--data", str(text)], r"data.chat: .*pretraining.jsonl:1: a record without .*is --data the right file"),
             (["--chat-template", str(tmp_path / "nope.jinja")], "data.chat_template: chat template .*nope.jinja: "
                                                                 "no such file")]
    out = tmp_path / "run"
    for args, message in cases:
        assert main([task, "--model", str(model_dir), *args, "--out", str(out), "--set", "train.steps=5"]) == 2
        captured = capsys.readouterr()
        assert re.match(f"config error: {message}", captured.err), captured.err
        assert captured.err.count("\n") == 1 and captured.out == ""  # (train.steps=5 shortens the warmup: no note)
        assert not out.exists()


def test_a_batch_larger_than_the_data_is_a_config_error(model_dir, tmp_path, capsys):
    """An update that would take more rows (sft) or pairs (dpo) than the data holds is refused before training."""
    pairs = _write(tmp_path / "prefs.jsonl", demo_preferences(16))
    with pytest.raises(ConfigError, match=r"batch: an update takes 32 preference pairs \(batch.micro_batch 16 x "
                                          r"batch.grad_accum 2 x 1 data-parallel rank\), more than the training data "
                                          r"holds: 16 \(data.chat\)"):
        Trainer(_config(model_dir, tmp_path / "dpo", "dpo", f"data.chat={pairs}", "data.demo=false",
                        "batch.micro_batch=16", "batch.grad_accum=2"))
    with pytest.raises(ConfigError, match=r"batch: an update takes 100,000 rows of batch.seq_len 128 .*more than the "
                                          r"training data holds: \d+ \(512 samples packed\)"):
        Trainer(_config(model_dir, tmp_path / "sft", "sft", "batch.micro_batch=100000"))
    Trainer(_config(model_dir, tmp_path / "fits", "dpo", f"data.chat={pairs}", "data.demo=false",
                    "batch.micro_batch=16")).close()  # all 16 pairs in one update: fine


def test_export_of_a_fine_tuning_run_has_its_tokenizer_and_chat_template(model_dir, tmp_path, caplog):
    """`hybridlm checkpoint export` of an sft run: the exported directory holds the tokenizer of model.init and the
    chat template the run trained with (data.chat_template), as the run's final/ does, so `hybridlm chat` loads it."""
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end_of_turn|>{% endfor %}"
                        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    run, out = tmp_path / "sft", tmp_path / "exported"
    trainer = Trainer(_config(model_dir, run, "sft", "train.steps=2", f"data.chat_template={template}"))
    trainer.train()
    trainer.close()
    assert main(["checkpoint", "export", "--run", str(run), "--out", str(out)]) == 0
    assert "has no tokenizer" not in caplog.text
    tokenizer_files = {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
    assert tokenizer_files <= {p.name for p in out.iterdir()}
    for name in tokenizer_files:
        assert (out / name).read_bytes() == (run / "final" / name).read_bytes(), name
    encoder = ChatEncoder.from_model_dir(out)
    assert encoder.chat_template == template.read_text()
    assert len(encoder.tokenizer) == len(ChatEncoder.from_model_dir(model_dir).tokenizer)
    assert main(["chat", "--model", str(out), "--prompt", "Hello!", "--max-new-tokens", "2", "--device", "cpu"]) == 0
