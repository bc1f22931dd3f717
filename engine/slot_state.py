"""Save a slot of a Stage into the slot-state format (contracts.slot_state) and place one back;
split and regroup a pipeline's states by layer (one state per stage, any split on either side).

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
    # One copy, taken now: the chunks must not alias KV that later steps overwrite.
    snapshot = [t.to("cpu", copy=True, memory_format=torch.contiguous_format) for t in views.values()]
    yield from encode_body(t.view(-1).view(torch.uint8).numpy() for t in snapshot)


def reader(data: bytes | bytearray | memoryview) -> Callable[[int], bytes]:
    """`read(n)` over bytes in memory (views, no copies): a truncated state is a SlotStateError, not
    a short read."""
    view, pos = memoryview(data), 0

    def read(n: int) -> bytes:
        nonlocal pos
        if pos + n > len(view):
            raise SlotStateError(f"slot state truncated: wanted {n} bytes at {pos}, it has {len(view)}")
        pos += n
        return view[pos - n : pos]

    return read


def restore(stage, slot: int, read: Callable[[int], bytes], fingerprint: str) -> list[int]:
    """Place a state read with `read(n)` into `slot`; returns the tokens it covers. The header is
    judged before the body is read."""
    header = SlotHeader.decode(read)
    check(stage, slot, header, fingerprint)
    return place(stage, slot, header, decode_body(read, header), fingerprint)


def place(stage, slot: int, header: SlotHeader, body, fingerprint: str) -> list[int]:
    """Place a state already read whole (its chunks checked) into `slot`."""
    views = check(stage, slot, header, fingerprint)
    tensors, offset = {}, 0
    for entry in header.tensors:
        view = views[entry.name]
        tensors[entry.name] = torch.frombuffer(body, dtype=view.dtype, count=view.numel(), offset=offset).view(view.shape)
        offset += entry.nbytes
    stage.kv_clear(slot)
    stage.place_slot_state(slot, len(header.tokens), tensors)
    return list(header.tokens)


def check(stage, slot: int, header: SlotHeader, fingerprint: str) -> dict[str, torch.Tensor]:
    """The slot's views, once the header fits this stage; else SlotStateError naming why."""
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
    return views


def read_all(data) -> list[tuple[SlotHeader, bytearray, memoryview]]:
    """Slot states back to back (a pipeline's, one per stage), each read whole and checked:
    (header, body, the state's own bytes)."""
    view, out = memoryview(data), []
    read, total = reader(view), len(view)
    consumed = 0

    def counted(n: int) -> bytes:
        nonlocal consumed
        consumed += n
        return read(n)

    while consumed < total:
        start = consumed
        header = SlotHeader.decode(counted)
        out.append((header, decode_body(counted, header), view[start:consumed]))
    if not out:
        raise SlotStateError("no slot state in an empty stream")
    return out


def regroup(states: list[tuple[SlotHeader, bytearray, memoryview]], ranges: list[tuple[int, int]]) -> list:
    """One state per layer range in `ranges`, from states of one slot that may be split otherwise
    (a prefill worker's own stages, a file saved under another split). They must agree on model,
    tokens and dtype and hold every layer asked for. A state whose range is asked for as it is
    passes unchanged."""
    first = states[0][0]
    as_is = {tuple(h.layers): raw for h, _, raw in states}
    parts: dict[int, list[tuple[TensorEntry, memoryview]]] = {}
    for header, body, _ in states:
        if (header.fingerprint, header.tokens, header.dtype) != (first.fingerprint, first.tokens, first.dtype):
            raise SlotStateError("slot states of different models, tokens or dtypes cannot be joined")
        offset, view = 0, memoryview(body)
        for entry in header.tensors:
            parts.setdefault(int(entry.name.split(".")[1]), []).append((entry, view[offset : offset + entry.nbytes]))
            offset += entry.nbytes
    out = []
    for a, b in ranges:
        if (a, b) in as_is:
            out.append(as_is[(a, b)])
            continue
        missing = [il for il in range(a, b) if il not in parts]
        if missing:
            raise SlotStateError(f"slot states lack layers {missing[:4]} of [{a}, {b})")
        chosen = [p for il in range(a, b) for p in parts[il]]
        header = SlotHeader(first.fingerprint, [a, b], list(first.tokens), first.dtype, first.kv_type, [e for e, _ in chosen])
        out.append(b"".join([header.encode(), *encode_body(v for _, v in chosen)]))
    return out
