"""The real console app under Textual's Pilot, supervising real (stand-in) worker processes.

The stand-in workers (`hydra_console.app.fake_worker`) are real processes serving /health and
/status on real sockets; they load no model, so these tests stay fast. The same flows against
real `hydra-engine` workers are in test_console_real.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest
from consoles import all_ready, console_process, fake_profile, kill_groups, uniform_shape, until
from rpc_workers import HTTP
from textual.command import CommandPalette
from textual.widgets import Static

from hydra_console.app.config import Alerts, Profile, SupervisorSettings, load_profile, save_profile
from hydra_console.app.incidents import IncidentLog, incidents_path
from hydra_console.app.records import State
from hydra_console.app.sources import FixedFeedSource, Probe
from hydra_console.app.supervisor import Supervisor
from hydra_console.app.ui.app import HydraConsole
from hydra_console.app.ui.detail import WorkerDetailScreen
from hydra_console.app.ui.dialogs import ConfirmScreen, HelpScreen
from hydra_console.app.ui.logs import LogsScreen
from hydra_console.app.ui.split_editor import SplitEditorScreen
from hydra_console.app.ui.triage import TriageScreen


def head_ranges(sup: Supervisor) -> list[list[int]]:
    doc = HTTP.get(f"{sup.head.spec.url}/status", timeout=2).json()
    return [s["layers"] for s in doc["stages"]]


SHAPE = uniform_shape(18, 5 << 20, 50 << 20, 1024)


# Each flow at the size the real-worker test (test_console_real.py) does not use.
@pytest.mark.parametrize("size", [(120, 40)])
async def test_restart_peer_from_the_dashboard_changes_its_pid(tmp_path, size):
    sup = Supervisor(fake_profile(alerts=Alerts(restarts=1)), log_dir=tmp_path)
    app = HydraConsole(sup, load_model_shape=False)
    async with app.run_test(size=size) as pilot:
        await until(pilot, lambda: all_ready(sup))
        peer = sup.workers["peer1"]
        old = peer.pid
        await pilot.press("down")  # cursor to peer1
        await pilot.press("R")
        assert isinstance(app.screen, ConfirmScreen)
        assert "peer1" in app.screen.question and f"pid {old}" in app.screen.question
        await pilot.press("y")
        await until(pilot, lambda: peer.pid != old and peer.state == State.READY)
        assert peer.restarts == 1 and sup.head.restarts == 0
        table = app.dashboard.query_one("#workers")
        # The table catches up at its next refresh: waited for, not slept on.
        await until(pilot, lambda: str(table.get_cell("peer1", "pid")) == str(peer.pid))
        await until(pilot, lambda: "● ready" in str(table.get_cell("peer1", "state")))
        assert str(table.get_cell("peer1", "rst")) == "1"  # the operator's own R raises no restart alert
        await pilot.press("q")
        assert isinstance(app.screen, ConfirmScreen) and "head (pid" in app.screen.question
        await pilot.press("y")
        await until(pilot, lambda: not sup.running_managed())
    assert all(w.state == State.STOPPED for w in sup.workers.values())
    sup.emit("head", "late", "an event after the app quit must not touch the UI")


@pytest.mark.parametrize("size", [(80, 24)])
async def test_split_editor_moves_boundary_applies_and_status_shows_new_ranges(tmp_path, size):
    sup = Supervisor(fake_profile(), log_dir=tmp_path)
    app = HydraConsole(sup, model_shape=SHAPE, profile_path=tmp_path / "fake.toml")
    async with app.run_test(size=size) as pilot:
        await until(pilot, lambda: all_ready(sup))
        assert head_ranges(sup) == [[0, 9], [9, 18]]
        await pilot.press("s")
        editor = app.screen
        assert isinstance(editor, SplitEditorScreen) and editor.counts == [9, 9]
        await pilot.press("right", "right", "right", "left")
        assert editor.counts == [11, 7]
        await pilot.press("u")
        assert editor.counts == [12, 6]
        await pilot.press("a")
        assert isinstance(app.screen, ConfirmScreen) and "12/6" in app.screen.question
        await pilot.press("y")
        # No live CONFIGURE on a stand-in head: the console restarts it with --split 12/6.
        await until(pilot, lambda: sup.head.state == State.READY and sup.head.restarts == 1)
        await until(pilot, lambda: head_ranges(sup) == [[0, 12], [12, 18]])
        assert editor.applied == [12, 6]
        await pilot.press("w")
        assert load_profile(tmp_path / "fake.toml").split == [12, 6]
        await pilot.press("escape")
        await until(pilot, lambda: "[0,12)" in str(app.dashboard.query_one("#workers").get_cell("head", "layers")))
        app._stop_and_exit(True)
        await until(pilot, lambda: not sup.running_managed())


async def test_readonly_starts_stops_and_applies_nothing_and_says_so(tmp_path):
    profile = fake_profile()
    owner = Supervisor(profile, log_dir=tmp_path / "owner")  # the console that runs the workers
    await owner.start()
    try:
        sup = Supervisor(profile, readonly=True, log_dir=tmp_path)
        app = HydraConsole(sup, model_shape=SHAPE)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: all_ready(sup))  # watched, not started: no "port in use"
            assert not sup.running_managed() and not any(e.kind in ("started", "error") for e in sup.events)
            pid = owner.head.pid
            await pilot.press("R")
            assert not isinstance(app.screen, ConfirmScreen)
            assert any("read-only console: restart is disabled" in n.message for n in app._notifications)
            await pilot.press("s", "right", "a")
            assert isinstance(app.screen, SplitEditorScreen)  # no confirmation: refused
            assert any("read-only console: applying a split is disabled" in n.message for n in app._notifications)
            assert "READ-ONLY" in app.sub_title
            commands = [c.title for c in app.get_system_commands(app.screen)]
            assert not any(t.startswith(("Restart", "Stop ", "Start ")) for t in commands)
            await pilot.press("escape", "q")  # nothing of its own runs: quits without asking
            await pilot.pause(0.2)
        assert not app.is_running
        assert owner.head.pid == pid and owner.head.restarts == 0 and all_ready(owner)
    finally:
        await owner.shutdown()


async def test_saving_a_draft_applies_nothing_and_the_editor_says_so(tmp_path):
    sup = Supervisor(fake_profile(), log_dir=tmp_path)
    app = HydraConsole(sup, model_shape=SHAPE, profile_path=tmp_path / "fake.toml")
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: all_ready(sup))
        argv = sup.head.argv
        await pilot.press("s", "right", "w")
        editor = app.screen
        assert editor.counts == [10, 8] and load_profile(tmp_path / "fake.toml").split == [10, 8]
        note = str(editor.query_one("#split-note").render())
        assert "split 10/8  (saved, not applied; running 9/9)" in note
        assert any("split 10/8 saved, not applied (running 9/9)" in n.message for n in app._notifications)
        assert sup.split == [9, 9] and sup.head.argv == argv and sup.head.restarts == 0
        assert "--split 9/9" in " ".join(sup.command_for("head"))  # a crash-restart relaunches what runs
        await pilot.press("escape")
        app.action_detail("head")
        await until(pilot, lambda: isinstance(app.screen, WorkerDetailScreen) and app.screen.is_mounted)
        table = app.screen.query_one("#detail-info").content
        rows = {str(k): str(v) for k, v in zip(table.columns[0]._cells, table.columns[1]._cells)}
        assert rows["command"] == shlex.join(argv) and "--split" not in rows["command"]
        assert "--split 9/9" in rows["next start"]
        app._stop_and_exit(True)
        await until(pilot, lambda: not sup.running_managed())


async def test_quit_can_detach_and_leave_the_workers_running(tmp_path):
    import psutil

    sup = Supervisor(fake_profile(), log_dir=tmp_path)
    app = HydraConsole(sup, load_model_shape=False)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: all_ready(sup))
        pids = [w.pid for w in sup.workers.values()]
        await pilot.press("q")
        assert isinstance(app.screen, ConfirmScreen)
        labels = [str(b.label) for b in app.screen.query("Button")]
        assert labels == ["Stop all and quit [y]", "Detach [d]", "Cancel [n]"]  # hints survive markup
        await pilot.press("d")
        await pilot.pause(0.5)
    sup.kill_all_sync()
    try:
        assert all(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
        nxt = Supervisor(sup.profile, log_dir=tmp_path)
        await nxt.start()
        assert [w.pid for w in nxt.workers.values()] == pids
        await nxt.shutdown()
    finally:
        kill_groups(pids)


async def test_logs_filter_invert_and_failure_highlight(tmp_path):
    body = (
        "import time\n"
        "print('hello from worker', flush=True)\n"
        "print('OSError: [Errno 98] Address already in use', flush=True)\n"
        "print('INFO hydra.http 3f2a9c1b7d4e POST /v1/completions 200 in=3 out=4 12ms', flush=True)\n"
        "print('long ' * 30 + 'and its end', flush=True)\n"
        "time.sleep(60)\n"
    )
    script = tmp_path / "w.py"
    script.write_text(body)
    profile = fake_profile(peers=0)
    profile.engine_command = f"{shlex.quote(sys.executable)} {shlex.quote(str(script))}"
    sup = Supervisor(profile, log_dir=tmp_path)
    app = HydraConsole(sup, load_model_shape=False)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: len(sup.head.log) >= 5)
        await pilot.press("l")
        logs = app.screen
        assert isinstance(logs, LogsScreen)
        await until(pilot, lambda: any("in=3" in strip.text for strip in logs.query_one("#log").lines))

        def shown() -> list[str]:
            return [strip.text for strip in logs.query_one("#log").lines]

        assert any("hello from worker" in t for t in shown())
        assert any("Address already in use" in t and "◀ port in use" in t for t in shown())
        assert any("and its end" in t for t in shown())  # a line past the edge wraps, not cut
        await pilot.resize_terminal(200, 24)  # and is rewrapped at a new width: one row now
        await until(pilot, lambda: any("long long" in t and "and its end" in t for t in shown()))
        await pilot.press("slash")
        await pilot.press(*"hel+o", "enter")
        assert logs.pattern_text == "hel+o"
        assert any("hello" in t for t in shown()) and not any("Address" in t for t in shown())
        await pilot.press("exclamation_mark")
        assert not any("hello" in t for t in shown()) and any("Address" in t for t in shown())
        titles = {c.title for c in app.get_system_commands(logs)}
        assert {"Logs: follow / pause", "Logs: invert filter", "Logs: next worker"} <= titles
        await pilot.press("c", "a")  # the access log only
        assert [t.split(maxsplit=2)[2].strip() for t in shown()] == [
            "INFO hydra.http 3f2a9c1b7d4e POST /v1/completions 200 in=3 out=4 12ms"
        ]
        assert "requests only" in str(logs.query_one("#logbar").render())
        await pilot.press("a", "f")
        records = [t for t in shown() if re.match(r"\d\d:\d\d:\d\d ", t)]  # not the wrapped rows
        assert logs.follow is False and len(records) == 5  # the launch line, then the four printed ones
        await pilot.press("w")
        assert logs.source == "head"
        app._stop_and_exit(True)
        await until(pilot, lambda: not sup.running_managed())


async def test_after_a_kill_9_of_its_console_an_adopted_workers_new_log_lines_show_in_l(tmp_path):
    """Workers write their own log files: the console that adopts them reads what they write now."""
    profile = fake_profile()
    console = console_process(profile, tmp_path)
    pids = []
    try:
        pids = [int(x) for x in (await asyncio.wait_for(asyncio.to_thread(console.stdout.readline), 60)).split()]
        console.kill()  # kill -9: no cleanup ran
        console.wait()
        sup = Supervisor(profile)  # its own --log-dir differs: it follows the files the workers write
        app = HydraConsole(sup, load_model_shape=False)
        async with app.run_test(size=(120, 40)) as pilot:
            await until(pilot, lambda: all_ready(sup) and [w.pid for w in sup.workers.values()] == pids)
            assert sup.head.log_path == tmp_path / "logs" / f"{profile.name}-head.log"
            assert any(f"started pid {pids[0]}" in ln.text for ln in sup.head.log)  # the first console's lines
            size = sup.head.log_path.stat().st_size
            await asyncio.to_thread(HTTP.get, f"{profile.head.url}/v1/after-adoption", timeout=5)
            await until(pilot, lambda: any("GET /v1/after-adoption 404" in ln.text for ln in sup.head.log))
            assert sup.head.log_path.stat().st_size > size  # the file goes on growing
            await pilot.press("l")
            logs = app.screen
            assert isinstance(logs, LogsScreen)
            await until(pilot, lambda: any("/v1/after-adoption" in st.text for st in logs.query_one("#log").lines))
            app._stop_and_exit(True)
            await until(pilot, lambda: not sup.running_managed())
    finally:
        console.kill()
        console.wait()
        kill_groups(pids)


async def test_a_peer_killed_before_a_console_restart_is_still_in_the_next_consoles_triage(tmp_path):
    profile = fake_profile()
    profile.supervisor.backoff_initial_s = 0.1
    sup = Supervisor(profile, log_dir=tmp_path)
    app = HydraConsole(sup, load_model_shape=False, incidents=IncidentLog(profile.alerts, incidents_path(sup)))
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: all_ready(sup))
        peer = sup.workers["peer1"]
        old = peer.pid
        os.killpg(old, signal.SIGKILL)
        await until(pilot, lambda: peer.pid != old and peer.state == State.READY)
        app._stop_and_exit(True)
        await until(pilot, lambda: not sup.running_managed())
    later = Supervisor(profile, attach=True, source=FixedFeedSource({}))  # nothing runs now
    app = HydraConsole(
        later, load_model_shape=False, incidents=IncidentLog(profile.alerts, incidents_path(later), writes=False)
    )
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("i")
        timeline = str(app.screen.query_one("#triage-timeline").render())
        assert f"peer1: pid {old} exited (SIGKILL)" in timeline and "restart" in timeline


def test_the_incidents_command_and_once_json_list_recorded_incidents(tmp_path, capsys):
    from hydra_console.app.main import run
    from hydra_console.app.triage import Incident

    profile = fake_profile()
    path = save_profile(profile, tmp_path / "p.toml")
    log = IncidentLog(profile.alerts, incidents_path(Supervisor(profile, attach=True)))
    now = time.time()
    log.add(
        [
            Incident(now - 4 * 3600, "peer-down", "127.0.0.1:9", "peer down overnight"),
            Incident(now - 3 * 3600, "crash", "head", "old one"),
            Incident(now - 3 * 3600 + 5, "up", "head", "ready again"),
            Incident(now - 60, "crash", "peer1", "pid 7 exited"),
        ]
    )
    assert run(["incidents", "--since", "2h", "--profile", str(path)]) == 0
    out = capsys.readouterr().out
    assert "peer1: pid 7 exited" in out and "old one" not in out
    assert run(["incidents", "--since", "3h", "--json", "--profile", str(path)]) == 0
    assert [i["message"] for i in json.loads(capsys.readouterr().out)] == ["ready again", "pid 7 exited"]
    assert run(["incidents", "--since", "5h", "--json", "--profile", str(path)]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 4
    assert run(["--once", "--json", "--profile", str(path)]) == 1  # nothing runs
    doc = json.loads(capsys.readouterr().out)
    assert [i["subject"] for i in doc["incidents"]] == ["peer1"]  # the last hour
    assert [i["message"] for i in doc["open_incidents"]] == ["peer down overnight", "pid 7 exited"]  # not over yet


async def test_a_second_console_watches_the_live_workers_read_only_and_names_the_owner(tmp_path):
    profile = fake_profile()
    console = console_process(profile, tmp_path)
    pids = []
    try:
        pids = [int(x) for x in (await asyncio.wait_for(asyncio.to_thread(console.stdout.readline), 60)).split()]
        sup = Supervisor(profile)
        app = HydraConsole(sup, load_model_shape=False)
        async with app.run_test(size=(120, 40)) as pilot:
            table = app.dashboard.query_one("#workers")
            await until(pilot, lambda: all("ready" in str(table.get_cell(n, "state")) for n in ("head", "peer1")))
            assert [str(table.get_cell(n, "pid")) for n in ("head", "peer1")] == [str(p) for p in pids]
            assert "READ-ONLY" in app.sub_title and f"workers run by console pid {console.pid}" in app.sub_title
            await until(pilot, lambda: "no device data yet" not in str(app.dashboard.query_one("#memory").render()))
            await until(pilot, lambda: any(f"started pid {pids[0]}" in ln.text for ln in sup.head.log))  # its log
            await pilot.press("R")
            assert not isinstance(app.screen, ConfirmScreen)  # refused: read-only
            await pilot.press("q")  # nothing of its own to stop: quits at once, the workers stay
            await until(pilot, lambda: not app.is_running)
        assert console.poll() is None and all(psutil.pid_exists(p) for p in pids)
        assert json.loads(sup.state_path.read_text())["console_pid"] == console.pid  # still the owner's file
    finally:
        console.kill()
        console.wait()
        kill_groups(pids)


async def test_the_dashboard_shows_each_peers_pool_as_it_fills():
    def peer(busy: int, queued: int, dropped: int) -> Probe:
        pool = {"size": 2, "busy": busy, "queued": queued, "queue_max": 64, "dropped": dropped, "compute": 1}
        return Probe(True, 200, {"status": "ok"}, {"role": "peer", "pool": pool})

    head = {"role": "head", "peers": [{"addr": "127.0.0.1:8091", "state": "up"}]}
    feed = FixedFeedSource({"head": Probe(True, 200, {"status": "ok"}, head), "peer1": peer(0, 0, 0)})
    sup = Supervisor(Profile(supervisor=SupervisorSettings(poll_s=3600)), attach=True, source=feed)
    app = HydraConsole(sup, load_model_shape=False)
    async with app.run_test(size=(120, 40)) as pilot:
        info = app.dashboard.query_one("#info")
        await until(pilot, lambda: "8091 ● up rtt — — · pool 0/2 · 0 queued · 0 dropped" in str(info.render()))
        feed.probes["peer1"] = peer(2, 64, 7)  # a flood: the pool full, its queue full, connections dropped
        await sup.poll_once()
        app.refresh_view()
        await until(pilot, lambda: "pool 2/2 · 64 queued · 7 dropped" in str(info.render()))
        assert any(i.kind == "pool-drop" and i.subject == "peer1" for i in app.incidents.since(0))


async def test_an_attached_console_offers_only_the_live_split_it_can_apply(tmp_path):
    """--attach: the head is another's to restart, so applying a split asks for the live re-split
    alone, and where CONFIGURE is unavailable (a stand-in head) refuses, restarting nothing."""
    profile = fake_profile()
    owner = Supervisor(profile, log_dir=tmp_path)
    await owner.start()
    try:
        deadline = time.monotonic() + 30
        while not all_ready(owner):
            assert time.monotonic() < deadline, "workers never ready"
            await asyncio.sleep(0.05)
        head_pid = owner.head.pid
        sup = Supervisor(profile, attach=True)
        app = HydraConsole(sup, model_shape=SHAPE)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: all_ready(sup) and sup.stage_ranges() is not None)
            await pilot.press("s", "right", "a")
            question = app.screen.question
            assert isinstance(app.screen, ConfirmScreen) and "10/8" in question, question
            assert "restarts" not in question and "attached" in question, question
            await pilot.press("y")
            await until(pilot, lambda: any("cannot be restarted" in n.message for n in app._notifications))
            assert owner.head.pid == head_pid and owner.head.restarts == 0
            await pilot.press("escape", "q")
    finally:
        await owner.shutdown()


async def test_help_lists_remapped_keys_and_palette_has_every_action(tmp_path):
    profile = fake_profile()
    profile.keys = {"hydra.restart": "ctrl+r", "hydra.split": "S", "hydra.palette": "ctrl+k", "hydra.nope": "x"}
    sup = Supervisor(profile, attach=True)  # nothing runs: attach to ports nobody serves
    app = HydraConsole(sup, model_shape=SHAPE)
    async with app.run_test(size=(80, 24)) as pilot:
        assert any("unknown binding id hydra.nope" in n.message for n in app._notifications)
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        rows = dict(app.screen.rows)
        assert rows["^r"] == "Restart" and rows["S"] == "Split" and rows["q"] == "Quit"
        await pilot.press("escape", "S")
        assert isinstance(app.screen, SplitEditorScreen)
        await pilot.press("escape")
        titles = {c.title for c in app.get_system_commands(app.screen)}
        assert {
            "Help",
            "Split editor",
            "Logs: all workers",
            "Log filter",
            "Save profile",
            "Detail: head",
            "Logs: peer1",
            "Theme: hydra-colourblind",
        } <= titles
        await pilot.press("ctrl+k")
        assert isinstance(app.screen, CommandPalette)
        await pilot.press("escape")
        await pilot.press("t")
        assert app.theme == "hydra-light"
        await pilot.press("q")  # nothing started: quits without asking
        await pilot.pause(0.2)
    assert not app.is_running
    assert all(w.state == State.UNREACHABLE for w in sup.workers.values())


def run_cli(*args, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hydra_console.app.main", *args], capture_output=True, text=True, timeout=timeout
    )


async def test_once_json_reports_running_workers_without_starting_any(tmp_path):
    profile = fake_profile()
    path = tmp_path / "p.toml"
    save_profile(profile, path)
    sup = Supervisor(profile, log_dir=tmp_path)
    await sup.start()
    try:
        deadline = time.monotonic() + 20
        while not all_ready(sup) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        proc = await asyncio.to_thread(run_cli, "--profile", str(path), "--once", "--json")
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        assert [(w["name"], w["state"], w["pid"], w["layers"]) for w in doc["workers"]] == [
            ("head", "ready", sup.head.pid, [0, 9]),
            ("peer1", "ready", sup.workers["peer1"].pid, [9, 18]),
        ]
    finally:
        await sup.shutdown()
    proc = await asyncio.to_thread(run_cli, "--profile", str(path), "--once")
    # Starts nothing of its own, and a script can tell: exit 1 while any worker is not ready.
    assert proc.returncode == 1 and "unreachable" in proc.stdout


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--json"], "--json needs --once or incidents"),
        (["incidents", "--since", "yesterday"], "--since 'yesterday': expected a number and s, m, h or d"),
        (["--profile", "/nonexistent/x.toml", "--once"], "profile not found"),
        (["--theme", "pink", "--profile", "/dev/null"], "unknown theme"),
        # in every mode, not only the dashboard's
        (["--theme", "neon", "--once", "--profile", "/dev/null"], "unknown theme 'neon'"),
        (["--theme", "neon", "--once", "--json", "--profile", "/dev/null"], "unknown theme 'neon'"),
        (["--theme", "neon", "incidents", "--profile", "/dev/null"], "unknown theme 'neon'"),
        (["--theme", "neon", "--write-profile", "/nonexistent/p.toml"], "unknown theme 'neon'"),
    ],
)
def test_cli_errors_are_one_line_without_traceback(args, needle):
    proc = run_cli(*args)
    assert proc.returncode == 2
    assert needle in proc.stderr and "Traceback" not in proc.stderr


def test_write_profile_then_load_it(tmp_path):
    out = tmp_path / "lab.toml"
    proc = run_cli("--write-profile", str(out))
    assert proc.returncode == 0, proc.stderr
    written = load_profile(out)
    assert written.head.port == 8080 and written.name == "lab"  # its own log and state files
    again = run_cli("--write-profile", str(out))
    assert again.returncode == 2 and "exists; pass --force" in again.stderr
    assert run_cli("--write-profile", str(out), "--force").returncode == 0


@pytest.mark.parametrize("where,needle", [("missing/dir/p.toml", "does not exist"), ("/proc/p.toml", "cannot write")])
def test_write_profile_errors_are_clean(tmp_path, where, needle):
    proc = run_cli("--write-profile", str(tmp_path / where))  # /proc: unwritable, even for root
    assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "missing").exists()  # no silent mkdir


def test_a_profile_saved_at_the_default_location_is_used_by_a_plain_console(tmp_path):
    from hydra_console.app.config import resolve_profile_path

    profile = fake_profile()
    save_profile(profile, resolve_profile_path("default"))  # where the console saves the built-in profile
    proc = run_cli("--once", "--json")  # XDG_CONFIG_HOME is this test's (conftest)
    doc = json.loads(proc.stdout)
    assert doc["profile"] == "fake" and doc["workers"][0]["url"] == profile.head.url


def _gone(pid: int) -> bool:
    import psutil

    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def _console_in_a_pty(profile, tmp_path, env: dict | None = None, output: bytearray | None = None):
    """The real `hydra-console` on a pseudo-terminal of its own (a drain thread reads it: a pty that
    nobody reads blocks the app's writes; into `output` if given), with `env` added to its
    environment; returns its pid, the pty and its workers' pids once they serve."""
    import pty
    import threading

    profile.supervisor.log_dir = str(tmp_path / "logs")
    path = save_profile(profile, tmp_path / "p.toml")
    pid, fd = pty.fork()
    if pid == 0:
        os.environ.update({"TERM": "xterm-256color", **(env or {})})
        os.execv(sys.executable, [sys.executable, "-m", "hydra_console.app.main", "--profile", str(path)])

    def drain():
        try:
            while chunk := os.read(fd, 65536):
                if output is not None:
                    output.extend(chunk)
        except OSError:
            pass

    threading.Thread(target=drain, daemon=True).start()
    worker_pids = {}
    deadline = time.monotonic() + 60
    while len(worker_pids) < len(profile.workers) and time.monotonic() < deadline:
        for w in profile.workers:
            try:
                worker_pids[w.name] = HTTP.get(f"{w.url}/status", timeout=1).json()["pid"]
            except httpx.HTTPError:
                pass
        time.sleep(0.2)
    return pid, fd, worker_pids


def _end_console(pid: int, fd: int, worker_pids: dict, close_pty: bool = True) -> None:
    """Whatever a pty test left: its workers' process groups, the console, the pty."""
    kill_groups(worker_pids.values())
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except OSError:
        pass
    if close_pty:
        os.close(fd)


def _wait_exit(pid: int) -> bool:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("hangup", ["sighup", "terminal_closed"])
async def test_a_dropped_ssh_session_detaches_and_the_next_console_adopts_the_workers(tmp_path, hangup):
    """`terminal_closed` is what sshd does: the pty goes away (the kernel sends SIGHUP) and every later
    write to it fails, so the console must not wait to restore the terminal. Serving goes on."""
    profile = fake_profile()
    pid, fd, worker_pids = _console_in_a_pty(profile, tmp_path)
    try:
        assert len(worker_pids) == 2, "the console never started its workers"
        if hangup == "sighup":
            os.kill(pid, signal.SIGHUP)
        else:
            os.close(fd)
        assert _wait_exit(pid), "the console did not exit on SIGHUP"
        assert not any(_gone(p) for p in worker_pids.values())
        nxt = Supervisor(profile)
        assert nxt.state_path.exists()  # the run file stays for the next console
        await nxt.start()
        try:
            assert {w.name: w.pid for w in nxt.workers.values()} == worker_pids
            assert [e.kind for e in nxt.events] == ["adopted", "adopted"]
        finally:
            await nxt.shutdown()  # it stops what it adopted
        assert all(_gone(p) for p in worker_pids.values()) and not nxt.state_path.exists()
    finally:
        _end_console(pid, fd, worker_pids, close_pty=hangup == "sighup")  # else the test closed it


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM])
async def test_adopted_workers_outlive_a_sighup_and_stop_on_a_sigterm(tmp_path, sig):
    """The console adopted the workers: SIGHUP leaves them for the next console, SIGTERM stops them
    (it supervises them as its own)."""
    profile = fake_profile()
    first = Supervisor(profile)
    await first.start()
    pids, pid, fd = [], None, None
    try:
        deadline = time.monotonic() + 30
        while not all_ready(first):
            assert time.monotonic() < deadline, "workers never ready"
            await asyncio.sleep(0.05)
        pids = [w.pid for w in first.workers.values()]
        await first.shutdown(stop_workers=False)
        pid, fd, _ = _console_in_a_pty(profile, tmp_path)  # it adopts them
        deadline = time.monotonic() + 30
        while json.loads(first.state_path.read_text())["console_pid"] != pid:
            assert time.monotonic() < deadline, "the console never adopted the workers"
            await asyncio.sleep(0.05)
        os.kill(pid, sig)
        assert _wait_exit(pid), f"the console did not exit on {sig.name}"
        if sig == signal.SIGTERM:
            deadline = time.monotonic() + 10
            while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert all(_gone(p) for p in pids) and not first.state_path.exists()
            return
        assert not any(_gone(p) for p in pids)
        nxt = Supervisor(profile)
        await nxt.start()
        assert [w.pid for w in nxt.workers.values()] == pids
        await nxt.shutdown()
    finally:
        kill_groups(pids or [w.pid for w in first.workers.values() if w.pid])
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except OSError:
                pass
            os.close(fd)


