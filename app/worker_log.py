"""A worker's own log file: the worker writes it, every console reads it.

The supervisor opens the file (append) and hands the descriptor to the worker as its stdout and
stderr, so the worker's lines land in the file from its first one, whichever console started it and
whether or not any console still runs. A console follows the file (`LogFile.read_new`), the one that
started or adopted the worker also bounds it: past `max_bytes` it copies the file to `.1` (older
copies shift up to `.{backups}`) and truncates it in place. The worker's descriptor is O_APPEND, so
its next write lands at the new end; a reader that finds the file shorter than its offset starts
again from the top. Lines written between the copy and the truncation are lost (a few at most).
"""

from __future__ import annotations

import os
from pathlib import Path

LINE_LIMIT = 1 << 20  # a longer line is cut here (a runaway write must not hold the console's memory)
READ_CHUNK = 1 << 20  # bytes read per call: a flood is shown over several polls, not in one stall


class LogFile:
    def __init__(self, path: Path, max_bytes: int, backups: int):
        self.path, self.max_bytes, self.backups = path, max_bytes, backups
        self._offset: int | None = None  # where the next read starts; None: not following yet
        self._partial = b""  # the last line read, while it has no newline yet

    def open_for_worker(self) -> int:
        """A descriptor the worker writes (stdout and stderr); the caller closes its copy after the spawn."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def append(self, text: str) -> None:
        """A line of the console's own (a start, an adoption) among the worker's lines."""
        fd = self.open_for_worker()
        try:
            os.write(fd, text.encode("utf-8", "replace") + b"\n")
        finally:
            os.close(fd)

    def follow_from_end(self) -> None:
        """Follow what is written from now on (a worker this console starts)."""
        if self._offset is None:
            self._offset = self._size()

    def follow_from_tail(self, lines: int) -> None:
        """Follow from about the last `lines` lines (a worker this console adopts or watches)."""
        if self._offset is not None:
            return
        size = self._size()
        start = max(0, size - lines * 200)
        self._offset = start
        if start:  # skip the line the guess cut in half
            try:
                with open(self.path, "rb") as f:
                    f.seek(start)
                    self._offset = start + len(f.readline())
            except OSError:
                self._offset = size

    def read_new(self) -> list[str]:
        """Complete lines written since the last call (none when the file is missing)."""
        if self._offset is None:
            return []
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < self._offset:  # rotated (truncated) since the last read
                    self._offset, self._partial = 0, b""
                f.seek(self._offset)
                data = f.read(READ_CHUNK)
        except OSError:
            return []
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        if len(self._partial) > LINE_LIMIT:
            lines.append(self._partial[:LINE_LIMIT] + b" [cut]")
            self._partial = b""
        return [ln.decode("utf-8", "replace").rstrip("\r") for ln in lines]

    def rotate_if_full(self) -> bool:
        """Copy-truncate once the file passes max_bytes (after `read_new` caught up with it)."""
        if self._size() <= self.max_bytes:
            return False
        for i in range(self.backups, 1, -1):
            older = self.path.with_name(f"{self.path.name}.{i - 1}")
            if older.exists():
                os.replace(older, self.path.with_name(f"{self.path.name}.{i}"))
        with open(self.path, "rb") as src, open(self.path.with_name(f"{self.path.name}.1"), "wb") as dst:
            while chunk := src.read(READ_CHUNK):
                dst.write(chunk)
        os.truncate(self.path, 0)
        self._offset, self._partial = 0, b""
        return True

    def _size(self) -> int:
        try:
            return self.path.stat().st_size
        except OSError:
            return 0
