"""The files of llama-server's `/slots/{id}?action=save|restore` under `--slot-save-path`, kept safe:

- a name is one plain file name of at most NAME_MAX bytes: no separator, NUL or leading dot (400);
- save writes a new file (mode 0600, `O_EXCL | O_NOFOLLOW`, a random dot-name no request can
  address) and renames it over the name only once the state is whole and on disk: a save that
  fails leaves the old file as it was, and a restore beside it reads the old file or the new one,
  never half of one;
- a name that is a symbolic link, a directory or anything but a regular file is refused (400) by
  both, and restore opens with `O_NOFOLLOW`: a link planted in the folder is never followed;
- restore reads the states of one pipeline, back to back, each layer once from layer 0 up: bytes
  after the last state, or a state twice, are refused (400), the slot untouched.

The route checks the slot before it calls any of this: a refused request touches no file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path
from typing import Callable, TypeVar

from ...contracts.slot_state import SlotStateError
from .errors import APIError

NAME_MAX = 255  # bytes of one file name (Linux's NAME_MAX)
TMP_PREFIX = ".hydra-slot-"  # a save in progress: a dot-name, which no request may address

T = TypeVar("T")


def checked_name(name: str) -> str:
    """`name` if it is one plain file name, else 400 naming `filename`."""
    if not name or "\x00" in name or "/" in name or "\\" in name or name.startswith("."):
        raise APIError(400, f"filename {name!r} must be a plain file name", param="filename")
    if len(name.encode("utf-8", "surrogatepass")) > NAME_MAX:
        raise APIError(400, f"filename is longer than {NAME_MAX} bytes", param="filename")
    return name


def _refuse_unless_file(path: Path, name: str) -> None:
    """400 when `path` exists and is not a regular file (a symbolic link, a directory, ...)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        what = "a symbolic link" if stat.S_ISLNK(mode) else "a directory" if stat.S_ISDIR(mode) else "not a file"
        raise APIError(400, f"filename {name!r} is {what} in --slot-save-path", param="filename")


def save(folder: Path, name: str, write_state: Callable[[Callable[[bytes], object]], T]) -> T:
    """`write_state(write)`'s bytes into folder/name, atomically (a temporary file renamed over it
    once complete and synced); what `write_state` returns."""
    path = folder / checked_name(name)
    _refuse_unless_file(path, name)
    tmp = folder / f"{TMP_PREFIX}{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)  # whatever the umask
            result = write_state(f.write)
            f.flush()
            os.fsync(f.fileno())
        _refuse_unless_file(path, name)  # planted meanwhile: refused still (rename would replace, not follow, it)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return result


def read(folder: Path, name: str) -> bytes:
    """The bytes of folder/name: 404 when there is none, 400 when it is not a regular file."""
    path = folder / checked_name(name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise APIError(404, f"no saved slot named {name!r}", "not_found_error", "filename") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise APIError(400, f"filename {name!r} is a symbolic link in --slot-save-path", param="filename") from None
        raise APIError(400, f"filename {name!r} cannot be read: {e.strerror}", param="filename") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        _refuse_unless_file(path, name)
        raise APIError(400, f"filename {name!r} is not a file in --slot-save-path", param="filename")
    with os.fdopen(fd, "rb") as f:
        return f.read()


def check_states(states: list) -> list:
    """`slot_state.read_all`'s states of one file, refused unless they hold each layer once, from
    layer 0 up, in order (a state twice, or overlapping ranges, is not a pipeline's save)."""
    end = 0
    for header, _, _ in states:
        a, b = header.layers
        if a != end or b < a:
            raise SlotStateError(
                f"slot states of layers {[h.layers for h, _, _ in states]}: each layer once, from 0 up, in order"
            )
        end = b
    return states
