"""The RPC token that workers a console starts prove on their ports.

`token` (the console passes HYDRA_TOKEN from its environment, so workers started elsewhere share it),
else a random one kept per profile (`profile_token`). Local workers get it in their environment;
remote ones in a 0600 file (`REMOTE_TOKEN_FILE`, written through the launcher with the token on
stdin: `token_file_command`), never in argv, where `ps` on either host would show it.
"""

from __future__ import annotations

import os
import secrets
import shlex
from pathlib import Path

REMOTE_TOKEN_FILE = ".hydra/token-{name}"  # relative: ssh starts the remote command in the login directory


def profile_token(path: Path) -> str:
    """The RPC token of a profile's workers, kept 0600 beside its state file: the next console of
    the profile (attached, or adopting workers a killed console left) proves the same one."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text().strip()
    except FileNotFoundError:  # no state directory yet
        path.parent.mkdir(parents=True, exist_ok=True)
        return profile_token(path)
    token = secrets.token_hex(32)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    return token


def token_file_command(name: str) -> str:
    """The remote shell command that writes its stdin to worker `name`'s 0600 token file."""
    path = REMOTE_TOKEN_FILE.format(name=name)
    return f"umask 077 && mkdir -p {shlex.quote(os.path.dirname(path))} && cat > {shlex.quote(path)}"
