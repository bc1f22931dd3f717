"""A split pipeline's lost peers: the pause of the forwards while a peer lost mid-forward comes
back (--peer-grace), the background watcher that re-attaches peers that went down (and pings the
others for RTT), and the wait for every peer at startup (--peer-wait).

A peer back after a loss has no KV for the running slots: `on_back(i)` tells the pipeline that
stages 0..i must be rebuilt by replay before its next forward.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from typing import Callable

from ..errors import UserError
from .peer_errors import PeerUnavailable

log = logging.getLogger("hydra.pipeline")

READY_POLL_S = 2.0
PAUSE_POLL_S = 0.2  # while streams are paused for a lost peer, try to re-attach it this often


class PeerRecovery:
    def __init__(self, remotes: list, lock: threading.RLock, on_back: Callable[[int], None]):
        self.remotes = remotes  # the pipeline's peers, in pipeline order (stage i + 1 is remotes[i])
        self._lock = lock  # the pipeline's: a re-attach never runs beside a forward
        self._on_back = on_back
        # A peer lost mid-forward (restarted, say) pauses the forwards for up to this many seconds
        # while it comes back; 0: they fail at once (--peer-grace).
        self.grace = 0.0
        self._resume_by: float | None = None  # monotonic deadline of the pause for the lost peers
        self._stopping = threading.Event()
        self._watch: threading.Thread | None = None

    def unavailable(self) -> str | None:
        """Why a forward would fail now (the peers not up), or None."""
        down = [
            f"peer {r.addr} {r.state}" + (f" ({r.error})" if r.error else "") for r in self.remotes if r.state != "up"
        ]
        left = self._resume_by - time.monotonic() if self._resume_by is not None and down else 0
        if left > 0:
            down.append(f"streams paused, waiting up to {left:.1f} s more for it (--peer-grace)")
        return "; ".join(down) or None

    def through_loss(self, work: Callable):
        """`work()`; a peer lost meanwhile pauses it (`_await_peers`), then it runs again (the
        caller holds the pipeline lock)."""
        while True:
            try:
                return work()
            except PeerUnavailable:
                if not self._await_peers():
                    raise

    def _await_peers(self) -> bool:
        """A forward lost a peer: re-attach every peer that is down, polling until `grace` after
        the loss (the running sequences wait, new ones queue); True when all are back (their KV is
        then rebuilt by replay before the batch runs again). Past the deadline it stays expired, so
        later forwards fail at once until the watcher re-attaches the peer."""
        down = [(i, r) for i, r in enumerate(self.remotes, 1) if r.state != "up"]
        if not down or self.grace <= 0 or self._stopping.is_set():
            return False
        if self._resume_by is None:
            self._resume_by = time.monotonic() + self.grace
            log.warning("peer(s) %s lost: pausing streams up to %g s (--peer-grace)", _addrs(down), self.grace)
        while True:
            for i, remote in down:
                with contextlib.suppress(PeerUnavailable, UserError):
                    remote.attach()
                    self._on_back(i)
                    log.warning("peer %s is back: re-attached, replaying the paused streams", remote.addr)
            down = [(i, r) for i, r in down if r.state != "up"]
            if not down:
                self._resume_by = None
                return True
            if time.monotonic() >= self._resume_by or self._stopping.wait(PAUSE_POLL_S):
                log.warning("peer(s) %s not back within --peer-grace: failing the paused streams", _addrs(down))
                return False

    def start_watch(self, interval_s: float = READY_POLL_S) -> None:
        """Background: re-attach peers that went down (then rebuild KV), ping the others for RTT."""
        self._watch = threading.Thread(target=self._watch_loop, args=(interval_s,), name="hydra-peers", daemon=True)
        self._watch.start()

    def interrupt(self) -> None:
        """The process is stopping: a forward paused for a lost peer fails now, the watcher ends."""
        self._stopping.set()

    def _watch_loop(self, interval_s: float) -> None:
        while not self._stopping.wait(interval_s):
            for remote in self.remotes:
                if remote.state == "up":
                    remote.ping()
                    continue
                try:  # cheap reachability first: never hold the pipeline while a host is gone
                    socket.create_connection((remote.host, remote.port), timeout=1.0).close()
                except OSError:
                    continue
                with self._lock:
                    if remote.state == "up":  # re-attached by a paused forward meanwhile
                        continue
                    try:
                        remote.attach()
                    except (PeerUnavailable, UserError) as e:
                        log.warning("peer %s not back yet: %s", remote.addr, e)
                        continue
                    log.warning("peer %s is back: re-attached, rebuilding KV", remote.addr)
                    self._on_back(self.remotes.index(remote) + 1)
                    if all(r.state == "up" for r in self.remotes):
                        self._resume_by = None  # the next loss gets a grace of its own


def _addrs(down: list) -> str:
    return ", ".join(r.addr for _, r in down)


def wait_for_peers(remotes: list, budget_s: float, poll_s: float = READY_POLL_S, ipc: bool = True) -> list:
    """Attach every peer, polling every `poll_s` for at most `budget_s`; returns those never up.
    `ipc`: map each one's CUDA IPC channel as it attaches (see `RemoteStage.attach`)."""
    deadline = time.monotonic() + budget_s
    pending = list(remotes)
    while pending:
        for remote in list(pending):
            try:
                remote.attach(ipc=ipc)
                pending.remove(remote)
            except PeerUnavailable as e:
                log.info("waiting for peer %s: %s", remote.addr, e)
        if not pending or time.monotonic() + poll_s > deadline:
            break
        time.sleep(poll_s)
    return pending


class PeersLoading:
    """`wait_for_peers` for each peer on a thread of its own, so that their LOAD_STAGEs (weights, then
    their graphs' compile and capture: as long as the head's own) run while the head loads and warms
    up its stage. Their CUDA IPC channels are mapped by `join`, on the caller's thread: mapping
    device memory beside the head's graph captures would invalidate them."""

    def __init__(self, remotes: list, budget_s: float):
        self.remotes = remotes
        self._missing: list = []
        self._errors: list[BaseException] = []
        self._threads = [
            threading.Thread(target=self._wait, args=(r, budget_s), name=f"hydra-attach-{r.addr}", daemon=True)
            for r in remotes
        ]
        for t in self._threads:
            t.start()

    def _wait(self, remote, budget_s: float) -> None:
        try:
            self._missing.extend(wait_for_peers([remote], budget_s, ipc=False))
        except BaseException as e:  # PeerMismatch: raised by `join`, on the loading thread
            self._errors.append(e)

    def check(self) -> None:
        """Raises what attaching a peer raised so far (another model, a refused LOAD_STAGE): the head
        stops there, not after its whole warm-up."""
        if self._errors:
            raise self._errors[0]

    def join(self) -> list:
        """Waits for every peer; returns those never up (as `wait_for_peers`), raises what attaching one raised."""
        for t in self._threads:
            t.join()
        self.check()
        for remote in self.remotes:
            if remote not in self._missing:
                remote.open_ipc()
        return [r for r in self.remotes if r in self._missing]
