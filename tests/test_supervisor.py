"""Supervisor against real child processes and real sockets (no Textual)."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import struct
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest
from consoles import FAKE, console_process, fake_profile, kill_groups, port_pair

from hydra_console.app import control_client
from hydra_console.app.config import Profile, SupervisorSettings, WorkerSpec
from hydra_console.app.log_writer import Rotating
from hydra_console.app.records import Backoff, State, SupervisorError, describe_exit
from hydra_console.app.sources import FixedFeedSource, HttpStatusSource, Probe
from hydra_console.app.supervisor import Supervisor
from hydra_console.app.worker_log import LogFile
from hydra_console.contracts.auth import ServerHandshake
from hydra_console.contracts.rpc import Op
from hydra_console.engine.cli import build_parser
from hydra_console.engine.cli_config import head_config
from hydra_console.engine.rpc.wire import pack_control_response


async def wait_until(cond, timeout: float = 60.0, step: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(step)


def script_profile(tmp_path: Path, body: str, *, peers: int = 0, **settings) -> Profile:
    script = tmp_path / "child.py"
    script.write_text(body)
    sup = SupervisorSettings(**{"grace_s": 5.0, "backoff_initial_s": 0.1, "backoff_max_s": 0.4, **settings})
    return Profile(
        name="t",
        engine_command=f"{shlex.quote(sys.executable)} {shlex.quote(str(script))}",
        head=WorkerSpec(name="head", port=port_pair()),
        peers=[WorkerSpec(name=f"peer{i + 1}", port=port_pair()) for i in range(peers)],
        supervisor=sup,
    )


def new_supervisor(profile: Profile, tmp_path: Path, **kw) -> Supervisor:
    # An unreachable feed: these tests are about processes, not health.
    return Supervisor(profile, source=FixedFeedSource({}), log_dir=tmp_path / "logs", **kw)


def test_backoff_doubles_to_the_cap_and_resets():
    b = Backoff(1.0, 30.0)
    assert [b.next() for _ in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    b.reset()
    assert b.next() == 1


def test_describe_exit_names_signals():
    assert describe_exit(None) == "—"
    assert describe_exit(3) == "3"
    assert describe_exit(-signal.SIGKILL) == "SIGKILL"


async def test_crash_restarts_with_growing_backoff(tmp_path):
    profile = script_profile(tmp_path, "import sys; print('boom', flush=True); sys.exit(3)\n", healthy_reset_s=30)
    sup = new_supervisor(profile, tmp_path)
    await sup.start_worker("head")
    head = sup.head
    await wait_until(lambda: head.restarts >= 4)
    await sup.shutdown()
    crashes = [e.message for e in sup.events if e.kind == "crashed"]
    delays = [float(m.rsplit("restart in ", 1)[1].split()[0]) for m in crashes[:5]]
    assert delays[:4] == [0.1, 0.2, 0.4, 0.4]
    assert all("exited (3)" in m for m in crashes)
    pids = {int(e.message.split()[1].rstrip(":")) for e in sup.events if e.kind == "started"}
    assert len(pids) >= 5  # every restart is a new process
    assert head.state == State.STOPPED


async def test_backoff_resets_after_a_healthy_run(tmp_path):
    # Each run lasts longer than healthy_reset_s, so every crash starts again from the first delay.
    profile = script_profile(tmp_path, "import sys, time; time.sleep(0.3); sys.exit(1)\n", healthy_reset_s=0.2)
    sup = new_supervisor(profile, tmp_path)
    await sup.start_worker("head")
    await wait_until(lambda: sup.head.restarts >= 3)
    await sup.shutdown()
    delays = [e.message.rsplit("restart in ", 1)[1] for e in sup.events if e.kind == "crashed"][:3]
    assert delays == ["0.1 s"] * 3


async def test_child_ignoring_sigterm_is_killed_after_grace(tmp_path):
    body = (
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('up', flush=True)\ntime.sleep(60)\n"
    )
    profile = script_profile(tmp_path, body)
    sup = new_supervisor(profile, tmp_path)
    await sup.start_worker("head")
    await wait_until(lambda: any(ln.text == "up" for ln in sup.head.log))
    pid = sup.head.pid
    t0 = time.monotonic()
    await sup.stop_worker("head", grace=0.5)
    waited = time.monotonic() - t0
    kinds = [e.kind for e in sup.events]
    assert "killed" in kinds and kinds[-1] == "stopped"
    assert sup.head.last_exit == -signal.SIGKILL
    assert sup.head.state == State.STOPPED and sup.head.restarts == 0  # a stop is not a crash
    assert waited >= 0.5
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    await sup.shutdown()


async def test_sigterm_stops_the_whole_process_group(tmp_path):
    body = (
        "import subprocess, sys, time\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print('grandchild', c.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    profile = script_profile(tmp_path, body)
    sup = new_supervisor(profile, tmp_path)
    await sup.start_worker("head")
    await wait_until(lambda: any(ln.text.startswith("grandchild") for ln in sup.head.log))
    grandchild = int(next(ln.text for ln in sup.head.log if ln.text.startswith("grandchild")).split()[1])
    assert os.getpgid(grandchild) == sup.head.pid  # its own group, led by the worker
    await sup.stop_worker("head", grace=5)
    assert "killed" not in [e.kind for e in sup.events]  # SIGTERM was enough
    await wait_until(
        lambda: not psutil.pid_exists(grandchild) or psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE, 5
    )
    await sup.shutdown()


async def test_output_goes_to_ring_buffer_and_log_file(tmp_path):
    body = "import sys\nfor i in range(300):\n    print(f'out {i}')\nprint('to stderr', file=sys.stderr)\n"
    profile = script_profile(tmp_path, body)
    profile.supervisor.ring_lines = 100
    sup = new_supervisor(profile, tmp_path, auto_restart=False)
    await sup.start_worker("head")
    await wait_until(lambda: sup.head.state == State.CRASHED)
    texts = [ln.text for ln in sup.head.log]
    assert len(texts) == 100  # ring buffer keeps the newest lines
    assert "out 299" in texts and "to stderr" in texts
    logged = sup.head.log_path.read_text()
    assert "out 0" in logged and "to stderr" in logged
    await sup.shutdown()


async def test_a_workers_log_file_is_rotated_with_no_line_lost_and_stays_bounded_with_no_console(tmp_path):
    go, start = tmp_path / "go", tmp_path / "start"
    body = (
        "import os, time\n"
        "print('ready', flush=True)\n"
        f"while not os.path.exists({str(start)!r}):\n    time.sleep(0.05)\n"
        "for i in range(2000):\n    print(f'line {i:04d} ' + 'x' * 90, flush=True)\n"
        f"while not os.path.exists({str(go)!r}):\n    time.sleep(0.05)\n"
        "for i in range(2000):\n    print(f'after {i:04d} ' + 'y' * 90, flush=True)\n"
        "time.sleep(60)\n"
    )
    limit = 1 << 16
    profile = script_profile(tmp_path, body, log_max_bytes=limit, log_backups=3)  # room for the first 2000
    sup = new_supervisor(profile, tmp_path)
    await sup.start_worker("head")
    pid, path = sup.head.pid, sup.head.log_path
    try:
        # The flood starts once the console follows the file (a follower that attaches late starts
        # at the current file; the rotations it missed are on disk, not in its view).
        await wait_until(lambda: any(ln.text == "ready" for ln in sup.head.log))
        start.touch()
        await wait_until(lambda: any(ln.text.startswith("line 1999") for ln in sup.head.log))
        lines = [ln.text[:9] for ln in sup.head.log if ln.text.startswith("line ")]
        assert lines == [f"line {i:04d}" for i in range(2000)]  # read across the rotations, in order
        assert path.with_name(path.name + ".3").exists() and path.stat().st_size <= limit + 100
        await sup.shutdown(stop_workers=False)  # no console any more: the file stays bounded
        go.touch()
        await wait_until(lambda: "after 1999" in path.read_text())
        assert path.stat().st_size <= limit + 100 and not path.with_name(path.name + ".4").exists()
        assert psutil.pid_exists(pid)
    finally:
        kill_groups([pid])


@pytest.mark.unit
def test_a_follower_reads_every_line_across_rotations_between_two_reads(tmp_path):
    """The log writer's rotation, three times over between two reads of the console's follower: it
    finishes the copy it was reading (now .3), then .2, .1 and the new file, in order, nothing lost,
    nothing twice. Four times over with three kept copies, the file it read is deleted (and the new
    one may get its inode number): the oldest kept copy on, each line once (the first file held
    "start" and the 99 lines that fit beside it)."""
    for rotations, first in ((3, 0), (4, 99)):
        path = tmp_path / f"r{rotations}" / "worker.log"
        path.parent.mkdir()
        writer, follower = Rotating(str(path), 100 * 101, 3), LogFile(path, 100 * 101, 3)
        writer.write(b"start\n")
        follower.follow_from_end()
        for i in range(rotations * 100 + 50):  # 101-byte lines, 100 a file
            writer.write(f"line {i:04d} ".encode() + b"x" * 90 + b"\n")
        got = [ln[:9] for ln in follower.read_new()]
        assert got == [f"line {i:04d}" for i in range(first, rotations * 100 + 50)], rotations


async def test_missing_executable_is_an_event_not_an_exception(tmp_path):
    profile = script_profile(tmp_path, "")
    profile.engine_command = str(tmp_path / "no-such-engine")
    sup = new_supervisor(profile, tmp_path, auto_restart=False)
    await sup.start_worker("head")
    assert sup.head.state == State.CRASHED
    assert any(e.kind == "error" and "cannot start" in e.message for e in sup.events)
    await sup.shutdown()


def test_remote_command_goes_through_ssh_template_as_one_argument():
    profile = Profile(
        peers=[WorkerSpec(name="far", host="gpu7", port=8090, device="cuda:1", launcher="ssh -p 2222 {host} {command}")]
    )
    sup = Supervisor(profile, source=FixedFeedSource({}))
    argv = sup.command_for("far")
    assert argv[:4] == ["ssh", "-p", "2222", "gpu7"] and len(argv) == 5
    remote = shlex.split(argv[4])
    assert remote[:2] == ["hydra-engine", "peer"]
    assert remote[remote.index("--host") + 1] == "0.0.0.0"  # reachable from the head
    assert remote[remote.index("--device") + 1] == "cuda:1"
    head = sup.command_for("head")
    assert head[head.index("--peer") + 1] == "gpu7:8091"
    assert head[:3] == [sys.executable, "-m", "hydra_console.engine.cli"]


async def test_attached_worker_is_monitored_not_started(tmp_path):
    profile = Profile(head=WorkerSpec(name="head", port=port_pair()), peers=[])
    sup = Supervisor(profile, attach=True, source=HttpStatusSource(timeout=0.5))
    await sup.start()
    await sup.poll_once()
    assert sup.head.state == State.UNREACHABLE and not sup.head.running
    assert sup.head.probe.error == "connection refused"
    with pytest.raises(SupervisorError, match="attached"):
        await sup.restart_worker("head")
    await sup.shutdown()


async def test_polling_reaches_ready_and_split_falls_back_to_head_restart(tmp_path):
    sup = Supervisor(fake_profile(peers=2), log_dir=tmp_path)
    await sup.start()
    try:
        await wait_until(lambda: all(w.state == State.READY for w in sup.workers.values()))
        assert [r for _, r in sup.stage_ranges()] == [(0, 6), (6, 12), (12, 18)]
        old_pid = sup.head.pid
        how = await sup.apply_split([8, 5, 5])  # nothing listens on the RPC port: no live CONFIGURE
        assert how == "restart" and sup.head.pid != old_pid
        assert sup.profile.split == [8, 5, 5]
        await wait_until(
            lambda: sup.stage_ranges() and [r for _, r in sup.stage_ranges()] == [(0, 8), (8, 13), (13, 18)]
        )
        assert any(e.kind == "split" and "[0,8)" in e.message for e in sup.events)
        assert sup.workers["peer1"].restarts == 0  # peers take their layers from the head
    finally:
        await sup.shutdown()
    assert not sup.running_managed()


async def test_a_poll_while_the_head_stops_does_not_undo_the_split_it_restarts_with(tmp_path):
    # The head takes a second to exit: a poll meanwhile still holds its old /status ([0,9)·[9,18)).
    profile = fake_profile(peers=1)
    profile.head.args = ["--stop-delay", "1"]
    sup = Supervisor(profile, log_dir=tmp_path)
    await sup.start()
    try:
        await wait_until(lambda: all(w.state == State.READY for w in sup.workers.values()))
        assert [r for _, r in sup.stage_ranges()] == [(0, 9), (9, 18)]
        applying = asyncio.create_task(sup.apply_split([12, 6]))
        await wait_until(lambda: sup.head.state == State.STOPPING)
        await sup.poll_once()
        assert sup.split == [12, 6]
        assert await applying == "restart"
        assert sup.head.argv[sup.head.argv.index("--split") + 1] == "12/6"
        await wait_until(lambda: sup.stage_ranges() and [r for _, r in sup.stage_ranges()] == [(0, 12), (12, 18)])
        assert sup.split == [12, 6]
    finally:
        await sup.shutdown()


class ControlServer:
    """A real TCP server speaking the control framing, answering CONFIGURE with a fixed status."""

    def __init__(self, status: int):
        self.status = status
        self.requests: list[tuple[int, dict]] = []
        self.token = None  # the console's, once it exists: this stand-in proves it as a head does

    async def handle(self, reader, writer):
        while True:
            header = await reader.readexactly(16)
            magic, op, _flags, key_len, payload_len, trace_len = struct.unpack("<HBBHQH", header)
            assert magic == 0x4859
            await reader.readexactly(key_len + trace_len)
            if op != Op.AUTH:
                break
            payload = await reader.readexactly(payload_len)
            if len(payload) == 16:  # the console's nonce: our proof first, then its proof (not checked here)
                hs = ServerHandshake(self.token, "control", "head", payload)
                meta = {"auth": True, "nonce": hs.nonce.hex(), "role": "head", "proof": hs.proof.hex()}
            else:
                meta = {"auth": True, "ok": True}
            writer.write(pack_control_response(control_client.OK, meta))
        self.requests.append((op, json.loads(await reader.readexactly(payload_len))))
        writer.write(pack_control_response(self.status, {"error": "not built"} if self.status else {"ok": True}))
        await writer.drain()
        writer.close()


@pytest.mark.parametrize("status,expected", [(control_client.OK, "live"), (control_client.NOT_IMPLEMENTED, "restart")])
async def test_split_goes_live_through_configure_when_the_head_accepts_it(tmp_path, status, expected, monkeypatch):
    monkeypatch.setattr(
        "hydra_console.contracts.auth._issued_here", lambda nonce: False
    )  # console and stand-in share this process
    profile = fake_profile(peers=1)
    ctl = ControlServer(status)
    sup = Supervisor(profile, log_dir=tmp_path)
    ctl.token = sup.token
    await sup.start()
    # The stand-in head opens no RPC port: this server answers CONFIGURE there in its place.
    server = await asyncio.start_server(ctl.handle, "127.0.0.1", profile.head.rpc)
    try:
        await wait_until(lambda: sup.head.state == State.READY)
        pid = sup.head.pid
        assert await sup.apply_split([12, 6]) == expected
        assert ctl.requests == [(control_client.OP_CONFIGURE, {"split": "12/6", "by": sup.identity})]
        assert (sup.head.pid == pid) == (expected == "live")
        if expected == "restart":
            assert any("NOT_IMPLEMENTED: not built" in e.message for e in sup.events)
    finally:
        await sup.shutdown()
        server.close()
        await server.wait_closed()


async def test_fixed_feed_drives_attached_states():
    profile = Profile(peers=[WorkerSpec(name="peer1", port=8090)])
    feed = FixedFeedSource({"head": Probe(True, 200, {"status": "degraded"}, {"pid": 42, "uptime_s": 5.0})})
    sup = Supervisor(profile, attach=True, source=feed, clock=lambda: 1000.0)
    await sup.poll_once()
    assert sup.head.state == State.DEGRADED and sup.head.shown_pid() == 42 and sup.head.uptime(0) == 5.0
    assert sup.workers["peer1"].state == State.UNREACHABLE
    assert [e.kind for e in sup.events] == ["degraded", "unreachable"]


async def test_a_port_held_by_another_process_is_named_and_the_worker_starts_once_it_frees(tmp_path):
    profile = script_profile(tmp_path, "import time; print('up', flush=True); time.sleep(60)\n", poll_s=0.1)
    holder_code = (
        "import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(); "
        "print('held', flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", holder_code, str(profile.head.port)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        sup = new_supervisor(profile, tmp_path)
        await sup.start_worker("head")
        assert not sup.head.running and sup.head.state == State.PORT_BUSY
        err = next(e.message for e in sup.events if e.kind == "error")
        assert f"port {profile.head.port} held by pid {holder.pid}" in err and "socket" in err  # its command line
        await asyncio.sleep(0.5)
        assert not sup.head.running  # still held: not started, not crashed
        holder.kill()
        holder.wait()
        await wait_until(lambda: sup.head.running)
        assert sup.head.state == State.STARTING and sup.running_managed() == [sup.head]
    finally:
        holder.kill()
        holder.wait()
    await sup.shutdown()
    assert sup.head.state == State.STOPPED


async def test_a_listener_that_never_accepts_is_a_busy_port(tmp_path):
    """Its backlog full, a connect to it times out as to a free port; a bind still finds it."""
    import socket

    profile = script_profile(tmp_path, "import time; time.sleep(60)\n", poll_s=0.1)
    holder = socket.socket()
    holder.bind(("127.0.0.1", profile.head.rpc))
    holder.listen(0)
    clients = []
    for _ in range(4):  # fill the accept queue: later connects hang
        c = socket.socket()
        c.setblocking(False)
        c.connect_ex(("127.0.0.1", profile.head.rpc))
        clients.append(c)
    sup = new_supervisor(profile, tmp_path)
    try:
        await sup.start_worker("head")
        assert not sup.head.running and sup.head.state == State.PORT_BUSY
        err = next(e.message for e in sup.events if e.kind == "error")
        assert f"port {profile.head.rpc} held by pid {os.getpid()}" in err
    finally:
        for c in [*clients, holder]:
            c.close()
        await sup.shutdown()


async def test_remote_worker_runs_through_the_launcher_template(tmp_path):
    """A stand-in for ssh runs the remote command line in a shell, as sshd would; 127.0.0.2 is 'another host'."""
    fake_ssh = tmp_path / "fake_ssh.py"
    fake_ssh.write_text(
        f"import os, sys\nhost, command = sys.argv[1], sys.argv[2]\nos.chdir({str(tmp_path)!r})\n"
        "os.execvp('sh', ['sh', '-c', command])\n"
    )  # sshd starts in the login directory
    port = port_pair()
    profile = Profile(
        name="remote",
        engine_command=FAKE,
        head=WorkerSpec(
            name="head",
            host="127.0.0.2",
            port=port,
            launcher=f"{shlex.quote(sys.executable)} {shlex.quote(str(fake_ssh))} {{host}} {{command}}",
        ),
        peers=[],
        supervisor=SupervisorSettings(poll_s=0.2),
    )
    sup = Supervisor(profile, log_dir=tmp_path)
    await sup.start()
    try:
        await wait_until(lambda: sup.head.state == State.READY)
        assert (sup.head.status.http.host, sup.head.status.http.port) == (
            "0.0.0.0",
            port,
        )  # a remote worker binds every address
        token_file = tmp_path / ".hydra" / "token-head"  # the token went by file, not argv
        assert token_file.read_text().strip() == sup.token and token_file.stat().st_mode & 0o777 == 0o600
        assert sup.token not in " ".join(sup.command_for("head"))
    finally:
        await sup.shutdown()
    assert sup.head.state == State.STOPPED


async def test_concurrent_restarts_never_leave_two_processes(tmp_path):
    profile = script_profile(tmp_path, "import time; print('up', flush=True); time.sleep(60)\n")
    sup = new_supervisor(profile, tmp_path)
    await sup.start_worker("head")
    first = sup.head.pid
    await asyncio.gather(sup.restart_worker("head"), sup.restart_worker("head"))
    started = [int(e.message.split()[1]) for e in sup.events if e.kind == "started"]
    assert len(started) == 3 and first == started[0] and sup.head.pid == started[-1]
    alive = [p for p in started if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert alive == [sup.head.pid]
    assert sup.head.restarts == 2
    await sup.shutdown()


async def test_a_missed_poll_is_tolerated_then_reported():
    up = Probe(True, 200, {"status": "ok"}, {"pid": 7})
    feed = FixedFeedSource({"head": up})
    sup = Supervisor(Profile(peers=[]), attach=True, source=feed, clock=lambda: 0.0)
    await sup.poll_once()
    assert sup.head.state == State.READY
    feed.probes["head"] = Probe(False, error="timed out")
    await sup.poll_once()
    await sup.poll_once()
    assert sup.head.state == State.READY and sup.head.probe.reachable  # two misses: still the last answer
    await sup.poll_once()
    assert sup.head.state == State.UNREACHABLE
    feed.probes["head"] = up
    await sup.poll_once()
    assert [e.kind for e in sup.events] == ["ready", "unreachable", "ready"]


class Override:
    """The real HTTP source, with the head's /status stages replaced: the head runs a split that
    someone else applied (another console's CONFIGURE), which the stand-in head cannot do itself."""

    def __init__(self):
        self.http, self.head_ranges = HttpStatusSource(), None

    async def probe(self, spec):
        p = await self.http.probe(spec)
        if spec.name == "head" and p.status is not None and self.head_ranges:
            stages = [replace(s, layers=r) for s, r in zip(p.status.stages, self.head_ranges)]
            p = replace(p, status=replace(p.status, stages=stages, split_by="hydra-console pid 1 on elsewhere"))
        return p

    async def aclose(self):
        await self.http.aclose()


async def test_crash_restart_relaunches_the_live_split_not_a_saved_draft(tmp_path):
    source = Override()
    sup = Supervisor(fake_profile(), source=source, log_dir=tmp_path)
    await sup.start()
    try:
        await wait_until(lambda: all(w.state == State.READY for w in sup.workers.values()))
        started = sup.head.argv
        assert "--split" not in started
        source.head_ranges = [(0, 10), (10, 18)]  # applied live by another console
        await wait_until(lambda: sup.split == [10, 8])
        assert any(e.kind == "split" and "applied by hydra-console pid 1 on elsewhere" in e.message for e in sup.events)
        sup.profile.split = [9, 9]  # a draft saved to the profile, never applied
        assert sup.head.argv == started  # the record is what runs, not what would run now
        os.killpg(sup.head.pid, signal.SIGKILL)
        await wait_until(lambda: sup.head.argv != started and sup.head.running)
        argv = sup.head.argv
        assert argv[argv.index("--split") + 1] == "10/8"
        assert sup.head.crash_restarts == 1
    finally:
        await sup.shutdown()


async def test_attached_console_follows_a_head_restart_and_its_recovery():
    now = [1000.0]
    feed = FixedFeedSource({"head": Probe(True, 200, {"status": "ok"}, {"pid": 42})})
    sup = Supervisor(Profile(peers=[]), attach=True, source=feed, clock=lambda: now[0])
    await sup.poll_once()
    feed.probes["head"] = Probe(False, error="connection refused")
    for _ in range(3):
        now[0] += 1
        await sup.poll_once()
    assert sup.head.state == State.UNREACHABLE
    now[0] += 2
    feed.probes["head"] = Probe(True, 200, {"status": "ok"}, {"pid": 43})
    await sup.poll_once()
    assert [(e.kind, e.message) for e in sup.events] == [
        ("ready", "ready"),
        ("unreachable", "connection refused"),
        ("restarted", "pid 42 → 43 (restarted outside this console)"),
        ("ready", "ready again after 2.0 s unreachable"),
    ]


async def test_ready_after_a_recovery_counts_from_the_degradation_not_the_first_start(tmp_path):
    now = [1000.0]
    profile = script_profile(tmp_path, "import time; time.sleep(60)\n")
    feed = FixedFeedSource({"head": Probe(True, 200, {"status": "ok"})})
    sup = Supervisor(profile, source=feed, clock=lambda: now[0], log_dir=tmp_path)
    await sup.start_worker("head")
    now[0] += 5
    await sup.poll_once()
    now[0] += 150
    feed.probes["head"] = Probe(True, 200, {"status": "degraded"})
    await sup.poll_once()
    now[0] += 2
    feed.probes["head"] = Probe(True, 200, {"status": "ok"})
    await sup.poll_once()
    ready = [e.message for e in sup.events if e.kind == "ready"]
    assert ready == ["ready 5.0 s after its start", "ready again after 2.0 s degraded"]
    await sup.shutdown()


async def test_quick_exits_are_a_named_crash_loop(tmp_path):
    body = "import sys\nprint('loading', flush=True)\nprint('hydra-engine: error: model file not found: /m.gguf', file=sys.stderr)\nsys.exit(2)\n"
    profile = script_profile(tmp_path, body, crash_loop_count=3)
    sup = new_supervisor(profile, tmp_path)
    await sup.start_worker("head")
    await wait_until(lambda: sup.head.state == State.CRASH_LOOP)
    loop = [e.message for e in sup.events if e.kind == "crash-loop"]
    assert loop and loop[0].startswith("3 exits in a row") and "model file not found: /m.gguf" in loop[0]
    assert sup.head.last_err == "hydra-engine: error: model file not found: /m.gguf"
    await wait_until(lambda: sup.head.running)
    assert sup.head.state == State.CRASH_LOOP  # a new try of a looping worker is not "starting"
    await sup.shutdown()
    assert sup.head.state == State.STOPPED


async def test_slow_failures_are_a_named_crash_loop_too(tmp_path):
    """Each try fails after longer than the old quick-exit window (a profile saved before still
    carries `crash_loop_s`): counted by failures, it is a crash loop with its last line."""
    go = tmp_path / "go"
    body = (
        "import os, sys, time\n"
        f"while not os.path.exists({str(go)!r}):\n    time.sleep(0.05)\n"
        "os.unlink(" + repr(str(go)) + ")\n"
        "print('hydra-engine: error: cannot open model file /m.gguf', file=sys.stderr, flush=True)\nsys.exit(2)\n"
    )
    profile = script_profile(tmp_path, body, crash_loop_count=3)
    profile.supervisor = SupervisorSettings.model_validate(
        {**profile.supervisor.model_dump(), "crash_loop_s": 0.01, "healthy_reset_s": 3600}
    )
    sup = new_supervisor(profile, tmp_path)
    await sup.start_worker("head")
    for tries in range(1, 4):  # each try ends when the test says so, never by the clock
        await wait_until(lambda: sup.head.running and sup.head.started_at < sup.clock() - 0.02)
        go.touch()
        await wait_until(lambda: sum(e.kind == "crashed" for e in sup.events) == tries)
    assert sup.head.state == State.CRASH_LOOP
    loop = [e.message for e in sup.events if e.kind == "crash-loop"]
    assert loop and loop[0].startswith("3 exits in a row") and "cannot open model file /m.gguf" in loop[0]
    await sup.shutdown()


async def test_kill_9_of_the_console_then_a_new_console_adopts_and_stops_its_workers(tmp_path):
    profile = fake_profile()
    console = console_process(profile, tmp_path)
    pids = []
    try:
        line = await asyncio.wait_for(asyncio.to_thread(console.stdout.readline), 60)
        pids = [int(x) for x in line.split()]
        assert len(pids) == 2
        console.kill()  # kill -9: no cleanup ran
        console.wait()
        assert all(psutil.pid_exists(p) for p in pids)
        sup = Supervisor(profile, log_dir=tmp_path / "logs")
        state = json.loads(sup.state_path.read_text())
        assert state["console_pid"] == console.pid and {w["pid"] for w in state["workers"].values()} == set(pids)
        run_id = state["workers"]["head"]["run_id"]
        assert psutil.Process(pids[0]).environ()["HYDRA_RUN_ID"] == run_id
        await sup.start()
        try:
            assert [w.pid for w in sup.workers.values()] == pids
            assert [e.kind for e in sup.events] == ["adopted", "adopted"]  # nothing started: no duplicates
            await wait_until(lambda: all(w.state == State.READY for w in sup.workers.values()))
            # Adopted workers are supervised: a crash is restarted (by this console, with its run id).
            os.killpg(pids[1], signal.SIGKILL)
            await wait_until(lambda: sup.workers["peer1"].running and sup.workers["peer1"].pid != pids[1])
            assert sup.workers["peer1"].run_id == sup.run_id
            peer_pid = sup.workers["peer1"].pid
        finally:
            await sup.shutdown()
        gone = lambda p: not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE  # noqa: E731
        await wait_until(lambda: gone(pids[0]) and gone(peer_pid))
        assert not sup.state_path.exists()
    finally:
        console.kill()
        kill_groups(pids)


async def test_detach_leaves_the_workers_running_for_the_next_console(tmp_path):
    profile = fake_profile(peers=0)
    sup = Supervisor(profile, log_dir=tmp_path)
    await sup.start()
    await wait_until(lambda: sup.head.state == State.READY)
    pid = sup.head.pid
    await sup.shutdown(stop_workers=False)
    sup.kill_all_sync()  # what main() does after the app: a no-op once detached
    await asyncio.sleep(0.3)
    assert psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    nxt = Supervisor(profile, log_dir=tmp_path)
    await nxt.start()
    assert nxt.head.pid == pid and [e.kind for e in nxt.events] == ["adopted"]
    await nxt.shutdown()
    await wait_until(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)


async def test_workers_of_a_live_console_are_watched_not_adopted_nor_duplicated(tmp_path):
    profile = fake_profile(peers=0)
    console = console_process(profile, tmp_path)
    pid = None
    try:
        pid = int(await asyncio.wait_for(asyncio.to_thread(console.stdout.readline), 60))
        sup = Supervisor(profile, log_dir=tmp_path / "logs")
        assert sup.owner == console.pid and sup.readonly and not sup.head.managed  # it watches
        await sup.start()
        assert not sup.head.running and not sup.running_managed()
        assert any(e.kind == "attached" and f"console pid {console.pid} runs" in e.message for e in sup.events)
        await wait_until(lambda: sup.head.state == State.READY and sup.head.shown_pid() == pid)
        await sup.shutdown()
        assert psutil.pid_exists(pid)
        # A live process with the console's pid but another start time got the pid after it died.
        doc = json.loads(sup.state_path.read_text())
        sup.state_path.write_text(json.dumps({**doc, "console_started": doc["console_started"] - 60}))
        assert Supervisor(profile, log_dir=tmp_path / "logs").owner is None
    finally:
        console.terminate()  # SIGTERM: asyncio.run is interrupted, its child transports kill the worker
        console.wait()
        if pid:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass


async def test_local_workers_get_the_token_in_their_environment_not_argv(tmp_path, monkeypatch):
    monkeypatch.delenv("HYDRA_TOKEN", raising=False)
    out = tmp_path / "env.txt"
    profile = script_profile(
        tmp_path,
        f"import os, sys, time\nopen({str(out)!r}, 'w').write(os.environ.get('HYDRA_TOKEN', '') + '|' + ' '.join(sys.argv))\ntime.sleep(60)\n",
    )
    sup = new_supervisor(profile, tmp_path)
    # Random, and kept for the profile: the next console of it (attached, adopting) proves the same one.
    assert len(sup.token) == 64 and sup.token == new_supervisor(profile, tmp_path).token
    assert new_supervisor(profile, tmp_path, token="shared").token == "shared"  # the console's HYDRA_TOKEN
    token_file = sup.state_path.with_suffix(".token")
    assert token_file.stat().st_mode & 0o777 == 0o600
    await sup.start_worker("head")
    try:
        await wait_until(lambda: out.exists() and out.read_text())
        token, argv = out.read_text().split("|", 1)
        assert token == sup.token and sup.token not in argv
    finally:
        await sup.shutdown()


def test_profile_speculative_adaptive_reaches_the_heads_argv_as_the_engine_reads_it():
    """`[speculative] adaptive` is the head's `--draft-adaptive`; "auto" adds nothing (the engine's
    own default: on for mtp), and the engine's parser takes what the console writes."""

    def head_spec(**speculative):
        sup = Supervisor(Profile(speculative=speculative), source=FixedFeedSource({}))
        argv = sup.command_for("head")
        return argv, head_config(build_parser().parse_args(argv[argv.index("serve") :]), {}).spec

    argv, spec = head_spec(type="mtp")
    assert "--draft-adaptive" not in argv and spec.adapts
    argv, spec = head_spec(type="mtp", adaptive="off")
    assert argv[argv.index("--draft-adaptive") + 1] == "off" and not spec.adapts
    argv, spec = head_spec(type="ngram", adaptive="on")
    assert spec.type == "ngram" and spec.adapts
    with pytest.raises(ValueError, match="adaptive"):
        Profile(speculative={"type": "mtp", "adaptive": "sometimes"})
