"""The pooled KV cache (`--kv-unified`): blocks taken as slots grow and given back, a pooled stage
computing what a reserved one does, slot state across both, a clear error when the pool is short,
and a real server whose idle slots' prompt cache is taken back for new requests."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
import torch
from rpc_workers import head, running
from stages import load, prefill

from hydra_console.engine import slot_state
from hydra_console.engine.cli import build_parser
from hydra_console.engine.cli_config import head_config
from hydra_console.engine.errors import UserError
from hydra_console.engine.model import ForwardBatch
from hydra_console.engine.model.kv_blocks import KV_BLOCK, KVBlocks, KVPoolFull

TOKENS = torch.randint(0, 1000, (400,), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.mark.unit
def test_blocks_are_taken_as_slots_grow_and_given_back():
    blocks = KVBlocks.pool(3, 1000, 5 * KV_BLOCK, "cpu")
    blocks.fit({0: 300})
    blocks.fit({1: 2 * KV_BLOCK})
    assert [len(h) for h in blocks.held] == [3, 2, 0] and blocks.free_tokens == 0
    with pytest.raises(KVPoolFull, match=r"needs 1 more blocks of 128 positions, 0 of 5 are free.*--kv-unified"):
        blocks.fit({2: 1})
    assert blocks.held[2] == [] and blocks.free_tokens == 0  # a refused fit takes nothing
    assert blocks.shortfall({0: 100, 2: 2 * KV_BLOCK}) == 0  # slot 0 cut back to one block pays for slot 2
    blocks.fit({0: 100, 2: 2 * KV_BLOCK})
    assert [len(h) for h in blocks.held] == [1, 2, 2]
    assert len({b for h in blocks.held for b in h}) == 5 and 0 not in {b for h in blocks.held for b in h}
    for slot, held in enumerate(blocks.held):
        assert blocks.table[slot, : len(held)].tolist() == held
    blocks.release(1)
    assert blocks.free_tokens == 2 * KV_BLOCK and blocks.pool_tokens == 5 * KV_BLOCK


def _decode(stage, slots_lengths: dict[int, int], steps: int) -> torch.Tensor:
    """Logits of `steps` batched decode steps over the given slots, from their lengths on."""
    out = []
    for i in range(steps):
        slots = list(slots_lengths)
        positions = [n + i for n in slots_lengths.values()]
        tokens = [TOKENS[(p * 7) % len(TOKENS)] for p in positions]
        h = stage.run_layers(stage.embed(torch.tensor(tokens)), torch.tensor(slots), torch.tensor(positions))
        out.append(stage.logits(h))
    return torch.stack(out)


@pytest.mark.parametrize("types", [("auto", "auto"), ("q8_0", "q8_0")])
def test_a_pooled_stage_computes_what_a_reserved_one_does(tiny_model, types):
    path = tiny_model("gemma3", head_dim=32)  # sliding-window layers too
    reserved = load(path, n_slots=3, n_ctx=512, kv_types=types)
    pooled = load(path, n_slots=3, n_ctx=512, kv_types=types, kv_pool=6 * KV_BLOCK)
    for stage in (reserved, pooled):  # prefill chunks cross block boundaries
        prefill(stage, TOKENS[:100], slot=0)
        prefill(stage, TOKENS[:60], slot=2)
        prefill(stage, TOKENS[100:250], slot=0, start=100)
    assert [len(h) for h in pooled.kv_blocks.held] == [2, 0, 1]
    want, got = _decode(reserved, {0: 250, 2: 60}, 12), _decode(pooled, {0: 250, 2: 60}, 12)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The batched torch path (what CUDA graphs capture, here on CPU) reads through the block table too.
    h = pooled.embed(torch.tensor([5, 6]))
    slots, positions = torch.tensor([2, 0]), torch.tensor([72, 262])
    eager = pooled.run_layers(h, slots, positions)
    batched = pooled.forward(h, ForwardBatch.batched(slots, positions, 1, pooled.n_ctx))
    torch.testing.assert_close(batched, eager, rtol=1e-5, atol=1e-5)
    assert pooled.kv_bytes < reserved.kv_bytes / 2 * 1.2  # 7 blocks of 128 against 3 x 512


def test_slot_state_moves_between_pooled_and_reserved_stages(tiny_model):
    path = tiny_model("llama", head_dim=32)
    reserved = load(path, n_slots=2, n_ctx=512)
    pooled = load(path, n_slots=2, n_ctx=512, kv_pool=4 * KV_BLOCK)
    fp = reserved.g.fingerprint
    prefill(pooled, TOKENS[:200], slot=1)
    state = bytes(slot_state.save(pooled, 1, TOKENS[:200], fp))
    assert slot_state.restore(reserved, 0, slot_state.Reader(state), fp) == TOKENS[:200]
    back = bytes(slot_state.save(reserved, 0, TOKENS[:200], fp))
    assert back == state  # what went in comes out, byte for byte
    assert slot_state.restore(pooled, 0, slot_state.Reader(back), fp) == TOKENS[:200]
    assert [len(h) for h in pooled.kv_blocks.held] == [2, 2]
    torch.testing.assert_close(_decode(pooled, {0: 200}, 3), _decode(reserved, {0: 200}, 3), rtol=1e-5, atol=1e-5)


def test_a_full_pool_refuses_the_step_and_loses_nothing(tiny_model):
    path = tiny_model("llama", head_dim=32)
    reserved = load(path, n_slots=2, n_ctx=512)
    pooled = load(path, n_slots=2, n_ctx=512, kv_pool=2 * KV_BLOCK)
    for stage in (reserved, pooled):
        prefill(stage, TOKENS[:200], slot=0)
    with pytest.raises(KVPoolFull, match="KV pool full, the context size has been exceeded"):  # as llama-server says
        prefill(pooled, TOKENS[:100], slot=1)
    assert pooled.kv_blocks.held[1] == []
    torch.testing.assert_close(_decode(pooled, {0: 200}, 3), _decode(reserved, {0: 200}, 3), rtol=1e-5, atol=1e-5)


@pytest.mark.unit
@pytest.mark.parametrize(
    "argv, ctx, pool",
    [
        (["-c", "4096", "-np", "8"], 512, None),
        (["-c", "4096", "-np", "8", "--kv-unified"], 4096, 4096),
        (["--ctx", "512", "-c", "4096", "-np", "8", "-kvu"], 512, 4096),
        (["--ctx", "512", "-np", "8", "--kv-unified"], 512, 4096),
    ],
)
def test_kv_unified_flags(argv, ctx, pool):
    cfg = head_config(build_parser().parse_args(["serve", *argv]), {})
    assert (cfg.model.ctx, cfg.model.kv_pool) == (ctx, pool)


@pytest.mark.unit
@pytest.mark.parametrize(
    "argv, match",
    [
        (["--ctx", "512", "-c", "4096"], "give one of them"),
        (["--ctx", "8192", "-c", "4096", "--kv-unified"], "--ctx 8192 per slot exceeds the --kv-unified pool"),
    ],
)
def test_kv_unified_flag_errors(argv, match):
    with pytest.raises(UserError, match=match):
        head_config(build_parser().parse_args(["serve", *argv]), {})


def test_a_server_takes_back_idle_prompt_cache_and_reports_a_full_pool(tiny_model, tmp_path):
    """Four slots in a pool of four blocks: four short requests fill it, their prompt cache stays; a longer request then gets the idle slots' blocks. Streams that outgrow the pool
    together: the newest wait for blocks, and when nothing can grow the newest is ended with an
    OpenAI-shaped 500 (llama-server's "context size has been exceeded") while the others complete; the server goes on serving."""
    server = head(
        tiny_model("llama", head_dim=32),
        tmp_path,
        (),
        "--dtype",
        "float32",
        "-c",
        str(4 * KV_BLOCK),
        "--kv-unified",
        parallel=4,
        ctx=4 * KV_BLOCK,
    )
    with running(server) as w:
        client = openai.OpenAI(base_url=f"{w.url}/v1", api_key="none", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        words = [f"w{i}" for i in range(400)]
        # One after another, without prompt-cache matching: each takes an empty slot (the least
        # cached), so all four slots keep a block of prompt cache, whatever the machine's speed.
        results = [
            client.completions.create(
                model=model,
                prompt=" ".join(words[i * 20 : i * 20 + 20]),
                max_tokens=30,
                temperature=0,
                extra_body={"cache_prompt": False},
            )
            for i in range(4)
        ]
        assert all(r.usage.completion_tokens == 30 for r in results), results
        long = client.completions.create(model=model, prompt=" ".join(words[100:150]), max_tokens=40, temperature=0)
        assert long.usage.prompt_tokens > KV_BLOCK and long.usage.completion_tokens == 40
        assert "KV pool short: took back the prompt cache of" in w.log()

        done, errors = [], []

        def grow(i: int, n: int) -> None:
            try:
                done.append(
                    client.completions.create(
                        model=model,
                        prompt=" ".join(words[i * 40 : i * 40 + 30]),
                        max_tokens=n,
                        temperature=0,
                        extra_body={"ignore_eos": True},
                    )
                )
            except openai.APIStatusError as e:
                errors.append(e)

        for n_req, n_gen in ((6, KV_BLOCK), (2, 4 * KV_BLOCK - 200)):  # 6 x 2 blocks; then 2 x 3 of 4
            done.clear()
            threads = [threading.Thread(target=grow, args=(i, n_gen)) for i in range(n_req)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            # Six streams of two blocks each in a pool of four: the newest wait; when nothing can
            # grow the newest is ended (500, as llama-server) and the others go on. None is lost silently.
            assert len(done) + len(errors) == n_req and done, errors
            assert all(r.usage.completion_tokens == n_gen for r in done)
            assert all(e.status_code == 500 and "context size has been exceeded" in str(e.body) for e in errors), errors
            errors.clear()
        again = client.completions.create(model=model, prompt="w1 w2 w3", max_tokens=5, temperature=0)
        assert again.usage.completion_tokens == 5


def test_a_peer_holds_the_pool_the_head_asks_for(tiny_model, tmp_path):
    """Head and peer (real processes, float32) with --kv-unified: LOAD_STAGE carries the pool, the
    peer's /status counts its bytes, and greedy text equals a solo head's with reserved slots."""
    from rpc_workers import greedy, solo_and_split

    model = tiny_model("llama", head_dim=32)
    pool = 3 * KV_BLOCK
    with solo_and_split(model, tmp_path, "--split", "1/1", "--kv-unified", "-c", str(pool)) as w:
        peer_kv = w["peer"].status()["stages"][0]["kv_bytes"]
        assert peer_kv == (pool + KV_BLOCK) * 2 * 32 * 2 * 4  # K and V of block 0 + the pool: 2 KV heads x 32, float32
        for prompt in ("the quick brown fox", "w1 w2 w3 w4 w5 w6"):
            assert greedy(w["head"], prompt, 20)[0] == greedy(w["solo"], prompt, 20)[0]


def test_a_full_pool_fails_a_request_that_holds_blocks_and_lets_waiting_prompts_wait(tiny_model, tmp_path):
    """llama-server's `-c 256 -np 4 --kv-unified` (here two blocks of 128): one request streams two
    long generations, which take a block each; two short requests arrive and wait for room. When
    both long ones need a second block nothing fits: the newer ends, saying the context size has
    been exceeded (its block lets the older grow), and the short ones, which hold nothing, wait and
    complete. Every answer is all of n_predict with the reason it stopped, or that error: never a
    silent short answer."""
    server = head(tiny_model("llama", head_dim=32), tmp_path, (), "-c", "256", "--kv-unified", parallel=4, ctx=256)
    with running(server) as w:
        long, short = [], []
        started = threading.Event()

        def stream_long() -> None:
            body = {"prompt": ["A", "A"], "n_predict": 200, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{w.url}/completion", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        started.set()  # both are in: their prompts took a block each
                        chunk = json.loads(line[6:])
                        if "error" in chunk or chunk["stop"]:  # how each one ended
                            long.append(chunk)
            started.set()

        def ask_short() -> None:
            body = {"prompt": "A", "n_predict": 20, "ignore_eos": True}
            short.append(httpx.post(f"{w.url}/completion", json=body, timeout=120))

        threads = [threading.Thread(target=stream_long)]
        threads[0].start()
        assert started.wait(60), w.log()
        threads += [threading.Thread(target=ask_short) for _ in range(2)]
        for t in threads[1:]:
            t.start()
        for t in threads:
            t.join()
        ended = sorted(long, key=lambda c: "error" in c)
        assert len(ended) == 2 and ended[0]["stop_type"] == "limit", long
        assert ended[0]["tokens_predicted"] == ended[0]["timings"]["predicted_n"] == 200
        assert "context size has been exceeded" in ended[1]["error"]["message"].lower(), long
        for r in short:
            assert r.status_code == 200, r.text
            assert r.json()["timings"]["predicted_n"] == 20 and r.json()["stop_type"] == "limit"


def test_max_tokens_past_the_context_in_a_pool_ends_at_the_context_or_says_the_pool_is_full(tiny_model, tmp_path):
    """`-c 256 -np 2 --kv-unified`: each slot's context is the whole pool. A request whose max_tokens
    runs far past it ends where its context is full ("length", every token it held), as with
    reserved slots; two at once outgrow the pool together: each either ends so or fails with a 500
    saying the context size has been exceeded (llama-server's), never a silent short answer."""
    n_ctx = 2 * KV_BLOCK
    server = head(
        tiny_model("llama", n_layers=1), tmp_path, (), "-c", str(n_ctx), "--kv-unified", parallel=2, ctx=n_ctx
    )
    with running(server) as w:
        client = openai.OpenAI(base_url=f"{w.url}/v1", api_key="none", max_retries=0, timeout=120)
        ended, errors = [], []

        def ask(prompt: str) -> None:
            try:
                ended.append(
                    client.completions.create(
                        model="m", prompt=prompt, max_tokens=100_000, extra_body={"ignore_eos": True}
                    )
                )
            except openai.APIStatusError as e:
                errors.append(e)

        ask("w1 w2 w3")
        threads = [threading.Thread(target=ask, args=(f"w{i} w{i + 1}",)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(ended) + len(errors) == 3 and len(ended) >= 2, errors
        for r in ended:
            assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == n_ctx - r.usage.prompt_tokens
        assert all(e.status_code == 500 and "context size has been exceeded" in str(e.body) for e in errors), errors
