"""Prefill/decode disaggregation: a long prompt is prefilled on a prefill worker (`serve --role
prefill`), its state comes back over the control protocol (PREFILL), and the decode head places
each stage's layers on that stage (its own here, the peers' through STATE_PUT) and decodes.

Decode side: `Disaggregator` decides which prompts go (at least `threshold` tokens not already in
the slot's prompt cache), fetches their state with a `PrefillClient` off the engine thread, and
hands it to the engine to place. Whatever goes wrong — the worker is down, slower than the
deadline, dies mid-transfer, or its state is refused — the request is prefilled here instead,
nothing lost, and the fallback is counted (`PdStats`: /status `pd`, /metrics `hydra_pd_*`).
Prefill side: `serve_prefill` runs the prompt through this worker's own engine and answers with
one slot state per range the decode head asked for; to a head on the same GPU, as CUDA IPC handles
of device buffers (rpc/cuda_ipc.py), which the head copies device to device; to a head on the same
host, written into the head's shared memory (rpc/shm.py), which the head checks and places from.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor

from prometheus_client.core import CounterMetricFamily

from ..contracts.auth import AuthError, control_login
from ..contracts.footprint import model_tensors
from ..contracts.rpc import STATE_PUT_CAP, ControlError, Op, PrefillReply, PrefillRequest, ShmOffer, Status
from ..contracts.slot_state import SlotStateError
from ..contracts.status import Disaggregation, Transfer
from . import slot_state
from .rpc.cuda_ipc import export_states, gpu_uuid, open_states
from .rpc.peer_errors import parse_addr
from .rpc.shm import Attached, Segment, Segments
from .rpc.wire import FrameError, FrameTimeout, SocketReader, pack_control_request, read_control_response
from .serving.sequence import Request

log = logging.getLogger("hydra.pd")

CONNECT_TIMEOUT_S = 2.0
RECENT = 16  # transfers kept for /status
IN_FLIGHT = 2  # PREFILL exchanges a decode head runs at once (one shared segment each)
AUTH_REPLY_MAX = 4 << 10  # an AUTH answer is a few hundred bytes of JSON
ID_BYTES = 8  # a token id's text in a state's header, at most: what a prompt may need beyond the bytes per token seen


class PdFallback(Exception):
    """The prompt is prefilled here after all; `reason` is what /metrics counts."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class PrefillClient:
    """One PREFILL exchange per prompt with the prefill worker's control port, within a deadline
    for the whole exchange (connect, prefill, transfer)."""

    def __init__(self, addr: str, auth_token: str | None, deadline_s: float):
        self.addr = addr
        self.host, self.port = parse_addr(addr)
        self.auth_token = auth_token
        self.deadline_s = deadline_s

    def prefill(
        self,
        tokens: list[int],
        ranges: list,
        fingerprint: str,
        limit: int,
        ipc: str | None = None,
        shm: Segment | None = None,
    ) -> tuple[PrefillReply, list]:
        """(the reply, slot states as `slot_state.read_all` answers them: each chunk checked as it
        arrived) or PdFallback naming why not. `limit`: the most bytes these states can take (the
        head's own model says: `ModelTensors.slot_state_bound`); a reply announcing more is refused
        before anything is allocated. `ipc`: this head's GPU; a worker on it answers CUDA IPC handles
        in the meta instead (contracts.rpc.PrefillReply). `shm`: this head's segment; a worker on
        this host writes the states there instead (meta `shm`, no payload)."""
        t_end = time.monotonic() + self.deadline_s
        try:
            sock = socket.create_connection((self.host, self.port), timeout=min(CONNECT_TIMEOUT_S, self.deadline_s))
        except OSError as e:
            raise PdFallback("down", f"prefill worker {self.addr} unreachable: {e.strerror or e}") from None
        request = PrefillRequest(
            tokens=list(tokens),
            ranges=[list(r) for r in ranges],
            fingerprint=fingerprint,
            ipc=ipc,
            shm=None if shm is None else ShmOffer.from_json(shm.offer),  # sent after AUTH: only a worker
        )  # that took our proof learns the name
        try:
            with sock:
                reader = SocketReader(sock)
                reader.expect(t_end - time.monotonic())
                if self.auth_token:  # the worker proves the token before it learns the prompt
                    self._login(sock, reader)

                def states(n: int) -> list:
                    """Checked as they arrive, into a kept buffer (none: CUDA IPC handles in the meta)."""
                    if n > limit:
                        raise SlotStateError(
                            f"the reply announces {n} bytes; {len(tokens)} tokens of layers {ranges} take at most {limit}"
                        )
                    buf = slot_state.BUFFERS.take(n) if n else None
                    try:
                        return slot_state.read_all(buf, reader.read_into) if n else []
                    except BaseException:
                        slot_state.BUFFERS.discard(buf)  # nothing stays reserved for a failed exchange
                        raise

                reply = self._exchange(sock, reader, Op.PREFILL, request.encode(), states)
                meta = PrefillReply.from_json(reply.meta)
        except (FrameTimeout, socket.timeout):
            raise PdFallback(
                "deadline", f"prefill worker {self.addr} did not answer within {self.deadline_s:g} s"
            ) from None
        except SlotStateError as e:  # a bad header or chunk: the rest is not read (the connection closes)
            raise PdFallback("refused", f"prefill worker {self.addr}'s state: {e}") from None
        except (FrameError, OSError, KeyError, ValueError) as e:  # a reply not of PrefillReply's layout too
            raise PdFallback("transfer", f"prefill worker {self.addr} failed mid-transfer: {e}") from None
        return meta, reply.payload

    def _login(self, sock, reader: SocketReader) -> None:
        def exchange(payload: bytes) -> tuple[bool, dict]:
            sock.sendall(pack_control_request(Op.AUTH, payload))
            reply = read_control_response(reader, AUTH_REPLY_MAX)
            return reply.status == Status.OK, reply.meta if isinstance(reply.meta, dict) else {}

        try:
            control_login(self.auth_token, ("prefill",), exchange)
        except AuthError as e:
            raise PdFallback("refused", f"prefill worker {self.addr} failed to authenticate: {e}") from None

    def _exchange(self, sock, reader: SocketReader, op: int, payload: bytes, read_payload=None):
        sock.sendall(pack_control_request(op, payload))
        reply = read_control_response(reader, STATE_PUT_CAP, read_payload)
        if reply.status != Status.OK:
            raise PdFallback("refused", f"prefill worker {self.addr}: {reply.meta.get('error', reply.status)}")
        return reply


