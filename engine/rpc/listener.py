"""The merged RPC port: one TCP listener, two protocols, and what a connection may cost.

One selector thread accepts every connection and runs its handshake without a thread of its
own: it reads the first byte (0x0E = compute, anything else = Hydra control; peer mode speaks
compute only), then each pre-auth frame whole (HELLO, AUTH, PING, at most PREAUTH_MAX_FRAME
bytes, within HEADER_DEADLINE_S) and hands it to the server's `preauth`. A silent or slow
socket so costs a file descriptor and a few hundred bytes until its deadline closes it, never a
thread, and no pre-auth frame allocates more than PREAUTH_MAX_FRAME.

After the handshake (HELLO, plus AUTH when a token is set):
- Peer mode: the selector waits for the first request's header. One that opens or joins the
  head's session (`opens_session`: CHECK, LOAD_STAGE, STATE_JOIN) gets its own thread, never
  queued (the fork found a pool throttled the hot peer path). Any other client (a probe, a stray
  client, a flood) holds a worker of the original's bounded pool for its life, waits in its FIFO
  queue, or is dropped (answered BUSY, closed, counted) when that is full.
- Head mode: the selector waits for each request's whole header, then a bounded pool
  (FIFO queue; a full queue drops the connection and counts it) serves that one request and
  hands the connection back. An idle or silent connection never holds a pool worker, so the
  console's INFO and CONFIGURE cannot be starved by open sockets.

Each request must arrive within `frame_deadline(size)` and each send of its reply must make
progress within `header_s`, so a client that trickles or never reads frees its thread.

Caps: MAX_CONNS open connections per port and MAX_CONNS_PER_IP per remote address (loopback
exempt); a connection over a cap is closed at accept.

Guessing costs time: each failed proof of the token is counted (`hydra_rpc_auth_failures_total`)
and slows its address's next connections down (auth_delay.py).
"""

from __future__ import annotations

import collections
import logging
import queue
import selectors
import socket
import threading
import time

from ...contracts.rpc import BACKLOG, COMPUTE_FIRST_BYTE, HEADER_DEADLINE_S, MAX_CONNS, MAX_CONNS_PER_IP
from ...contracts.status import Pool
from ..errors import UserError
from .auth_delay import AuthDelay
from .port_conn import Conn, Server
from .tcp import send_quietly, shutdown_quietly, tune_socket
from .wire import AuthFailed, FrameError, Refused, SocketReader

log = logging.getLogger("hydra.rpc")

LOOPBACK = frozenset({"127.0.0.1", "::1", "::ffff:127.0.0.1"})
SCAN_S = 0.25  # how often the selector closes connections past their deadline
DROP_DRAIN = 1 << 16  # bytes of a dropped request read (not waited for) before its connection closes


