"""The console plans the split against each card (issue 37, item 2): every stage's need, its card's
size less the headroom, why a split does not fit and the split that does; a split that cannot fit
is refused before anything loads (profile start, the split editor's apply), and `--once --json`
shows the plan. The users' setting is checked on a 27B-shaped GGUF written header-only."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from consoles import all_ready, fake_profile, until
from rpc_workers import free_ports

from hydra_console.app.cards import card_capacity, nvml_totals
from hydra_console.app.config import Profile, WorkerSpec, load_profile
from hydra_console.app.launch import worker_argv
from hydra_console.app.split_advisor import advise
from hydra_console.app.split_fit import Planner
from hydra_console.app.split_plan import ModelShape
from hydra_console.app.supervisor import Supervisor
from hydra_console.app.ui.app import HydraConsole
from hydra_console.app.ui.dialogs import ConfirmScreen
from hydra_console.contracts.errors import UserError
from hydra_console.contracts.fit import GIB
from hydra_console.engine.cli import build_parser
from hydra_console.engine.cli_config import head_config
from hydra_console.engine.synth import QWEN35_27B, write_synthetic


@pytest.fixture(scope="module")
def qwen27b(tmp_path_factory):
    """The users' model (Qwen3.5-27B Q5_K_M + its MTP block), metadata and tensor table only."""
    return write_synthetic(tmp_path_factory.mktemp("q27") / "q27.gguf", header_only=True, **QWEN35_27B)


def users_profile(model, head_gb: float, peer_gb: float) -> Profile:
    """Q5_K_M + MTP (draft-max 3), q8_0 KV, 96K context, one slot, 40/24 over a head card and a remote peer's."""
    http, peer_http = free_ports(2, pairs=True)
    return Profile(
        name="users",
        model=str(model),
        ctx=98304,
        parallel=1,
        split=[40, 24],
        cache_type_k="q8_0",
        cache_type_v="q8_0",
        speculative={"type": "mtp", "draft_max": 3},
        head=WorkerSpec(name="head", port=http, card_gb=head_gb),
        peers=[WorkerSpec(name="peer1", port=peer_http, card_gb=peer_gb)],
    )


def planner(profile: Profile, totals=None) -> Planner:
    return Planner(ModelShape.from_gguf(profile.model), profile, [(w, None) for w in profile.workers], totals or {})


def test_header_only_file_is_the_27b_shape_in_a_few_mib_of_disk(qwen27b):
    shape = ModelShape.from_gguf(qwen27b)
    assert shape.n_layers == 64 and shape.tensors.mtp_layers == [64]
    assert os.path.getsize(qwen27b) > 16 * GIB  # the full model's size, as a hole
    assert os.stat(qwen27b).st_blocks * 512 < 64 << 20


def test_users_setting_fits_16_and_12_gb_cards(qwen27b):
    plan = planner(users_profile(qwen27b, 16, 12)).plan([40, 24])
    head, peer = plan.stages
    assert plan.fits is True and plan.refusal is None and plan.proposal is None
    assert head.mtp and not peer.mtp  # the head holds the MTP block
    assert head.capacity == 16 * GIB and peer.capacity == 12 * GIB and head.source == "card_gb"
    assert head.need + head.headroom <= 16 * GIB and head.need > 14 * GIB  # 40 layers + embedding + KV at 96K


def test_a_split_that_cannot_fit_names_need_and_card_and_the_split_that_fits(qwen27b):
    p = planner(users_profile(qwen27b, 15, 12))
    plan = p.plan([40, 24])
    head = plan.stages[0]
    assert plan.fits is False and head.fits is False and plan.stages[1].fits is True
    need = f"{head.need / GIB:.1f} GiB"
    assert f"head needs {need} for layers [0,40) + the MTP block + 0.5 GiB headroom, card has 15.0 GiB" in plan.refusal
    # The fitting split that moves the fewest layers: one more layer on the head does not fit.
    (n_head, n_peer) = plan.proposal
    assert n_head < 40 and all(s.fits for s in plan.proposal_stages)
    assert p.plan([n_head + 1, n_peer - 1]).fits is False
    assert f"{n_head}/{n_peer} fits" in plan.refusal
    # A bigger headroom (the profile's headroom_gb) asks for more room.
    roomy = users_profile(qwen27b, 15, 12)
    roomy.headroom_gb = 2.0
    assert planner(roomy).plan(plan.proposal).fits is False


