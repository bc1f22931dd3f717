"""The console's client of the Hydra control protocol (DESIGN §4): CONFIGURE, PROBE and INFO.

Op and status codes come from `contracts.rpc`, framing from `contracts.framing` (request `<HBBHQH`
header + key + trace + payload; response status u8 + meta_len u24 + payload_len u64, meta JSON,
payload), the same code the head serves with, so the console and the head never disagree on bytes.
One blocking socket per request, run in a thread: these ops are rare.
With a token (the supervisor's), the AUTH challenge is answered first, as the head requires.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass

from ..contracts.auth import AuthError, control_login
from ..contracts.framing import FrameError, SocketReader, pack_control_request, read_control_response
from ..contracts.rpc import STATUS_NAMES, ConfigureRequest, Op, PipelineProbeRequest, Status

OP_CONFIGURE, OP_INFO = Op.CONFIGURE, Op.INFO
OK, NOT_IMPLEMENTED = Status.OK, Status.NOT_IMPLEMENTED
MAX_RESPONSE = 16 << 20  # the console only reads small JSON replies


class ControlUnreachable(Exception):
    """The control port could not be reached or did not answer with a frame."""


@dataclass(frozen=True)
class ControlReply:
    status: int
    meta: dict
    payload: bytes

    @property
    def status_name(self) -> str:
        return STATUS_NAMES.get(self.status, f"status {self.status}")

    @property
    def ok(self) -> bool:
        return self.status == OK


def _exchange(sock: socket.socket, reader: SocketReader, op: int, payload: bytes) -> ControlReply:
    sock.sendall(pack_control_request(op, payload))
    r = read_control_response(reader, MAX_RESPONSE)
    return ControlReply(r.status, r.meta if isinstance(r.meta, dict) else {"value": r.meta}, r.payload)


def request_sync(
    host: str, port: int, op: int, payload: bytes = b"", *, timeout: float = 10.0, token: str | None = None
) -> ControlReply:
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            reader = SocketReader(sock)
            if token:  # the worker proves the token first: we send nothing to an impostor

                def exchange(proof: bytes) -> tuple[bool, dict]:
                    answer = _exchange(sock, reader, Op.AUTH, proof)
                    return answer.ok, answer.meta

                try:
                    control_login(token, ("head", "prefill"), exchange)
                except AuthError as e:
                    return ControlReply(Status.ERROR, {"error": f"{host}:{port} failed to authenticate: {e}"}, b"")
            return _exchange(sock, reader, op, payload)
    except FrameError as e:
        raise ControlUnreachable(f"{host}:{port}: bad reply: {e}") from None
    except OSError as e:
        raise ControlUnreachable(f"cannot reach {host}:{port}: {e.strerror or e or 'timed out'}") from None


async def request(
    host: str, port: int, op: int, payload: bytes = b"", *, timeout: float = 10.0, token: str | None = None
) -> ControlReply:
    return await asyncio.to_thread(request_sync, host, port, op, payload, timeout=timeout, token=token)


async def configure(
    host: str, port: int, settings: ConfigureRequest | dict, *, timeout: float = 120.0, token: str | None = None
) -> ControlReply:
    """CONFIGURE (contracts.rpc.ConfigureRequest); a live re-split is `{"split": "12/6"}` (layer
    counts, head first) and an optional `"by"`. A dict that is not of its layout raises WireError."""
    body = settings if isinstance(settings, ConfigureRequest) else ConfigureRequest.from_json(settings)
    return await request(host, port, OP_CONFIGURE, body.encode(), timeout=timeout, token=token)


async def probe(
    host: str, port: int, tokens: int, reps: int, *, timeout: float = 300.0, token: str | None = None
) -> ControlReply:
    """PROBE: every stage times its layers (the split advisor); the reply's meta is a PipelineProbe."""
    body = PipelineProbeRequest(tokens=tokens, reps=reps).encode()
    return await request(host, port, Op.PROBE, body, timeout=timeout, token=token)


async def info(host: str, port: int, *, timeout: float = 5.0, token: str | None = None) -> ControlReply:
    return await request(host, port, OP_INFO, timeout=timeout, token=token)
