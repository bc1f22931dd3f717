"""The split advisor on REAL workers: a peer slowed on purpose (`hydra-engine peer --layer-delay-ms`,
a hidden test flag), the console's split editor measuring, proposing and applying a split live."""

from __future__ import annotations

import asyncio

import openai
import pytest
from consoles import all_ready, port_pair, until

from hydra_console.app.config import Profile, SupervisorSettings, WorkerSpec
from hydra_console.app.split_plan import ModelShape
from hydra_console.app.supervisor import Supervisor
from hydra_console.app.ui.app import HydraConsole
from hydra_console.app.ui.dialogs import ConfirmScreen
from hydra_console.app.ui.split_editor import SplitEditorScreen

DELAY_MS = 50  # per layer on the peer: dominates a tiny model's own compute even on a loaded machine
N_LAYERS = 8


def ms_per_token(client: openai.OpenAI) -> float:
    """The head's own decode time per token for a fixed-length greedy completion."""
    r = client.completions.create(
        model="any",
        prompt="one two three",
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True, "cache_prompt": False},
    )
    assert r.usage.completion_tokens == 12
    return r.model_extra["timings"]["predicted_per_token_ms"]


async def test_advisor_moves_layers_off_a_slowed_peer_and_the_proposal_beats_the_even_split(tiny_model, tmp_path):
    model = tiny_model("llama", n_layers=N_LAYERS)
    profile = Profile(
        name="advisor",
        model=str(model),
        ctx=128,
        parallel=1,
        head=WorkerSpec(name="head", port=port_pair(), device="cpu"),
        peers=[WorkerSpec(name="peer1", port=port_pair(), device="cpu", args=["--layer-delay-ms", str(DELAY_MS)])],
        supervisor=SupervisorSettings(poll_s=0.25, grace_s=10),
    )
    sup = Supervisor(profile, log_dir=tmp_path, state_path=tmp_path / "run.json")
    app = HydraConsole(sup, model_shape=ModelShape.from_gguf(model))
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: all_ready(sup) and sup.stage_ranges() is not None, timeout=120)
        assert [r for _, r in sup.stage_ranges()] == [(0, 4), (4, 8)]
        client = openai.OpenAI(base_url=f"{sup.head.spec.url}/v1", api_key="unused", max_retries=0, timeout=120)
        even_ms = await asyncio.to_thread(ms_per_token, client)

        await pilot.press("s", "m")
        editor = app.screen
        assert isinstance(editor, SplitEditorScreen)
        await until(pilot, lambda: editor.advice is not None, timeout=120)
        advice = editor.advice
        peer = advice.stages[1]
        assert peer.mean_ms() > DELAY_MS and advice.stages[0].mean_ms() < DELAY_MS  # each stage timed its own layers
        assert advice.proposal == [N_LAYERS - 1, 1]  # every layer but the one a peer must keep leaves the slow peer
        assert advice.best.tok_s > 2 * advice.current.tok_s
        shown = str(editor.query_one("#split-verdict").render())
        assert "proposal 7/1" in shown and "tok/s" in shown

        await pilot.press("P")
        assert isinstance(app.screen, ConfirmScreen) and "7/1" in app.screen.question
        await pilot.press("y")
        await until(pilot, lambda: [r for _, r in sup.stage_ranges() or []] == [(0, 7), (7, 8)], timeout=60)
        # After applying, the advisor measures again: predicted against achieved, on the new split.
        await until(pilot, lambda: editor.advice is not None and editor.advice.current.counts == [7, 1], timeout=120)
        shown = str(editor.query_one("#split-verdict").render())
        assert "applied 7/1" in shown and "achieved" in shown
        assert any(e.kind == "split" and "7/1" in e.message for e in sup.events)
        # The editor shows the applied split, so `a` there applies it, not the draft from before.
        assert editor.counts == [7, 1] and "split 7/1" in str(editor.query_one("#split-note").render())
        await pilot.press("a")
        assert isinstance(app.screen, ConfirmScreen) and "Apply split 7/1?" in app.screen.question
        await pilot.press("n")

        proposal_ms = await asyncio.to_thread(ms_per_token, client)
        print(
            f"decode ms/token: even 4/4 {even_ms:.1f}, proposal 7/1 {proposal_ms:.1f}; "
            f"predicted {advice.current.step_ms:.1f} -> {advice.best.step_ms:.1f}"
        )
        # The injected delay dominates: 4 slowed layers a step against 1 (a generous margin for noise).
        assert proposal_ms < 0.6 * even_ms

        await pilot.press("escape", "q")
        if isinstance(app.screen, ConfirmScreen):
            await pilot.press("y")
        await until(pilot, lambda: not sup.running_managed(), timeout=30)


@pytest.mark.unit
def test_hidden_delay_flag_is_validated():
    from hydra_console.contracts.errors import UserError
    from hydra_console.engine.cli import build_parser
    from hydra_console.engine.cli_config import peer_config

    args = build_parser().parse_args(["peer", "--layer-delay-ms", "-1"])
    with pytest.raises(UserError, match="--layer-delay-ms"):
        peer_config(args, {})
    assert "--layer-delay-ms" not in build_parser()._subparsers._group_actions[0].choices["peer"].format_help()
