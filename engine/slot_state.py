"""Save a slot of a Stage into the slot-state format (contracts.slot_state) and place one back.

Placing is transactional: the header, every tensor's name, shape and dtype, and every chunk's
checksum are checked before the first byte reaches the slot, so a refused state leaves the slot
as it was.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch

from ..contracts.slot_state import SlotHeader, SlotStateError, TensorEntry, decode_body, encode_body


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def save(stage, slot: int, tokens: list[int], fingerprint: str) -> Iterator[bytes]:
    """The state of `slot`'s first len(tokens) positions, as the byte chunks of the format."""
    if stage.recurrent and stage.state_len[slot] != len(tokens):
        raise SlotStateError(f"slot {slot}'s recurrent state covers {stage.state_len[slot]} tokens, not the {len(tokens)} asked for")
    views = stage.slot_state(slot, len(tokens))
    dtype = _dtype_name(stage.dtype)
    entries = [TensorEntry(name, list(t.shape), _dtype_name(t.dtype), t.numel() * t.element_size()) for name, t in views.items()]
    yield SlotHeader(fingerprint, list(stage.layer_range), list(tokens), dtype, dtype, entries).encode()
    yield from encode_body(t.contiguous().cpu().view(-1).view(torch.uint8).numpy() for t in views.values())


def reader(data: bytes | bytearray | memoryview) -> Callable[[int], bytes]:
    """`read(n)` over bytes in memory: a truncated state is a SlotStateError, not a short read."""
    view, pos = memoryview(data), 0

    def read(n: int) -> bytes:
        nonlocal pos
        if pos + n > len(view):
            raise SlotStateError(f"slot state truncated: wanted {n} bytes at {pos}, it has {len(view)}")
        pos += n
        return bytes(view[pos - n : pos])

    return read


def restore(stage, slot: int, read: Callable[[int], bytes], fingerprint: str) -> list[int]:
    """Place a state read with `read(n)` into `slot`; returns the tokens it covers."""
    header = SlotHeader.decode(read)
    if header.fingerprint != fingerprint:
        raise SlotStateError(f"slot state is of model {header.fingerprint}, this worker serves {fingerprint}")
    if tuple(header.layers) != tuple(stage.layer_range):
        raise SlotStateError(f"slot state holds layers {header.layers}, this stage holds {list(stage.layer_range)}")
    if header.dtype != _dtype_name(stage.dtype):
        raise SlotStateError(f"slot state is {header.dtype}, this stage computes in {_dtype_name(stage.dtype)}")
    if not 0 <= slot < stage.n_slots:
        raise SlotStateError(f"slot {slot} does not exist ({stage.n_slots} slots)")
    n = len(header.tokens)
    if n > stage.n_ctx:
        raise SlotStateError(f"slot state of {n} tokens exceeds this stage's context of {stage.n_ctx}")
    views = stage.slot_state(slot, n)
    want = [(name, list(t.shape), _dtype_name(t.dtype)) for name, t in views.items()]
    got = [(t.name, t.shape, t.dtype) for t in header.tensors]
    if got != want or any(t.nbytes != views[t.name].numel() * views[t.name].element_size() for t in header.tensors):
        raise SlotStateError(f"slot state tensors {got[:2]}... do not match this stage's {want[:2]}...")
    body = decode_body(read, header)
    stage.kv_clear(slot)
    offset = 0
    for entry in header.tensors:
        view = views[entry.name]
        src = torch.frombuffer(body, dtype=view.dtype, count=view.numel(), offset=offset).view(view.shape)
        view.copy_(src)
        offset += entry.nbytes
    stage.restored(slot, n)
    return list(header.tokens)
