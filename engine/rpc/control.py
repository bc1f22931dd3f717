"""Hydra control protocol server (the fork's framing and status codes).

One request at a time per connection. Bad magic or a broken frame closes the connection; after
AUTH (or without a token) a bad key or an unknown op answers ERROR and the connection lives on;
before AUTH every op but AUTH closes it unanswered. Ops the backend does not build
answer NOT_IMPLEMENTED, after their payload has been drained so the stream stays in sync.
"""

from __future__ import annotations

import logging
from typing import Protocol

from ...contracts.auth import AuthError, ServerHandshake
from ...contracts.rpc import (
    CONTROL_HEADER,
    CONTROL_IDLE_S,
    KNOWN_OPS,
    PREAUTH_MAX_FRAME,
    STATE_PUT_CAP,
    ConfigureRequest,
    ControlError,
    Op,
    PipelineProbeRequest,
    PrefillRequest,
    Status,
    frame_deadline,
)
from ...contracts.wire_json import Message, WireError
from .wire import (
    AuthFailed,
    BufferReader,
    Refused,
    SocketReader,
    control_response_head,
    read_control_body,
    read_control_header,
    read_control_request,
    send_all,
)

log = logging.getLogger("hydra.rpc.control")


class ControlBackend(Protocol):
    """What a worker exposes over the control port. Missing ops answer NOT_IMPLEMENTED."""

    def info(self) -> dict: ...

    def configure(self, request: ConfigureRequest) -> dict: ...

    def set_expert_mode(self, mode: str) -> dict: ...


def _none(key: bytes, payload) -> None:
    return None


def _json(layout: type[Message]):
    return lambda key, payload: layout.decode(payload)


def _slot(key: bytes, payload) -> int:
    text = key.decode("ascii", "replace")
    if not text.isdigit():
        raise ControlError(f"bad key {text!r}: a slot id in ASCII digits")
    return int(text)


# op -> (backend method, parse(key, payload) -> the op's request). The server's dispatch table holds
# the ops its backend has: (parse, the bound method taking the parsed request).
_OPS = {
    Op.INFO: ("info", _none),
    Op.CONFIGURE: ("configure", _json(ConfigureRequest)),
    Op.PROBE: ("probe", _json(PipelineProbeRequest)),
    Op.SET_EXPERT_MODE: ("set_expert_mode", lambda key, payload: payload.decode("utf-8", "replace").strip()),
    Op.STATE_GET: ("state_get", _slot),
    Op.STATE_PUT: ("state_put", lambda key, payload: (_slot(key, payload), payload)),
    Op.STATE_META: ("state_meta", _slot),
    Op.PREFILL: ("prefill", _json(PrefillRequest)),
}
_SPREAD = {Op.STATE_PUT}  # their parsed request is the method's arguments


