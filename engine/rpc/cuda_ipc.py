"""Same-GPU hand-off of hidden states between a head and a peer process: CUDA IPC.

When head and peer compute on the same physical GPU, the hidden states need not cross the host.
The peer allocates two device buffers (inbox: head → peer, outbox: peer → head) and two
interprocess events, and exports their handles over the compute connection (IPC_OPEN); the head
maps them. A FORWARD_IPC frame then carries only epoch, slots and positions:

    head:  copy h into inbox, record `ready`, send the frame        (no wait for its own layers)
    peer:  its stream waits on `ready`, runs its layers, copies into outbox, records `done`, replies
    head:  its stream waits on `done`, copies out of outbox          (no wait for the peer's layers)

Neither host waits for the GPU inside a decode step, so the frame's round trip overlaps the GPU
work instead of adding to it (long batches wait on the host instead: see HOST_WAIT_ROWS). Reuse
is safe without locks: the head writes the inbox only after its stream waited for the previous
`done` (the peer has read it), and the peer writes the outbox only after waiting for the next
`ready`, which the head records after its stream consumed the outbox.

A slot's state moves the same way between a prefill worker and a head on one GPU (PREFILL,
`export_states` / `open_states`): the worker copies it into one device buffer per range and answers
their handles and headers (contracts.slot_state.IpcSlotState) instead of the bytes; the head
checks each header and copies device to device into its slot.

The peer owns every resource, so a head that dies leaves the peer intact. The handles are torch's
own IPC export (what `torch.multiprocessing` sends between processes); they are JSON-encoded here
and never unpickled.
"""

from __future__ import annotations

import base64

import torch
from zlib_ng.zlib_ng import crc32

from ...contracts.rpc import IPC_ROWS, IpcOpenRequest
from ...contracts.slot_state import IpcSlotState, SlotHeader, SlotStateError
from .resident import DTYPES, ComputeError

IPC_TOKENS = IPC_ROWS  # rows per buffer; larger batches (long prefills) take the byte path
# Batches of at least this many rows wait for the other process's event on the host. Two
# processes time-share the GPU: work queued behind a cross-process wait keeps its context in the
# rotation and slowed the other side's long prefill by a third on an H200; a decode step is too
# short for that, and there the GPU-side wait (no host round trip) is the faster one.
HOST_WAIT_ROWS = 64


def _wait(event, rows: int, device: torch.device) -> None:
    if rows >= HOST_WAIT_ROWS:
        event.synchronize()
    torch.cuda.current_stream(device).wait_event(event)


def gpu_uuid(device: torch.device) -> str:
    """The physical GPU's identity, the same in every process whatever CUDA_VISIBLE_DEVICES says."""
    return str(torch.cuda.get_device_properties(device).uuid)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def export_tensor(t: torch.Tensor) -> dict:
    """A contiguous CUDA tensor's IPC handle, as JSON (`open_tensor` maps it in another process)."""
    storage = t.untyped_storage()
    (_, handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle, event_sync) = storage._share_cuda_()
    return {
        "shape": list(t.shape),
        "handle": _b64(handle),
        "size_bytes": size_bytes,
        "offset_bytes": offset_bytes,
        "ref_handle": _b64(ref_handle),
        "ref_offset": ref_offset,
        "event_handle": _b64(event_handle) if event_handle else "",
        "event_sync": bool(event_sync),
    }


def open_tensor(desc: dict, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Map what `export_tensor` described; torch counts the mapping, so the exporting process keeps
    the memory until this tensor is freed."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    shape = desc["shape"]
    stride = [1] * len(shape)  # contiguous
    for i in range(len(shape) - 2, -1, -1):
        stride[i] = stride[i + 1] * shape[i + 1]
    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size(shape),
        stride,
        0,
        torch.UntypedStorage,
        dtype,
        device.index,
        base64.b64decode(desc["handle"]),
        desc["size_bytes"],
        desc["offset_bytes"],
        False,
        base64.b64decode(desc["ref_handle"]),
        desc["ref_offset"],
        base64.b64decode(desc["event_handle"]) or None,
        desc["event_sync"],
    )