def test_the_output_head_on_the_last_peer_fits_the_users_split_on_15_and_12_gb_cards(qwen27b):
    """`output_stage = "last"`: the output norm + head (0.97 GiB), the MTP block and its KV leave the
    head for peer1, so 40/24 fits a 15 GiB head card; with them on the head it does not, and the
    refusal says the other place fits, with both stages' needs."""
    profile = users_profile(qwen27b, 15, 12)
    profile.output_stage = "last"
    plan = planner(profile).plan([40, 24])
    head, peer = plan.stages
    assert plan.fits is True and plan.refusal is None and plan.output_stage == "last"
    assert peer.mtp and not head.mtp  # the MTP block lives with the output head
    assert head.need < 13.8 * GIB and peer.need < 10.2 * GIB
    # The same split with the output on the head: refused, naming the alternative and its numbers.
    on_head = planner(users_profile(qwen27b, 15, 12)).plan([40, 24])
    assert on_head.fits is False and on_head.output_stage == "head" and on_head.stages[0].mtp
    alt = on_head.alternative
    assert (
        alt.output_stage == "last" and alt.counts == [40, 24] and [s.need for s in alt.stages] == [head.need, peer.need]
    )
    assert (
        f'; with output_stage = "last" (the output head and MTP block on peer1) 40/24 fits: '
        f"head {head.need / GIB:.1f} GiB, peer1 {peer.need / GIB:.1f} GiB" in on_head.refusal
    )
    # Moved, not made: the two stages need the same bytes together either way, but for the prefill's
    # dequantization scratch (each stage's largest matrix; the output head's is no stage's largest here).
    assert sum(s.need for s in on_head.stages) == head.need + peer.need
    # Without MTP drafting only the output head moves; a split that fits as it is offers no alternative.
    plain = users_profile(qwen27b, 14.5, 12)
    plain.speculative.type = "off"
    assert "(the output head on peer1) 40/24 fits" in planner(plain).plan([40, 24]).refusal
    assert planner(users_profile(qwen27b, 16, 12)).plan([40, 24]).alternative is None


def test_output_stage_reaches_the_heads_argv_only_with_peers(qwen27b):
    profile = users_profile(qwen27b, 15, 12)
    assert "--output-stage" not in worker_argv(profile, profile.head, "head", [40, 24])
    profile.output_stage = "last"
    argv = worker_argv(profile, profile.head, "head", [40, 24])
    assert argv[argv.index("--output-stage") + 1] == "last"
    assert head_config(build_parser().parse_args(argv[argv.index("serve") :]), {}).output_stage == "last"
    assert "--output-stage" not in worker_argv(profile, profile.peers[0], "peer", None)
    profile.split = None
    profile.peers = []  # a head alone is the last stage: nothing to say
    assert "--output-stage" not in worker_argv(profile, profile.head, "head", None)