class PdStats:
    """Counters both roles report: transfers and fallbacks (decode head), prefills served."""

    def __init__(self, prefill_worker: str | None = None, threshold: int = 0):
        self.prefill_worker, self.threshold = prefill_worker, threshold
        self.lock = threading.Lock()
        self.transfers = self.bytes = self.served = self.served_bytes = 0
        self.seconds = 0.0
        self.fallbacks: Counter[str] = Counter()
        self.recent: deque[Transfer] = deque(maxlen=RECENT)

    def record(self, t: Transfer) -> None:
        with self.lock:
            self.recent.append(t)
            if t.fallback:
                self.fallbacks[t.fallback] += 1
            else:  # moving time: the prefill worker's compute is not the transfer's
                self.transfers += 1
                self.bytes += t.bytes
                self.seconds += (t.ms - (t.prefill_ms or 0.0)) / 1e3

    def served_one(self, n_bytes: int) -> None:
        with self.lock:
            self.served += 1
            self.served_bytes += n_bytes

    def status(self) -> dict:
        with self.lock:
            return {
                "pd": Disaggregation(
                    self.prefill_worker,
                    self.threshold,
                    self.transfers,
                    self.bytes,
                    round(self.seconds, 6),
                    sum(self.fallbacks.values()),
                    dict(self.fallbacks),
                    self.served,
                    self.served_bytes,
                    list(self.recent),
                )
            }

    def collect(self):
        with self.lock:
            yield CounterMetricFamily(
                "hydra_pd_transfers", "Prompt states fetched from the prefill worker and placed.", value=self.transfers
            )
            yield CounterMetricFamily("hydra_pd_transfer_bytes", "Bytes of prompt state fetched.", value=self.bytes)
            yield CounterMetricFamily(
                "hydra_pd_transfer_seconds",
                "Time moving prompt states: fetch + placement, less the prefill worker's compute.",
                value=self.seconds,
            )
            fb = CounterMetricFamily(
                "hydra_pd_fallbacks", "Prompts prefilled locally after all, by reason.", labels=["reason"]
            )
            for reason in ("down", "deadline", "transfer", "refused"):
                fb.add_metric([reason], self.fallbacks[reason])
            yield fb
            yield CounterMetricFamily(
                "hydra_pd_prefills_served", "PREFILL requests this worker answered.", value=self.served
            )
            yield CounterMetricFamily(
                "hydra_pd_served_bytes", "Bytes of prompt state this worker sent.", value=self.served_bytes
            )


