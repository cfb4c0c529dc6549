"""Right-padded batches (TRL's `packing=False`) and padding-free packed rows marked only by `position_ids` (TRL's
`packing=True`) give each sequence the logits and loss it has alone: no pad token and no other document reaches a
short conv, an SSD or fast-weight state, or attention. float64 on the CPU, a Mamba-2 and a fast-weight hybrid."""

import pytest
import torch

from tests.models.helpers import VOCAB, make_model

TOL = 1e-10
HYBRIDS = {
    "mamba2": dict(),
    "fast-weight": dict(ssm_mixer="fast_weight", fw_heads=4, fw_head_dim=8, fw_chunk_size=4),
}
LENGTHS = (7, 3, 11)  # T not a multiple of any chunk size


def sequences(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator) for n in LENGTHS]


def model_for(hybrid):
    return make_model(seed=3, **HYBRIDS[hybrid]).double()


def alone(model, seqs):
    """Per sequence: (logits [n, V], summed next-token loss, target count)."""
    out = []
    for seq in seqs:
        result = model(seq[None], labels=seq[None])
        out.append((result.logits[0], result.loss * (len(seq) - 1), len(seq) - 1))
    return out


def right_padded(seqs, pad=0):
    length = max(map(len, seqs))
    ids = torch.full((len(seqs), length), pad)
    mask = torch.zeros(len(seqs), length, dtype=torch.long)
    for i, seq in enumerate(seqs):
        ids[i, : len(seq)], mask[i, : len(seq)] = seq, 1
    return ids, mask


