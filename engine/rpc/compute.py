"""Compute protocol server (ggml-rpc framing) over a `StageHost`.

Request `cmd u8 | size u64 | payload`, response `size u64 | payload`. HELLO (cmd 14) must come
first; a version whose major/minor differs from ours is refused with a message and the
connection closed, so an upstream llama.cpp rpc client gets a clean refusal instead of a hang.
Our commands use ids >= 32; each response payload starts with a status byte (0 OK, 1 ERROR,
2 STALE_EPOCH) followed by JSON, raw hidden states, or an error message.

FORWARD carries a whole batch in one frame: `<QIIB3x` (epoch, n_tokens, n_embd, dtype code),
int32 slots[T], int32 positions[T], then the hidden states as raw bytes in the compute dtype
(bit-exact, no JSON on the hot path). The reply is `<B3xI` (status, peer compute µs) + hidden.
A head on the peer's own GPU may open a CUDA IPC channel (IPC_OPEN, see cuda_ipc.py); its
FORWARD_IPC frames are FORWARD without the hidden bytes, and so are their replies. FORWARD_ACK
frames are FORWARD's, their replies `FORWARD_REPLY` alone (a pipelined prompt chunk: the head reads
the replies later, so this connection's frames are run strictly in order, as all of them are).
FORWARD_OUT goes to a last stage that holds the output (`--output-stage last`: output_stage.py):
FORWARD's frame plus the logit rows (and the token ids its MTP block follows), answered with float32
logits; DRAFT asks its MTP block for drafts.
"""

from __future__ import annotations

import itertools
import json
import logging
import struct
import time

import numpy as np
import torch

from ...contracts.auth import AuthError, ServerHandshake
from ...contracts.rpc import (
    AHEAD_DRAFT,
    CAP_AUTH,
    CAP_FORWARD,
    CAP_FORWARD_ACK,
    CAP_IPC,
    CAP_OUTPUT,
    CAP_RESOLVE,
    COMPUTE_HEADER,
    COMPUTE_IDLE_S,
    COMPUTE_SIZE,
    FORWARD_REPLY,
    HELLO,
    HELLO_MAX,
    KV_CLEAR,
    KV_SHIFT,
    KV_TRIM,
    PING_MAX,
    PREAUTH_MAX_FRAME,
    STATE_PUT_CAP,
    STATE_SLOT,
    VERSION,
    CheckReply,
    CheckRequest,
    Cmd,
    DraftAsk,
    IpcOpenRequest,
    LoadStageRequest,
    ProbeRequest,
    StaleEpoch,
    StateGetRequest,
    frame_deadline,
)
from ...contracts.rpc import ReplyStatus as R
from ...contracts.slot_state import SlotStateError
from ...contracts.wire_json import Message, WireError
from ..device import host_buffer, to_host
from .cuda_ipc import IpcChannel
from .forward_frames import raw_bytes, unpack_forward, unpack_forward_out
from .resident import ComputeError
from .wire import (
    AuthFailed,
    FrameError,
    Refused,
    SocketReader,
    read_compute_header,
    send_all,
    spin_until_readable,
)

log = logging.getLogger("hydra.rpc.compute")


def pack_hello(caps: int = 0, version=VERSION, nonce: bytes = b"") -> bytes:
    """HELLO's struct, then (a client with a token: caps has CAP_AUTH) the client's nonce."""
    return HELLO.pack(*version, 0, caps) + nonce