class Disaggregator:
    """The decode head's side: which prompts go to the prefill worker, and fetching their state."""

    def __init__(
        self,
        client: PrefillClient,
        threshold: int,
        pipeline,
        stats: PdStats,
        *,
        cuda_ipc: bool = True,
        shm: bool = True,
    ):
        self.client, self.threshold, self.pipeline, self.stats = client, threshold, pipeline, stats
        device = pipeline.local.device
        # A prefill worker on our GPU hands the states over in device memory (HYDRA_CUDA_IPC=0: bytes).
        self.ipc = gpu_uuid(device) if cuda_ipc and device.type == "cuda" else None
        # One on our host writes them into our memory (HYDRA_SHM=0: bytes on the socket).
        self.segments = Segments(keep=IN_FLIGHT) if shm else None
        self._per_token = 0.0  # state bytes per prompt token, the most seen: sizes the segments
        g = pipeline.local.g
        self.tensors = model_tensors(g.metadata, g.tensors)  # bounds what a reply may announce
        self._pool = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="hydra-pd")

    def wants(self, seq) -> bool:
        """A prompt with at least `threshold` tokens to compute (beyond the slot's cached prefix;
        the last one runs here: its logits pick the first token). Scored prompts need every row."""
        return seq.req.prompt_logprobs is None and seq.n_prompt - 1 - seq.n_past >= self.threshold

    def start(self, seq, place, done) -> None:
        """Fetch `seq`'s prompt state in the background; `place(payload, tokens)` puts it in the
        slot (raises to refuse), `done(transfer)` always follows."""
        self._pool.submit(self._run, seq, place, done)

    def _run(self, seq, place, done) -> None:
        tokens = seq.tokens[: seq.n_prompt - 1]
        t0 = time.perf_counter()
        n_bytes, prefill_ms, collect_ms, place_ms, fallback, error = 0, None, None, None, None, None
        transport = "socket"
        try:
            with self._segment(len(tokens)) as shm:  # placed from it: reused only once the placement is done
                limit = self.tensors.slot_state_bound(self.pipeline.ranges, len(tokens))
                meta, payload = self.client.prefill(
                    tokens, self.pipeline.ranges, self.pipeline.local.g.fingerprint, limit, self.ipc, shm
                )
                prefill_ms, collect_ms = meta.prefill_ms, meta.collect_ms
                t_place = time.perf_counter()
                try:
                    if meta.ipc is not None:  # on our GPU: the states stay in the worker's device memory
                        transport, payload = "cuda-ipc", open_states(meta.ipc, self.pipeline.local.device)
                        n_bytes = sum(header.body_bytes for header, _ in payload)
                    else:
                        if meta.shm:  # written into our segment: read there, every chunk checked
                            transport = "shm"
                            if shm is None or payload:
                                raise SlotStateError(
                                    "states answered in shared memory that was not offered, or in both places"
                                )
                            payload = slot_state.read_all(shm.states(meta.sizes))
                        n_bytes = sum(raw.nbytes for *_, raw in payload)
                        self._learn(shm, transport, n_bytes, len(tokens))
                    place(payload, tokens)
                    place_ms = round((time.perf_counter() - t_place) * 1e3, 3)
                except Exception as e:  # a state this head will not take: the slot is as it was
                    raise PdFallback("refused", str(e)) from None
        except PdFallback as e:
            fallback, error = e.reason, str(e)
            log.warning("request %d prefills here: %s", seq.req.id, e)
        except Exception as e:  # a bug must not lose the request: it prefills here
            log.exception("prompt state transfer failed")
            fallback, error = "transfer", f"{type(e).__name__}: {e}"
        transfer = Transfer(
            seq.req.id,
            len(tokens),
            n_bytes,
            round((time.perf_counter() - t0) * 1e3, 3),
            prefill_ms,
            fallback,
            error,
            collect_ms,
            place_ms,
            transport,
        )
        self.stats.record(transfer)
        done(transfer)

    def _segment(self, n_tokens: int):
        """A shared segment for this exchange, sized from the states seen so far (none yet: the
        first one comes over the socket), or a null context."""
        segments = self.segments
        if segments is None or not self._per_token:
            return contextlib.nullcontext()
        return segments.lease(int(self._per_token * n_tokens) + ID_BYTES * n_tokens)

    def _learn(self, shm: Segment | None, transport: str, n_bytes: int, n_tokens: int) -> None:
        self._per_token = max(self._per_token, n_bytes / n_tokens)
        segments = self.segments
        if shm is not None and transport == "socket" and n_bytes <= shm.capacity and segments is not None:
            # Offered with room and not taken: the worker cannot open it (another host or mount namespace, a split worker).
            log.info(
                "prefill worker %s does not share memory with this head: states come over the socket", self.client.addr
            )
            self.segments = None
            segments.close()

    def stop(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.segments is not None:
            self.segments.close()


def serve_prefill(
    engine, pipeline, request: PrefillRequest, stats: PdStats, attached: Attached
) -> tuple[PrefillReply, list]:
    """PREFILL on a prefill worker: run `tokens` through this worker's engine (its prompt cache
    helps), then answer one slot state per range asked for, regrouped from this worker's own
    stages. The slot is held (engine lock) from the moment the prompt is done until its state is
    copied out. `attached`: this worker's mappings of its heads' shared memory."""
    tokens, fingerprint = request.tokens, request.fingerprint
    ranges = [(a, b) for a, b in request.ranges]
    ours = pipeline.local.g.fingerprint
    if fingerprint != ours:
        raise ControlError(f"PREFILL for model {fingerprint}, this worker serves {ours}", Status.BAD_REQUEST)
    if not tokens:
        raise ControlError("PREFILL of no tokens", Status.BAD_REQUEST)
    t0 = time.perf_counter()
    try:
        events = list(engine.generate(Request(tokens, max_tokens=0), timeout=None))
    except Exception as e:  # bad token ids, too long, overloaded: the decode head prefills itself
        raise ControlError(f"PREFILL refused: {e}", Status.BAD_REQUEST) from None
    if events and events[-1].error is not None:
        raise ControlError(f"PREFILL failed: {events[-1].error}")
    t1 = time.perf_counter()
    device = pipeline.local.device
    # A head on this GPU takes the states in device memory (CUDA IPC handles in the meta, no payload).
    by_ipc = request.ipc is not None and device.type == "cuda" and request.ipc == gpu_uuid(device)
    by_ipc = by_ipc and not pipeline.remotes
    # A head on this host offers its memory: the states are packed straight into it (no bytes on the socket).
    window = attached.window(request.shm) if request.shm is not None and not by_ipc and not pipeline.remotes else None
    if by_ipc:
        collect = lambda slot, toks: pipeline.device_states(slot, toks, ranges)  # noqa: E731
    elif not pipeline.remotes:  # one copy per range asked for, whatever the asker's split
        collect = lambda slot, toks: pipeline.pack_states(slot, toks, ranges, window)  # noqa: E731
    else:
        collect = pipeline.collect_state
    try:
        states = engine.held_state(tokens, collect)
        if states is None:
            raise ControlError("the prefilled slot was taken before its state was copied out: retry", Status.BUSY)
        if by_ipc:
            parts, sizes, extra = [], [header.body_bytes for header, _ in states], {"ipc": export_states(states)}
        else:  # a split worker's states go as they are when the asker's split is ours, else regrouped
            same = not pipeline.remotes or ranges == [tuple(r) for r in pipeline.ranges]
            parts = states if same else slot_state.regroup(slot_state.read_all(b"".join(states)), ranges)
            sizes, extra = [memoryview(p).nbytes for p in parts], {}
            if window is not None and sum(sizes) <= len(window):  # they were packed into the head's memory
                parts, extra = [], {"shm": True}
    except SlotStateError as e:
        raise ControlError(str(e), Status.BAD_REQUEST) from None
    stats.served_one(sum(sizes))
    meta = PrefillReply(
        n_tokens=len(tokens),
        sizes=sizes,
        prefill_ms=round((t1 - t0) * 1e3, 3),
        collect_ms=round((time.perf_counter() - t1) * 1e3, 3),
        **extra,
    )
    return meta, list(parts)