class RpcListener:
    def __init__(
        self,
        host: str,
        port: int,
        *,
        mode: str,
        compute: Server,
        control: Server | None = None,
        pool_size: int = 2,
        queue_max: int = 64,
        header_s: float = HEADER_DEADLINE_S,
        max_conns: int = MAX_CONNS,
        max_per_ip: int = MAX_CONNS_PER_IP,
        cap_exempt: frozenset[str] = LOOPBACK,
    ):
        if mode not in ("head", "peer"):
            raise ValueError(f"listener mode must be head or peer, not {mode!r}")
        if pool_size < 1 or queue_max < 0:
            raise UserError(f"--rpc-pool-size must be >= 1 and --rpc-queue >= 0 (got {pool_size}, {queue_max})")
        self.host, self.port, self.mode = host, port, mode
        self.compute, self.control = compute, control
        self.pool_size, self.queue_max = pool_size, queue_max
        self.header_s, self.max_conns, self.max_per_ip, self.cap_exempt = header_s, max_conns, max_per_ip, cap_exempt
        self._sock: socket.socket | None = None
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._returned: collections.deque[Conn] = collections.deque()  # served, back to the selector
        self._queue: queue.Queue = queue.Queue(maxsize=max(queue_max, 1))
        self._running = threading.Event()
        self._threads: list[threading.Thread] = []
        self._conns: set[Conn] = set()  # every open connection: handshaking, waiting or served
        self._per_ip: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._busy = self._dropped = self._accepted = self._auth_failures = 0
        self._auth_delay = AuthDelay()
        self._held: list[Conn] = []  # accepted from a failing address, not read yet

    # --- lifecycle --------------------------------------------------------------------------------

    def start(self) -> "RpcListener":
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as e:
            sock.close()
            raise UserError(f"cannot bind the RPC port {self.host}:{self.port}: {e.strerror}") from None
        sock.listen(BACKLOG)
        sock.setblocking(False)
        self._sock = sock
        self._sel.register(sock, selectors.EVENT_READ, None)
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._running.set()
        self._spawn(self._select_loop, "rpc-accept")
        for i in range(self.pool_size):
            self._spawn(self._pool_worker, f"rpc-pool-{i}")
        log.info("RPC %s listener on %s:%d", self.mode, self.host, self.bound_port)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        if not self._running.is_set():
            return
        self._running.clear()
        self._wake()
        for _ in range(self.pool_size):
            try:
                self._queue.put_nowait(None)  # wakes idle pool workers
            except queue.Full:
                break
        with self._lock:
            for c in list(self._conns):
                shutdown_quietly(c.sock)  # wakes session threads blocked in recv
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout)
        self._sock.close()

    def is_running(self) -> bool:
        return self._running.is_set()

    @property
    def bound_port(self) -> int:
        return self._sock.getsockname()[1] if self._sock is not None else self.port

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    def stats(self) -> Pool:
        conns = list(self._conns)
        if self.mode == "peer":  # the head's sessions, outside the pool
            compute = sum(1 for c in conns if c.own_thread)
        else:
            compute = sum(1 for c in conns if c.server is self.compute)
        counts = (self._dropped, self._accepted, len(conns), compute, self._auth_failures)
        return Pool(self.pool_size, self._busy, self._queue.qsize(), self.queue_max, *counts)

    # --- the selector thread: accept, handshakes, waiting for requests ----------------------------

    def _spawn(self, target, name: str, *args) -> threading.Thread:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        t.start()
        if name != "rpc-peer-conn":
            self._threads.append(t)
        return t

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass  # already full: the selector wakes anyway

    def _select_loop(self) -> None:
        next_scan = 0.0
        try:
            while self._running.is_set():
                for key, _ in self._sel.select(SCAN_S):
                    if key.fileobj is self._sock:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        self._take_returned()
                    else:
                        self._step(key.data)
                now = time.monotonic()
                if now >= next_scan:  # deadlines to SCAN_S: a scan per event would cost O(sockets) each
                    self._expire(now)
                    next_scan = now + SCAN_S
        finally:
            for key in list(self._sel.get_map().values()):
                if key.data is not None:
                    self._close(key.data)
            for c in self._held:
                self._close(c)
            self._sel.close()
            self._wake_r.close()
            self._wake_w.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self._sock.accept()
            except BlockingIOError:
                return
            except OSError as e:  # EMFILE and friends: leave the rest in the backlog for now
                log.warning("RPC accept failed: %s", e)
                time.sleep(0.05)
                return
            ip = addr[0]
            with self._lock:
                self._accepted += 1
                over = len(self._conns) >= self.max_conns or (
                    ip not in self.cap_exempt and self._per_ip[ip] >= self.max_per_ip
                )
                if over:
                    self._dropped += 1
            if over:
                sock.close()
                continue
            try:
                tune_socket(sock)
                sock.setblocking(False)
            except OSError:
                sock.close()  # reset before we could even configure it
                continue
            now = time.monotonic()
            c = Conn(sock, ip, now + self.header_s, held_until=self._auth_delay.hold_until(ip, now))
            with self._lock:
                self._conns.add(c)
                self._per_ip[ip] += 1
            if c.held_until > now:
                c.deadline = c.held_until + self.header_s
                self._held.append(c)
            else:
                self._sel.register(sock, selectors.EVENT_READ, c)

    def _release_held(self, now: float) -> None:
        due = [c for c in self._held if c.held_until <= now]
        if due:
            self._held = [c for c in self._held if c.held_until > now]
            for c in due:
                c.deadline = now + self.header_s
                self._sel.register(c.sock, selectors.EVENT_READ, c)

    def _step(self, c: Conn) -> None:
        """Read what `c` has towards its next step (never more than that step needs), then take it."""
        try:
            data = c.sock.recv(c.need - len(c.buf))
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close(c)
            return
        c.buf += data
        if len(c.buf) < c.need:
            return
        try:
            self._advance(c)
        except Refused as e:
            if e.reply:
                send_quietly(c.sock, e.reply)
            if isinstance(e, AuthFailed):
                self._auth_delay.failed(c.ip, e)
                with self._lock:
                    self._auth_failures += 1
            else:
                log.debug("RPC connection from %s refused: %s", c.ip, e)
            self._close(c)
        except (FrameError, OSError) as e:
            log.debug("RPC handshake with %s closed: %s", c.ip, e)
            self._close(c)

    def _advance(self, c: Conn) -> None:
        if c.server is None:  # the first byte picks the protocol
            compute = self.mode == "peer" or c.buf[0] == COMPUTE_FIRST_BYTE
            c.server = self.compute if compute else self.control
            c.session = c.server.open()
            c.need = c.server.header
            return
        if c.session["authed"]:  # a whole request header
            self._sel.unregister(c.sock)
            if self.mode == "peer" and c.server.opens_session(bytes(c.buf)):
                c.own_thread = True
                self._spawn(self._serve_session, "rpc-peer-conn", c)
            else:
                self._hand_to_pool(c)  # head mode: this one request; peer mode: the connection's life
            return
        if len(c.buf) == c.server.header:
            c.need = c.server.preauth_len(bytes(c.buf), c.session)
            if c.need > len(c.buf):
                return
        frame, c.buf = bytes(c.buf), bytearray()
        c.server.preauth(c.sock, frame, c.session)
        c.need, c.deadline = c.server.header, time.monotonic() + self.header_s
        if not c.session["authed"]:
            return
        self._auth_delay.forget(c.ip)
        c.deadline = time.monotonic() + c.server.idle_s

    def _expire(self, now: float) -> None:
        self._release_held(now)
        for key in list(self._sel.get_map().values()):
            c = key.data
            if c is not None and c.deadline <= now:
                log.debug("RPC connection from %s closed: deadline passed", c.ip)
                self._close(c)

    def _take_returned(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        while self._returned:
            c = self._returned.popleft()
            c.sock.setblocking(False)
            c.need, c.deadline = c.server.header, time.monotonic() + c.server.idle_s
            self._sel.register(c.sock, selectors.EVENT_READ, c)

    def _close(self, c: Conn) -> None:
        try:
            self._sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass  # not registered: served by a thread
        with self._lock:
            if c in self._conns:
                self._conns.discard(c)
                self._per_ip[c.ip] -= 1
                if not self._per_ip[c.ip]:
                    del self._per_ip[c.ip]
        shutdown_quietly(c.sock)
        c.sock.close()

    # --- serving authenticated connections --------------------------------------------------------

    def _hand_to_pool(self, c: Conn) -> None:
        if self.queue_max == 0 and self._busy >= self.pool_size:
            self._drop(c)
            return
        try:
            self._queue.put_nowait(c)
        except queue.Full:
            self._drop(c)

    def _drop(self, c: Conn) -> None:
        """The pool and its queue are full: the request's answer says so, then the connection closes."""
        with self._lock:
            self._dropped += 1
        why = f"busy: this port's RPC pool is full ({self.pool_size} workers, {self.queue_max} queued); try again later"
        send_quietly(c.sock, c.server.busy_reply(why))
        try:
            c.sock.recv(DROP_DRAIN)  # what has arrived of the request: closed unread, it would reset the reply
        except OSError:
            pass
        self._close(c)

    def _pool_worker(self) -> None:
        while self._running.is_set():
            c = self._queue.get()
            if c is None:
                return
            with self._lock:
                self._busy += 1
            try:
                if self.mode == "peer":  # the connection holds this worker for its life, as the original's
                    self._serve_session(c)
                    continue
                keep = self._serve(c, SocketReader(c.sock, prefix=bytes(c.buf), send_timeout=self.header_s))
            finally:
                with self._lock:
                    self._busy -= 1
            if keep and self._running.is_set():
                c.buf = bytearray()
                self._returned.append(c)
                self._wake()
            else:
                self._close(c)

    def _serve_session(self, c: Conn) -> None:
        """Peer mode: the connection's requests, the first one's header already read, until it
        closes or idles past the server's idle time."""
        reader = SocketReader(c.sock, prefix=bytes(c.buf), send_timeout=self.header_s)
        try:
            while self._running.is_set():
                reader.expect(c.server.idle_s)
                if not self._serve(c, reader):
                    break
        finally:
            self._close(c)

    def _serve(self, c: Conn, reader: SocketReader) -> bool:
        """One request; False closes the connection."""
        c.sock.settimeout(self.header_s)  # bounds sends when the request was read from the prefix
        try:
            return c.server.serve(c.sock, reader, c.session)
        except (FrameError, OSError) as e:  # timeout, truncated frame, reset: close this one only
            log.debug("RPC connection from %s closed: %s", c.ip, e)
        except Exception:  # one broken connection never takes the listener down
            log.exception("RPC connection handler failed")
        return False
