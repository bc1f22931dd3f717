"""Save a slot of a Stage into the slot-state format (contracts.slot_state) and place one back;
split and regroup a pipeline's states by layer (one state per stage, any split on either side).

A state is built in one buffer: each tensor is copied once, straight into its place in the body,
each chunk checksummed as soon as it is complete. A state is read into one buffer, from memory or
from a socket (each chunk checked as it arrives), and placed from views of those bytes (no copy
until the slot's own tensors). Placing is transactional: the header, every tensor's name,
shape and dtype, and every chunk's checksum are checked before the first byte reaches the slot, so
a refused state leaves the slot as it was.

`extra`: per-slot state kept beside the stage's own (the head's MTP block: names `mtp.*`), saved
after the stage's tensors; a receiver without it skips those tensors.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from ..contracts.slot_state import CHUNK_BYTES, SlotHeader, SlotStateError, TensorEntry, check_body, chunk_crcs

EXTRA_PREFIX = "mtp."


class Buffers:
    """Large byte buffers for slot states, kept for reuse: a fresh buffer costs its page faults on
    first touch (measured on a 2-core VM: ~40 ms for 64 MiB, six times the copy into it, on every
    transfer). A kept buffer is handed out again once nothing but this pool refers to it (the
    views, tensors and sockets that used it are gone). At most `keep` are kept."""

    def __init__(self, keep: int = 2):
        self.keep = keep
        self._kept: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self, n: int) -> memoryview:
        """A writable view of n bytes (contents undefined)."""
        with self._lock:
            free = [b for b in self._kept if sys.getrefcount(b) <= 3]  # the list, `b`, the call's argument
            fits = [b for b in free if len(b) >= n]
            if fits:
                return memoryview(min(fits, key=len))[:n]
            buf = bytearray(n)
            if free:  # a kept buffer too small for states of this size: this one replaces it
                self._kept.remove(min(free, key=len))
            if len(self._kept) < self.keep:
                self._kept.append(buf)
            return memoryview(buf)

    def discard(self, view: memoryview) -> None:
        """Stop keeping the buffer under `view` (its exchange failed: nothing stays reserved for it)."""
        with self._lock:
            self._kept = [b for b in self._kept if b is not view.obj]


BUFFERS = Buffers()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def save(
    stage, slot: int, tokens: list[int], fingerprint: str, extra: dict[str, torch.Tensor] | None = None
) -> memoryview:
    """The state of `slot`'s first len(tokens) positions (and `extra`'s tensors), in one buffer:
    a copy, taken now, that later steps cannot overwrite."""
    views = _slot_views(stage, slot, tokens, extra)
    return pack(_header(stage, stage.layer_range, tokens, fingerprint, views), views.values())


def _slot_views(stage, slot: int, tokens: list[int], extra: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """The tensors holding `slot`'s first len(tokens) positions, and `extra`'s, by name."""
    if stage.recurrent and stage.recurrent_progress.length[slot] != len(tokens):
        held = stage.recurrent_progress.length[slot]
        raise SlotStateError(f"slot {slot}'s recurrent state covers {held} tokens, not the {len(tokens)} asked for")
    return {**stage.slot_state(slot, len(tokens)), **(extra or {})}


def _header(stage, layers, tokens: list[int], fingerprint: str, views: dict[str, torch.Tensor]) -> SlotHeader:
    """The header of a state of layers [a, b) made of `views`, in their order."""
    dtype = _dtype_name(stage.dtype)
    entries = [
        TensorEntry(name, list(t.shape), _dtype_name(t.dtype), t.numel() * t.element_size())
        for name, t in views.items()
    ]
    return SlotHeader(fingerprint, list(layers), list(tokens), dtype, dtype, entries)


def pack(header: SlotHeader, parts: Iterable[torch.Tensor | memoryview], out: memoryview | None = None) -> memoryview:
    """A whole state: `parts` (tensors on any device, or raw bytes) copied once into the body, in
    header order, then the prefix with the body's checksums; into `out` (exactly its size) when
    given, else a kept buffer."""
    start = header.prefix_bytes
    out = BUFFERS.take(start + header.body_bytes) if out is None else out
    offset = done = start
    crcs: list[int] = []
    for entry, part in zip(header.tensors, parts):
        if entry.nbytes:
            if isinstance(part, torch.Tensor):
                torch.frombuffer(out, dtype=part.dtype, count=part.numel(), offset=offset).view(part.shape).copy_(part)
            else:
                out[offset : offset + entry.nbytes] = part
        offset += entry.nbytes
        whole = offset - (offset - start) % CHUNK_BYTES  # each complete chunk now, while its bytes are in cache
        crcs += chunk_crcs(out[done:whole])
        done = whole
    out[:start] = header.encode(crcs + chunk_crcs(out[done:offset]))
    return out


class Reader:
    """`read(n)` over one buffer, as views (no copies; read-only bytes are copied once: tensors are
    made over them): a truncated state is a SlotStateError, not a short read. `fill(view,
    progress=None)`: the buffer is still to be filled from a stream (a socket's `read_into`); each
    read brings its bytes in first, a body's chunks are checked as they arrive."""

    def __init__(self, data, fill: Callable | None = None):
        self.view, self.pos, self.fill = memoryview(data).cast("B"), 0, fill
        if self.view.readonly:
            self.view = memoryview(bytearray(self.view))

    def _take(self, n: int) -> memoryview:
        if self.pos + n > len(self.view):
            raise SlotStateError(f"slot state truncated: wanted {n} bytes at {self.pos}, it has {len(self.view)}")
        self.pos += n
        return self.view[self.pos - n : self.pos]

    def __call__(self, n: int) -> memoryview:
        piece = self._take(n)
        if self.fill is not None:
            self.fill(piece)
        return piece

    def body(self, header: SlotHeader, crcs: list[int]) -> memoryview:
        """The next state's body, every chunk checked (from a stream, as it arrives)."""
        body = self._take(header.body_bytes)
        check_body(body, header, crcs, self.fill)
        return body


def restore(stage, slot: int, read: Reader, fingerprint: str) -> list[int]:
    """Place the state `read` holds into `slot`; returns the tokens it covers. The header is
    judged before the body is read."""
    header, crcs = SlotHeader.decode(read)
    check(stage, slot, header, fingerprint)
    return place(stage, slot, header, read.body(header, crcs), fingerprint)


def place(
    stage, slot: int, header: SlotHeader, body, fingerprint: str, extra: dict[str, torch.Tensor] | None = None
) -> list[int]:
    """Place a state already read whole (its chunks checked) into `slot` (positions past the
    state's are never read: nothing to clear). `extra`: where the `mtp.*` tensors go (None: they
    are skipped)."""
    place_checked(stage, slot, header, body, check(stage, slot, header, fingerprint, extra))
    return list(header.tokens)


def place_checked(stage, slot: int, header: SlotHeader, body, views: dict[str, torch.Tensor]) -> None:
    """Place a state whose header `check` accepted (`views`: its answer) into `slot`: `staged`, then
    `place_staged`."""
    place_staged(stage, slot, len(header.tokens), staged(header, body, views), views)


def staged(header: SlotHeader, body, views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state's tensors, ready to copy into the slot, for a state whose header `check` accepted
    (`views`: its answer): made over the body's bytes (no copy: on the CPU the received body is the
    staging area), copied to the views' device when that is a GPU. Tensors without a view are
    skipped. Touches no slot: a worker stages without holding its forwards."""
    tensors, offset = {}, 0
    for entry in header.tensors:
        view = views.get(entry.name)
        if view is not None:  # an empty one (no positions yet) is its own empty view
            tensors[entry.name] = view if not entry.nbytes else _tensor_at(body, offset, view).to(view.device)
        offset += entry.nbytes
    return tensors


def _tensor_at(body, offset: int, like: torch.Tensor) -> torch.Tensor:
    """`like`'s shape and dtype over the body's bytes from `offset`: host bytes, or a uint8 device
    buffer (a state handed over by CUDA IPC)."""
    if not isinstance(body, torch.Tensor):
        return torch.frombuffer(body, dtype=like.dtype, count=like.numel(), offset=offset).view(like.shape)
    raw = body[offset : offset + like.numel() * like.element_size()]
    if offset % like.element_size():
        raw = raw.clone()  # a view as a wider dtype must start aligned
    return raw.view(like.dtype).view(like.shape)


def split_views(
    stage,
    slot: int,
    tokens: list[int],
    fingerprint: str,
    ranges: list[tuple[int, int]],
    extra: dict[str, torch.Tensor] | None = None,
) -> list[tuple[SlotHeader, list[torch.Tensor]]]:
    """The state of `slot`'s tokens split by `ranges` (which this stage's layers must cover): per
    range its header and the slot's tensors in header order (views: copy them before the slot
    moves on). `mtp.*` tensors go with the range that starts at layer 0."""
    views = _slot_views(stage, slot, tokens, extra)
    out = []
    for a, b in ranges:
        chosen = {name: t for name, t in views.items() if (a == 0 if _layer(name) < 0 else a <= _layer(name) < b)}
        missing = [il for il in range(a, b) if il not in {_layer(name) for name in chosen}]
        if missing:
            raise SlotStateError(f"this worker lacks layers {missing[:4]} of [{a}, {b})")
        out.append((_header(stage, (a, b), tokens, fingerprint, chosen), list(chosen.values())))
    return out


def save_ranges(
    stage,
    slot: int,
    tokens: list[int],
    fingerprint: str,
    ranges: list[tuple[int, int]],
    extra: dict[str, torch.Tensor] | None = None,
    into: memoryview | None = None,
) -> list[memoryview]:
    """`split_views`' states, each packed (one copy, every chunk checksummed): back to back from the
    start of `into` when they all fit there (memory shared with the asker: rpc/shm.py), else each
    into a kept buffer."""
    states = split_views(stage, slot, tokens, fingerprint, ranges, extra)
    sizes = [header.prefix_bytes + header.body_bytes for header, _ in states]
    if into is None or sum(sizes) > len(into):
        return [pack(header, parts) for header, parts in states]
    out, offset = [], 0
    for (header, parts), n in zip(states, sizes):
        out.append(pack(header, parts, into[offset : offset + n]))
        offset += n
    return out


def device_states(
    stage,
    slot: int,
    tokens: list[int],
    fingerprint: str,
    ranges: list[tuple[int, int]],
    extra: dict[str, torch.Tensor] | None = None,
) -> list[tuple[SlotHeader, torch.Tensor]]:
    """`split_views`' states, each as (header, body) with the body a uint8 buffer on the stage's
    device: what a worker hands over by CUDA IPC (no checksums: the body never crosses a wire)."""
    out = []
    for header, parts in split_views(stage, slot, tokens, fingerprint, ranges, extra):
        body, offset = torch.empty(header.body_bytes, dtype=torch.uint8, device=stage.device), 0
        for entry, t in zip(header.tensors, parts):
            body[offset : offset + entry.nbytes].copy_(t.contiguous().view(-1).view(torch.uint8))
            offset += entry.nbytes
        out.append((header, body))
    return out


def entry_bytes(header: SlotHeader, body: torch.Tensor) -> list[torch.Tensor]:
    """Each tensor's bytes in a device body, as uint8 views (`pack` takes them)."""
    offsets = [0]
    for entry in header.tensors:
        offsets.append(offsets[-1] + entry.nbytes)
    return [body[a:b] for a, b in zip(offsets, offsets[1:])]


