"""The split over the control port: a live re-split through the head's CONFIGURE op (the
supervisor restarts the head with --split when the head refuses it), the split advisor's PROBE,
and the layer ranges the head reports in /status, which the supervisor follows."""

from __future__ import annotations

from ..contracts.split import split_arg
from ..contracts.status import Status
from . import control_client
from .config import WorkerSpec
from .launch import connect_host
from .records import SupervisorError


def stage_ranges(status: Status | None) -> list[tuple[str, tuple[int, int]]] | None:
    """Layer ranges the head reports in /status, pipeline order."""
    out = [(s.addr or s.role, s.layers) for s in (status.stages if status else []) if s.layers is not None]
    return out or None


def ranges_text(key: tuple, by: str | None) -> str:
    """The split event's text for the ranges `key` a head reports (applied by `by`)."""
    return "layers now " + " · ".join(f"[{a},{b})" for a, b in key) + (f" (applied by {by})" if by else "")


async def configure(head: WorkerSpec, counts: list[int], identity: str, token: str) -> str | None:
    """Re-split live through the head's CONFIGURE op: None once applied, else why not."""
    host = connect_host(head.rpc_host or head.host)
    try:
        reply = await control_client.configure(
            host, head.rpc, {"split": split_arg(counts), "by": identity}, token=token
        )
        if reply.ok:
            return None
        return reply.status_name + (f": {reply.meta['error']}" if "error" in reply.meta else "")
    except control_client.ControlUnreachable as e:
        return str(e)


async def probe(head: WorkerSpec, tokens: int, reps: int, token: str) -> dict:
    """The head's PROBE (every stage times its own layers, the head times each hop and a whole
    step): its reply's meta. Requests pause for its length."""
    host = connect_host(head.rpc_host or head.host)
    try:
        reply = await control_client.probe(host, head.rpc, tokens, reps, token=token)
    except control_client.ControlUnreachable as e:
        raise SupervisorError(f"probe: {e}") from None
    if not reply.ok:
        raise SupervisorError(f"probe refused ({reply.status_name}): {reply.meta.get('error', '')}")
    return reply.meta