class IpcChannel:
    """Two buffers of `rows` × `width` and the events that order their use (see module doc)."""

    def __init__(self, inbox, outbox, ready, done):
        self.inbox, self.outbox, self.ready, self.done = inbox, outbox, ready, done

    @property
    def rows(self) -> int:
        return self.inbox.shape[0]

    def fits(self, hidden: torch.Tensor) -> bool:
        """Whether a batch of this shape and dtype goes through the channel (larger ones take the frames)."""
        t, d = hidden.shape
        return t <= self.rows and d == self.inbox.shape[1] and hidden.dtype == self.inbox.dtype

    @classmethod
    def create(cls, device: torch.device, request: IpcOpenRequest, width: int) -> tuple[IpcChannel, dict]:
        """Peer side: allocate and export. Refuses (ComputeError) unless this worker computes on
        the very GPU the head names (rows and dtype are bounded by the request's layout)."""
        if device.type != "cuda":
            raise ComputeError(f"this peer computes on {device}: no CUDA IPC")
        if request.uuid != gpu_uuid(device):
            raise ComputeError("head and peer are on different GPUs: no CUDA IPC")
        rows, dtype = request.rows, DTYPES[request.dtype]
        inbox = torch.empty(rows, width, dtype=dtype, device=device)
        outbox = torch.empty(rows, width, dtype=dtype, device=device)
        ready, done = (torch.cuda.Event(interprocess=True) for _ in range(2))
        desc = {
            "inbox": export_tensor(inbox),
            "outbox": export_tensor(outbox),
            "ready": _b64(ready.ipc_handle()),
            "done": _b64(done.ipc_handle()),
        }
        return cls(inbox, outbox, ready, done), desc

    @classmethod
    def open(cls, desc: dict, dtype: torch.dtype, device: torch.device) -> IpcChannel:
        """Head side: map what the peer exported."""
        if device.index is None:  # an event opened for device index -1 cannot be recorded
            device = torch.device("cuda", torch.cuda.current_device())
        ready, done = (torch.cuda.Event.from_ipc_handle(device, base64.b64decode(desc[k])) for k in ("ready", "done"))
        return cls(open_tensor(desc["inbox"], dtype, device), open_tensor(desc["outbox"], dtype, device), ready, done)

    # head side
    def send(self, h: torch.Tensor) -> None:
        stream = torch.cuda.current_stream(h.device)
        self.inbox[: h.shape[0]].copy_(h)
        self.ready.record(stream)

    def receive(self, n: int) -> torch.Tensor:
        _wait(self.done, n, self.outbox.device)
        return self.outbox[:n].clone()

    # peer side
    def incoming(self, n: int) -> torch.Tensor:
        _wait(self.ready, n, self.inbox.device)
        return self.inbox[:n]

    def reply(self, out: torch.Tensor) -> None:
        self.outbox[: out.shape[0]].copy_(out)
        self.done.record(torch.cuda.current_stream(self.outbox.device))


def export_states(states: list[tuple[SlotHeader, torch.Tensor]]) -> list[IpcSlotState]:
    """Prefill worker side: (header, device body) of `slot_state.device_states` as IPC handles.
    Torch keeps each buffer until the head has freed its mapping (its IPC reference count), so
    they are not held here; its copies into them are complete before the reply goes."""
    if states:
        torch.cuda.current_stream(states[0][1].device).synchronize()
        torch.cuda.ipc_collect()  # buffers of earlier transfers the heads are done with go back
    out = []
    for header, body in states:
        raw = header.to_json()
        out.append(IpcSlotState(header=raw.decode(), header_crc=crc32(raw), body=export_tensor(body)))
    return out


def open_states(descs: list, device: torch.device) -> list[tuple[SlotHeader, torch.Tensor]]:
    """Head side: (header, device body) of each state `export_states` described, each header
    checked against its checksum and its body's size against the header's; SlotStateError if not."""
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    out = []
    for desc in descs:
        try:
            raw = desc["header"].encode()
            if crc32(raw) != desc["header_crc"]:
                raise SlotStateError("slot state header handed over by CUDA IPC fails its checksum")
            header = SlotHeader.from_json(raw)
            if desc["body"]["shape"] != [header.body_bytes]:
                raise SlotStateError(
                    f"slot state body of {desc['body']['shape']} bytes, the header names {header.body_bytes}"
                )
            out.append((header, open_tensor(desc["body"], torch.uint8, device)))
        except (KeyError, TypeError, AttributeError) as e:
            raise SlotStateError(f"malformed CUDA IPC slot state: {e!r}") from None
    return out