class ComputeServer:
    """Serves each connection's session (from many threads at once in peer mode); the state every
    connection shares lives in the StageHost. The listener runs the handshake frame by frame
    (`preauth_len`, `preauth`: HELLO first, then with a token AUTH or PING, nothing else) and
    then calls `serve` once per request."""

    header = COMPUTE_HEADER.size

    def __init__(
        self,
        host,
        *,
        auth_token: str | None = None,
        max_frame: int = 1 << 30,
        spin_s: float = 0.0,
        idle_s: float = COMPUTE_IDLE_S,
        role: str = "peer",
    ):
        self.host, self.role = host, role
        self.auth_token = auth_token
        self.max_frame = max_frame
        self.idle_s = idle_s
        self.bytes_in = self.bytes_out = 0
        self.spin_s = spin_s  # busy-wait for the next frame (RpcSettings.spin_seconds)
        self._sessions = itertools.count(1)
        self.commands = self._commands()

    @property
    def caps(self) -> int:
        ipc = CAP_IPC if self.host.device.type == "cuda" else 0
        return CAP_FORWARD | CAP_FORWARD_ACK | CAP_OUTPUT | CAP_RESOLVE | ipc | (CAP_AUTH if self.auth_token else 0)

    def open(self) -> dict:
        # `id` owns the slots of a stage this session loads (StageHost.owner).
        return {"id": next(self._sessions), "hello": False, "authed": False, "handshake": None, "checked": False}

    def _send(self, conn, *parts) -> None:
        body = sum(len(memoryview(p).cast("B")) for p in parts)
        self.bytes_out += send_all(conn, COMPUTE_SIZE.pack(body), *parts)

    def _reply(self, conn, status: int, *parts) -> None:
        self._send(conn, bytes([status]), *(p.encode() if isinstance(p, str) else p for p in parts))

    # --- the handshake: judged by each frame's header, so no refused payload is ever read -----------

    def preauth_len(self, header: bytes, session: dict) -> int:
        cmd, size = COMPUTE_HEADER.unpack(header)
        if not session["hello"]:
            if cmd != Cmd.HELLO:  # a stray protocol gets one line, not a wait for its payload
                error = f"the first command must be HELLO (14), got {cmd}".encode()
                raise Refused(error.decode(), COMPUTE_SIZE.pack(1 + len(error)) + bytes([R.ERROR]) + error)
            limit = HELLO_MAX
        else:
            limit = {Cmd.AUTH: PREAUTH_MAX_FRAME, Cmd.PING: PING_MAX}.get(cmd, -1)
        if size > min(limit, PREAUTH_MAX_FRAME - self.header):
            raise Refused(f"command {cmd} with {size} bytes before AUTH")
        return self.header + size

    def preauth(self, conn, frame: bytes, session: dict) -> None:
        cmd, payload = frame[0], frame[self.header :]
        self.bytes_in += len(frame)
        if not session["hello"]:
            if not self._hello(conn, payload):
                raise Refused("HELLO refused")
            session["hello"] = True
            if self.auth_token:
                self._challenge(conn, payload, session)
            else:
                session["authed"] = True
        elif cmd == Cmd.PING:
            self._reply(conn, R.OK, payload)
        elif session["handshake"].check(payload):
            session["authed"] = True
            self._reply(conn, R.OK)
        else:
            self._reply(conn, R.ERROR, "authentication failed: AUTH (40) must carry the client's proof of the token")
            raise AuthFailed("authentication failed: a wrong proof")

    def _challenge(self, conn, hello: bytes, session: dict) -> None:
        """Our nonce, role and proof over the client's nonce (sent after HELLO's struct): a client
        that offers none gets the HELLO it needs to say why, then the connection closes."""
        caps = HELLO.unpack_from(hello)[4] if len(hello) >= HELLO.size else 0
        if not caps & CAP_AUTH:
            raise Refused("a client without CAP_AUTH: this worker requires the token")
        try:
            session["handshake"] = hs = ServerHandshake(self.auth_token, "compute", self.role, hello[HELLO.size :])
        except AuthError as e:
            raise AuthFailed(str(e)) from None
        self._send(conn, hs.nonce, hs.proof, self.role.encode())

    # --- after the handshake ------------------------------------------------------------------------

    def busy_reply(self, why: str) -> bytes:
        """The answer to a request the listener's pool drops (ggml-rpc framing: size, then ERROR and why)."""
        text = why.encode()
        return COMPUTE_SIZE.pack(1 + len(text)) + bytes([R.ERROR]) + text

    def opens_session(self, header: bytes) -> bool:
        """A first request that opens (CHECK, then LOAD_STAGE) or joins (STATE_JOIN) the head's
        stage session: the listener serves it on a thread of its own, never behind the pool."""
        return COMPUTE_HEADER.unpack(header)[0] in _SESSION_OPENERS

    def serve(self, conn, reader: SocketReader, session: dict) -> bool:
        """One request and its reply."""
        if not reader.prefix:
            spin_until_readable(conn, self.spin_s)
        try:
            cmd, payload = self._read_request(reader)
            status, parts = R.OK, self._command(cmd, payload, session)  # a STATE_PUT streams in here
        except (FrameError, OSError):  # the stream itself broke: close the connection
            raise
        except StaleEpoch as e:
            status, parts = R.STALE_EPOCH, [str(e).encode()]
        except ComputeError as e:
            status, parts = R.ERROR, [str(e).encode()]
        except Exception as e:  # a bug or a device error fails this command, not the worker
            log.exception("compute command %d failed", cmd)
            status, parts = R.ERROR, [f"{type(e).__name__}: {e}".encode()]
        finally:
            self.bytes_in += reader.bytes_in
            reader.bytes_in = 0
        if status == R.OK and cmd in _FORWARDS:
            self._send(conn, *parts)  # the FORWARD reply carries its own status header
        else:
            self._reply(conn, status, *parts)
        return True

    def _read_request(self, reader: SocketReader) -> tuple[int, object]:
        """The next frame, within a deadline scaled to its size. A FORWARD for a CUDA stage lands
        in page-locked memory, so its hidden states reach the device by DMA (unpack_forward's
        tensors are views of this buffer). A STATE_PUT is not read here: its command streams the
        state in (up to STATE_PUT_CAP, beyond the frame limit)."""
        cmd, size = read_compute_header(reader, 1 << 64)
        reader.expect(frame_deadline(size))
        if cmd == Cmd.STATE_PUT:
            return cmd, (reader, size)
        if size > self.max_frame:
            raise FrameError(f"compute frame of {size} bytes exceeds the {self.max_frame}-byte limit (cmd {cmd})")
        if cmd not in (Cmd.FORWARD, Cmd.FORWARD_ACK, Cmd.FORWARD_OUT) or self.host.device.type != "cuda":
            return cmd, reader.read_exact(size)
        buf = host_buffer((size,), torch.uint8, self.host.device).numpy()
        reader.read_into(memoryview(buf))
        return cmd, buf

    def _commands(self) -> dict[int, tuple]:
        """The dispatch table: command id -> (parse the payload into the command's request, run it
        with the session; returns buffers, or a `Message` / dict sent as JSON). Parsing refuses what
        the layout does not allow (contracts.rpc, naming the field) before anything runs."""
        raw = _raw_payload
        return {
            Cmd.CHECK: (CheckRequest.decode, self._check),
            Cmd.LOAD_STAGE: (LoadStageRequest.decode, lambda r, s: self.host.load(r, owner=s["id"])),
            Cmd.RESOLVE: (_text, lambda name, s: self.host.resolve(name)),
            Cmd.FORWARD: (raw, lambda p, s: self._forward(Cmd.FORWARD, p, s)),
            Cmd.FORWARD_IPC: (raw, lambda p, s: self._forward(Cmd.FORWARD_IPC, p, s)),
            Cmd.FORWARD_ACK: (raw, lambda p, s: self._forward(Cmd.FORWARD_ACK, p, s)),
            Cmd.FORWARD_OUT: (raw, self._forward_out),
            Cmd.DRAFT: (DraftAsk.decode, lambda r, s: self.host.draft(r, owner=s["id"])),
            Cmd.KV_CLEAR: (_struct(KV_CLEAR), lambda r, s: self.host.kv_clear(r[0], owner=s["id"]) or []),
            Cmd.KV_TRIM: (_struct(KV_TRIM), lambda r, s: []),  # rollback is implicit: positions >= n are overwritten
            Cmd.KV_SHIFT: (_struct(KV_SHIFT), lambda r, s: self.host.kv_shift(*r, owner=s["id"]) or []),
            Cmd.STATS: (
                raw,
                lambda p, s: {**self.host.stats(), "bytes_in": self.bytes_in, "bytes_out": self.bytes_out},
            ),
            Cmd.PING: (raw, lambda p, s: [bytes(p[:PING_MAX])]),
            Cmd.PROBE: (ProbeRequest.decode, lambda r, s: self.host.probe(r, owner=s["id"])),
            Cmd.STATE_META: (_struct(STATE_SLOT), lambda r, s: self.host.state_meta(r[0], owner=s["id"])),
            Cmd.STATE_GET: (StateGetRequest.decode, lambda r, s: self.host.state_get(r, owner=s["id"])),
            Cmd.STATE_PUT: (raw, lambda p, s: self._state_put(*p, s)),  # (reader, size): it streams in
            Cmd.STATE_JOIN: (raw, self._join),
            Cmd.IPC_OPEN: (IpcOpenRequest.decode, self._ipc_open),
        }

    def _command(self, cmd: int, payload, session: dict) -> list:
        """Run one command; returns the reply body as buffers."""
        parse, run = self.commands.get(cmd, (None, None))
        if run is None:
            raise ComputeError(f"unknown command {cmd}")
        if cmd in _AFTER_CHECK and not session["checked"]:
            raise ComputeError(f"CHECK (fingerprint and shapes) must pass before {_NAMES[cmd]}")
        try:
            request = parse(payload)
        except WireError as e:
            raise ComputeError(str(e)) from None
        body = run(request, session)
        if isinstance(body, list):
            return body
        body = body.to_json() if isinstance(body, Message) else body
        return [json.dumps(body, separators=(",", ":")).encode()]

    def _check(self, request: CheckRequest, session: dict) -> CheckReply:
        reply = self.host.check(request)
        session["checked"] = True
        return reply

    def _join(self, key, session: dict) -> list:
        session["id"] = self.host.join(key)
        return []

    def _ipc_open(self, request: IpcOpenRequest, session: dict) -> dict:
        session["ipc"] = None  # a failed re-open leaves no channel half-set
        session["ipc"], desc = IpcChannel.create(self.host.device, request, self.host.cfg.n_embd)
        return desc

    def _state_put(self, reader: SocketReader, size: int, session: dict) -> Message:
        """STATE_PUT: `STATE_SLOT` then the state, read straight off the socket; whatever the
        refusal leaves unread is drained in 64 KiB pieces, so the session stays in sync."""
        left = size

        def take(n: int) -> None:  # before anything is allocated for them
            nonlocal left
            if n > left:
                raise SlotStateError(f"slot state truncated: the frame ends {n - left} bytes early")
            left -= n

        def read(n: int) -> bytearray:
            take(n)
            return reader.read_exact(n)

        def fill(view: memoryview, progress=None) -> None:
            take(len(view))
            reader.read_into(view, progress)

        try:
            if size > STATE_PUT_CAP:
                raise ComputeError(f"STATE_PUT of {size} bytes over the {STATE_PUT_CAP >> 30} GiB cap")
            if size < STATE_SLOT.size:
                raise ComputeError("STATE_PUT shorter than its slot id")
            (slot,) = STATE_SLOT.unpack(read(STATE_SLOT.size))
            return self.host.state_put(slot, read, fill, owner=session["id"])
        finally:
            reader.drain(left)

    def _forward(self, cmd: int, payload, session: dict) -> list:
        """FORWARD: hidden states in the frame and back in the reply. FORWARD_IPC: they stay on
        the GPU (the reply goes out as soon as the work is queued; `compute_us` is then the
        time to queue it). FORWARD_ACK: in the frame, not back (the reply once they are computed)."""
        via_ipc, ipc = cmd == Cmd.FORWARD_IPC, session.get("ipc")
        epoch, hidden, slots, positions = unpack_forward(payload, with_hidden=not via_ipc)
        if via_ipc:
            if ipc is None:
                raise ComputeError("FORWARD_IPC needs an open CUDA IPC channel (IPC_OPEN)")
            t, d = hidden.shape
            if not ipc.fits(hidden):
                raise ComputeError(
                    f"FORWARD_IPC of {t}x{d} {hidden.dtype} does not fit the channel's "
                    f"{ipc.rows}x{ipc.inbox.shape[1]} {ipc.inbox.dtype}"
                )
            hidden = ipc.incoming(t)
        t0 = time.perf_counter()
        out = self.host.forward(epoch, hidden, slots, positions, owner=session["id"])
        if via_ipc:
            ipc.reply(out)
            body = []
        elif cmd == Cmd.FORWARD_ACK:
            body = []
            if out.device.type == "cuda":
                torch.cuda.current_stream(out.device).synchronize()  # the reply says the chunk is done
        else:
            body = [raw_bytes(to_host(out).to(hidden.dtype))]
        compute_us = min(int((time.perf_counter() - t0) * 1e6), 0xFFFFFFFF)
        return [FORWARD_REPLY.pack(R.OK, compute_us), *body]

    def _forward_out(self, payload, session: dict) -> list:
        """FORWARD_OUT: FORWARD through this last stage's output: the logit rows back (float32), or
        their argmax alone (int32), every row's normed hidden state when asked (an embedding), and
        the drafts ahead asked for."""
        epoch, hidden, slots, positions, rows, tokens, want_hidden, argmax, ahead = unpack_forward_out(payload)
        t0 = time.perf_counter()
        logits, x, drafts = self.host.forward_out(
            epoch, hidden, slots, positions, rows, tokens, want_hidden, ahead, owner=session["id"]
        )
        out = logits.argmax(-1).to(torch.int32) if argmax else logits.float()
        body = [raw_bytes(to_host(out))] + ([raw_bytes(to_host(x).float())] if x is not None else [])
        for position, token, draft in drafts:
            body += [AHEAD_DRAFT.pack(position, token, len(draft)), np.asarray(draft, dtype=np.int32)]
        compute_us = min(int((time.perf_counter() - t0) * 1e6), 0xFFFFFFFF)
        return [FORWARD_REPLY.pack(R.OK, compute_us), *body]

    def _hello(self, conn, payload: bytes) -> bool:
        if len(payload) < 3:
            # An upstream ggml-rpc client: answer in its 3-byte shape so it reports the version mismatch.
            self._send(conn, bytes(VERSION))
            log.warning("refused a ggml-rpc client (no version in HELLO): this port speaks Hydra compute %s", VERSION)
            return False
        major, minor, patch = payload[0], payload[1], payload[2]
        if (major, minor) != VERSION[:2]:
            message = (
                f"Hydra compute protocol {'.'.join(map(str, VERSION))} refuses client version {major}.{minor}.{patch}: "
                "major/minor must match (upstream llama.cpp rpc clients cannot drive a Hydra worker)"
            )
            self._send(conn, pack_hello(self.caps), message.encode())
            log.warning(message)
            return False
        self._send(conn, pack_hello(self.caps))
        return True


_FORWARDS = (Cmd.FORWARD, Cmd.FORWARD_IPC, Cmd.FORWARD_ACK, Cmd.FORWARD_OUT)  # replies with their own status header
_SESSION_OPENERS = frozenset({Cmd.CHECK, Cmd.LOAD_STAGE, Cmd.STATE_JOIN})  # ComputeServer.opens_session
_AFTER_CHECK = frozenset({*_FORWARDS, Cmd.LOAD_STAGE, Cmd.DRAFT})
_NAMES = {v: k for k, v in vars(Cmd).items() if k.isupper()}


def _raw_payload(payload):
    return payload


def _text(payload) -> str:
    return bytes(payload).decode("utf-8", "replace")


def _struct(st: struct.Struct):
    """A fixed-size payload's fields."""

    def parse(payload) -> tuple:
        if len(payload) != st.size:
            raise ComputeError(f"payload must be {st.size} bytes, got {len(payload)}")
        return st.unpack(payload)

    return parse