def test_sigterm_stops_the_workers_the_console_runs(tmp_path):
    profile = fake_profile()
    pid, fd, worker_pids = _console_in_a_pty(profile, tmp_path)
    try:
        assert len(worker_pids) == 2, "the console never started its workers"
        os.kill(pid, signal.SIGTERM)
        assert _wait_exit(pid), "the console did not exit on SIGTERM"
        deadline = time.monotonic() + 10
        while not all(_gone(p) for p in worker_pids.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(_gone(p) for p in worker_pids.values())
        assert not Supervisor(profile).state_path.exists()
    finally:
        _end_console(pid, fd, worker_pids)


# An SGR parameter that sets a foreground or background colour (38/48 start a 256-colour or RGB one).
COLOUR_SGR = re.compile(r"\x1b\[(?:[\d;]*;)?(?:3[0-8]|4[0-8]|9[0-7]|10[0-7])(?:;[\d;]*)?m")


@pytest.mark.parametrize("no_color", [True, False])
def test_no_color_sends_no_colour_codes(tmp_path, no_color):
    """NO_COLOR (no-color.org), on a real terminal: the console draws with no colour at all (bold,
    dim and reverse still mark what colour would); without it, it draws in colour."""
    out = bytearray()
    env = {"NO_COLOR": "1"} if no_color else {}
    pid, fd, worker_pids = _console_in_a_pty(fake_profile(), tmp_path, env, out)
    try:
        assert len(worker_pids) == 2, "the console never started its workers"
        deadline = time.monotonic() + 30
        while out.count(b"ready") < 2 and time.monotonic() < deadline:  # both rows drawn ready
            time.sleep(0.1)
        drawn = out.decode(errors="replace")
        assert drawn.count("ready") >= 2, drawn[-2000:]
        assert bool(COLOUR_SGR.search(drawn)) is not no_color, COLOUR_SGR.findall(drawn)[:5]
        os.kill(pid, signal.SIGTERM)
        assert _wait_exit(pid), "the console did not exit on SIGTERM"
    finally:
        _end_console(pid, fd, worker_pids)


async def test_events_panel_rewraps_after_a_resize():
    sup = Supervisor(Profile(peers=[]), attach=True, source=FixedFeedSource({}))
    app = HydraConsole(sup, load_model_shape=False)
    async with app.run_test(size=(80, 24)) as pilot:
        sup.emit("head", "error", "a long event line " + "x" * 90 + " END")
        log = app.dashboard.query_one("#events")
        await until(pilot, lambda: any(strip.text.rstrip().endswith("END") for strip in log.lines))

        def shown() -> list[str]:
            return [strip.text.rstrip() for strip in log.lines]

        def span(lines: list[str]) -> int:
            """Lines the long event takes (other events, the polls' own, may come and go around it);
            0 while it is not laid out."""
            start = next((i for i, t in enumerate(lines) if "long event" in t), None)
            end = None if start is None else next((i for i, t in enumerate(lines[start:]) if t.endswith("END")), None)
            return 0 if end is None else end + 1

        narrow = shown()
        assert narrow[-1].endswith("END") and span(narrow) > 1  # wrapped
        await pilot.resize_terminal(200, 30)
        # Re-wrapped onto one line: waited for, not slept on (a loaded machine lays out later).
        await until(pilot, lambda: span(shown()) == 1, 60)
        await pilot.press("q")


async def test_sort_pause_refresh_rate_and_help_at_80x24():
    feed = FixedFeedSource(
        {
            "peer1": Probe(True, 200, {"status": "ok"}, {"pid": 7, "uptime_s": 50.0}),
            "head": Probe(True, 200, {"status": "ok"}, {"pid": 9, "uptime_s": 10.0}),
        }
    )
    sup = Supervisor(Profile(supervisor=SupervisorSettings(poll_s=1.0)), attach=True, source=feed)
    app = HydraConsole(sup, load_model_shape=False)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: all_ready(sup))
        dash = app.dashboard
        table = dash.query_one("#workers")

        def order() -> list[str]:
            return [str(table.get_row_at(i)[0]) for i in range(table.row_count)]

        assert order() == ["head", "peer1"]
        await pilot.click("#workers", offset=(40, 1))  # a header cell: sort by that column
        assert dash.sort_column is not None
        dash.sort_column, dash.sort_reverse = "uptime", True
        dash.refresh_view()
        assert order() == ["peer1", "head"] and "by uptime ▼" in table.border_title
        await pilot.press("o")  # the next column after uptime
        assert dash.sort_column == "rst"
        await pilot.press("p")
        assert app.paused and "PAUSED" in app.sub_title
        sup.emit("head", "error", "while paused")
        await pilot.pause(0.2)
        assert not any("while paused" in s.text for s in dash.query_one("#events").lines)
        await pilot.press("p")
        assert any("while paused" in s.text for s in dash.query_one("#events").lines)  # caught up
        await pilot.press("r")
        assert app.refresh_s == 2.0 and "refresh 2 s" in app.sub_title
        await pilot.press("question_mark")
        help_box = app.screen.query_one("#help")
        assert help_box.region.bottom <= 24 and help_box.has_focus
        rows = dict(app.screen.rows)
        assert {"Pause", "Sort"} <= set(rows.values())
        if help_box.max_scroll_y:  # taller than the screen: it scrolls
            await pilot.press("end")
            assert help_box.scroll_y == help_box.max_scroll_y
        await pilot.press("escape", "q")


