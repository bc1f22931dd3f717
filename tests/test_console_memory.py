"""The split editor's memory estimate follows the profile's KV cache types (Pilot on the real app,
stand-in workers) and what the supervisor launches carries them."""

from __future__ import annotations

from consoles import all_ready, fake_profile, port_pair, until

from hydra_console.app import display
from hydra_console.app.config import WorkerSpec
from hydra_console.app.split_plan import ModelShape, WorkerMemory
from hydra_console.app.supervisor import Supervisor
from hydra_console.app.ui.app import HydraConsole


def column(editor, name: str) -> list[str]:
    table = editor.query_one("#split-table").content
    (col,) = [c for c in table.columns if c.header == name]
    return [str(cell) for cell in col._cells]


async def test_split_editor_estimates_kv_in_the_profiles_cache_types(tmp_path, tiny_model):
    # The stand-in workers report 18 layers.
    shape = ModelShape.from_gguf(tiny_model("llama", n_layers=18, n_embd=256, n_ff=256, qtype="Q4_K"))
    profile = fake_profile(cache_type_k="q8_0", cache_type_v="q8_0")
    profile.peers = [WorkerSpec(name="peer1", port=port_pair(), args=["--cache-type-v", "f16"])]  # its own V type
    sup = Supervisor(profile, log_dir=tmp_path)
    assert " --cache-type-k q8_0 --cache-type-v q8_0" in " ".join(sup.command_for("head"))
    assert " ".join(sup.command_for("peer1")).endswith("--cache-type-v q8_0 --cache-type-v f16")  # the last one wins
    try:
        app = HydraConsole(sup, model_shape=shape)
        async with app.run_test(size=(160, 40)) as pilot:
            await until(pilot, lambda: all_ready(sup))
            await pilot.press("s")
            editor = app.screen
            await until(pilot, lambda: editor.is_mounted and editor.counts == [9, 9])
            kv = column(editor, "KV")
            q8 = WorkerMemory("cpu", kv_types=("q8_0", "q8_0"))
            q8_f16 = WorkerMemory("cpu", kv_types=("q8_0", "f16"))
            want = shape.estimate([9, 9], profile.ctx, profile.parallel, [q8, q8_f16])
            assert kv == [display.fmt_bytes(e.kv_bytes) for e in want]
            bf16 = shape.estimate([9, 9], profile.ctx, profile.parallel, [WorkerMemory("cpu")] * 2)
            assert (
                want[0].kv_bytes == bf16[0].kv_bytes * 17 // 32
                and bf16[1].kv_bytes > want[1].kv_bytes > want[0].kv_bytes
            )
            note = str(editor.query_one("#split-note").render())
            assert "head (cpu): weights int8 + bf16 prefill copy, KV q8_0/q8_0" in note
            assert "peer1 (cpu): weights int8 + bf16 prefill copy, KV q8_0/f16" in note
            # The profile's type changed (as a reload would): the next render follows it.
            sup.profile.cache_type_k = sup.profile.cache_type_v = "auto"
            editor.render_plan()
            assert column(editor, "KV")[0] == display.fmt_bytes(bf16[0].kv_bytes)
    finally:
        await sup.shutdown()  # the stand-in workers this test started
