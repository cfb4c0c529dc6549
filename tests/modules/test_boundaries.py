"""Document boundaries of packed batches (`hybridlm.modules.boundaries`) on small cases written out by hand."""

import pytest
import torch

from hybridlm.modules.boundaries import (
    cu_seqlens_from_position_ids,
    has_restarts,
    local_positions,
    pack_rows,
    sequence_ids,
)

# One row of four documents, lengths 3, 1, 2, 4: the 1-token document sits between two longer ones.
FOUR_DOCS_POSITIONS = torch.tensor([[0, 1, 2, 0, 0, 1, 0, 1, 2, 3]])
FOUR_DOCS_OFFSETS = torch.tensor([0, 3, 4, 6, 10])
FOUR_DOCS_LOCAL = torch.tensor([0, 1, 2, 0, 0, 1, 0, 1, 2, 3])
FOUR_DOCS_IDS = torch.tensor([0, 0, 0, 1, 2, 2, 3, 3, 3, 3])


def same(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Same values, dtype and shape (offsets and indices are integers: no tolerance)."""
    return got.dtype == expected.dtype and got.shape == expected.shape and torch.equal(got, expected)


# --- cu_seqlens_from_position_ids --------------------------------------------------------------------------------


@pytest.mark.parametrize("position_ids,expected", [
    (FOUR_DOCS_POSITIONS, [0, 3, 4, 6, 10]),
    (torch.tensor([[0, 1, 2, 3, 4]]), [0, 5]),  # a single document
    (torch.tensor([[0, 0, 0]]), [0, 1, 2, 3]),  # only 1-token documents
    (torch.tensor([[0, 1, 0]]), [0, 2, 3]),  # a 1-token document last
    # Two rows: each row start begins a document, also where the row continues one (positions 5, 6 ...).
    (torch.tensor([[0, 1, 2, 0, 1], [5, 6, 0, 1, 2]]), [0, 3, 5, 7, 10]),
    (torch.tensor([[0, 1, 2], [0, 1, 2]]), [0, 3, 6]),  # rows without restarts: one document per row
], ids=["four-docs", "single-doc", "all-1-token", "1-token-last", "two-rows", "rows-no-restarts"])
def test_cu_seqlens_from_position_ids(position_ids, expected):
    assert same(cu_seqlens_from_position_ids(position_ids), torch.tensor(expected, dtype=torch.int64))


def test_cu_seqlens_from_1d_int32_position_ids_are_int64():
    """A 1-D row counts as [1, T]; the offsets come back int64 whatever the positions' integer type, and the row
    start opens a document even when its position is not 0."""
    position_ids = torch.tensor([3, 4, 0, 1, 0], dtype=torch.int32)
    assert same(cu_seqlens_from_position_ids(position_ids), torch.tensor([0, 2, 4, 5]))
    assert same(position_ids, torch.tensor([3, 4, 0, 1, 0], dtype=torch.int32))  # the input is left as it was


# --- has_restarts ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("position_ids,expected", [
    (FOUR_DOCS_POSITIONS, True),
    (torch.tensor([[0, 1, 2, 3]]), False),  # a single document
    (torch.tensor([[7, 8, 9]]), False),  # a row that continues a document, no 0 anywhere
    (torch.tensor([[0, 1, 2], [0, 1, 2]]), False),  # the 0 of the first step is no restart
    (torch.tensor([[0, 1, 2, 3], [0, 1, 0, 1]]), True),  # only the second row restarts
    (torch.tensor([[5, 0]]), True),  # a restart at the last step
    (torch.tensor([0, 1, 0]), True),  # 1-D: one row
    (torch.tensor([0, 1, 2]), False),
    (torch.tensor([[0]]), False),  # T < 2: nothing can restart
    (torch.tensor([[0], [0]]), False),
], ids=["four-docs", "single-doc", "continued-row", "rows-no-restarts", "second-row-restarts", "restart-last",
        "1d-restart", "1d-none", "one-step", "one-step-two-rows"])
def test_has_restarts(position_ids, expected):
    assert has_restarts(position_ids) is expected


# --- local_positions and sequence_ids --------------------------------------------------------------------------------


@pytest.mark.parametrize("cu_seqlens,local,doc_ids", [
    (FOUR_DOCS_OFFSETS, FOUR_DOCS_LOCAL, FOUR_DOCS_IDS),
    (torch.tensor([0, 5]), torch.tensor([0, 1, 2, 3, 4]), torch.tensor([0, 0, 0, 0, 0])),  # a single document
    (torch.tensor([0, 1, 2, 3]), torch.tensor([0, 0, 0]), torch.tensor([0, 1, 2])),  # only 1-token documents
    (torch.tensor([0, 1, 4]), torch.tensor([0, 0, 1, 2]), torch.tensor([0, 1, 1, 1])),  # a 1-token document first
], ids=["four-docs", "single-doc", "all-1-token", "1-token-first"])
@pytest.mark.parametrize("offset_dtype", [torch.int64, torch.int32])
def test_local_positions_and_sequence_ids(cu_seqlens, local, doc_ids, offset_dtype):
    offsets = cu_seqlens.to(offset_dtype)
    total_len = int(cu_seqlens[-1])
    assert same(local_positions(offsets, total_len), local)  # int64 whatever the offsets' integer type
    assert same(sequence_ids(offsets, total_len), doc_ids)


def test_local_positions_invert_cu_seqlens_from_position_ids():
    """position_ids -> offsets -> local positions gives the position_ids back, for rows that start at 0."""
    position_ids = torch.tensor([[0, 1, 0, 0, 1, 2], [0, 1, 2, 3, 0, 1]])
    offsets = cu_seqlens_from_position_ids(position_ids)
    assert same(local_positions(offsets, position_ids.numel()), position_ids.reshape(-1))
    assert same(sequence_ids(offsets, position_ids.numel()), torch.tensor([0, 0, 1, 2, 2, 2, 3, 3, 3, 3, 4, 4]))


# --- pack_rows -------------------------------------------------------------------------------------------------------


def test_pack_rows_with_restarts_in_several_rows():
    position_ids = torch.tensor([[0, 1, 2, 0, 1], [0, 0, 1, 2, 3], [0, 1, 2, 3, 4]])  # B = 3, T = 5
    x = torch.arange(3 * 5 * 2, dtype=torch.float32).reshape(3, 5, 2)
    packed, cu_seqlens, packed_positions = pack_rows(x, position_ids)
    # Row after row: [0, 1], [2, 3], ... [28, 29] in one row.
    assert same(packed, torch.arange(30, dtype=torch.float32).reshape(1, 15, 2))
    assert same(cu_seqlens, torch.tensor([0, 3, 5, 6, 10, 15]))
    assert cu_seqlens.device.type == "cpu"
    assert same(packed_positions, torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1, 2, 3, 0, 1, 2, 3, 4]]))


def test_pack_rows_shares_one_position_row_among_all_rows():
    """position_ids [1, T] stand for every row: each row's documents are found at the same places."""
    position_ids = torch.tensor([[0, 1, 0, 1, 2]])
    x = torch.randn(2, 5, 3)
    packed, cu_seqlens, packed_positions = pack_rows(x, position_ids)
    assert same(packed, torch.cat([x[0], x[1]]).unsqueeze(0))
    assert same(cu_seqlens, torch.tensor([0, 2, 5, 7, 10]))
    assert same(packed_positions, torch.tensor([[0, 1, 0, 1, 2, 0, 1, 0, 1, 2]]))


def test_pack_rows_without_restarts_gives_one_document_per_row():
    x = torch.randn(2, 4, 3)
    _, cu_seqlens, packed_positions = pack_rows(x, torch.arange(4).unsqueeze(0))
    assert same(cu_seqlens, torch.tensor([0, 4, 8]))
    assert same(packed_positions, torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]))