def _layer(name: str) -> int:
    """The layer a tensor of the state belongs to; -1 for the MTP block's (`mtp.*`)."""
    return -1 if name.startswith(EXTRA_PREFIX) else int(name.split(".")[1])


def place_staged(stage, slot: int, n: int, tensors: dict[str, torch.Tensor], views: dict[str, torch.Tensor]) -> None:
    """Copy `staged` tensors of n tokens into `slot`: the stage's through `Stage.place_slot_state`
    (a pooled cache takes its blocks there), the `mtp.*` ones into their views."""
    own = {name: t for name, t in tensors.items() if not name.startswith(EXTRA_PREFIX)}
    for name in tensors.keys() - own.keys():
        views[name].copy_(tensors[name])
    stage.place_slot_state(slot, n, own)


def check(
    stage, slot: int, header: SlotHeader, fingerprint: str, extra: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """Where each of the header's tensors goes (the slot's views, and `extra`'s for `mtp.*` ones
    when given), once the header fits this stage; else SlotStateError naming why."""
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
    own = [t for t in header.tensors if not t.name.startswith(EXTRA_PREFIX)]
    _match(own, views, "this stage's")
    side = [t for t in header.tensors if t.name.startswith(EXTRA_PREFIX)]
    if extra and side:
        _match(side, extra, "this head's MTP block's")
        views = {**views, **extra}
    return views


def has_extra(header: SlotHeader) -> bool:
    """Whether the state carries the MTP block's own state (`mtp.*`)."""
    return any(t.name.startswith(EXTRA_PREFIX) for t in header.tensors)


def _match(entries: list[TensorEntry], views: dict[str, torch.Tensor], whose: str) -> None:
    want = [(name, list(t.shape), _dtype_name(t.dtype)) for name, t in views.items()]
    got = [(t.name, t.shape, t.dtype) for t in entries]
    if got != want or any(t.nbytes != views[t.name].numel() * views[t.name].element_size() for t in entries):
        raise SlotStateError(f"slot state tensors {got[:2]}... do not match {whose} {want[:2]}...")


def read_all(data, fill: Callable | None = None) -> list[tuple[SlotHeader, memoryview, memoryview]]:
    """Slot states back to back (a pipeline's, one per stage), each read and checked:
    (header, body, the state's own bytes), all views of `data`. Read-only bytes (a file's) are
    copied once: tensors are made over the body. `fill`: `data` is a buffer still to be filled
    from a stream (`Reader`), each chunk checked as it arrives."""
    read, out = Reader(data, fill), []
    while read.pos < len(read.view):
        start = read.pos
        header, crcs = SlotHeader.decode(read)
        body = read.body(header, crcs)
        out.append((header, body, read.view[start : read.pos]))
    if not out:
        raise SlotStateError("no slot state in an empty stream")
    return out


def regroup(states: list[tuple[SlotHeader, memoryview, memoryview]], ranges: list[tuple[int, int]]) -> list:
    """One state per layer range in `ranges`, from states of one slot that may be split otherwise
    (a prefill worker's own stages, a file saved under another split). They must agree on model,
    tokens and dtype and hold every layer asked for; `mtp.*` tensors go with the range that starts
    at layer 0 (the head's). A state whose range is asked for as it is passes unchanged."""
    first = states[0][0]
    as_is = {tuple(h.layers): raw for h, _, raw in states}
    parts: dict[int, list[tuple[TensorEntry, memoryview]]] = {}
    for header, body, _ in states:
        if (header.fingerprint, header.tokens, header.dtype) != (first.fingerprint, first.tokens, first.dtype):
            raise SlotStateError("slot states of different models, tokens or dtypes cannot be joined")
        offset = 0
        for entry in header.tensors:
            parts.setdefault(_layer(entry.name), []).append((entry, body[offset : offset + entry.nbytes]))
            offset += entry.nbytes
    out = []
    for a, b in ranges:
        if (a, b) in as_is:
            out.append(as_is[(a, b)])
            continue
        missing = [il for il in range(a, b) if il not in parts]
        if missing:
            raise SlotStateError(f"slot states lack layers {missing[:4]} of [{a}, {b})")
        chosen = [p for il in range(a, b) for p in parts[il]] + (parts.get(-1, []) if a == 0 else [])
        header = SlotHeader(
            first.fingerprint, [a, b], list(first.tokens), first.dtype, first.kv_type, [e for e, _ in chosen]
        )
        out.append(pack(header, (v for _, v in chosen)))
    return out


@dataclass(frozen=True)
class PreparedState:
    """A slot's states checked and split for a pipeline (`prepare`): the head's
    own (header, body view) and each peer's whole state, for the ranges they were split by."""

    header: SlotHeader
    body: memoryview | torch.Tensor  # a device buffer when handed over by CUDA IPC
    peer_states: list
    ranges: list


def prepare(local, ranges: list, data, tokens: list[int] | None = None) -> PreparedState:
    """Slot states (back to back, any split that covers the model) read, checksummed and regrouped
    to a pipeline's `ranges` (its head stage `local`), without holding the pipeline: the costly
    half of a placement, off the forward's path. They must cover `tokens` when given. `data` may
    instead be states already read and checked (`read_all`'s answer: as they arrived from a
    socket), or (header, device body) per range of the pipeline, handed over by CUDA IPC: the head
    stage's is then placed device to device, the peers' are packed into bytes for their STATE_PUT."""
    fingerprint = local.g.fingerprint
    states = data if isinstance(data, list) else read_all(data)
    if not states:
        raise SlotStateError("no slot state in an empty stream")
    on_device = isinstance(states[0][1], torch.Tensor)
    if on_device:
        if [tuple(h.layers) for h, _ in states] != list(ranges):
            raise SlotStateError(f"slot states of ranges {[h.layers for h, _ in states]}, this pipeline holds {ranges}")
        states = [(h, body, None) for h, body in states]
    if states[0][0].fingerprint != fingerprint:
        raise SlotStateError(f"slot state is of model {states[0][0].fingerprint}, this worker serves {fingerprint}")
    if tokens is not None and states[0][0].tokens != list(tokens):
        raise SlotStateError(f"slot state covers other tokens than the {len(tokens)} asked for")
    ranges = list(ranges)
    if on_device:
        parts = [None] + [pack(h, entry_bytes(h, body)) for h, body, _ in states[1:]]
    else:
        parts = regroup(states, ranges)
    mine = next(((h, body) for h, body, _ in states if tuple(h.layers) == tuple(ranges[0])), None)
    if mine is None:  # our range came regrouped: read it back
        mine = read_all(parts[0])[0][:2]
    check(local, 0, mine[0], fingerprint)  # a state that cannot fit is refused here, before any lock
    return PreparedState(*mine, parts[1:], ranges)