def test_a_bad_output_stage_is_refused_naming_the_key(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('output_stage = "tail"\n')
    with pytest.raises(UserError, match="output_stage: Input should be 'head' or 'last'"):
        load_profile(path)


def test_no_split_fits_cards_too_small(qwen27b):
    plan = planner(users_profile(qwen27b, 4, 4)).plan([40, 24])
    assert plan.proposal is None and plan.refusal.endswith("no split fits these cards")


def test_card_sizes_from_card_gb_else_nvml_else_unknown(qwen27b):
    assert isinstance(nvml_totals(), dict)  # no NVML here (or no GPU): an empty dict, never an error
    spec = WorkerSpec(name="head", port=8080)
    assert card_capacity(spec, None, {}) == (None, "")
    assert card_capacity(spec, None, {0: 16 * GIB}) == (16 * GIB, "nvml")
    assert card_capacity(spec.model_copy(update={"device": "cuda:1"}), None, {0: 16 * GIB}) == (None, "")
    assert card_capacity(spec.model_copy(update={"card_gb": 12}), None, {0: 16 * GIB}) == (12 * GIB, "card_gb")
    remote = WorkerSpec(name="peer1", host="10.0.0.2", port=8090)
    assert card_capacity(remote, None, {0: 16 * GIB}) == (None, "")  # NVML here says nothing of its card
    # Unknown cards: the plan shows needs, refuses nothing.
    profile = users_profile(qwen27b, 15, 12)
    profile.head.card_gb = profile.peers[0].card_gb = None
    plan = planner(profile).plan([40, 24])
    assert plan.fits is None and plan.refusal is None and plan.stages[0].need > 0
    # Through NVML, for a local head on a GPU.
    assert planner(profile, {0: 15 * GIB}).plan([40, 24]).stages[0].source.startswith("nvml, less")


def test_workers_on_one_card_share_it(qwen27b):
    """A head and a peer on this machine's one GPU (NVML): each stage gets what the other leaves."""
    profile = users_profile(qwen27b, 15, 12)
    profile.head.card_gb = profile.peers[0].card_gb = None
    needs = [s.need for s in planner(profile, {0: 1 << 40}).plan([40, 24]).stages]  # as GPU stages
    roomy = planner(profile, {0: sum(needs) + 1 * GIB}).plan([40, 24])
    assert roomy.fits is True and roomy.stages[0].capacity == sum(needs) + 1 * GIB - needs[1]
    tight = planner(profile, {0: sum(needs)}).plan([40, 24])
    assert tight.fits is False and tight.proposal is None  # moving layers within one card frees nothing
    assert f"less {needs[1] / GIB:.1f} GiB of peer1 on it" in tight.refusal
    assert f"less {needs[0] / GIB:.1f} GiB of head on it" in tight.refusal


def test_the_advisor_proposes_only_a_split_that_fits(qwen27b):
    """Measured: the peer's layers are 4x slower, so the fastest split piles layers on the head; its
    card stops it where the head's stage no longer fits."""
    p = planner(users_profile(qwen27b, 15, 12))
    stages = [
        {"name": "head", "layers": [0, 40], "device": "cuda:0", "decode_ms": [0.1] * 40, "layer_bytes": [1] * 64},
        {"name": "peer1", "layers": [40, 64], "device": "cuda:0", "decode_ms": [0.4] * 24, "layer_bytes": [1] * 64},
    ]
    free = advise({"stages": stages})
    assert free.proposal == [63, 1]  # memory unknown to the probe: everything on the fast card
    fits = advise({"stages": stages}, fits=p.fits_for([40, 24]))
    n_head = fits.proposal[0]
    assert p.plan(fits.proposal).fits is True and p.plan([n_head + 1, 63 - n_head]).fits is False


def test_once_json_shows_the_plan(qwen27b, tmp_path):
    path = tmp_path / "users.toml"
    path.write_text(
        f'model = "{qwen27b}"\nctx = 98304\nparallel = 1\nsplit = [40, 24]\ncache_type_k = "q8_0"\n'
        'cache_type_v = "q8_0"\n[speculative]\ntype = "mtp"\ndraft_max = 3\n'
        f'[head]\nname = "head"\nport = {free_ports(1)[0]}\ncard_gb = 15\n'
        f'[[peers]]\nname = "peer1"\nport = {free_ports(1)[0]}\ncard_gb = 12\n'
    )
    out = subprocess.run(
        [sys.executable, "-m", "hydra_console.app.main", "--once", "--json", "--profile", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1, out.stderr  # nothing runs
    plan = json.loads(out.stdout)["plan"]
    assert plan["split"] == "40/24" and plan["fits"] is False and plan["proposal"]
    head, peer = plan["stages"]
    assert head["capacity_bytes"] == 15 * GIB and head["capacity_source"] == "card_gb" and head["fits"] is False
    assert head["need_bytes"] + head["headroom_bytes"] > head["capacity_bytes"] and head["mtp"] is True
    assert peer["fits"] is True and peer["need_bytes"] > 0
    assert "head needs" in plan["refusal"] and "card has 15.0 GiB" in plan["refusal"]
    # The output head on the head; with it (and the MTP block) on peer1 the split fits.
    assert plan["output_stage"] == "head" and 'with output_stage = "last"' in plan["refusal"]
    alt = plan["alternative"]
    assert alt["output_stage"] == "last" and alt["split"] == "40/24" and alt["fits"] is True
    assert [s["mtp"] for s in alt["stages"]] == [False, True]
    path.write_text(path.read_text().replace("split = [40, 24]\n", 'split = [40, 24]\noutput_stage = "last"\n'))
    out = subprocess.run(
        [sys.executable, "-m", "hydra_console.app.main", "--once", "--json", "--profile", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    plan = json.loads(out.stdout)["plan"]
    assert plan["output_stage"] == "last" and plan["fits"] is True and plan["refusal"] is None
    assert [s["mtp"] for s in plan["stages"]] == [False, True] and plan["alternative"] is None
    # --headroom-gb overrides the profile's: with none, the same split still does not fit 15 GiB.
    out = subprocess.run(
        [sys.executable, "-m", "hydra_console.app.main", "--once", "--json", "-p", str(path), "--headroom-gb", "-1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "--headroom-gb must be >= 0" in out.stderr


def column(editor, name: str) -> list[str]:
    (col,) = [c for c in editor.query_one("#split-table").content.columns if c.header == name]
    return [str(cell) for cell in col._cells]


def note(editor) -> str:
    return str(editor.query_one("#split-note").render())


def tiny_profile(tiny_model, split, head_gb, peer_gb) -> Profile:
    """Stand-in workers (18 layers) planned on a real GGUF of 18 layers, on CPU, with card sizes."""
    model = tiny_model("llama", n_layers=18, n_embd=256, n_ff=1024, qtype="Q4_K")
    profile = fake_profile(model=str(model), split=split, headroom_gb=0.0)
    profile.head.device = profile.peers[0].device = "cpu"
    profile.head.card_gb, profile.peers[0].card_gb = head_gb, peer_gb
    return profile


def stage_gib(profile: Profile, counts) -> list[float]:
    return [s.need / GIB for s in planner(profile).plan(counts).stages]


async def test_profile_start_refuses_a_split_that_cannot_fit(tmp_path, tiny_model):
    probe = tiny_profile(tiny_model, [12, 6], 1.0, 1.0)
    head_gib, peer_gib = stage_gib(probe, [12, 6])
    profile = tiny_profile(tiny_model, [12, 6], head_gib * 0.9, 1.0)  # the head's card is 10% short
    sup = Supervisor(profile, log_dir=tmp_path)
    try:
        app = HydraConsole(sup, load_model_shape=False)
        async with app.run_test(size=(160, 40)) as pilot:
            await until(pilot, lambda: any(e.kind == "refused" for e in sup.events))
            (ev,) = [e for e in sup.events if e.kind == "refused"]
            assert "split 12/6 does not fit: head needs" in ev.message and "(card_gb)" in ev.message
            assert any("does not fit" in str(n.message) for n in app._notifications)
            assert all(w.pid is None for w in sup.workers.values())  # nothing was started
    finally:
        await sup.shutdown()


async def test_split_editor_shows_each_card_and_refuses_a_split_that_cannot_fit(tmp_path, tiny_model):
    probe = tiny_profile(tiny_model, [9, 9], 1.0, 1.0)
    nine, _ = stage_gib(probe, [9, 9])
    twelve, _ = stage_gib(probe, [12, 6])
    head_gb = (nine + twelve) / 2  # 9 layers fit the head's card, 12 do not
    profile = tiny_profile(tiny_model, [9, 9], head_gb, 1.0)
    sup = Supervisor(profile, log_dir=tmp_path)
    try:
        app = HydraConsole(sup, model_shape=ModelShape.from_gguf(profile.model))
        async with app.run_test(size=(200, 50)) as pilot:
            await until(pilot, lambda: all_ready(sup))
            await pilot.press("s")
            editor = app.screen
            await until(pilot, lambda: editor.is_mounted and editor.counts == [9, 9])
            assert [cell.endswith("✗") for cell in column(editor, "total")] == [False, False]
            assert "cards, each keeping 0 B free: head" in note(editor) and "✗" not in note(editor)
            for _ in range(3):
                await pilot.press("right")
            assert editor.counts == [12, 6]
            assert [cell.endswith("✗") for cell in column(editor, "total")] == [True, False]
            assert "split 12/6 does not fit: head needs" in note(editor) and "f takes the split that fits" in note(
                editor
            )
            await pilot.press("a")
            await pilot.pause()
            assert not isinstance(app.screen, ConfirmScreen)  # refused before asking, nothing applied
            assert any("split 12/6 does not fit" in str(n.message) for n in app._notifications)
            assert sup.split == [9, 9]
            await pilot.press("f")  # the draft becomes the split that fits, fewest layers moved
            assert editor.counts == planner(profile).plan([12, 6]).proposal and editor.counts[0] in (10, 11)
            assert [cell.endswith("✗") for cell in column(editor, "total")] == [False, False]
            # Every other way in (the palette, a script) meets the supervisor's refusal.
            with pytest.raises(Exception, match="does not fit"):
                await sup.apply_split([12, 6])
    finally:
        await sup.shutdown()
