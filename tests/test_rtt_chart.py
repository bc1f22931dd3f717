"""Each peer's round-trip times over the last polls: the chart as text, what the supervisor records
from each poll of the head's /status, and the real app drawing a spike on the dashboard and the
triage screen."""

from __future__ import annotations

from consoles import until

from hydra_console.app.config import Profile, SupervisorSettings
from hydra_console.app.rtt_text import rtt_chart
from hydra_console.app.sources import FixedFeedSource, Probe
from hydra_console.app.supervisor import Supervisor
from hydra_console.app.ui.app import HydraConsole
from hydra_console.app.ui.triage import TriageScreen

HEALTH = {"status": "ok", "startup_stage": 4}


def head_probe(*peers: dict) -> Probe:
    return Probe(True, 200, HEALTH, {"role": "head", "state": "ok", "startup_stage": 4, "peers": list(peers)})


def test_a_spike_stands_up_over_a_healthy_link_and_the_scale_is_stated():
    samples = [(float(t), 0.3) for t in range(10)]
    samples[4:7] = [(4.0, 812.5), (5.0, 812.5), (6.0, 400.0)]  # one stall, held by the head's 10 s window
    text, tone = rtt_chart(samples, alert_ms=50.0, cells=60)
    assert (text, tone) == ("▁▁▁▁██▄▁▁▁ 0–813 ms · 1 spike ≥ 50 ms ⚠ · 9s", "warn")


def test_a_healthy_link_reads_against_the_alert_and_gaps_are_dots():
    samples = [(0.0, 1.0), (1.0, None), (2.0, 25.0), (3.0, 50.0)]  # a poll while the peer was down
    assert rtt_chart(samples, alert_ms=100.0, cells=60) == ("▁·▂▄ 0–100 ms · 3s", "ok")


def test_each_run_over_the_alert_is_one_spike_and_only_the_newest_cells_show():
    samples = [(float(t), ms) for t, ms in enumerate([900, 1, 60, 70, 1, None, 80, 1])]
    assert rtt_chart(samples, 50.0, cells=7) == ("▁▆▇▁·█▁ 0–80 ms · 2 spikes ≥ 50 ms ⚠ · 6s", "warn")


def test_no_round_trip_yet_says_so():
    assert rtt_chart([], 50.0, 30) == ("no round trip measured yet", "muted")
    assert rtt_chart([(0.0, None)], 50.0, 30) == ("no round trip measured yet", "muted")


async def test_each_poll_records_every_peers_worst_round_trip_and_forgets_a_peer_no_longer_driven():
    feed = FixedFeedSource({"head": head_probe({"addr": "a:1", "state": "up", "rtt_ms": 0.3, "rtt_max_ms": 812.5})})
    sup = Supervisor(Profile(peers=[]), attach=True, source=feed)
    await sup.poll_once()
    feed.probes["head"] = head_probe({"addr": "a:1", "state": "down"}, {"addr": "b:2", "state": "up", "rtt_ms": 2.0})
    await sup.poll_once()
    assert {a: [ms for _, ms in h] for a, h in sup.head.rtt_hist.items()} == {"a:1": [812.5, None], "b:2": [2.0]}
    feed.probes["head"] = head_probe({"addr": "b:2", "state": "up", "rtt_ms": 3.0})
    await sup.poll_once()
    assert {a: [ms for _, ms in h] for a, h in sup.head.rtt_hist.items()} == {"b:2": [2.0, 3.0]}


async def test_the_dashboard_and_triage_chart_a_peers_rtt_spike():
    def peer(rtt: float, worst: float) -> Probe:
        return head_probe({"addr": "10.0.0.7:8091", "state": "up", "rtt_ms": rtt, "rtt_max_ms": worst})

    feed = FixedFeedSource({"head": peer(0.3, 0.4)})
    sup = Supervisor(Profile(peers=[], supervisor=SupervisorSettings(poll_s=3600)), attach=True, source=feed)
    app = HydraConsole(sup, load_model_shape=False)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: len(sup.head.history) == 1)  # the app's first poll: a healthy link
        for rtt, worst in [(0.3, 812.5), (0.3, 0.4)]:  # a stall between two polls, then normal again
            feed.probes["head"] = peer(rtt, worst)
            await sup.poll_once()
        app.refresh_view()
        info = app.dashboard.query_one("#info")
        await until(pilot, lambda: "rtt ▁█▁ 0–813 ms · 1 spike ≥ 50 ms ⚠" in str(info.render()))
        await pilot.press("i")
        assert isinstance(app.screen, TriageScreen)
        chart = str(app.screen.query_one("#triage-rtt").render())
        assert "Peer RTT (worst per poll)\n10.0.0.7:8091\n  ▁█▁ 0–813 ms · 1 spike ≥ 50 ms ⚠" in chart
        assert "peer 10.0.0.7:8091 RTT 812.5 ms" in str(app.screen.query_one("#triage-timeline").render())
        await pilot.press("escape", "q")
