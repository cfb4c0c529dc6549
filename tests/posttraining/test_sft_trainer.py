"""trl's SFTTrainer drives HybridForCausalLM unmodified: conversational data with an assistant-only loss and
prompt-completion data with a completion-only loss, padding-free packing (`packing=True`: rows described by
position_ids only) and right padding (`packing=False`), with TRL's defaults (gradient checkpointing on)."""

import pytest
import torch

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from trl import SFTConfig, SFTTrainer  # noqa: E402
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling  # noqa: E402


def sft_config(tmp_path, **changes):
    options = dict(
        output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=1,
        lr_scheduler_type="constant", report_to="none", save_strategy="no", use_cpu=True, max_length=64,
        disable_tqdm=True, seed=0,
    )
    options.update(changes)
    return SFTConfig(**options)


def losses(trainer):
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_conversations_with_assistant_only_loss(tmp_path, tokenizer, make_model, data, packing):
    model = make_model(tokenizer)
    args = sft_config(tmp_path, packing=packing, assistant_only_loss=True)
    trainer = SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(data["conversations"]()),
                         processing_class=tokenizer)
    batch = next(iter(trainer.get_train_dataloader()))
    assert ("position_ids" in batch) == packing and ("attention_mask" in batch) == (not packing)
    # Only the assistant's turns are trained on: the counted labels spell answers and their end-of-turn markers.
    trained = tokenizer.decode(batch["labels"][batch["labels"] != -100])
    assert "<|end_of_turn|>" in trained and "<|user|>" not in trained and "what is" not in trained
    trainer.train()
    assert model.model.gradient_checkpointing  # TRL's default, switched on by the trainer, honoured by the blocks
    steps = losses(trainer)
    assert len(steps) == 6 and all(torch.isfinite(torch.tensor(steps)))
    assert sum(steps[-2:]) < sum(steps[:2]) - 0.2  # the repeated data is being learnt


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_prompt_completion_with_completion_only_loss(tmp_path, tokenizer, make_model, data, packing):
    model = make_model(tokenizer, ssm_mixer="fast_weight", fw_heads=2, fw_head_dim=16, fw_chunk_size=16)
    args = sft_config(tmp_path, packing=packing, completion_only_loss=True)
    trainer = SFTTrainer(model=model, args=args,
                         train_dataset=datasets.Dataset.from_list(data["prompt_completions"]()),
                         processing_class=tokenizer)
    batch = next(iter(trainer.get_train_dataloader()))
    trained = tokenizer.decode(batch["labels"][batch["labels"] != -100])
    assert "?" not in trained and any(answer in trained for answer in ("four", "blue", "hello there"))
    trainer.train()
    steps = losses(trainer)
    assert all(torch.isfinite(torch.tensor(steps))) and sum(steps[-2:]) < sum(steps[:2]) - 0.2


def test_a_padding_free_batch_scores_like_the_right_padded_one(tokenizer, make_model, data):
    """TRL's two collators over the same tokenized conversations: the model's loss is the same."""
    model = make_model(tokenizer, seed=1).eval()
    examples = [
        {"input_ids": tokenizer.apply_chat_template(c["messages"], tokenize=True, return_dict=True)["input_ids"]}
        for c in data["conversations"](repeat=1)
    ]
    lengths = {len(e["input_ids"]) for e in examples}
    assert len(lengths) > 1  # rows of different lengths: the padded batch has padding
    pad = tokenizer.pad_token_id
    padded = DataCollatorForLanguageModeling(pad_token_id=pad)(examples)
    packed = DataCollatorForLanguageModeling(pad_token_id=pad, padding_free=True)(examples)
    with torch.no_grad():
        padded_loss = model(**padded, use_cache=False).loss
        packed_loss = model(**packed, use_cache=False).loss
        joined_loss = model(packed["input_ids"], labels=packed["labels"]).loss  # boundaries ignored
    torch.testing.assert_close(packed_loss, padded_loss, rtol=1e-5, atol=1e-6)
    assert abs(joined_loss - padded_loss) > 1e-4