async def test_an_alert_toasts_and_rings_once_per_incident_and_goes_into_the_history():
    from hydra_console.app.ui.alerts import AlertsScreen

    slow = {"peers": [{"addr": "10.0.0.7:8091", "state": "up", "rtt_ms": 80.0}]}
    fast = {"peers": [{"addr": "10.0.0.7:8091", "state": "up", "rtt_ms": 1.0}]}
    feed = FixedFeedSource({"head": Probe(True, 200, {"status": "ok"}, slow)})
    sup = Supervisor(Profile(peers=[]), attach=True, source=feed)
    app = HydraConsole(sup, load_model_shape=False)
    bells = []
    app.bell = lambda: bells.append(1)
    async with app.run_test(size=(80, 24)) as pilot:
        await sup.poll_once()
        app.check_alerts()
        app.check_alerts()  # still the same incident
        assert len(bells) == 1 and [m for _, m in app.alert_history] == [
            "peer 10.0.0.7:8091 RTT 80.0 ms (alert at 50 ms)"
        ]
        feed.probes["head"] = Probe(True, 200, {"status": "ok"}, fast)
        await sup.poll_once()
        app.check_alerts()
        feed.probes["head"] = Probe(True, 200, {"status": "ok"}, slow)
        await sup.poll_once()
        app.check_alerts()  # cleared, then crossed again: a new incident
        assert len(bells) == 2 and len(app.alert_history) == 2
        await pilot.press("A")
        assert isinstance(app.screen, AlertsScreen)
        shown = [str(w.render()) for w in app.screen.query(Static)]
        assert "thresholds: the profile's [alerts] table · esc closes" in shown, shown  # not read as markup
        await pilot.press("escape", "q")


