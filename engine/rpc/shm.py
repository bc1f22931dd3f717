"""Shared memory between a decode head and a prefill worker on one host: PREFILL's slot states
are written straight into the head's memory instead of crossing a socket, whose two copies (into
the kernel, out of it) were half the CPU of a CPU transfer (docs/PERF.md, issue 17).

Head: `Segments` keeps one file under SHM_DIR per exchange in flight (contracts.rpc: mode 0600,
created exclusively, an unguessable name, its nonce in the first bytes), reused from one exchange
to the next, so its pages stay mapped in both processes (no page faults per transfer). A segment
whose exchange failed is dropped, not reused: the worker may still be writing into it. All are
unlinked at stop; those a killed head left are removed by the next one on this host.

Worker: `Attached` maps the file a PREFILL request offers, if it is this host's (the name exists
here, is a regular file of this user, of the offered size, and holds the offered nonce), and keeps
the mapping while the head keeps the file. Anything else: None, and the states go on the socket.

The name travels only in the PREFILL request, after AUTH when a token is set; the file's mode
keeps other users out (the names under SHM_DIR are listed for anyone, so the mode is what
guards). The head reads only inside its segment (the reply's sizes are checked against it) and
checks every chunk's crc32 before placing, as off a socket. A worker still mapping the file could
change it after that check: it then spoils the state of the prompt it was asked to compute,
which it could anyway.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import stat
import threading
from collections import OrderedDict

from ...contracts.rpc import SHM_DATA_OFFSET, SHM_DIR, SHM_NAME, STATE_PUT_CAP, ShmOffer
from ...contracts.slot_state import SlotStateError

log = logging.getLogger("hydra.shm")

NONCE_BYTES = 16
GRAIN = 16 << 20  # segments grow in steps of this: a slightly longer prompt needs no new one


class Segment:
    """One file under `directory`, mapped here: the nonce, then room for `capacity` bytes of states.
    Its pages are reserved at creation (posix_fallocate): a full tmpfs is refused here, instead of
    a SIGBUS in the worker that writes into it."""

    def __init__(self, capacity: int, directory: str = SHM_DIR):
        self.name = f"hydra-pd-{os.getpid()}-{secrets.token_hex(16)}"
        self.path = os.path.join(directory, self.name)
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        size = SHM_DATA_OFFSET + capacity
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
            self.map = mmap.mmap(fd, size)
        except OSError:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self.map[:NONCE_BYTES] = self.nonce

    @property
    def capacity(self) -> int:
        return len(self.map) - SHM_DATA_OFFSET

    @property
    def offer(self) -> dict:
        """The JSON of its `ShmOffer`."""
        return ShmOffer(name=self.name, size=len(self.map), nonce=self.nonce.hex()).to_json()

    def states(self, sizes) -> memoryview:
        """The bytes of states of these sizes, back to back (a PREFILL reply's `sizes`); a
        SlotStateError unless they lie inside this segment."""
        if (
            not isinstance(sizes, list)
            or not all(type(n) is int and n >= 0 for n in sizes)
            or sum(sizes) > self.capacity
        ):
            raise SlotStateError(f"slot states of {sizes!r} bytes do not fit the shared segment of {self.capacity}")
        return memoryview(self.map)[SHM_DATA_OFFSET : SHM_DATA_OFFSET + sum(sizes)]

    def close(self) -> None:
        """Unlink the file; the mapping goes once no view of it is left (now, if none)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        with contextlib.suppress(BufferError):
            self.map.close()


class Segments:
    """The head's segments: `lease` one per exchange (never two exchanges in one segment), at most
    `keep` kept free for reuse."""

    def __init__(self, directory: str = SHM_DIR, keep: int = 2):
        self.directory, self.keep = directory, keep
        self._free: list[Segment] = []
        self._live: set[Segment] = set()
        self._lock = threading.Lock()
        self._closed = False
        remove_stale(directory)

    @contextlib.contextmanager
    def lease(self, want: int):
        """A segment with room for `want` bytes for one exchange, or None when none can be made
        (no SHM_DIR, no room there). It goes back for reuse when the block ends normally; it is
        dropped when the block raises."""
        segment = self._take(want)
        try:
            yield segment
        except BaseException:
            if segment is not None:
                with self._lock:
                    self._drop(segment)
            raise
        if segment is not None:
            with self._lock:
                if self._closed or len(self._free) >= self.keep:
                    self._drop(segment)
                else:
                    self._free.append(segment)

    def _take(self, want: int) -> Segment | None:
        with self._lock:
            if self._closed:
                return None
            fits = [s for s in self._free if s.capacity >= want]
            if fits:
                segment = min(fits, key=lambda s: s.capacity)
                self._free.remove(segment)
                return segment
            if self._free:  # too small for states of this size: a larger one replaces it
                self._drop(self._free.pop(self._free.index(max(self._free, key=lambda s: s.capacity))))
        try:
            segment = Segment(-(-want // GRAIN) * GRAIN, self.directory)
        except OSError as e:
            log.info("no shared memory for prompt states (%s): they come over the socket", e)
            return None
        with self._lock:
            self._live.add(segment)
        return segment

    def _drop(self, segment: Segment) -> None:
        self._live.discard(segment)
        segment.close()

    def close(self) -> None:
        """Unlink every segment (those still leased are unmapped when given back)."""
        with self._lock:
            self._closed = True
            for segment in list(self._live):
                self._drop(segment)
            self._free.clear()


def remove_stale(directory: str) -> None:
    """Unlink the segments of heads on this host that are gone (killed before their stop)."""
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            m = SHM_NAME.fullmatch(entry.name)
            if m is None or entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            try:
                os.kill(int(m.group(1)), 0)
            except ProcessLookupError:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
            except OSError:  # alive, another user's process
                pass


class Attached:
    """The prefill worker's mappings of its heads' segments, by name, each kept while its file
    exists (at most `keep`): the pages are mapped once, not per transfer."""

    def __init__(self, directory: str = SHM_DIR, keep: int = 4):
        self.directory, self.keep = directory, keep
        self._maps: OrderedDict[str, tuple[int, mmap.mmap]] = OrderedDict()
        self._lock = threading.Lock()

    def window(self, offer: ShmOffer | dict) -> memoryview | None:
        """Where the states go in the segment `offer` names (a PREFILL request's `shm`), or None
        when this worker cannot use it: malformed, not on this host (no such file, or another
        nonce: another host's or mount namespace's), not this user's, not of the offered size."""
        try:
            offer = offer if isinstance(offer, ShmOffer) else ShmOffer.from_json(offer)
            name, size, nonce = offer.name, offer.size, bytes.fromhex(offer.nonce)
        except ValueError:  # WireError included
            return None
        if SHM_NAME.fullmatch(name) is None or not SHM_DATA_OFFSET < size <= SHM_DATA_OFFSET + STATE_PUT_CAP:
            return None
        with self._lock:
            self._forget_unlinked()
            mapped = self._maps.get(name) or self._open(name, size)
            if mapped is None:
                return None
            self._maps[name] = mapped
            self._maps.move_to_end(name)
            while len(self._maps) > self.keep:
                self._forget(next(iter(self._maps)))
            m = mapped[1]
            if len(m) != size or len(nonce) != NONCE_BYTES or m[:NONCE_BYTES] != nonce:
                self._forget(name)
                return None
            return memoryview(m)[SHM_DATA_OFFSET:]

    def _open(self, name: str, size: int) -> tuple[int, mmap.mmap] | None:
        try:
            fd = os.open(os.path.join(self.directory, name), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and st.st_nlink == 1 and st.st_size == size:
                return fd, mmap.mmap(fd, size)
        except OSError:
            pass
        os.close(fd)
        return None

    def _forget_unlinked(self) -> None:
        """Mappings of files their head removed go: they would keep its memory alive."""
        for name, (fd, _) in list(self._maps.items()):
            if os.fstat(fd).st_nlink == 0:
                self._forget(name)

    def _forget(self, name: str) -> None:
        fd, m = self._maps.pop(name)
        os.close(fd)
        with contextlib.suppress(BufferError):  # a transfer still writing: unmapped when it is done
            m.close()

    def close(self) -> None:
        with self._lock:
            for name in list(self._maps):
                self._forget(name)
