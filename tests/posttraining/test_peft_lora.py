"""peft LoRA on HybridForCausalLM, the SSM half's projections included: training moves only the adapters, the
merged model computes what the adapted one does, a saved adapter loads back to the same logits, and TRL's
SFTTrainer takes a LoRA config."""

import pytest
import torch

peft = pytest.importorskip("peft")

from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

import hybridlm  # noqa: E402
from hybridlm.models.model import HybridForCausalLM  # noqa: E402

TARGETS = ["in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
HYBRIDS = {
    "mamba2": dict(),
    "fast-weight": dict(ssm_mixer="fast_weight", fw_heads=2, fw_head_dim=16, fw_chunk_size=16),
}


def lora_config():
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")


def batch(tokenizer, data):
    """The conversations right-padded, labels -100 on the padding."""
    rows = [tokenizer.apply_chat_template(c["messages"], tokenize=True, return_dict=True)["input_ids"]
            for c in data["conversations"](repeat=1)]
    length = max(map(len, rows))
    ids = torch.full((len(rows), length), tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
    return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))


@pytest.mark.parametrize("hybrid", list(HYBRIDS))
def test_lora_trains_merges_saves_and_loads(tmp_path, tokenizer, make_model, data, hybrid):
    base = make_model(tokenizer, seed=4, **HYBRIDS[hybrid])
    frozen = {name: p.detach().clone() for name, p in base.named_parameters()}
    model = get_peft_model(base, lora_config())
    wrapped = {name for name, module in model.named_modules() if hasattr(module, "lora_A")}
    assert {"base_model.model.model.layers.0.ssm.in_proj", "base_model.model.model.layers.1.ssm.out_proj"} <= wrapped
    assert all(("lora_" in name) == p.requires_grad for name, p in model.named_parameters())

    # A few steps with transformers' gradient checkpointing, as Trainer runs it: the loss falls on repeated data.
    model.gradient_checkpointing_enable()
    model.train()
    inputs = batch(tokenizer, data)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(5):
        loss = model(**inputs, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0] - 0.1
    model.eval()
    for name, p in model.get_base_model().named_parameters():
        if "lora_" not in name:  # the base weights did not move
            torch.testing.assert_close(p, frozen[name.replace(".base_layer", "")], rtol=0, atol=0)

    with torch.no_grad():
        adapted = model(**inputs).logits
        with model.disable_adapter():
            plain = model(**inputs).logits
    assert (adapted - plain).abs().max() > 1e-3  # the adapters change the model

    # Generation runs through the adapters with our decoding loop.
    prompt = inputs["input_ids"][:1, :6]
    generated = model.generate(input_ids=prompt, max_new_tokens=4, do_sample=False)

    # Saved adapter -> a fresh base -> the same logits.
    model.save_pretrained(tmp_path / "adapter")
    fresh = PeftModel.from_pretrained(make_model(tokenizer, seed=4, **HYBRIDS[hybrid]), tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(fresh(**inputs).logits, adapted, rtol=1e-5, atol=1e-5)

    # Merged: a plain HybridForCausalLM with the adapted logits, which saves and loads as one.
    merged = model.merge_and_unload()
    assert type(merged) is HybridForCausalLM
    with torch.no_grad():
        torch.testing.assert_close(merged(**inputs).logits, adapted, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged.generate(prompt, max_new_tokens=4, do_sample=False), generated)
    merged.save_pretrained(tmp_path / "merged")
    loaded = hybridlm.load_model(tmp_path / "merged")
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, adapted, rtol=1e-5, atol=1e-5)


def test_sft_trainer_with_a_lora_config(tmp_path, tokenizer, make_model, data):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    model = make_model(tokenizer, seed=5)
    args = trl.SFTConfig(
        output_dir=str(tmp_path), max_steps=5, per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=1,
        lr_scheduler_type="constant", report_to="none", save_strategy="no", use_cpu=True, max_length=64,
        disable_tqdm=True, seed=0, packing=True, assistant_only_loss=True,
    )
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(data["conversations"]()),
                             processing_class=tokenizer, peft_config=lora_config())
    assert isinstance(trainer.model, PeftModel)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0] - 0.1


def test_dpo_trainer_with_a_lora_config(tmp_path, tokenizer, make_model, data):
    """The reference log-probabilities come from the same model with its adapters off."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    model = make_model(tokenizer, seed=6)
    args = trl.DPOConfig(
        output_dir=str(tmp_path), max_steps=5, per_device_train_batch_size=8, learning_rate=1e-2, logging_steps=1,
        lr_scheduler_type="constant", report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
        beta=0.1,
    )
    trainer = trl.DPOTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(data["preferences"]()),
                             processing_class=tokenizer, peft_config=lora_config())
    assert isinstance(trainer.model, PeftModel)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logged[0]["loss"] == pytest.approx(0.6931, abs=1e-3)  # adapters start at zero: policy == reference
    assert logged[-1]["loss"] < logged[0]["loss"] - 0.05 and logged[-1]["rewards/margins"] > 0
