"""The console's side of prefill/decode disaggregation: the profile key that becomes the head's
--prefill-worker, each worker's reported role, and the transfers and fallbacks of /status `pd`."""

from __future__ import annotations

import pytest

from hydra_console.app import display
from hydra_console.app.config import Profile, profile_from_dict
from hydra_console.app.sources import FixedFeedSource, Probe
from hydra_console.app.supervisor import Supervisor
from hydra_console.contracts.status import Status
from hydra_console.engine.errors import UserError

pytestmark = pytest.mark.unit

PD = {
    "prefill_worker": "gpu2:8181",
    "threshold": 512,
    "transfers": 3,
    "bytes": 3_000_000,
    "seconds": 0.003,
    "fallbacks": 2,
    "fallback_reasons": {"deadline": 1, "down": 1},
    "recent": [
        {"request": 7, "tokens": 900, "bytes": 1_000_000, "ms": 12.0},
        {"request": 8, "tokens": 700, "fallback": "deadline", "error": "too slow"},
    ],
}


def test_the_prefill_worker_profile_key_becomes_the_heads_flags():
    sup = Supervisor(Profile(prefill_worker="gpu2:8181", prefill_threshold=512), source=FixedFeedSource({}))
    argv = sup.command_for("head")
    assert argv[argv.index("--prefill-worker") + 1] == "gpu2:8181"
    assert argv[argv.index("--prefill-threshold") + 1] == "512"
    assert "--prefill-worker" not in Supervisor(Profile(), source=FixedFeedSource({})).command_for("head")
    assert "--prefill-worker" not in sup.command_for("peer1")
    with pytest.raises(UserError, match="prefill_worker: .*HOST:PORT"):
        profile_from_dict({"prefill_worker": "gpu2"})


async def test_reported_role_and_transfers_show():
    feed = FixedFeedSource(
        {
            "head": Probe(True, 200, {"status": "ok"}, {"role": "head", "pd": PD}),
            "peer1": Probe(True, 200, {"status": "ok"}, {"role": "prefill", "pd": {"served": 4, "served_bytes": 2048}}),
        }
    )
    sup = Supervisor(Profile(), attach=True, source=feed, clock=lambda: 0.0)
    await sup.poll_once()
    assert display.worker_row(sup.workers["peer1"], sup, now=0.0)[0][1] == "prefill"
    assert display.worker_row(sup.head, sup, now=0.0)[0][1] == "head"
    lines = display.pd_lines(sup.head.status)
    assert lines[0].startswith("prefill worker gpu2:8181 (≥ 512 tokens) · 3 transfers") and "1.00 GB/s" in lines[0]
    assert "fallbacks 2 (deadline 1, down 1)" in lines[0]
    assert lines[1:] == ["request 7: 900 tokens · 976.6 KiB in 12 ms", "request 8: 700 tokens · fallback: deadline"]
    assert display.pd_lines(sup.workers["peer1"].status) == ["served 4 prefills · 2.0 KiB"]


@pytest.mark.parametrize("pd", [None, 3, "x", {"recent": "no", "fallback_reasons": [1]}, {"recent": [1, {"ms": "x"}]}])
def test_a_malformed_pd_section_never_raises(pd):
    st = Status.from_json({"role": "head", "pd": pd})
    assert isinstance(display.pd_lines(st), list)
