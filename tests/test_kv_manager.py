"""The owner of the slots' KV and recurrent memory (`serving/kv_manager.py`): the prompt cache a
request takes, the pool's fit counting idle slots' cache as free, taking that cache back on every
stage for a step that needs it (never a busy slot's), over real stages, pipelines and engines; the
drafters' own pools (the MTP block's, a draft model's) follow."""

from __future__ import annotations

import pytest
import torch
from stages import load, prefill

from hydra_console.engine.errors import KVPoolFull
from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.model.kv_blocks import KV_BLOCK
from hydra_console.engine.pipeline import Pipeline
from hydra_console.engine.serving.kv_manager import KVManager
from hydra_console.engine.serving.runtime import Engine
from hydra_console.engine.serving.sampling_params import SamplingParams
from hydra_console.engine.serving.sequence import Request
from hydra_console.engine.spec import SpecConfig, Speculator, build_speculator
from hydra_console.engine.text.tokenizer import Tokenizer

TOKENS = torch.randint(0, 600, (400,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.mark.unit
def test_a_request_takes_the_slot_holding_the_longest_prefix_of_its_prompt():
    kv = KVManager(3)
    assert kv.take([0, 1, 2], Request([1, 2, 3, 4])) == (0, 0)
    assert kv.take([1, 2], Request([1, 2])) == (1, 0)
    assert kv.busy_slots() == {0, 1}
    kv.release(0, [1, 2, 3, 4])
    kv.release(1, [1, 2])
    assert kv.idle_holding([1, 2]) == 1 and kv.idle_holding([1, 2, 3]) is None
    assert kv.take([0, 1, 2], Request([7, 8])) == (2, 0)  # no prefix: the least cached, the others stay
    assert kv.take([0, 1], Request([1, 2, 3, 9])) == (0, 3)
    assert kv.cached(0) == [] and kv.busy_slots() == {0, 2}  # spent: the slot is the request's now
    kv.release(0, [1, 2, 3, 4])
    assert kv.take([0, 1], Request([1, 2, 3, 4])) == (0, 3)  # all of it held: the last token still runs
    kv.release(0, [1, 2, 3, 4])
    # A scored prompt needs every row's logits, an embedding every row's hidden state: nothing reused.
    assert kv.take([0, 1], Request([1, 2, 3, 5], prompt_logprobs=1)) == (0, 0)
    kv.release(0, [1, 2, 3, 4])
    assert kv.take([0, 1], Request([1, 2, 3, 5], embedding=True)) == (0, 0)
    kv.release(0, [1, 2, 3, 4])
    assert kv.take([0, 1], Request([1, 2, 3, 5], cache_prompt=False)) == (1, 0)


@pytest.mark.unit
def test_a_recurrent_slot_is_reused_only_by_a_prompt_extending_all_it_holds():
    kv = KVManager(2, recurrent=True)
    for slot, tokens in ((0, [1, 2, 3, 4]), (1, [1, 2])):
        kv.take([slot], Request(tokens))
        kv.release(slot, tokens)
    # Slot 0 shares three tokens but its state has taken in the fourth: it cannot be cut back.
    assert kv.take([0, 1], Request([1, 2, 3, 9])) == (1, 2)
    assert kv.take([0], Request([1, 2, 3, 4, 5])) == (0, 4)


@pytest.mark.unit
def test_the_prompt_cache_goes_when_the_pipeline_loses_kv():
    generation = [0]
    kv = KVManager(2, kv_generation=lambda: generation[0])
    kv.take([0], Request([1, 2, 3]))
    kv.release(0, [1, 2, 3])
    assert kv.cached(0) == [1, 2, 3]
    generation[0] += 1  # a re-split or a peer's rebuild: only busy slots' KV was replayed
    assert kv.cached(0) == [] and kv.idle_holding([1, 2, 3]) is None
    assert kv.take([0, 1], Request([1, 2, 3, 4])) == (0, 0)


def test_a_short_pool_takes_back_idle_prompt_cache_on_every_stage_never_a_busy_slots(tiny_model):
    stage = load(tiny_model("llama", head_dim=32), n_slots=3, n_ctx=512, kv_pool=4 * KV_BLOCK)
    pipeline = Pipeline(stage)
    kv = KVManager.of(pipeline, 3)
    held = stage.kv_blocks.held
    assert kv.take([0, 1, 2], Request(TOKENS[:200])) == (0, 0)
    prefill(stage, TOKENS[:200], slot=0)  # two blocks, left as prompt cache
    kv.release(0, TOKENS[:200])
    assert kv.take([1, 2], Request(TOKENS[200:300])) == (1, 0)
    prefill(stage, TOKENS[200:300], slot=1)  # one block, busy
    assert kv.take([2], Request(TOKENS[300:])) == (2, 0)
    assert kv.fits({2: 2 * KV_BLOCK}) and not kv.fits({2: 3 * KV_BLOCK + 1})  # slot 0's cache counts as free
    kv.make_room({2: KV_BLOCK})  # the free block is enough: the cache stays
    assert len(held[0]) == 2 and kv.cached(0) == TOKENS[:200]
    with pytest.raises(KVPoolFull):  # without room made, the stage refuses the step
        prefill(stage, TOKENS[300:400] * 2, slot=2)
    kv.make_room({2: 2 * KV_BLOCK})
    assert held[0] == [] and len(held[1]) == 1 and kv.cached(0) == []  # the idle slot's blocks and its cache
    prefill(stage, TOKENS[300:400] * 2, slot=2)
    assert [len(h) for h in held] == [0, 1, 2]
    kv.make_room({2: 4 * KV_BLOCK})  # only a busy slot holds blocks now: nothing to take, the stage refuses
    assert len(held[1]) == 1
    with pytest.raises(KVPoolFull):
        prefill(stage, TOKENS[:300], slot=2, start=200)


def test_an_engine_makes_room_for_a_request_in_its_idle_slots_prompt_cache(tiny_model):
    """Two slots in a pool of two blocks: the first request's prompt cache fills the pool; the next
    request, in the other slot, gets those blocks (before, an engine not wired by the head's
    composition root left them held, and the step failed with KVPoolFull)."""
    g = GGUFFile(tiny_model("llama", head_dim=32))
    stage = load(g.path, n_slots=2, n_ctx=2 * KV_BLOCK, kv_pool=2 * KV_BLOCK)
    engine = Engine(Pipeline(stage), Tokenizer.from_gguf(g), 2, 2 * KV_BLOCK).start()
    try:
        _two_requests_in_a_pool_of_two_blocks(engine)
    finally:
        engine.stop()
    assert [len(h) for h in stage.kv_blocks.held] == [0, 1]


def _two_requests_in_a_pool_of_two_blocks(engine: Engine) -> None:
    """The first request's prompt cache fills the pool; the second, in the other slot, needs a block of it."""
    greedy = SamplingParams(temperature=0.0)
    for prompt in (TOKENS[:150], TOKENS[150:250]):
        *_, last = engine.generate(Request(prompt, greedy, max_tokens=4, ignore_eos=True), timeout=60)
        assert last.error is None and last.finish_reason == "length"


def test_the_mtp_blocks_pool_gives_back_what_the_target_takes_back(tiny_model):
    """The MTP block's KV follows the target's, in a pool of its own: an idle slot the target's pool
    takes back is cleared in the block's too (it held on to it, and the next step failed with KVPoolFull)."""
    path = tiny_model("qwen35", n_layers=4, nextn=True)
    g = GGUFFile(path)
    stage = load(path, n_slots=2, n_ctx=2 * KV_BLOCK, kv_pool=2 * KV_BLOCK)
    spec = build_speculator(SpecConfig(type="mtp", n_max=3, p_min=0.0), None, g, None, 2, head=stage)
    engine = Engine(Pipeline(stage), Tokenizer.from_gguf(g), 2, 2 * KV_BLOCK, speculator=spec).start()
    try:
        _two_requests_in_a_pool_of_two_blocks(engine)
    finally:
        engine.stop()
    assert [len(h) for h in spec.mtp.nextn.block.kv_blocks.held] == [len(h) for h in stage.kv_blocks.held] == [0, 1]


def test_a_draft_models_pool_holds_no_idle_slot(tiny_model):
    """The draft model feeds a new request from position 0: a slot's draft KV goes when its request
    leaves (idle slots held the draft pool before, and the next request's drafts failed with KVPoolFull)."""
    path = tiny_model("llama", head_dim=32)
    g = GGUFFile(path)
    stage = load(path, n_slots=2, n_ctx=2 * KV_BLOCK, kv_pool=2 * KV_BLOCK)
    draft = load(path, n_slots=2, n_ctx=2 * KV_BLOCK, kv_pool=2 * KV_BLOCK)
    spec = Speculator(SpecConfig(type="draft", n_max=3, p_min=0.0), draft_pipeline=Pipeline(draft))
    engine = Engine(Pipeline(stage), Tokenizer.from_gguf(g), 2, 2 * KV_BLOCK, speculator=spec).start()
    try:
        _two_requests_in_a_pool_of_two_blocks(engine)
    finally:
        engine.stop()
    assert [len(h) for h in draft.kv_blocks.held] == [0, 0] and spec.stats.drafts > 0
