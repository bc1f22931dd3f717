"""A worker's log writer: `python -m hydra_console.app.log_writer PATH MAX_BYTES BACKUPS`.

The supervisor starts one beside each worker, in a session of its own, and hands the worker the
write end of a pipe whose read end only this process holds: the worker's stdout and stderr reach
its log file whether or not any console still runs, and the file stays bounded. Past MAX_BYTES,
at the end of a line, PATH becomes PATH.1 (older copies shift up to PATH.BACKUPS) and a new PATH
starts, so no line spans two files and none is lost. It exits when every writer has closed the
pipe (the worker and whatever it spawned have exited). No hydra import: it starts in milliseconds.
"""

from __future__ import annotations

import os
import sys

CHUNK = 1 << 16


class Rotating:
    def __init__(self, path: str, max_bytes: int, backups: int):
        self.path, self.max_bytes, self.backups = path, max_bytes, backups
        self.fd = self._open()
        self.mid_line = False  # the file ends inside a line: no rotation before its newline

    def _open(self) -> int | None:
        try:
            return os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        except OSError:
            return None  # the worker's output is dropped, never blocked: it must not die of EPIPE

    def write(self, data: bytes) -> None:
        if self.fd is None:
            self.fd = self._open()
        if self.fd is None:
            return
        try:
            # A file is filled with the whole lines that fit before the next one starts: rotating as soon
            # as a read chunk would overflow wasted a kept copy on a near-empty file under a flood.
            while data and self.fd is not None:
                size = os.fstat(self.fd).st_size
                if size + len(data) <= self.max_bytes:
                    self._put(data)
                    return
                cut = data.rfind(b"\n", 0, max(0, self.max_bytes - size)) + 1  # the whole lines that fit
                if not cut and size and not self.mid_line:
                    self._rotate()
                    continue
                if not cut:  # finish the line begun here (or one longer than a file) in this file
                    cut = data.find(b"\n") + 1 or len(data)
                self._put(data[:cut])
                data = data[cut:]
                if data:
                    self._rotate()
        except OSError:
            pass  # a full disk drops lines; the next write tries again

    def _put(self, data: bytes) -> None:
        os.write(self.fd, data)
        self.mid_line = not data.endswith(b"\n")

    def _rotate(self) -> None:
        for i in range(self.backups, 1, -1):
            older = f"{self.path}.{i - 1}"
            if os.path.exists(older):
                os.replace(older, f"{self.path}.{i}")
        os.replace(self.path, f"{self.path}.1")
        os.close(self.fd)
        self.fd = self._open()


def main(argv: list[str]) -> int:
    path, max_bytes, backups = argv[0], int(argv[1]), int(argv[2])
    out = Rotating(path, max_bytes, backups)
    while data := os.read(0, CHUNK):
        out.write(data)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