@pytest.mark.parametrize("shape", [(3, 5, 4), (2, 5, 3, 4), (1, 5, 4)], ids=["BTD", "BTHD", "B1"])
def test_pack_rows_round_trips_the_hidden_states(shape):
    """`y.reshape(B, T, ...)` undoes the packing exactly, also for trailing head dims and for a transposed
    (non-contiguous) input."""
    position_ids = torch.tensor([[0, 1, 2, 0, 1]])
    x = torch.randn(shape)
    packed, _, _ = pack_rows(x, position_ids)
    assert packed.shape == (1, shape[0] * shape[1], *shape[2:])
    assert same(packed.reshape(shape), x)
    last = shape[0] - 1  # row b, step t is token b * T + t of the packed row
    assert same(packed[0, last * shape[1] + 3], x[last, 3])
    transposed = torch.randn(shape[1], shape[0], *shape[2:]).transpose(0, 1)  # [B, T, ...], not contiguous
    packed, _, _ = pack_rows(transposed, position_ids)
    assert same(packed.reshape(shape), transposed)


@pytest.mark.parametrize("position_ids", [
    torch.tensor([[0, 1, 2]]),  # T = 3 positions for rows of T = 5
    torch.tensor([[0, 1, 2, 0, 1]] * 3),  # three rows of positions for two rows of states
], ids=["wrong-length", "wrong-rows"])
def test_pack_rows_rejects_positions_that_do_not_fit_the_rows(position_ids):
    """position_ids must be [B, T] or [1, T]; anything else raises (the expand to [B, T]), never broadcasts."""
    with pytest.raises(RuntimeError, match="expanded size"):
        pack_rows(torch.randn(2, 5, 4), position_ids)
