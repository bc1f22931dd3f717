"""The merged RPC port: one TCP listener, two protocols.

Head mode: accepted connections go through a bounded pool (FIFO queue; a full queue drops the
newest connection and counts it, the accept loop never blocks), then a 1-byte MSG_PEEK picks
the protocol: 0x0E = compute, anything else = Hydra control. A connection holds its worker for
its whole life.
Peer mode: one thread per connection straight into the compute protocol: no pool, no peek
(the fork found both throttled the hot peer path).
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
from dataclasses import dataclass
from typing import Callable

from ...contracts.rpc import COMPUTE_FIRST_BYTE
from ...contracts.status import Pool
from ..errors import UserError

log = logging.getLogger("hydra.rpc")

BACKLOG = 16
KEEPALIVE = {"TCP_KEEPIDLE": 30, "TCP_KEEPINTVL": 10, "TCP_KEEPCNT": 3}
RECV_TIMEOUT_S = 120.0

Handler = Callable[[socket.socket], None]


def tune_socket(conn: socket.socket) -> None:
    """TCP_NODELAY (one small frame per decode step) and keepalive 30/10/3 (find dead peers)."""
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in KEEPALIVE.items():
        if hasattr(socket, name):
            conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class RpcListener:
    def __init__(
        self,
        host: str,
        port: int,
        *,
        mode: str,
        compute: Handler,
        control: Handler | None = None,
        pool_size: int = 2,
        queue_max: int = 64,
        recv_timeout: float = RECV_TIMEOUT_S,
    ):
        if mode not in ("head", "peer"):
            raise ValueError(f"listener mode must be head or peer, not {mode!r}")
        if mode == "head" and (pool_size < 1 or queue_max < 0):
            raise UserError(f"--rpc-pool-size must be >= 1 and --rpc-queue >= 0 (got {pool_size}, {queue_max})")
        self.host, self.port, self.mode = host, port, mode
        self.compute, self.control = compute, control
        self.pool_size, self.queue_max = pool_size, queue_max
        self.recv_timeout = recv_timeout
        self._sock: socket.socket | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=max(queue_max, 1))
        self._running = threading.Event()
        self._threads: list[threading.Thread] = []
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._busy = self._dropped = self._accepted = 0

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
        self._sock = sock
        self._running.set()
        self._spawn(self._accept_loop, "rpc-accept")
        if self.mode == "head":
            for i in range(self.pool_size):
                self._spawn(self._pool_worker, f"rpc-pool-{i}")
        log.info("RPC %s listener on %s:%d", self.mode, self.host, self.bound_port)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        if not self._running.is_set():
            return
        self._running.clear()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            for conn in list(self._open):
                _shutdown(conn)
        for _ in range(self.pool_size):
            try:
                self._queue.put_nowait(None)  # wakes idle pool workers
            except queue.Full:
                break
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout)

    def is_running(self) -> bool:
        return self._running.is_set()

    @property
    def bound_port(self) -> int:
        return self._sock.getsockname()[1] if self._sock is not None else self.port

    def stats(self) -> Pool:
        queued = self._queue.qsize() if self.mode == "head" else 0
        size = self.pool_size if self.mode == "head" else 0
        queue_max = self.queue_max if self.mode == "head" else 0
        return Pool(size, self._busy, queued, queue_max, self._dropped, self._accepted)

    # --- internals --------------------------------------------------------------------------------

    def _spawn(self, target, name: str, *args) -> threading.Thread:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        t.start()
        if self.mode == "head" or name == "rpc-accept":
            self._threads.append(t)
        return t

    def _accept_loop(self) -> None:
        while self._running.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                if self._running.is_set():
                    continue
                return
            try:
                tune_socket(conn)
            except OSError:
                conn.close()  # reset before we could even configure it
                continue
            with self._lock:
                self._accepted += 1
            if self.mode == "peer":
                self._spawn(self._serve, "rpc-peer-conn", conn, self.compute)
                continue
            if self.queue_max == 0 and self._busy >= self.pool_size:
                self._drop(conn)
                continue
            try:
                self._queue.put_nowait(conn)
            except queue.Full:
                self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        with self._lock:
            self._dropped += 1
        conn.close()

    def _pool_worker(self) -> None:
        while self._running.is_set():
            conn = self._queue.get()
            if conn is None:
                return
            with self._lock:
                self._busy += 1
            try:
                self._dispatch(conn)
            finally:
                with self._lock:
                    self._busy -= 1

    def _dispatch(self, conn: socket.socket) -> None:
        conn.settimeout(self.recv_timeout)
        try:
            first = conn.recv(1, socket.MSG_PEEK)
        except OSError:
            first = b""
        if not first:
            conn.close()  # a failed or empty peek closes the socket
            return
        handler = self.compute if first[0] == COMPUTE_FIRST_BYTE else self.control
        self._serve(conn, handler)

    def _serve(self, conn: socket.socket, handler: Handler) -> None:
        with self._lock:
            self._open.add(conn)
        try:
            handler(conn)
        except Exception:  # one broken connection never takes the listener down
            log.exception("RPC connection handler failed")
        finally:
            with self._lock:
                self._open.discard(conn)
            _shutdown(conn)
            conn.close()


def _shutdown(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
