"""trl's DPOTrainer drives HybridForCausalLM unmodified: right-padded chosen / rejected rows, a reference model's
log-probabilities precomputed or from a frozen copy, and preferences that move the model."""

import pytest
import torch

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer  # noqa: E402

import hybridlm  # noqa: E402


def margins(model, tokenizer, examples):
    """chosen - rejected summed log-probability of the completions, per example (float64 sums)."""
    out = []
    model.eval()
    with torch.no_grad():
        for example in examples:
            prompt = tokenizer(example["prompt"], add_special_tokens=False)["input_ids"]
            scores = []
            for key in ("chosen", "rejected"):
                completion = tokenizer(example[key], add_special_tokens=False)["input_ids"]
                ids = torch.tensor([prompt + completion])
                logp = model(ids).logits[0, :-1].double().log_softmax(-1)
                picked = logp.gather(-1, ids[0, 1:, None])[:, 0]
                scores.append(picked[len(prompt) - 1 :].sum())
            out.append((scores[0] - scores[1]).item())
    return torch.tensor(out)


@pytest.mark.parametrize("precompute", [True, False], ids=["precomputed-reference", "frozen-reference"])
def test_dpo_moves_the_preference_margin(tmp_path, tokenizer, make_model, data, precompute):
    model = make_model(tokenizer, seed=2)
    examples = data["preferences"]()
    before = margins(model, tokenizer, examples)
    args = DPOConfig(
        output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=8, learning_rate=3e-3, logging_steps=1,
        lr_scheduler_type="constant", report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
        beta=0.1, precompute_ref_log_probs=precompute,
    )
    ref_model = None if precompute else make_model(tokenizer, seed=2)
    trainer = DPOTrainer(model=model, ref_model=ref_model, args=args,
                         train_dataset=datasets.Dataset.from_list(examples), processing_class=tokenizer)
    batch = next(iter(trainer.get_train_dataloader()))
    assert not bool(batch["attention_mask"].all())  # right-padded rows of different lengths
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 6 and all(torch.isfinite(torch.tensor([e["loss"] for e in logged])))
    assert logged[0]["loss"] == pytest.approx(torch.log(torch.tensor(2.0)).item(), abs=1e-3)  # policy == reference
    assert logged[-1]["loss"] < logged[0]["loss"] - 0.05
    after = margins(model, tokenizer, examples)
    assert after.mean() > before.mean() + 1.0


def test_trainers_build_models_from_a_directory(tmp_path, tokenizer, make_model, data):
    """The forms where TRL loads the model itself (its model-from-path helper reads `config.auto_map`, then
    AutoModelForCausalLM): SFTTrainer given a model directory, DPOTrainer building its reference model from the
    directory the policy was loaded from; both reference copies equal the saved weights."""
    saved = tmp_path / "model"
    make_model(tokenizer, seed=2).save_pretrained(saved)
    tokenizer.save_pretrained(saved)
    common = dict(max_steps=1, per_device_train_batch_size=4, report_to="none", save_strategy="no", use_cpu=True,
                  disable_tqdm=True, max_length=64)
    sft = SFTTrainer(model=str(saved), args=SFTConfig(output_dir=str(tmp_path / "sft"), **common),
                     train_dataset=datasets.Dataset.from_list(data["conversations"](1)), processing_class=tokenizer)
    policy = hybridlm.load_model(saved).train()
    dpo = DPOTrainer(model=policy, ref_model=None, args=DPOConfig(output_dir=str(tmp_path / "dpo"), **common),
                     train_dataset=datasets.Dataset.from_list(data["preferences"]()), processing_class=tokenizer)
    for model in (sft.model, dpo.ref_model):
        assert isinstance(model, hybridlm.HybridForCausalLM)
        for name, tensor in policy.state_dict().items():
            assert torch.equal(model.state_dict()[name], tensor), name
    dpo.train()
    assert torch.isfinite(torch.tensor(dpo.state.log_history[-1]["train_loss"]))