class ControlServer:
    """With a token, the listener runs the handshake (`preauth_len`, `preauth`): only AUTH frames
    of at most PREAUTH_MAX_FRAME are read before the proof; any other op closes the connection
    unanswered. Then `serve` answers one request at a time."""

    header = CONTROL_HEADER.size

    def __init__(
        self,
        backend,
        *,
        auth_token: str | None = None,
        max_frame: int = 1 << 30,
        idle_s: float = CONTROL_IDLE_S,
        role: str = "head",
    ):
        self.backend, self.role = backend, role
        self.handlers = {
            op: (parse, method)
            for op, (name, parse) in _OPS.items()
            if (method := getattr(backend, name, None)) is not None
        }
        self.auth_token = auth_token
        self.max_frame = max_frame
        self.idle_s = idle_s

    def open(self) -> dict:
        return {"authed": not self.auth_token, "handshake": None}

    def busy_reply(self, why: str) -> bytes:
        """The answer to a request the listener's pool drops: BUSY and why."""
        return control_response_head(Status.BUSY, {"error": why}, 0)

    def preauth_len(self, header: bytes, session: dict) -> int:
        h = read_control_header(BufferReader(header))
        size = self.header + h.key_len + h.trace_len + h.payload_len
        if h.op != Op.AUTH or size > PREAUTH_MAX_FRAME:
            raise Refused(f"op 0x{h.op:02x} with {size} bytes before AUTH")
        return size

    def preauth(self, conn, frame: bytes, session: dict) -> None:
        reader = BufferReader(frame)
        req = read_control_request(reader)
        if not self._auth(conn, bytes(reader.read_exact(req.payload_len)), session):
            raise AuthFailed("authentication failed")

    def serve(self, conn, reader: SocketReader, session: dict) -> bool:
        """Serve one request; False closes the connection."""
        h = read_control_header(reader)
        reader.expect(frame_deadline(h.key_len + h.trace_len + h.payload_len))
        req = read_control_body(reader, h)
        handler = self.handlers.get(req.op)
        readable = req.op == Op.AUTH or handler is not None
        if req.op == Op.STATE_PUT and req.payload_len > STATE_PUT_CAP:
            reader.drain(req.payload_len)  # an oversize STATE_PUT is drained; the connection lives
            self._reply(conn, Status.ERROR, {"error": f"STATE_PUT of {req.payload_len} bytes over the 4 GiB cap"})
            return True
        # Payloads we read must fit the frame limit; those we only skip are drained in 64 KiB
        # chunks up to the STATE_PUT cap. Anything larger is malformed: answer, then close.
        cap = (STATE_PUT_CAP if req.op == Op.STATE_PUT else self.max_frame) if readable else STATE_PUT_CAP
        if req.payload_len > cap:
            self._reply(
                conn, Status.BAD_REQUEST, {"error": f"payload of {req.payload_len} bytes over the {cap}-byte limit"}
            )
            return False
        if not readable:
            reader.drain(req.payload_len)
            known = req.op in KNOWN_OPS
            self._reply(
                conn,
                Status.NOT_IMPLEMENTED if known else Status.ERROR,
                {"error": f"op 0x{req.op:02x} is not implemented" if known else f"unknown op 0x{req.op:02x}"},
            )
            return True
        payload = reader.read_exact(req.payload_len)  # writable: a slot state is placed from it as it is
        if req.op == Op.AUTH:
            return self._auth(conn, payload, session)
        self._handle(conn, req, *handler, payload)
        return True

    def _auth(self, conn, payload: bytes, session: dict) -> bool:
        """First AUTH: the client's nonce; we answer ours, our role and our proof (contracts.auth).
        Second AUTH: the client's proof. Without a token: {"auth": false} (a client holding a
        token refuses us then)."""
        if not self.auth_token:
            self._reply(conn, Status.OK, {"auth": False})
            return True
        handshake, session["handshake"] = session["handshake"], None
        if handshake is None:
            try:
                session["handshake"] = hs = ServerHandshake(self.auth_token, "control", self.role, payload)
            except AuthError as e:
                self._reply(conn, Status.ERROR, {"error": f"authentication failed: {e}"})
                return False
            self._reply(
                conn, Status.OK, {"auth": True, "nonce": hs.nonce.hex(), "role": self.role, "proof": hs.proof.hex()}
            )
            return True
        if handshake.check(payload):
            session["authed"] = True
            self._reply(conn, Status.OK, {"auth": True, "ok": True})
            return True
        self._reply(conn, Status.ERROR, {"error": "authentication failed"})
        return False

    def _handle(self, conn, req, parse, method, payload: bytes) -> None:
        try:
            try:
                request = parse(req.key, payload)
            except WireError as e:
                raise ControlError(str(e), Status.BAD_REQUEST) from None
            if req.op in _SPREAD:
                result = method(*request)
            else:
                result = method() if request is None else method(request)
        except ControlError as e:
            self._reply(conn, e.status, {"error": str(e)})
            return
        except Exception as e:  # the worker keeps serving; the caller learns what failed
            log.exception("control op 0x%02x failed", req.op)
            self._reply(conn, Status.ERROR, {"error": f"{type(e).__name__}: {e}"})
            return
        meta, body = result if isinstance(result, tuple) else (result, b"")
        meta = meta.to_json() if isinstance(meta, Message) else meta
        self._reply(conn, Status.OK, meta, body)

    @staticmethod
    def _reply(conn, status: int, meta: dict | None, payload: bytes | list = b"") -> None:
        """`payload`: bytes, or a list of buffers sent back to back (slot states: no joined copy)."""
        parts = payload if isinstance(payload, list) else [payload]
        try:
            send_all(conn, control_response_head(status, meta, sum(memoryview(p).nbytes for p in parts)), *parts)
        except OSError:
            pass
