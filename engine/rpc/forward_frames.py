"""The FORWARD family's frames (FORWARD, FORWARD_IPC, FORWARD_ACK, FORWARD_OUT), packed by the head
and unpacked by the peer: raw bytes in the compute dtype, every size checked against the frame's own
batch before anything is allocated (contracts/rpc.py declares the layouts)."""

from __future__ import annotations

import numpy as np
import torch

from ...contracts.rpc import (
    AHEAD,
    CODE_DTYPES,
    DTYPE_CODES,
    FORWARD_HEADER,
    FORWARD_OUT,
    OUT_ARGMAX,
    OUT_HIDDEN,
    OUT_TOKENS,
)
from .compute_error import ComputeError
from .resident import DTYPES


def pack_forward(
    epoch: int, hidden: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, *, with_hidden: bool = True
) -> list:
    """FORWARD payload as buffers (header, slots, positions, hidden) for a zero-copy sendmsg;
    without the hidden bytes for FORWARD_IPC (`hidden` then only gives shape and dtype)."""
    t, d = hidden.shape
    header = FORWARD_HEADER.pack(epoch, t, d, DTYPE_CODES[str(hidden.dtype).removeprefix("torch.")])
    parts = [header, slots.to(torch.int32).contiguous().numpy(), positions.to(torch.int32).contiguous().numpy()]
    return parts + [raw_bytes(hidden)] if with_hidden else parts


def raw_bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy()


def pack_forward_out(
    epoch: int,
    hidden: torch.Tensor,
    slots,
    positions,
    rows: torch.Tensor,
    tokens: torch.Tensor | None,
    want_hidden: bool,
    argmax: bool = False,
    ahead: tuple = (),
) -> list:
    """FORWARD_OUT payload: FORWARD's, then the logit rows, (to a stage with the MTP block) the token
    ids, and the drafts ahead asked for: (slot, drafted, k, p_min) each."""
    flags = (OUT_HIDDEN if want_hidden else 0) | (OUT_TOKENS if tokens is not None else 0)
    flags |= OUT_ARGMAX if argmax else 0
    parts = [*pack_forward(epoch, hidden, slots, positions), FORWARD_OUT.pack(rows.numel(), len(ahead), flags)]
    parts.append(rows.to(torch.int32).contiguous().numpy())
    parts += [tokens.to(torch.int32).contiguous().numpy()] if tokens is not None else []
    return parts + [b"".join(AHEAD.pack(*entry) for entry in ahead)]


def unpack_forward_out(payload):
    """(epoch, hidden, slots, positions, rows, tokens or None, want_hidden, argmax, ahead entries);
    every size checked against the frame's own batch (rows index it, an entry's slot is in it)."""
    view = memoryview(payload)
    _, t, d, dtype = _header(view, "FORWARD_OUT")
    o = FORWARD_HEADER.size + 8 * t + t * d * dtype.itemsize
    if len(view) < o + FORWARD_OUT.size:
        raise ComputeError(
            f"FORWARD_OUT of {t}x{d} needs more than {o + FORWARD_OUT.size} bytes, frame has {len(view)}"
        )
    n_rows, n_ahead, flags = FORWARD_OUT.unpack_from(view, o)
    if flags & ~(OUT_HIDDEN | OUT_TOKENS | OUT_ARGMAX) or n_rows > t or n_ahead > t:
        raise ComputeError(
            f"FORWARD_OUT flags {flags:#x}, {n_rows} logit rows or {n_ahead} drafts ahead of a {t}-row batch refused"
        )
    o += FORWARD_OUT.size
    n_tokens = t if flags & OUT_TOKENS else 0
    want = o + 4 * n_rows + 4 * n_tokens + AHEAD.size * n_ahead
    if len(view) != want:
        raise ComputeError(f"FORWARD_OUT of {t} rows and {n_rows} logit rows needs {want} bytes, frame has {len(view)}")

    def ints(at: int, n: int) -> torch.Tensor:
        return (
            torch.frombuffer(view[at : at + 4 * n], dtype=torch.int32).long() if n else torch.zeros(0, dtype=torch.long)
        )

    rows = ints(o, n_rows)
    if n_rows and not (0 <= int(rows.min()) and int(rows.max()) < t):
        raise ComputeError(f"FORWARD_OUT logit rows must index the batch's {t} rows")
    tokens = ints(o + 4 * n_rows, n_tokens) if flags & OUT_TOKENS else None
    if n_tokens and int(tokens.min()) < 0:
        raise ComputeError("FORWARD_OUT token ids must be >= 0")
    at = o + 4 * n_rows + 4 * n_tokens
    ahead = [AHEAD.unpack_from(view, at + i * AHEAD.size) for i in range(n_ahead)]
    epoch, hidden, slots, positions = unpack_forward(view[: FORWARD_HEADER.size + 8 * t + t * d * dtype.itemsize])
    return epoch, hidden, slots, positions, rows, tokens, bool(flags & OUT_HIDDEN), bool(flags & OUT_ARGMAX), ahead


def unpack_forward(payload, *, with_hidden: bool = True) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(epoch, hidden, slots, positions). Without the hidden bytes (FORWARD_IPC), `hidden` is a
    meta tensor: the frame's shape and dtype, no data."""
    view = memoryview(payload)
    epoch, t, d, dtype = _header(view, "FORWARD")
    want = FORWARD_HEADER.size + 8 * t + (t * d * dtype.itemsize if with_hidden else 0)
    if len(view) != want:
        raise ComputeError(f"FORWARD of {t}x{d} needs {want} bytes, frame has {len(view)}")
    o = FORWARD_HEADER.size
    slots = torch.frombuffer(view[o : o + 4 * t], dtype=torch.int32) if t else torch.zeros(0, dtype=torch.int32)
    positions = (
        torch.frombuffer(view[o + 4 * t : o + 8 * t], dtype=torch.int32) if t else torch.zeros(0, dtype=torch.int32)
    )
    if not with_hidden:
        hidden = torch.empty(t, d, dtype=dtype, device="meta")
    elif t * d:
        hidden = torch.frombuffer(view[o + 8 * t :], dtype=dtype).view(t, d)
    else:
        hidden = torch.zeros(t, d, dtype=dtype)
    return epoch, hidden, slots.long(), positions.long()


def _header(view: memoryview, what: str) -> tuple[int, int, int, torch.dtype]:
    """FORWARD_HEADER's (epoch, rows, width, dtype), or ComputeError naming the frame `what`."""
    if len(view) < FORWARD_HEADER.size:
        raise ComputeError(f"{what} payload shorter than its header")
    epoch, t, d, code = FORWARD_HEADER.unpack_from(view)
    dtype = DTYPES.get(CODE_DTYPES.get(code, ""))
    if dtype is None:
        raise ComputeError(f"FORWARD dtype code {code} unknown")
    return epoch, t, d, dtype