async def test_triage_strip_and_timeline_follow_the_heads_history():
    ok = {
        "role": "head",
        "state": "ok",
        "startup_stage": 4,
        "requests": {"slots_total": 2},
        "peers": [{"addr": "p:1", "state": "up", "rtt_ms": 1.0}],
    }
    health = {"status": "ok", "startup_stage": 4}
    feed = FixedFeedSource({"head": Probe(True, 200, health, ok)})
    sup = Supervisor(Profile(peers=[], supervisor=SupervisorSettings(poll_s=0.2)), attach=True, source=feed)
    app = HydraConsole(sup, load_model_shape=False)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: len(sup.head.history) >= 1)
        assert app.dashboard.query_one("#advice").display is False  # nothing to change: no strip
        feed.probes["head"] = Probe(
            True,
            200,
            health,
            {
                **ok,
                "requests": {"slots_total": 2, "queued": 9},
                "peers": [{"addr": "p:1", "state": "down", "error": "reset"}],
            },
        )
        strip = app.dashboard.query_one("#advice")
        await until(
            pilot, lambda: strip.display and "queue 9 deep with 2 slots: raise --parallel (i)" in str(strip.render())
        )
        await pilot.press("i")
        assert isinstance(app.screen, TriageScreen)
        timeline = str(app.screen.query_one("#triage-timeline").render())
        assert "peer-down" in timeline and "peer p:1 up → down (reset)" in timeline
        assert "⚑ queue 9 deep with 2 slots: raise --parallel" in str(app.screen.query_one("#triage-advice").render())
        await pilot.press("escape")
        assert app.screen is app.dashboard
