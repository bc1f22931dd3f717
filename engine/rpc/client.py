"""Head-side peer client: `RemoteStage` runs a layer range on a peer over the compute protocol.

It has the shape of `model.Stage` that the pipeline chains (`run_layers(h, slots, positions)`,
`kv_clear(slot)`, `assign(a, b)`, `layer_range`, `device`, `state`). One FORWARD frame per step
carries the whole batch as raw bytes in the compute dtype; with a peer on the head's own GPU the
hidden states stay on the GPU instead (CUDA IPC, see cuda_ipc.py) and the frame carries only slots
and positions. A prompt's chunks may be pipelined (`send_layers`: FORWARD_ACK, the reply read
later) so that the head computes the next chunk while the peer computes this one. A peer that dies
mid-request fails that request within ~2 s with `PeerUnavailable` (HTTP 503, peer_errors.py), never
a hang (peer_watch.py); `attach()` re-validates and re-assigns when it comes back. The opening
handshake is peer_handshake.py's, the pipelined sends peer_pipelining.py's, the slot-state ops
peer_state_ops.py's, the CUDA IPC channel peer_ipc.py's, a last peer's output (FORWARD_OUT, DRAFT)
peer_output.py's.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from typing import TypeVar

import torch

from ...contracts.footprint import model_tensors
from ...contracts.rpc import (
    CAP_OUTPUT,
    COMPUTE_HEADER,
    FORWARD_REPLY,
    KV_CLEAR,
    KV_SHIFT,
    CheckReply,
    CheckRequest,
    Cmd,
    LoadStageReply,
    LoadStageRequest,
    ProbeRequest,
    StageProbe,
    StaleEpoch,
)
from ...contracts.rpc import ReplyStatus as R
from ...contracts.status import PeerInfo
from ...contracts.wire_json import Message, WireError
from ..device import host_buffer, to_host
from ..errors import UserError
from .cuda_ipc import IpcChannel
from .exchange_lock import ExchangeLock, run_meanwhile
from .forward_frames import pack_forward
from .peer_errors import PeerError, PeerMismatch, PeerUnavailable, parse_addr
from .peer_handshake import open_session
from .peer_ipc import IpcChannelOps
from .peer_output import OutputOps
from .peer_pipelining import PipelinedSends
from .peer_state_ops import SlotStateOps
from .peer_watch import WATCH_S, RttWindow, probe
from .resident import tensor_shapes
from .tcp import tune_socket
from .wire import (
    FrameError,
    SocketReader,
    read_compute_response,
    read_compute_response_size,
    reply_status,
    send_all,
    spin_until_readable,
)

log = logging.getLogger("hydra.rpc.client")

CONNECT_TIMEOUT_S = 2.0
PIPELINE_IDLE_S = 5.0  # pipelined replies unread this long: the watcher's ping reads them
M = TypeVar("M", bound=Message)


class RemoteStage(PipelinedSends, SlotStateOps, OutputOps, IpcChannelOps):
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
        output: bool = False,
        mtp: bool = False,
    ):
        self.addr = addr
        self.host, self.port = parse_addr(addr)
        self.layer_range = tuple(layers)
        self.g, self.dtype, self.n_slots, self.n_ctx, self.kv_pool = g, dtype, n_slots, n_ctx, kv_pool
        self._tensors = model_tensors(g.metadata, g.tensors)  # bounds the states a peer may send back
        self.n_vocab = (self._tensors.output or self._tensors.embedding).shape[0]  # FORWARD_OUT's logit rows
        self.output, self.mtp = output, mtp  # --output-stage last: it holds the output head (and the MTP block)
        self.ahead_drafts = {}  # the MTP block's drafts made in the last FORWARD_OUT, per slot
        self.kv_types = kv_types  # the peer allocates its KV in the head's cache types, as llama.cpp's RPC backend does
        self.max_run = max_run  # and captures graphs for the head's verify steps before it serves
        self.deterministic = deterministic  # a split computes as the head does: batch-invariant or not
        self.auth_token = auth_token
        self.max_frame = max_frame
        self.state = "connecting"
        self.device = "remote"
        self.epoch = 0
        self.state_key: bytes | None = None  # LOAD_STAGE's: lets a second connection move slot states (STATE_JOIN)
        self._rtts = RttWindow()
        self.compute_ms: float | None = None  # the peer's own time for the last FORWARD
        self.bytes_sent = self.bytes_recv = 0
        self.error: str | None = None
        self.attaches = 0
        self.on_state = lambda: None  # called after every up/down change
        self._sock: socket.socket | None = None
        self._reader: SocketReader | None = None
        self._lock = ExchangeLock()  # one exchange on the socket at a time
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

    def attach(self, ipc: bool = True) -> None:
        """Connect, HELLO, prove the token, check identity, assign our layers (and, with `ipc`, map
        the CUDA IPC channel of a peer on our GPU: `open_ipc`). Raises PeerUnavailable when the peer
        cannot be reached and PeerMismatch when it can but must not be used."""
        with self._lock:
            self._close()
            try:
                self._connect()
                self._request(
                    Cmd.CHECK, CheckRequest(fingerprint=self.g.fingerprint, shapes=tensor_shapes(self.g)), CheckReply
                )
                self._load(self.layer_range)
                if ipc:
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
            self._caps = open_session(
                self.addr,
                self.auth_token,
                lambda cmd, payload: self._exchange(cmd, payload, link),
                lambda: self._read_reply(link),
            )
        except BaseException:
            sock.close()
            raise
        return link

    def _load(self, layers) -> None:
        if self.output and not self._caps & CAP_OUTPUT:
            raise PeerMismatch(f"peer {self.addr} cannot hold the output head (--output-stage last): an older worker")
        request = LoadStageRequest(
            layers=list(layers),
            dtype=str(self.dtype).removeprefix("torch."),
            n_slots=self.n_slots,
            n_ctx=self.n_ctx,
            kv_pool=self.kv_pool,
            kv_types=list(self.kv_types),
            max_run=self.max_run,
            deterministic=self.deterministic,
            output=self.output,
            mtp=self.mtp,
        )
        reply = self._request(Cmd.LOAD_STAGE, request, LoadStageReply)
        try:
            self.epoch, self.state_key = reply.epoch, bytes.fromhex(reply.state_key)
        except ValueError:
            raise PeerMismatch(f"peer {self.addr} answered LOAD_STAGE with a state_key that is not hex") from None
        self.layer_range = tuple(layers)
        self.device = reply.device

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
            with self._lost_on_error("failed mid-request"):
                self._settle()  # the pipelined chunks before this one, whose replies come first
                t0 = time.perf_counter()
                if via_ipc:
                    ipc.send(h)
                    self._send(
                        Cmd.FORWARD_IPC, pack_forward(self.epoch, h, slots.cpu(), positions.cpu(), with_hidden=False)
                    )
                    failed, busy = run_meanwhile(meanwhile)
                    compute_us = self._forward_reply(0)
                    out = ipc.receive(h.shape[0])
                else:
                    hidden = to_host(h)  # the residual stream's own dtype: bit-exact across the wire
                    self._send(Cmd.FORWARD, pack_forward(self.epoch, hidden, slots.cpu(), positions.cpu()))
                    failed, busy = run_meanwhile(meanwhile)
                    compute_us = self._forward_reply(hidden.numel() * hidden.element_size())
                    out = host_buffer(hidden.shape, hidden.dtype, h.device)
                    self._reader.read_into(memoryview(out.view(-1).view(torch.uint8).numpy()))
                    out = out.to(h.device, h.dtype, non_blocking=True)  # from page-locked memory: the device orders it
            self.compute_ms = compute_us / 1e3
            self._rtts.note(max((time.perf_counter() - t0 - busy) * 1e3 - self.compute_ms, 0.0))
        if failed is not None:
            raise failed
        return out

    def _forward_reply(self, hidden_bytes: int, more: int = 0) -> int:
        """Reads a FORWARD reply up to its hidden states (`hidden_bytes` of them must follow, and at
        most `more` bytes after them, which `self._more` then counts); returns the peer's compute µs.
        A refusal raises StaleEpoch or PeerError."""
        spin_until_readable(self._sock, self._spin_s)
        size = read_compute_response_size(self._reader, self.max_frame)
        head = self._reader.read_exact(min(size, FORWARD_REPLY.size))
        if not head or head[0] != R.OK or size < FORWARD_REPLY.size:
            body = bytes(head[1:]) + bytes(self._reader.read_exact(size - len(head)))
            if head and head[0] == R.STALE_EPOCH:
                raise StaleEpoch(f"peer {self.addr}: {body.decode('utf-8', 'replace')}")
            raise PeerError(f"peer {self.addr} could not run the batch: {body.decode('utf-8', 'replace')}")
        self._more = size - FORWARD_REPLY.size - hidden_bytes
        if not 0 <= self._more <= more:
            raise FrameError(f"FORWARD reply of {size} bytes, expected {FORWARD_REPLY.size + hidden_bytes}")
        return FORWARD_REPLY.unpack(head)[1]

    def kv_clear(self, slot: int) -> None:
        with self._lock:
            if self.state == "up":
                self._guarded(lambda: self._exchange(Cmd.KV_CLEAR, KV_CLEAR.pack(slot)))

    def kv_shift(self, slot: int, keep: int, discard: int, n: int) -> None:
        """KV_SHIFT: the peer's part of a context shift. A refusal is the head's bug, never skipped:
        the slot's KV would differ between stages."""
        with self._lock:
            if self.state != "up":
                raise PeerUnavailable(f"peer {self.addr} is down ({self.error}): cannot shift slot {slot}")
            status, body = self._guarded(
                lambda: reply_status(self._exchange(Cmd.KV_SHIFT, KV_SHIFT.pack(slot, keep, discard, n)))
            )
        if status != R.OK:
            raise PeerError(f"peer {self.addr} refused to shift slot {slot}: {body.decode('utf-8', 'replace')}")

    def time_layers(self, request: ProbeRequest) -> StageProbe:
        """PROBE: the peer times its own layers."""
        with self._lock:
            if self.state != "up":
                raise PeerUnavailable(f"peer {self.addr} is down ({self.error}): cannot probe it")
            status, body = self._guarded(lambda: reply_status(self._exchange(Cmd.PROBE, request.encode())))
        if status != R.OK:
            raise UserError(f"peer {self.addr} refused the probe: {body.decode('utf-8', 'replace')}")
        try:
            return StageProbe.decode(body)
        except WireError as e:
            raise UserError(f"peer {self.addr} answered the probe badly: {e}") from None

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
            return self._rtts.note((time.perf_counter() - t0) * 1e3)
        except (PeerUnavailable, StaleEpoch):  # StaleEpoch: the next forward re-attaches
            return None
        finally:
            self._lock.release()

    @property
    def rtt_ms(self) -> float | None:
        return self._rtts.last

    @property
    def rtt_max_ms(self) -> float | None:
        """The worst round trip of the last RTT_WINDOW_S (None: none measured then)."""
        return self._rtts.worst

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
        status, body = reply_status(self._exchange(cmd, request.encode()))
        if status != R.OK:
            raise PeerMismatch(f"peer {self.addr} refused: {body.decode('utf-8', 'replace')}")
        try:
            return reply_type.decode(body)
        except WireError as e:
            raise PeerMismatch(f"peer {self.addr} answered {request.OP} badly: {e}") from None

    def _guarded(self, fn):
        with self._lost_on_error("failed"):
            return fn()

    @contextlib.contextmanager
    def _lost_on_error(self, what: str):
        """A broken exchange marks the peer down and raises PeerUnavailable ("peer ADDR {what}: ...");
        its bytes are counted either way."""
        try:
            yield
        except (OSError, FrameError, PeerUnavailable) as e:
            self._down(f"{type(e).__name__}: {e}")
            raise PeerUnavailable(f"peer {self.addr} {what}: {e}") from None
        finally:
            self._account()

    def _account(self) -> None:
        if self._reader is not None:
            self.bytes_recv += self._reader.bytes_in
            self._reader.bytes_in = 0

    def _probe(self) -> None:
        probe(self.addr, self.host, self.port)