def relative(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("hybrid", list(HYBRIDS))
def test_a_right_padded_batch_equals_each_sequence_alone(hybrid):
    model, seqs = model_for(hybrid), sequences()
    ids, mask = right_padded(seqs, pad=5)  # a pad id that is an ordinary token: only the mask can keep it out
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        batch = model(ids, attention_mask=mask, labels=labels)
        reference = alone(model, seqs)
    for i, (logits, _, _) in enumerate(reference):
        assert relative(batch.logits[i, : len(seqs[i])], logits) < TOL
    expected = sum(loss for _, loss, _ in reference) / sum(n for _, _, n in reference)
    assert abs(batch.loss.item() - expected.item()) < TOL * expected.item()
    # The labels of the pads need not be -100: targets at and after a pad position are skipped by the mask.
    with torch.no_grad():
        assert abs(model(ids, attention_mask=mask, labels=ids).loss.item() - expected.item()) < TOL * expected.item()
    # The pad positions were left out of the run (their hidden states are zeros), not only out of the loss.
    hidden = model.model(ids, attention_mask=mask).last_hidden_state
    assert hidden[mask == 0].abs().max() == 0 and hidden[mask == 1].abs().min() > 0


@pytest.mark.parametrize("hybrid", list(HYBRIDS))
def test_a_packed_row_marked_by_position_ids_equals_each_sequence_alone(hybrid):
    model, seqs = model_for(hybrid), sequences(seed=1)
    ids = torch.cat(seqs)[None]  # [1, total], TRL's padding-free row
    position_ids = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    labels = ids.clone()
    labels[position_ids == 0] = -100  # as TRL's collator marks each document's first token
    with torch.no_grad():
        packed = model(ids, position_ids=position_ids, labels=labels)
        # TRL's collator also passes the offsets under transformers' names; they must agree with position_ids
        offsets = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
        with_offsets = model(ids, position_ids=position_ids, labels=labels, cu_seq_lens_q=offsets,
                             cu_seq_lens_k=offsets, max_length_q=max(LENGTHS), max_length_k=max(LENGTHS),
                             seq_idx=torch.repeat_interleave(torch.arange(3), torch.tensor(LENGTHS))[None],
                             use_cache=False)
        reference = alone(model, seqs)
    start = 0
    for (logits, _, _), seq in zip(reference, seqs):
        assert relative(packed.logits[0, start : start + len(seq)], logits) < TOL
        assert relative(with_offsets.logits[0, start : start + len(seq)], logits) < TOL
        start += len(seq)
    expected = sum(loss for _, loss, _ in reference) / sum(n for _, _, n in reference)
    assert abs(packed.loss.item() - expected.item()) < TOL * expected.item()
    assert abs(with_offsets.loss.item() - expected.item()) < TOL * expected.item()
    # The same row read as one document differs: the boundaries matter here.
    with torch.no_grad():
        joined = model(ids, labels=labels)
    assert abs(joined.loss.item() - expected.item()) > 1e-6


def test_num_items_in_batch_divides_the_summed_loss():
    model, seqs = model_for("mamba2"), sequences()
    ids, mask = right_padded(seqs)
    with torch.no_grad():
        mean = model(ids, attention_mask=mask, labels=ids).loss
        summed = model(ids, attention_mask=mask, labels=ids, num_items_in_batch=torch.tensor(7)).loss
    count = sum(n - 1 for n in LENGTHS)
    assert abs(summed.item() - mean.item() * count / 7) < 1e-9


def test_padding_the_model_cannot_read_is_refused():
    model = make_model()
    ids = torch.randint(0, VOCAB, (2, 5))
    with pytest.raises(ValueError, match="one contiguous run of tokens"):
        model(ids, attention_mask=torch.tensor([[1, 0, 1, 1, 1], [1, 1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="LEFT padding"):
        model(ids, attention_mask=torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]), cache=model.new_cache())
    with pytest.raises(ValueError, match="cu_seq_lens_q and cu_seq_lens_k differ"):
        model(ids[:1], cu_seq_lens_q=torch.tensor([0, 2, 5]), cu_seq_lens_k=torch.tensor([0, 3, 5]))
    with pytest.raises(TypeError, match="unsupported keyword.*bogus"):
        model(ids, bogus=1)


@pytest.mark.parametrize("hybrid", list(HYBRIDS))
def test_the_chunked_loss_equals_the_logits_loss(hybrid):
    """`return_logits=False` (the LM head and cross entropy over row chunks, no logits kept) gives the loss and every
    parameter's gradient of the logits path, with labels on packed documents, with shift_labels (the trainer's
    targets, aligned with the positions) and with `num_items_in_batch`; tied or muP-scaled heads alike."""
    model = make_model(seed=3, lm_head_multiplier=0.7, **HYBRIDS[hybrid]).double()
    seqs = sequences(1)
    ids = torch.cat(seqs)[None]
    cu_seqlens = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    shifted = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    shifted[:, 4] = -100
    params = [p for p in model.parameters() if p.requires_grad]
    for keywords in (dict(labels=ids, cu_seqlens=cu_seqlens), dict(shift_labels=shifted),
                     dict(shift_labels=shifted, num_items_in_batch=5)):
        full = model(ids, **keywords)
        chunked = model(ids, **keywords, return_logits=False)
        assert chunked.logits is None and full.logits is not None
        assert abs(chunked.loss.item() - full.loss.item()) < TOL * abs(full.loss.item())
        for a, b in zip(torch.autograd.grad(chunked.loss, params), torch.autograd.grad(full.loss, params)):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_loss_keywords_are_checked():
    model = make_model(seed=0).double()
    ids = sequences()[0][None]
    with pytest.raises(ValueError, match="not both"):
        model(ids, labels=ids, shift_labels=ids)
    with pytest.raises(ValueError, match="pass labels or shift_labels"):
        model(ids, return_logits=False)
    with pytest.raises(ValueError, match="kept positions' shape"):
        model(ids, shift_labels=ids[:, 1:])
    with pytest.raises(ValueError, match="leave logits_to_keep at 0"):
        model(ids, labels=ids, logits_to_keep=2)
    positions = torch.tensor([1, 4])
    kept = model(ids, shift_labels=ids[:, [2, 5]], logits_to_keep=positions, return_logits=False).loss
    full = model(ids, shift_labels=ids[:, [2, 5]], logits_to_keep=positions).loss
    assert abs(kept.item() - full.item()) < TOL * full.item()


def test_an_adapted_head_computes_its_logits():
    """A head that is not a plain bias-free Linear (an adapter's wrapper) keeps its own forward: the loss without
    logits still goes through it."""

    class Offset(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) + 1.0 * torch.arange(self.out_features, dtype=x.dtype)

    model = make_model(seed=0).double()
    head = Offset(model.lm_head.in_features, model.lm_head.out_features, bias=False).double()
    head.weight = model.lm_head.weight
    model.lm_head = head
    ids = sequences()[2][None]
    chunked = model(ids, labels=ids, return_logits=False).loss
    full = model(ids, labels=ids).loss
    assert abs(chunked.item() - full.item()) < TOL * full.item()


def test_a_hooked_head_computes_its_logits():
    """A forward hook on the head (a user's, or an offloading library's) is honoured: the loss without logits goes
    through the module call too."""
    model = make_model(seed=0).double()
    model.lm_head.register_forward_hook(lambda module, args, out: out + torch.arange(out.shape[-1], dtype=out.dtype))
    ids = sequences()[2][None]
    chunked = model(ids, labels=ids, return_logits=False).loss
    full = model(ids, labels=ids).loss
    assert abs(chunked.item() - full.item()) < TOL * full.item()
