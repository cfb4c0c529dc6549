"""Mamba-2 SSD as a plain loop over time steps: the executable specification of `ssd`.

Notation of the Mamba-2 paper (Dao & Gu 2024, "Transformers are SSMs", section 3: the SSD layer is
a selective SSM whose transition is a scalar times the identity, A_t = a_t I). Per head, the state
is a [P, N] matrix (head dim x state dim) and, with the discretization Mamba-2 uses,

    a_t = exp(dt_t * A)                              (scalar decay, in (0, 1] since dt >= 0, A < 0)
    h_t = a_t * h_{t-1} + dt_t * x_t B_t^T           (x_t [P], B_t [N]: a rank-1 write)
    y_t = h_t C_t + D * x_t                          (C_t [N]; D is the optional skip)

Head h reads B and C of group h // (H // G). Inputs reach this function already checked and cast to
the compute dtype by `hybridlm.ops.ssd.ssd`; call it through `ssd(..., backend="naive")`.
"""

from __future__ import annotations

import torch


def naive_ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    D: torch.Tensor | None,
    initial_state: torch.Tensor,
    offsets: torch.Tensor | None,
    segments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return `(y [b, T, H, P], final_state [b or N_seq, H, P, N])`, both in the inputs' dtype.

    With `offsets` (checked `cu_seqlens`, b == 1) every packed sequence runs on its own from its own
    row of `initial_state`. With `segments` ([b, T], `ssd`'s `seq_idx` numbered from 0) the state restarts from
    zero at every step whose segment differs from the step before.
    """
    if offsets is None:
        return _recurrence(x, dt, A, B, C, D, initial_state, segments)
    ys, finals = [], []
    for i in range(len(offsets) - 1):
        start, end = int(offsets[i]), int(offsets[i + 1])
        y_i, h_i = _recurrence(
            x[:, start:end], dt[:, start:end], A, B[:, start:end], C[:, start:end], D, initial_state[i : i + 1]
        )
        ys.append(y_i)
        finals.append(h_i)
    return torch.cat(ys, dim=1), torch.cat(finals, dim=0)


def _recurrence(x, dt, A, B, C, D, h, segments=None):
    b, T, H, P = x.shape
    G = B.shape[2]
    # 0. Every head reads its group's B and C: head h -> group h // (H // G).
    B = B.repeat_interleave(H // G, dim=2)  # [b, T, H, N]
    C = C.repeat_interleave(H // G, dim=2)  # [b, T, H, N]
    ys = []
    for t in range(T):
        # 1. Decay: a_t = exp(dt_t * A), one scalar per (batch, head); 0 where a new segment starts.
        decay = torch.exp(dt[:, t] * A)  # [b, H]
        if segments is not None and t > 0:
            decay = decay * (segments[:, t] == segments[:, t - 1])[:, None]
        # 2. Write: the rank-1 update dt_t * x_t B_t^T.
        write = (dt[:, t, :, None] * x[:, t])[..., :, None] * B[:, t, :, None, :]  # [b, H, P, N]
        # 3. State: h_t = a_t h_{t-1} + dt_t x_t B_t^T.
        h = decay[..., None, None] * h + write  # [b, H, P, N]
        # 4. Read (after the write): y_t = h_t C_t.
        y_t = torch.einsum("bhpn,bhn->bhp", h, C[:, t])  # [b, H, P]
        # 5. Skip: y_t += D x_t.
        if D is not None:
            y_t = y_t + D[:, None] * x[:, t]
        ys.append(y_t)
    y = torch.stack(ys, dim=1) if ys else x.new_zeros(b, 0, H, P)  # [b, T, H, P]
    return y, h
