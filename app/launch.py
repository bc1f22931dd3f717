"""Launching a worker: the argv that starts it (locally, or through its ssh launcher on its host),
its environment, the remote token file written through the launcher, and whether its ports are free."""

from __future__ import annotations

import asyncio
import os
import shlex
import socket
import sys

import psutil

from ..contracts.fit import DEFAULT_HEADROOM_GIB
from ..contracts.split import split_arg
from .config import DEFAULT_SSH_TEMPLATE, Profile, WorkerSpec
from .tokens import REMOTE_TOKEN_FILE, token_file_command

RUN_ID_ENV = "HYDRA_RUN_ID"  # set on every started worker: a later console recognises its workers by it


def connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def port_taken(host: str, port: int) -> bool:
    """Binding fails where the worker would bind (SO_REUSEADDR, as its servers set it, so only a
    socket still bound there counts, not connections closing). A connect would miss a holder that
    does not accept: a full backlog times out like a free port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host or "0.0.0.0", port))
        except OSError:
            return True
    return False


def busy_ports(spec: WorkerSpec) -> list[int]:
    """The worker's HTTP and RPC ports that something on this machine still holds."""
    rpc_host = spec.rpc_host or spec.host
    return [port for host, port in ((spec.host, spec.port), (rpc_host, spec.rpc)) if port_taken(host, port)]


def port_owner(port: int) -> str:
    """Who listens on `port` on this machine: "pid 4711 (python -m http.server 8080)"."""
    try:
        conns = psutil.net_connections(kind="inet")
    except psutil.Error:
        conns = []
    for c in conns:
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
            try:
                cmd = shlex.join(psutil.Process(c.pid).cmdline())
            except psutil.Error:
                cmd = "?"
            return f"pid {c.pid} ({cmd[:80]})"
    return "a process this user cannot see"


DRAIN_MARGIN_S = 5.0  # a head's drain ends this long before the console's SIGKILL (`supervisor.grace_s`)


def worker_argv(p: Profile, spec: WorkerSpec, role: str, split: list[int] | None) -> list[str]:
    """argv that starts the worker of `spec` (through its ssh launcher when remote); a head gets `split`."""
    bind = spec.host if spec.is_local else "0.0.0.0"
    rpc_bind = spec.rpc_host or (spec.host if spec.is_local else "0.0.0.0")
    args = ["serve" if role == "head" else "peer"]
    if p.model:
        args += ["--model", p.model]
    args += ["--host", bind, "--port", str(spec.port), "--rpc-host", rpc_bind, "--rpc-port", str(spec.rpc)]
    args += ["--device", spec.device, "--ctx", str(p.ctx)]
    for kv, kind in (("k", p.cache_type_k), ("v", p.cache_type_v)):
        if kind != "auto":
            args += [f"--cache-type-{kv}", kind]
    if p.headroom_gb != DEFAULT_HEADROOM_GIB:
        args += ["--headroom-gb", f"{p.headroom_gb:g}"]
    if role == "head":
        args += ["--parallel", str(p.parallel)]
        # A stop or restart drains the head's requests until just before this console's SIGKILL.
        args += ["--drain-grace", f"{max(0.0, p.supervisor.grace_s - DRAIN_MARGIN_S):g}"]
        for peer in p.peers:
            args += ["--peer", f"{connect_host(peer.host)}:{peer.rpc}"]
        if split:
            args += ["--split", split_arg(split)]
        if p.output_stage != "head" and p.peers:
            args += ["--output-stage", p.output_stage]
        if p.prefill_worker:
            args += ["--prefill-worker", p.prefill_worker, "--prefill-threshold", str(p.prefill_threshold)]
        sp = p.speculative
        if sp.type != "off":
            args += ["--spec-type", sp.type, "--draft-max", str(sp.draft_max)]
            if sp.model_draft:
                args += ["--model-draft", sp.model_draft]
            if sp.adaptive != "auto":
                args += ["--draft-adaptive", sp.adaptive]
    args += spec.args
    if spec.is_local:
        prefix = (
            shlex.split(p.engine_command) if p.engine_command else [sys.executable, "-m", "hydra_console.engine.cli"]
        )
        return prefix + args
    args += ["--auth-token-file", REMOTE_TOKEN_FILE.format(name=spec.name)]
    return remote_argv(spec, shlex.join(shlex.split(p.engine_command or "hydra-engine") + args))


def remote_argv(spec: WorkerSpec, command: str, tty: bool = True) -> list[str]:
    """The launcher's argv running `command` on the worker's host (`tty=False` drops ssh's -tt,
    so stdin reaches the command unechoed)."""
    # Substitute per token so the remote command stays one argument for ssh to hand to the remote shell.
    return [
        command if tok == "{command}" else tok.format(host=spec.host, command=command)
        for tok in shlex.split(spec.launcher or DEFAULT_SSH_TEMPLATE)
        if tty or tok != "-tt"
    ]


def worker_env(token: str, run_id: str) -> dict[str, str]:
    """A started worker's environment: ours, unbuffered, with its token and the console's run id."""
    return dict(os.environ, PYTHONUNBUFFERED="1", HYDRA_TOKEN=token, **{RUN_ID_ENV: run_id})


async def send_token(spec: WorkerSpec, token: str, timeout: float) -> str | None:
    """Write the token to the remote worker's 0600 token file through the launcher, on stdin.
    None once written, else what went wrong."""
    argv = remote_argv(spec, token_file_command(spec.name), tty=False)
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True,
        )
        await asyncio.wait_for(proc.communicate(token.encode() + b"\n"), timeout)
    except (OSError, asyncio.TimeoutError) as e:
        return f"cannot write the token file on {spec.host}: {e}"
    if proc.returncode:
        return f"writing the token file on {spec.host} exited with {proc.returncode}"
    return None
