"""Head-side peer client: `RemoteStage` runs a layer range on a peer over the compute protocol.

It has the shape of `model.Stage` that the pipeline chains (`run_layers(h, slots, positions)`,
`kv_clear(slot)`, `assign(a, b)`, `layer_range`, `device`, `state`). One FORWARD frame per step
carries the whole batch as raw bytes in the compute dtype; with a peer on the head's own GPU the
hidden states stay on the GPU instead (CUDA IPC, see cuda_ipc.py) and the frame carries only slots
and positions. A prompt's chunks may be pipelined (`send_layers`: FORWARD_ACK, the reply read
later) so that the head computes the next chunk while the peer computes this one. A peer that dies mid-request fails that request within ~2 s with
`PeerUnavailable` (HTTP 503), never a hang; `attach()` re-validates and re-assigns when it comes
back.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections import deque
from typing import TypeVar

import torch

from ...contracts.auth import NONCE_BYTES, PROOF_BYTES, AuthError, ClientHandshake
from ...contracts.footprint import model_tensors
from ...contracts.rpc import (
    CAP_AUTH,
    CAP_FORWARD_ACK,
    CAP_IPC,
    COMPUTE_HEADER,
    FORWARD_REPLY,
    HELLO,
    KV_CLEAR,
    STATE_SLOT,
    VERSION,
    CheckReply,
    CheckRequest,
    Cmd,
    IpcOpenRequest,
    LoadStageReply,
    LoadStageRequest,
    ProbeRequest,
    StageProbe,
    StaleEpoch,
    StateGetRequest,
    StateMeta,
)
from ...contracts.rpc import ReplyStatus as R
from ...contracts.status import PeerInfo
from ...contracts.wire_json import Message, WireError
from ..device import host_buffer, to_host
from ..errors import Unavailable, UserError
from .compute import pack_forward, pack_hello
from .cuda_ipc import IPC_TOKENS, IpcChannel, gpu_uuid
from .listener import tune_socket
from .resident import DTYPES, tensor_shapes
from .wire import (
    FrameError,
    SocketReader,
    pack_compute_request,
    read_compute_response,
    read_compute_response_size,
    send_all,
    spin_until_readable,
)

log = logging.getLogger("hydra.rpc.client")

CONNECT_TIMEOUT_S = 2.0
WATCH_S = 1.0  # while a reply is pending, probe the peer this often
PROBE_ANSWER_S = 2.0
PIPELINE_IDLE_S = 5.0  # pipelined replies unread this long: the watcher's ping reads them
# /status `rtt_max_ms`: the worst round trip this recent, so a spike between two polls of a console
# (or hidden behind a normal round trip just before the poll) still shows on its timeline.
RTT_WINDOW_S = 10.0
M = TypeVar("M", bound=Message)


class PeerError(RuntimeError):
    """A peer could not run a request; the runtime fails that request."""


class PeerUnavailable(PeerError, Unavailable):
    """A peer is down or died mid-request: the request fails (HTTP 503) and the head re-attaches."""


class PeerMismatch(UserError):
    """The peer serves a different model, refuses our protocol version, or rejects our token."""


class _ExchangeLock:
    """One exchange on a peer's socket at a time. The thread holding it that comes back for it (work
    run between a frame and its reply calling into the same peer) gets an error, not a deadlock."""

    def __init__(self):
        self._lock, self._owner = threading.Lock(), None

    def acquire(self, blocking: bool = True) -> bool:
        if self._owner == threading.get_ident():
            raise RuntimeError(
                "a peer's exchange re-entered from inside it: work run between a frame and its "
                "reply must not call the pipeline"
            )
        if not self._lock.acquire(blocking):
            return False
        self._owner = threading.get_ident()
        return True

    def release(self) -> None:
        self._owner = None
        self._lock.release()

    __enter__ = acquire

    def __exit__(self, *exc) -> None:
        self.release()


def _call(fn) -> tuple[BaseException | None, float]:
    """`fn()` (if any): (what it raised instead of raising it, seconds it took)."""
    t0 = time.perf_counter()
    try:
        if fn is not None:
            fn()
    except BaseException as e:  # noqa: BLE001 — re-raised by the caller once its reply is read
        return e, time.perf_counter() - t0
    return None, time.perf_counter() - t0


def parse_addr(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"--peer {text!r}: expected HOST:PORT (the peer's RPC port)")
    return host.strip("[]"), int(port)


class RemoteStage:
    def __init__(
        self,
        addr: str,
        layers: tuple[int, int],
        *,
        g,
        dtype: torch.dtype,
        n_slots: int,
        n_ctx: int,
        kv_pool: int | None = None,
        kv_types: tuple[str, str] = ("auto", "auto"),
        max_run: int = 1,
        deterministic: bool = False,
        auth_token: str | None = None,
        max_frame: int = 1 << 30,
        spin_s: float = 0.0,
        head_device: torch.device | None = None,
        pipeline_depth: int = 0,
    ):
        self.addr = addr
        self.host, self.port = parse_addr(addr)
        self.layer_range = tuple(layers)
        self.g, self.dtype, self.n_slots, self.n_ctx, self.kv_pool = g, dtype, n_slots, n_ctx, kv_pool
        self._tensors = model_tensors(g.metadata, g.tensors)  # bounds the states a peer may send back
        self.kv_types = kv_types  # the peer allocates its KV in the head's cache types, as llama.cpp's RPC backend does
        self.max_run = max_run  # and captures graphs for the head's verify steps before it serves
        self.deterministic = deterministic  # a split computes as the head does: batch-invariant or not
        self.auth_token = auth_token
        self.max_frame = max_frame
        self.state = "connecting"
        self.device = "remote"
        self.epoch = 0
        self.state_key: bytes | None = None  # LOAD_STAGE's: lets a second connection move slot states (STATE_JOIN)
        self.rtt_ms: float | None = None
        self._rtts: deque[tuple[float, float]] = deque()  # (monotonic time, ms) of the last RTT_WINDOW_S
        self.compute_ms: float | None = None  # the peer's own time for the last FORWARD
        self.bytes_sent = self.bytes_recv = 0
        self.error: str | None = None
        self.attaches = 0
        self.on_state = lambda: None  # called after every up/down change
        self._sock: socket.socket | None = None
        self._reader: SocketReader | None = None
        self._lock = _ExchangeLock()  # one exchange on the socket at a time
        self._spin_s = spin_s  # busy-wait budget for each FORWARD reply (RpcSettings.spin_seconds)
        self._head_device = head_device  # a CUDA device: try CUDA IPC with a peer on the same GPU
        self._caps = 0
        self._ipc: IpcChannel | None = None
        self._retired: list[IpcChannel] = []  # closed channels our GPU stream may still be reading
        self.pipeline_depth = pipeline_depth  # FORWARD_ACK replies that may wait unread (0: never pipeline)
        self.pipelined = 0  # prompt chunks sent without waiting (FORWARD_ACK), in all
        self._unread = 0  # FORWARD_ACK replies on the main connection not read yet
        self._pipelined_at = 0.0  # monotonic time of the last FORWARD_ACK sent

    # --- connection -------------------------------------------------------------------------------

    def attach(self) -> None:
        """Connect, HELLO, prove the token, check identity, assign our layers. Raises PeerUnavailable
        when the peer cannot be reached and PeerMismatch when it can but must not be used."""
        with self._lock:
            self._close()
            try:
                self._connect()
                self._request(
                    Cmd.CHECK, CheckRequest(fingerprint=self.g.fingerprint, shapes=tensor_shapes(self.g)), CheckReply
                )
                self._load(self.layer_range)
                self._open_ipc()
            except PeerMismatch as e:
                self._down(str(e))
                raise
            except (OSError, FrameError, PeerUnavailable) as e:
                self._down(f"{type(e).__name__}: {e}")
                raise PeerUnavailable(f"peer {self.addr} unavailable: {e}") from None
            self.state, self.error = "up", None
            self.attaches += 1
        self.on_state()

    def _connect(self) -> None:
        self._sock, self._reader = self._handshake()

    def _handshake(self) -> tuple[socket.socket, SocketReader]:
        """A new connection past HELLO (and AUTH when the peer asks for it)."""
        sock = socket.create_connection((self.host, self.port), timeout=CONNECT_TIMEOUT_S)
        try:
            tune_socket(sock)
            sock.settimeout(WATCH_S)
            link = (sock, SocketReader(sock, on_idle=self._probe))
            hs = ClientHandshake(self.auth_token, "compute", ("peer",)) if self.auth_token else None
            reply = self._exchange(Cmd.HELLO, pack_hello(CAP_AUTH, nonce=hs.nonce) if hs else pack_hello(), link)
            if len(reply) < HELLO.size:
                raise PeerMismatch(f"peer {self.addr} answered HELLO with {len(reply)} bytes: not a Hydra worker")
            major, minor, patch, _, caps = HELLO.unpack_from(reply)
            self._caps = caps
            if (major, minor) != VERSION[:2]:
                detail = bytes(reply[HELLO.size :]).decode("utf-8", "replace")
                raise PeerMismatch(
                    f"peer {self.addr} speaks compute protocol {major}.{minor}.{patch}, we {VERSION}: {detail}"
                )
            if caps & CAP_AUTH and hs is None:
                raise PeerMismatch(f"peer {self.addr} requires a token: set --auth-token or HYDRA_TOKEN")
            if hs is not None:  # the peer proves the token before we send it anything
                if not caps & CAP_AUTH:
                    raise PeerMismatch(
                        f"peer {self.addr} offers no authentication and we hold a token: refused "
                        "(start it with the same --auth-token / HYDRA_TOKEN)"
                    )
                challenge = bytes(self._read_reply(link))
                nonce, proof, role = (
                    challenge[:NONCE_BYTES],
                    challenge[NONCE_BYTES : NONCE_BYTES + PROOF_BYTES],
                    challenge[NONCE_BYTES + PROOF_BYTES :],
                )
                try:
                    ours = hs.answer(nonce, role.decode("utf-8", "replace"), proof)
                except AuthError as e:
                    raise PeerMismatch(
                        f"peer {self.addr} failed to authenticate ({e}): a different --auth-token, "
                        "or not one of our workers"
                    ) from None
                status, body = self._status(self._exchange(Cmd.AUTH, ours, link))
                if status != R.OK:
                    raise PeerMismatch(f"peer {self.addr} rejected our token: {body.decode(errors='replace')}")
        except BaseException:
            sock.close()
            raise
        return link

    def _load(self, layers) -> None:
        request = LoadStageRequest(
            layers=list(layers),
            dtype=str(self.dtype).removeprefix("torch."),
            n_slots=self.n_slots,
            n_ctx=self.n_ctx,
            kv_pool=self.kv_pool,
            kv_types=list(self.kv_types),
            max_run=self.max_run,
            deterministic=self.deterministic,
        )
        reply = self._request(Cmd.LOAD_STAGE, request, LoadStageReply)
        try:
            self.epoch, self.state_key = reply.epoch, bytes.fromhex(reply.state_key)
        except ValueError:
            raise PeerMismatch(f"peer {self.addr} answered LOAD_STAGE with a state_key that is not hex") from None
        self.layer_range = tuple(layers)
        self.device = reply.device

    def _open_ipc(self) -> None:
        """Map the peer's CUDA IPC channel when it computes on our GPU; otherwise (another GPU or
        host, a CPU peer, a driver that refuses the mapping) the hidden states go in the frames."""
        dev = self._head_device
        if dev is None or dev.type != "cuda":
            return
        if self._retired and torch.cuda.current_stream(dev).query():
            self._retired.clear()  # nothing queued can touch them any more: unmap
        if not self._caps & CAP_IPC:
            return
        request = IpcOpenRequest(uuid=gpu_uuid(dev), rows=IPC_TOKENS, dtype="float32")
        status, body = self._status(self._exchange(Cmd.IPC_OPEN, request.encode()))
        if status != R.OK:
            log.info("peer %s: hidden states go over the socket (%s)", self.addr, body.decode("utf-8", "replace"))
            return
        try:
            self._ipc = IpcChannel.open(json.loads(body), DTYPES[request.dtype], dev)
        except (RuntimeError, KeyError, ValueError) as e:
            log.warning(
                "peer %s shares our GPU but its CUDA IPC channel could not be mapped (%s): using the socket",
                self.addr,
                e,
            )

    @property
    def transport(self) -> str:
        return "cuda-ipc" if self._ipc is not None else "socket"

    def assign(self, a: int, b: int) -> None:
        """Live re-split: the peer re-materialises [a,b) from its own file (its KV starts empty)."""
        with self._lock:
            if self.state != "up":
                raise PeerUnavailable(f"peer {self.addr} is {self.state}: cannot re-split onto it")
            try:
                self._load((a, b))
            except (OSError, FrameError, PeerUnavailable) as e:
                self._down(str(e))
                raise PeerUnavailable(f"peer {self.addr} failed during re-split: {e}") from None

    def close(self) -> None:
        with self._lock:
            self._close()
            self.state = "down"

    def _close(self) -> None:
        self._unread = 0  # their replies go with the connection
        if self._ipc is not None:
            # Work queued on our stream (the last step's copy out of the outbox) may still read the
            # mapping: keep it until the stream is seen idle, never wait for it here (a dead peer's
            # event must not be able to wedge the head).
            self._retired.append(self._ipc)
            self._ipc = None
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = self._reader = None

    def _down(self, why: str) -> None:
        """Lost (or not yet reached): "connecting" until the first attach, "down" after."""
        state = "down" if self.attaches else "connecting"
        if state == "down" and self.state != "down":
            log.warning("peer %s down: %s", self.addr, why)
        changed = state != self.state
        self.state, self.error = state, why
        self._close()
        if changed:
            self.on_state()

    # --- the stage interface ----------------------------------------------------------------------

    def run_layers(self, h: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, meanwhile=None) -> torch.Tensor:
        """This peer's layers over `h`; `meanwhile` (the caller's host work) runs between the frame
        and the reply: what it raises is raised once the reply is read, so the connection stays in step."""
        failed, busy = None, 0.0
        with self._lock:
            if self.state != "up":
                raise PeerUnavailable(f"peer {self.addr} is down ({self.error}); retry when it is back")
            ipc = self._ipc
            via_ipc = ipc is not None and h.device == ipc.inbox.device and ipc.fits(h)
            try:
                self._settle()  # the pipelined chunks before this one, whose replies come first
                t0 = time.perf_counter()
                if via_ipc:
                    ipc.send(h)
                    self._send(
                        Cmd.FORWARD_IPC, pack_forward(self.epoch, h, slots.cpu(), positions.cpu(), with_hidden=False)
                    )
                    failed, busy = _call(meanwhile)
                    compute_us = self._forward_reply(0)
                    out = ipc.receive(h.shape[0])
                else:
                    hidden = to_host(h)  # the residual stream's own dtype: bit-exact across the wire
                    self._send(Cmd.FORWARD, pack_forward(self.epoch, hidden, slots.cpu(), positions.cpu()))
                    failed, busy = _call(meanwhile)
                    compute_us = self._forward_reply(hidden.numel() * hidden.element_size())
                    out = host_buffer(hidden.shape, hidden.dtype, h.device)
                    self._reader.read_into(memoryview(out.view(-1).view(torch.uint8).numpy()))
                    out = out.to(h.device, h.dtype, non_blocking=True)  # from page-locked memory: the device orders it
            except (OSError, FrameError, PeerUnavailable) as e:
                self._down(f"{type(e).__name__}: {e}")
                raise PeerUnavailable(f"peer {self.addr} failed mid-request: {e}") from None
            finally:
                self._account()
            self.compute_ms = compute_us / 1e3
            self._note_rtt(max((time.perf_counter() - t0 - busy) * 1e3 - self.compute_ms, 0.0))
        if failed is not None:
            raise failed
        return out

    def can_pipeline(self) -> bool:
        """Whether `send_layers` may be used: pipelining is on, the peer knows FORWARD_ACK, and the
        hidden states go over the socket (a CUDA IPC channel has one inbox: one frame at a time)."""
        return self.pipeline_depth > 0 and bool(self._caps & CAP_FORWARD_ACK) and self._ipc is None

    def send_layers(self, h: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """This peer's layers over `h`, no output wanted (a prompt chunk before its last, this the
        last stage): the frame goes out and the caller goes on while the peer computes. The peer runs
        its frames in order; their replies are read before anything else uses this connection
        (`settle`), and before this frame when `pipeline_depth` of them are already waiting."""
        with self._lock:
            if self.state != "up":
                raise PeerUnavailable(f"peer {self.addr} is down ({self.error}); retry when it is back")
            try:
                if self._unread >= self.pipeline_depth:
                    self._read_acks(1)
                hidden = to_host(h)
                self._send(Cmd.FORWARD_ACK, pack_forward(self.epoch, hidden, slots.cpu(), positions.cpu()))
                self._unread += 1
                self.pipelined += 1
                self._pipelined_at = time.monotonic()
            except (OSError, FrameError, PeerUnavailable) as e:
                self._down(f"{type(e).__name__}: {e}")
                raise PeerUnavailable(f"peer {self.addr} failed mid-request: {e}") from None
            finally:
                self._account()

    def settle(self) -> None:
        """Read the replies of the pipelined chunks still outstanding (see `_settle`)."""
        with self._lock:
            if self._unread:
                try:
                    self._settle()
                except (OSError, FrameError, PeerUnavailable) as e:
                    self._down(f"{type(e).__name__}: {e}")
                    raise PeerUnavailable(f"peer {self.addr} failed mid-request: {e}") from None
                finally:
                    self._account()

    def _settle(self) -> None:
        """Every outstanding FORWARD_ACK reply, read (the caller holds the lock). A peer that
        replaced its resident set meanwhile: StaleEpoch once all are read (the pipeline re-attaches and
        replays). A chunk it could not run leaves its KV unknown: the session is dropped (the
        watcher re-attaches and the pipeline replays the active slots), PeerUnavailable."""
        stale = None
        while self._unread:
            try:
                self._read_acks(1)
            except StaleEpoch as e:
                stale = e
        if stale is not None:
            raise stale

    def _read_acks(self, n: int) -> None:
        for _ in range(n):
            self._unread -= 1
            try:
                self.compute_ms = self._forward_reply(0) / 1e3
            except StaleEpoch:
                raise
            except PeerError as e:
                raise PeerUnavailable(f"a pipelined prompt chunk failed there ({e})") from None

    def _forward_reply(self, hidden_bytes: int) -> int:
        """Reads a FORWARD reply up to its hidden states (`hidden_bytes` of them must follow);
        returns the peer's compute µs. A refusal raises StaleEpoch or PeerError."""
        spin_until_readable(self._sock, self._spin_s)
        size = read_compute_response_size(self._reader, self.max_frame)
        head = self._reader.read_exact(min(size, FORWARD_REPLY.size))
        if not head or head[0] != R.OK or size < FORWARD_REPLY.size:
            body = bytes(head[1:]) + bytes(self._reader.read_exact(size - len(head)))
            if head and head[0] == R.STALE_EPOCH:
                raise StaleEpoch(f"peer {self.addr}: {body.decode('utf-8', 'replace')}")
            raise PeerError(f"peer {self.addr} could not run the batch: {body.decode('utf-8', 'replace')}")
        if size - FORWARD_REPLY.size != hidden_bytes:
            raise FrameError(f"FORWARD reply of {size} bytes, expected {FORWARD_REPLY.size + hidden_bytes}")
        return FORWARD_REPLY.unpack(head)[1]

    def kv_clear(self, slot: int) -> None:
        with self._lock:
            if self.state == "up":
                self._guarded(lambda: self._exchange(Cmd.KV_CLEAR, KV_CLEAR.pack(slot)))

    def time_layers(self, request: ProbeRequest) -> StageProbe:
        """PROBE: the peer times its own layers."""
        with self._lock:
            if self.state != "up":
                raise PeerUnavailable(f"peer {self.addr} is down ({self.error}): cannot probe it")
            status, body = self._guarded(lambda: self._status(self._exchange(Cmd.PROBE, request.encode())))
        if status != R.OK:
            raise UserError(f"peer {self.addr} refused the probe: {body.decode('utf-8', 'replace')}")
        try:
            return StageProbe.decode(body)
        except WireError as e:
            raise UserError(f"peer {self.addr} answered the probe badly: {e}") from None

    # --- state ops: this peer's layers of a slot, out and in (contracts.slot_state) ----------------

    def state_meta(self, slot: int) -> dict:
        return self._state_reply(self._state_call(Cmd.STATE_META, [STATE_SLOT.pack(slot)]))

    def state_get(self, slot: int, tokens: list[int]) -> memoryview:
        """The state of `slot`'s first len(tokens) positions on this peer's layers (a view of the
        reply as it was received: no copy)."""
        limit = 1 + self._tensors.slot_state_bound([self.layer_range], len(tokens))  # + the status byte
        return self._state_call(Cmd.STATE_GET, [StateGetRequest(slot=slot, tokens=list(tokens)).encode()], limit)

    def state_put(self, slot: int, state) -> dict:
        """Place a state of this peer's layers into `slot`; a refusal (PeerError) leaves it as it was."""
        return self._state_reply(self._state_call(Cmd.STATE_PUT, [STATE_SLOT.pack(slot), state]))

    def _state_reply(self, body) -> dict:
        """A `StateMeta` reply, checked against its layout, as JSON."""
        try:
            return StateMeta.decode(body).to_json()
        except WireError as e:
            raise PeerError(f"peer {self.addr}: {e}") from None

    def _state_call(self, cmd: int, parts: list, limit: int | None = None) -> memoryview:
        """One state op on a connection of its own, joined to our session (STATE_JOIN): a slot's
        state streams while the forwards go on over the main connection. A peer that fails here is
        not marked down (the main connection's next exchange tells)."""
        if self.state != "up":
            raise PeerUnavailable(f"peer {self.addr} is down ({self.error})")
        link = None
        try:
            link = self._handshake()
            status, body = self._status(self._exchange(Cmd.STATE_JOIN, self.state_key, link))
            if status != R.OK:
                raise PeerError(f"peer {self.addr}: {body.decode('utf-8', 'replace')}")
            self._send(cmd, parts, link)
            reply = read_compute_response(link[1], min(limit or self.max_frame, self.max_frame))
        except (OSError, FrameError) as e:
            raise PeerUnavailable(f"peer {self.addr} failed during a state op: {e}") from None
        finally:
            if link is not None:
                link[0].close()
                self.bytes_recv += link[1].bytes_in
        if not reply:
            raise PeerError(f"peer {self.addr} sent an empty reply")
        body = memoryview(reply)[1:]
        if reply[0] != R.OK:
            raise PeerError(f"peer {self.addr}: {bytes(body).decode('utf-8', 'replace')}")
        return body

    def ping(self) -> float | None:
        """RTT of an empty round trip in ms; skipped (None) while a forward holds the socket or a
        prompt's pipelined chunks are flowing. Their replies left unread for PIPELINE_IDLE_S (the
        prompt was cancelled) are read first: the session stays pinged, a lost peer is seen."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            if self.state != "up":
                return None
            if self._unread:
                if time.monotonic() - self._pipelined_at < PIPELINE_IDLE_S:
                    return None  # the prompt's own next step reads them
                self._guarded(self._settle)
            t0 = time.perf_counter()
            self._guarded(lambda: self._exchange(Cmd.PING, b""))
            return self._note_rtt((time.perf_counter() - t0) * 1e3)
        except (PeerUnavailable, StaleEpoch):  # StaleEpoch: the next forward re-attaches
            return None
        finally:
            self._lock.release()

    def _note_rtt(self, ms: float) -> float:
        now = time.monotonic()
        self.rtt_ms = ms
        self._rtts.append((now, ms))
        while self._rtts[0][0] < now - RTT_WINDOW_S:
            self._rtts.popleft()
        return ms

    @property
    def rtt_max_ms(self) -> float | None:
        """The worst round trip of the last RTT_WINDOW_S (None: none measured then)."""
        since = time.monotonic() - RTT_WINDOW_S
        return max((ms for t, ms in list(self._rtts) if t >= since), default=None)

    def status(self) -> PeerInfo:
        worst = self.rtt_max_ms
        return PeerInfo(
            addr=self.addr,
            state=self.state,
            rtt_ms=None if self.rtt_ms is None else round(self.rtt_ms, 3),
            rtt_max_ms=None if worst is None else round(worst, 3),
            compute_ms=None if self.compute_ms is None else round(self.compute_ms, 3),
            layers=tuple(self.layer_range),
            bytes_sent=self.bytes_sent,
            bytes_recv=self.bytes_recv,
            epoch=self.epoch,
            transport=self.transport,
            attaches=self.attaches,
            error=self.error,
            pipelined=self.pipelined,
        )

    # --- framing helpers: on the main connection (caller holds the lock) or on `link` (sock, reader) --

    def _send(self, cmd: int, parts, link=None) -> None:
        """A peer busy with earlier pipelined chunks may not read a frame for a while: the send
        waits, probing the peer every WATCH_S as a pending reply does."""
        parts = parts if isinstance(parts, list) else [parts]
        size = sum(memoryview(p).cast("B").nbytes for p in parts)
        sock = link[0] if link else self._sock
        self.bytes_sent += send_all(sock, COMPUTE_HEADER.pack(cmd, size), *parts, on_idle=self._probe)

    def _read_reply(self, link=None):
        return read_compute_response(link[1] if link else self._reader, self.max_frame)

    def _exchange(self, cmd: int, payload, link=None) -> bytearray:
        if link is None and self._unread:  # the pipelined chunks' replies come first on this connection
            self._settle()
        self._send(cmd, payload, link)
        return self._read_reply(link)

    def _request(self, cmd: int, request: Message, reply_type: type[M]) -> M:
        """A JSON command and its reply, checked against the reply's layout."""
        status, body = self._status(self._exchange(cmd, request.encode()))
        if status != R.OK:
            raise PeerMismatch(f"peer {self.addr} refused: {body.decode('utf-8', 'replace')}")
        try:
            return reply_type.decode(body)
        except WireError as e:
            raise PeerMismatch(f"peer {self.addr} answered {request.OP} badly: {e}") from None

    @staticmethod
    def _status(reply) -> tuple[int, bytes]:
        if not reply:
            raise FrameError("empty reply")
        return reply[0], bytes(reply[1:])

    def _guarded(self, fn):
        try:
            return fn()
        except (OSError, FrameError, PeerUnavailable) as e:
            self._down(f"{type(e).__name__}: {e}")
            raise PeerUnavailable(f"peer {self.addr} failed: {e}") from None
        finally:
            self._account()

    def _account(self) -> None:
        if self._reader is not None:
            self.bytes_recv += self._reader.bytes_in
            self._reader.bytes_in = 0

    def _probe(self) -> None:
        """Called every WATCH_S while a reply is pending. A fresh connection must get a HELLO
        answer within PROBE_ANSWER_S (peer mode serves it on its own thread, even mid-forward): a host
        that vanished (no RST ever comes) or a frozen process fails the request in 2-3 s, not at
        TCP keepalive's 60 s or never."""
        try:
            with socket.create_connection((self.host, self.port), timeout=WATCH_S) as probe:
                probe.settimeout(PROBE_ANSWER_S)  # a busy CPU peer may be slow to schedule the answer
                probe.sendall(pack_compute_request(Cmd.HELLO, pack_hello()))
                read_compute_response(SocketReader(probe), 4096)
        except (OSError, FrameError) as e:
            raise PeerUnavailable(f"peer {self.addr} stopped answering: {e}") from None
