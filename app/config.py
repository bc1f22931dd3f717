"""Console profiles: which workers to run or attach to, where, with which model and split.

A profile is one TOML file, read with tomllib and validated by pydantic (a typo in a key is a
clear error, not a silently ignored setting) and written back atomically with tomli-w (temp
file in the same folder + fsync + rename), so a crash mid-save never leaves half a profile.

With no profile the console runs `default_profile()`: a head and one peer on this machine on
fixed, documented ports, so `hydra-console --once --json` beside a live console finds it:

    head   HTTP 127.0.0.1:8080   RPC 127.0.0.1:8081
    peer1  HTTP 127.0.0.1:8090   RPC 127.0.0.1:8091
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Literal

import tomli_w
import tomllib
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..contracts.errors import UserError
from ..contracts.fit import DEFAULT_HEADROOM_GIB
from ..contracts.footprint import CACHE_TYPES

HEAD_HTTP_PORT, HEAD_RPC_PORT = 8080, 8081
PEER_HTTP_PORT, PEER_RPC_PORT = 8090, 8091
# Remote workers run through this unless a worker names its own launcher. -tt gives the remote
# process a terminal, so it gets SIGHUP when the console ends the ssh session.
DEFAULT_SSH_TEMPLATE = "ssh -o BatchMode=yes -tt {host} {command}"
LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class WorkerSpec(_Strict):
    """One worker process: where it listens and how it is launched."""

    name: str
    host: str = "127.0.0.1"
    port: int = Field(ge=1, le=65535)
    rpc_port: int | None = Field(default=None, ge=1, le=65535)
    rpc_host: str | None = None  # bind of the RPC port; default: host (0.0.0.0 for remote peers)
    device: str = "auto"
    # ssh command template with {host} and {command}; "" = local subprocess (or DEFAULT_SSH_TEMPLATE for a remote host)
    launcher: str = ""
    attach: bool = False  # monitor only: the console neither starts nor stops it
    # GiB of the worker's card (a "16 GB" card is 16), for the split plan where the console cannot
    # read it: a remote peer, a worker not started yet on a machine without NVML. None: NVML or /status.
    card_gb: float | None = Field(default=None, gt=0)
    args: list[str] = []  # extra hydra-engine flags, appended verbatim

    @property
    def rpc(self) -> int:
        return self.rpc_port if self.rpc_port is not None else self.port + 1

    @property
    def is_local(self) -> bool:
        return self.host in LOCAL_HOSTS and not self.launcher

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


class SpeculativeSettings(_Strict):
    type: Literal["off", "ngram", "draft", "mtp"] = "off"
    draft_max: int = Field(default=3, ge=1, le=16)
    model_draft: str = ""
    adaptive: Literal["auto", "on", "off"] = "auto"  # the head's --draft-adaptive (auto: on for mtp)


class Alerts(_Strict):
    """Thresholds at which the dashboard marks a value as a warning."""

    vram_pct: float = Field(default=90.0, gt=0, le=100)
    rtt_ms: float = Field(default=50.0, gt=0)
    restarts: int = Field(default=3, ge=1)


class SupervisorSettings(_Strict):
    @model_validator(mode="before")
    @classmethod
    def _drop_crash_loop_s(cls, data):
        # Profiles saved before crash loops were counted by failures carry this key; it means nothing now.
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if k != "crash_loop_s"}
        return data

    poll_s: float = Field(default=1.0, gt=0)
    # SIGTERM to SIGKILL. A head this console starts drains for 5 s less (`launch.DRAIN_MARGIN_S`).
    grace_s: float = Field(default=40.0, ge=0)
    backoff_initial_s: float = Field(default=1.0, gt=0)
    backoff_max_s: float = Field(default=30.0, gt=0)
    healthy_reset_s: float = Field(default=60.0, gt=0)  # running this long resets the backoff
    # Exiting crash_loop_count times in a row without a healthy run (healthy_reset_s) makes a worker
    # `crash-loop`, however long each try took.
    crash_loop_count: int = Field(default=3, ge=1)
    log_dir: str = ""  # "" = $XDG_STATE_HOME/hydra-console/logs
    # Past this size a worker's log writer renames its log file to .1 (.2, … up to log_backups).
    log_max_bytes: int = Field(default=20 << 20, ge=1 << 16)
    log_backups: int = Field(default=3, ge=1)
    ring_lines: int = Field(default=5000, ge=100)


class Profile(_Strict):
    name: str = "default"
    model: str = ""  # "" = the embedded default model
    ctx: int = Field(default=4096, ge=16)
    parallel: int = Field(default=4, ge=1)
    split: list[int] | None = None  # layers per stage, head first; None = even
    # Every worker's --cache-type-k / --cache-type-v (a worker's own args may override them).
    cache_type_k: str = "auto"
    cache_type_v: str = "auto"
    # GiB every stage must leave free on its card (driver, desktop): the split plan's and the workers'
    # --headroom-gb (contracts/fit.py)
    headroom_gb: float = Field(default=DEFAULT_HEADROOM_GIB, ge=0)
    engine_command: str = ""  # "" = this Python's hydra_console.engine.cli locally, "hydra-engine" remotely
    head: WorkerSpec = WorkerSpec(name="head", port=HEAD_HTTP_PORT, rpc_port=HEAD_RPC_PORT)
    peers: list[WorkerSpec] = [WorkerSpec(name="peer1", port=PEER_HTTP_PORT, rpc_port=PEER_RPC_PORT)]
    speculative: SpeculativeSettings = SpeculativeSettings()
    # Which stage holds the output norm + head (and, drafting with `type = "mtp"`, the MTP block and
    # its KV): the head's, or the last peer's (the head's `--output-stage last`; a head alone holds it).
    output_stage: Literal["head", "last"] = "head"
    # A prefill worker (`hydra-engine serve --role prefill`) the head sends long prompts to:
    # its RPC HOST:PORT ("" = none, the head prefills itself), and the prompt length that goes there.
    prefill_worker: str = ""
    prefill_threshold: int = Field(default=256, ge=0)
    alerts: Alerts = Alerts()
    supervisor: SupervisorSettings = SupervisorSettings()
    keys: dict[str, str] = {}  # binding id -> keys, e.g. {"hydra.restart" = "ctrl+r"}

    @field_validator("split")
    @classmethod
    def _split_positive(cls, v):
        if v is not None and (not v or any(n < 1 for n in v)):
            raise ValueError("every stage needs at least one layer")
        return v

    @field_validator("cache_type_k", "cache_type_v")
    @classmethod
    def _cache_type(cls, v):
        if v not in CACHE_TYPES:
            raise ValueError(f"expected one of {', '.join(CACHE_TYPES)} (llama.cpp's cache types), got {v!r}")
        return v

    @field_validator("prefill_worker")
    @classmethod
    def _host_port(cls, v):
        host, sep, port = v.rpartition(":")
        if v and (not sep or not host or not port.isdigit() or not 0 < int(port) < 65536):
            raise ValueError(f"expected HOST:PORT (the prefill worker's RPC port), got {v!r}")
        return v

    @model_validator(mode="after")
    def _consistent(self):
        names = [self.head.name] + [p.name for p in self.peers]
        if len(set(names)) != len(names):
            raise ValueError(f"worker names must be unique, got {names}")
        if self.split is not None and len(self.split) != 1 + len(self.peers):
            raise ValueError(f"split has {len(self.split)} stages but there are {1 + len(self.peers)} workers")
        return self

    @property
    def workers(self) -> list[WorkerSpec]:
        """Pipeline order: head first, then peers in the order the head is given them."""
        return [self.head, *self.peers]

    def worker(self, name: str) -> WorkerSpec:
        for w in self.workers:
            if w.name == name:
                return w
        raise UserError(f"no worker named {name!r} in profile {self.name!r}")


def default_profile() -> Profile:
    return Profile()


def config_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "hydra-console"


def state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "hydra-console"


def resolve_profile_path(name_or_path: str) -> Path:
    """A path as given, or a bare name looked up as <config dir>/profiles/<name>.toml."""
    p = Path(name_or_path).expanduser()
    if p.suffix == ".toml" or os.sep in name_or_path:
        return p
    return config_dir() / "profiles" / f"{name_or_path}.toml"


def _describe(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        where = ".".join(str(x) for x in e["loc"]) or "profile"
        parts.append(f"{where}: {e['msg']}")
    return "; ".join(parts)


def profile_from_dict(data: dict, source: str = "profile") -> Profile:
    try:
        return Profile.model_validate(data)
    except ValidationError as e:
        raise UserError(f"{source}: {_describe(e)}") from None


def load_profile(path: str | Path) -> Profile:
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise UserError(f"profile not found: {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path}: not valid TOML: {e}") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read: {e.strerror}") from None
    data.setdefault("name", path.stem)
    return profile_from_dict(data, str(path))


def profile_to_toml(profile: Profile) -> str:
    data = profile.model_dump(mode="json", exclude_none=True)
    return tomli_w.dumps(data)


def save_profile(profile: Profile, path: str | Path, *, mkdir: bool = True, overwrite: bool = True) -> Path:
    """Write atomically. `mkdir=False`: a missing folder is an error naming it (a typo in a path
    given on the command line must not create a tree); `overwrite=False`: an existing file is one."""
    path = Path(path)
    if not overwrite and path.exists():
        raise UserError(f"{path} exists; pass --force to overwrite it")
    if not mkdir and not path.parent.is_dir():
        raise UserError(f"folder {path.parent} does not exist; create it first")
    try:
        atomic_write(path, profile_to_toml(profile), mkdir=mkdir)
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror or e}") from None
    return path


def atomic_write(path: Path, text: str, *, mkdir: bool = True) -> None:
    """Readers see the old file or the new one, never a torn one (temp file + fsync + rename)."""
    if mkdir:
        path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
