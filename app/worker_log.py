"""A worker's own log file: its log writer writes it, every console reads it.

The supervisor starts each worker with the write end of a pipe as its stdout and stderr, the read
end held only by the worker's log writer (`log_writer.py`, a process of its own session), so the
worker's lines land in the file from its first one, whichever console started it and whether or
not any console still runs, and the writer keeps the file bounded (renamed to `.1` at a line end,
older copies shifting up). A console follows the file (`LogFile.read_new`): when the name points
to a new file, it finishes the one it was reading (now `.1`) before it starts on the new one.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import BinaryIO

LINE_LIMIT = 1 << 20  # a longer line is cut here (a runaway write must not hold the console's memory)
READ_CHUNK = 1 << 20  # bytes read per call: a flood is shown over several polls, not in one stall
TAIL_LINE_GUESS = 200  # bytes per line assumed when starting from the last N lines
SNAPSHOT_TRIES = 20  # attempts at opening the rotated copies while no name moves


class LogFile:
    def __init__(self, path: Path, max_bytes: int, backups: int):
        self.path, self.max_bytes, self.backups = path, max_bytes, backups
        self._offset: int | None = None  # where the next read starts; None: not following yet
        self._ino: int | None = None  # the file being read (a rotation gives the name a new one)
        self._partial = b""  # the last line read, while it has no newline yet
        # .1's inode when last looked: a rotation changes it, even when the new file got the inode
        # number of the one it replaced (deleted past the kept copies, then reused)
        self._copy1: int | None = None

    def writer_argv(self) -> list[str]:
        """The log writer of a worker that writes this file."""
        module = f"{__package__}.log_writer"
        return [sys.executable, "-m", module, str(self.path), str(self.max_bytes), str(self.backups)]

    def append(self, text: str) -> None:
        """A line of the console's own (a start, an adoption) among the worker's lines."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, text.encode("utf-8", "replace") + b"\n")
        finally:
            os.close(fd)

    def follow_from_end(self) -> None:
        """Follow what is written from now on (a worker this console starts)."""
        if self._offset is None:
            st = self._stat()
            self._offset, self._ino = (st.st_size, st.st_ino) if st else (0, None)
            self._copy1 = _inode(self._copy(1))

    def follow_from_tail(self, lines: int) -> None:
        """Follow from about the last `lines` lines (a worker this console adopts or watches)."""
        if self._offset is not None:
            return
        st, self._copy1 = self._stat(), _inode(self._copy(1))
        if st is None:
            self._offset = 0
            return
        start = max(0, st.st_size - lines * TAIL_LINE_GUESS)
        self._offset, self._ino = start, st.st_ino
        if start:  # skip the line the guess cut in half
            try:
                with open(self.path, "rb") as f:
                    f.seek(start)
                    self._offset = start + len(f.readline())
            except OSError:
                self._offset = st.st_size

    def read_new(self) -> list[str]:
        """Complete lines written since the last call (none when the file is missing)."""
        if self._offset is None:
            return []
        st, copy1 = self._stat(), _inode(self._copy(1))
        lines: list[str] = []
        if self._ino is not None and (st is None or st.st_ino != self._ino or copy1 != self._copy1):
            # Rotated: finish the file we were reading (.1 now, or older after a flood), then the newer
            # copies and the file now current.
            files, self._copy1 = self._since_rotation()
            for i, f in enumerate(files):
                with f:
                    lines += self._read_open(f, READ_CHUNK if i == len(files) - 1 else None)
                if i < len(files) - 1:
                    self._offset, self._ino = 0, None
            return lines
        self._copy1 = copy1
        f = _open(self.path)
        if f is not None:
            with f:
                lines += self._read_open(f, READ_CHUNK)
        return lines

    def _since_rotation(self) -> tuple[list[BinaryIO], int | None]:
        """The copies from the one we were reading (by inode) to .1 and the current file, oldest first,
        open, and .1's inode; every kept copy when a flood rotated that one away (its unread lines
        are lost; the new file may then carry its inode number: only the copies are searched). They are
        opened together and kept only when no name moved meanwhile: a flood renames copies between a
        look and a read, and a copy read by name after that is another file (lines were skipped so)."""
        names = [self._copy(i) for i in range(self.backups, 0, -1)] + [self.path]
        for _ in range(SNAPSHOT_TRIES):
            before = [_inode(n) for n in names]
            files = [_open(n) for n in names]
            held = [None if f is None else os.fstat(f.fileno()).st_ino for f in files]
            if before == held == [_inode(n) for n in names]:
                break
            for f in files:
                if f is not None:
                    f.close()
            files, held = [None] * len(names), [None] * len(names)
        copies = held[:-1]
        if self._ino in copies:
            k = copies.index(self._ino)
        else:
            k, self._offset, self._ino, self._partial = 0, 0, None, b""
        for f in files[:k]:
            if f is not None:
                f.close()
        return [f for f in files[k:] if f is not None], held[-2]

    def _copy(self, i: int) -> Path:
        return self.path.with_name(f"{self.path.name}.{i}")

    def _read_open(self, f: BinaryIO, limit: int | None) -> list[str]:
        st = os.fstat(f.fileno())
        if self._ino is not None and st.st_ino != self._ino:
            return []
        if st.st_size < self._offset:  # emptied in place: start again from the top
            self._offset, self._partial = 0, b""
        self._ino = st.st_ino
        f.seek(self._offset)
        data = f.read(-1 if limit is None else limit)
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        if len(self._partial) > LINE_LIMIT:
            lines.append(self._partial[:LINE_LIMIT] + b" [cut]")
            self._partial = b""
        return [ln.decode("utf-8", "replace").rstrip("\r") for ln in lines]

    def _stat(self) -> os.stat_result | None:
        try:
            return self.path.stat()
        except OSError:
            return None


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except OSError:
        return None


def _open(path: Path) -> BinaryIO | None:
    try:
        return open(path, "rb")
    except OSError:
        return None
