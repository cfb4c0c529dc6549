"""Document boundaries of packed batches: `cu_seqlens` offsets from `position_ids`, local positions.

A packed row holds several documents end to end. Two spellings of where they start are accepted
across the library: `cu_seqlens` [N + 1] (offsets into one packed row, B == 1) and `position_ids`
[B, T] that restart at 0 at each document start (the Hugging Face convention for packed rows).
"""

from __future__ import annotations

import torch


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """position_ids [B, T] -> int64 offsets [N + 1] of the documents of the flattened [1, B*T] row.

    Every row start and every position equal to 0 starts a document.
    """
    if position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
    batch, length = position_ids.shape
    starts = position_ids == 0  # [B, T]
    starts[:, 0] = True
    flat_starts = torch.nonzero(starts.reshape(-1), as_tuple=False).flatten()
    end = torch.tensor([batch * length], device=flat_starts.device, dtype=flat_starts.dtype)
    return torch.cat([flat_starts, end]).to(torch.int64)


def has_restarts(position_ids: torch.Tensor) -> bool:
    """True when some row of position_ids [B, T] restarts at 0 after its first step (packed documents).
    Reading the answer is a host synchronization (none for T < 2)."""
    if position_ids.shape[-1] < 2:
        return False
    rows = position_ids.unsqueeze(0) if position_ids.dim() == 1 else position_ids
    return bool((rows[:, 1:] == 0).any())


def local_positions(cu_seqlens: torch.Tensor, total_len: int) -> torch.Tensor:
    """Offsets [N + 1] -> [total_len] position of every token inside its own document (0, 1, ...)."""
    offsets = cu_seqlens.to(torch.int64)
    lengths = offsets[1:] - offsets[:-1]
    starts = torch.repeat_interleave(offsets[:-1], lengths, output_size=total_len)
    return torch.arange(total_len, device=offsets.device) - starts


def sequence_ids(cu_seqlens: torch.Tensor, total_len: int) -> torch.Tensor:
    """Offsets [N + 1] -> [total_len] index of the document each token belongs to."""
    offsets = cu_seqlens.to(torch.int64)
    lengths = offsets[1:] - offsets[:-1]
    return torch.repeat_interleave(torch.arange(len(lengths), device=offsets.device), lengths, output_size=total_len)


def padding_mask(attention_mask: torch.Tensor, shape: torch.Size) -> torch.Tensor | None:
    """attention_mask [B, T] (1 = token) -> the boolean mask, or None when nothing is padded.
    Each row holds its tokens as one contiguous run: left padding, right padding (what training collators such as
    TRL's produce) or both, with at least one token per row. Padding inside a row is refused: whether its two runs are
    one document or two is not something the mask says."""
    if tuple(attention_mask.shape) != tuple(shape):
        raise ValueError(f"attention_mask must be [B, T] = {list(shape)}, got {list(attention_mask.shape)}")
    keep = attention_mask.to(torch.bool)
    if bool(keep.all()):
        return None
    runs = (keep[:, :1].sum(1) + (keep[:, 1:] & ~keep[:, :-1]).sum(1))  # [B] runs of tokens per row
    if bool((runs != 1).any()):
        raise ValueError(
            "attention_mask: each row must hold one contiguous run of tokens (left or right padding), with at least "
            "one token; padding inside a row and empty rows are not supported (pack documents with position_ids "
            "restarting at 0, or cu_seqlens)"
        )
    return keep


def left_padding_mask(attention_mask: torch.Tensor, shape: torch.Size) -> torch.Tensor | None:
    """attention_mask [B, T] (1 = token) -> the boolean mask, or None when nothing is padded.
    Only left padding is accepted (each row: zeros, then ones), with at least one token per row: what decoding
    needs, since every row continues at its end."""
    if tuple(attention_mask.shape) != tuple(shape):
        raise ValueError(f"attention_mask must be [B, T] = {list(shape)}, got {list(attention_mask.shape)}")
    keep = attention_mask.to(torch.bool)
    if bool(keep.all()):
        return None
    if not bool(keep[:, -1].all()) or bool((keep[:, :-1] & ~keep[:, 1:]).any()):
        raise ValueError(
            "attention_mask must be LEFT padding (each row: zeros, then ones, ending on a token); "
            "right or inner padding is not supported"
        )
    return keep


def pack_rows(x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows [B, T, ...] whose position_ids [B, T] (or [1, T]) mark documents -> one packed row:
    (x [1, B*T, ...], cu_seqlens [N + 1] on the host, position_ids [1, B*T]). Undo with `y.reshape(B, T, ...)`.
    Finding the documents reads position_ids on the host once; the offsets stay there, where every consumer checks
    them (`check_cu_seqlens`), so no layer reads the device again."""
    batch, length = x.shape[:2]
    position_ids = position_ids.expand(batch, length)
    cu_seqlens = cu_seqlens_from_position_ids(position_ids.cpu())
    return x.reshape(1, batch * length, *x.shape[2:]), cu_seqlens, position_ids.reshape(1, batch * length)
