"""The workers' log writer (app/log_writer.py), fed as its main loop feeds it: pipe-sized reads."""

from __future__ import annotations

from hydra_console.app.log_writer import CHUNK, Rotating


def feed(out: Rotating, data: bytes) -> None:
    for i in range(0, len(data), CHUNK):
        out.write(data[i : i + CHUNK])


def kept(path, backups: int) -> list[bytes]:
    names = [f"{path}.{i}" for i in range(backups, 0, -1)] + [str(path)]
    return [open(n, "rb").read() for n in names]


def test_a_flood_fills_each_file_before_rotating_so_the_kept_copies_hold_it_all(tmp_path):
    path, limit = tmp_path / "w.log", 1 << 16
    out = Rotating(str(path), limit, 3)
    lines = [b"ready\n"] + [f"line {i:04d} ".encode() + b"x" * 90 + b"\n" for i in range(2000)]
    out.write(lines[0])  # the worker's first line, read alone; then the flood, a pipe's worth a read
    feed(out, b"".join(lines[1:]))
    files = kept(path, 3)
    assert b"".join(files) == b"".join(lines)  # nothing lost, in order
    # bounded (a line begun in a file ends there), no line split
    assert all(len(f) <= limit + len(lines[-1]) and f.endswith(b"\n") for f in files)
    assert all(len(f) > limit - 200 for f in files[:-1])  # each copy full before the next began


def test_a_line_longer_than_a_file_stays_whole_and_the_next_starts_a_new_file(tmp_path):
    path = tmp_path / "w.log"
    out = Rotating(str(path), 100, 2)
    out.write(b"short\n")
    out.write(b"y" * 150)  # no newline yet: the line goes on in this file
    out.write(b"y" * 50 + b"\nnext\n")
    assert kept(path, 2) == [b"short\n", b"y" * 200 + b"\n", b"next\n"]
