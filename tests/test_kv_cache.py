"""KV cache types (`--cache-type-k/-v`): q8_0 as llama.cpp quantizes it, f16/bf16 storage under an fp32
compute, through the real stage (prefill, decode, slot state) on CPU."""

from __future__ import annotations

import pytest
import torch
from stages import load, prefill

from hydra_console.engine.cli import build_parser
from hydra_console.engine.cli_config import head_config
from hydra_console.engine.errors import UserError
from hydra_console.engine.model.kv_blocks import KV_BLOCK, KVBlocks
from hydra_console.engine.model.kv_cache import KVCache, check_cache_type

pytestmark = pytest.mark.unit


def test_q8_0_round_trip_is_within_half_a_step_per_block_plus_the_float16_scale():
    kv = KVCache(
        KVBlocks.reserved(2, 16, "cpu"), 3, 64, compute=torch.float32, device="cpu", k_type="q8_0", v_type="q8_0"
    )
    k = torch.randn(16, 3, 64) * torch.logspace(-3, 2, 16)[:, None, None]  # blocks of very different scales
    kv.scatter(torch.full((16,), 1), torch.arange(16), k, -k)
    got_k, got_v = kv.read_run(1, 0, 16)
    blocks = k.transpose(0, 1).unflatten(-1, (2, 32))
    step = blocks.abs().amax(-1, keepdim=True) / 127  # d of each block
    err = (got_k.unflatten(-1, (2, 32)) - blocks).abs()
    scale_err = 127 * (step - step.half().float()).abs()  # the scale is stored as float16, as llama.cpp's
    assert (err <= step / 2 * 1.001 + scale_err).all() and torch.equal(got_v, -got_k)
    assert kv.k.codes.dtype == torch.int8 and kv.k.scale.shape == (2, 3, 16, 2)
    assert sum(t.nbytes for t in kv.tensors()) == 2 * (2 * 3 * 16 * 64 * (1 + 2 / 32))
    kv.scatter(
        torch.zeros(4, dtype=torch.long), torch.arange(4), torch.zeros(4, 3, 64), torch.zeros(4, 3, 64)
    )  # an all-zero block: scale 0, no NaN
    assert torch.equal(kv.read_run(0, 0, 4)[0], torch.zeros(3, 4, 64))


def test_scatter_and_gather_match_runs():
    kv = KVCache(
        KVBlocks.reserved(3, 8, "cpu"), 2, 32, compute=torch.float32, device="cpu", k_type="q8_0", v_type="f16"
    )
    k, v = torch.randn(3, 2, 32), torch.randn(3, 2, 32)
    kv.scatter(torch.tensor([2, 0, 1]), torch.tensor([5, 0, 7]), k, v)
    keys, vals = kv.gather(torch.tensor([2, 0, 1]), 8)
    assert keys.shape == (3, 2, 8, 32) and vals.dtype == torch.float32
    assert torch.equal(keys[0, :, 5], kv.read_run(2, 5, 6)[0][:, 0])
    assert torch.equal(vals[2, :, 7], v[2].half().float())


@pytest.mark.parametrize("pooled", [False, True])
def test_the_padding_slot_writes_past_every_context_and_costs_a_few_positions(pooled):
    """The CUDA graphs' padding rows (slot `pad_slot`, positions n_ctx..n_ctx + padding - 1) land in
    block 0 beyond any slot's positions: every slot's KV stays as it was, at a few positions' cost."""
    n_ctx, padding, n_kv, d = 40, 4, 2, 32
    pool = 3 * -(-n_ctx // KV_BLOCK) * KV_BLOCK
    blocks = KVBlocks.pool(3, n_ctx, pool, "cpu", padding) if pooled else KVBlocks.reserved(3, n_ctx, "cpu", padding)
    kv = KVCache(blocks, n_kv, d, compute=torch.float32, device="cpu")
    for slot in range(3):
        blocks.fit({slot: n_ctx})
        kv.scatter(
            torch.full((n_ctx,), slot), torch.arange(n_ctx), torch.randn(n_ctx, n_kv, d), torch.randn(n_ctx, n_kv, d)
        )
    before = [kv.read_run(slot, 0, n_ctx) for slot in range(3)]
    pad = torch.full((padding,), blocks.pad_slot)
    kv.scatter(
        pad, n_ctx + torch.arange(padding), torch.full((padding, n_kv, d), 1e4), torch.full((padding, n_kv, d), -1e4)
    )
    assert blocks.pad_slot == 3
    for slot in range(3):
        assert all(torch.equal(a, b) for a, b in zip(kv.read_run(slot, 0, n_ctx), before[slot]))
    assert torch.equal(kv.rows(pad, n_ctx + torch.arange(padding))[0], torch.full((padding, n_kv, d), 1e4))
    if not pooled:  # three contexts and `padding` positions each, not a fourth context
        assert kv.k.codes.shape == (3, n_kv, n_ctx + padding, d) and blocks.pool_tokens == 3 * n_ctx


@pytest.mark.parametrize("types", [("q8_0", "q8_0"), ("f16", "bf16")])
def test_a_stage_with_a_smaller_cache_stays_close_to_the_exact_one(tiny_model, types):
    path = tiny_model("llama", n_layers=2, n_embd=128, n_head=4, n_head_kv=2)
    exact, small = load(path, n_slots=2, n_ctx=64), load(path, n_slots=2, n_ctx=64, kv_types=types)
    tokens = torch.randint(0, 1000, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    want, got = prefill(exact, tokens[:32], slot=1), prefill(small, tokens[:32], slot=1)
    for i, t in enumerate(tokens[32:]):  # decode continues over the stored cache
        want = torch.cat([want, prefill(exact, [t], slot=1, start=32 + i)])
        got = torch.cat([got, prefill(small, [t], slot=1, start=32 + i)])
    rel = ((got - want).norm() / want.norm()).item()
    assert 0 < rel < 2e-2, rel  # not exact (it is stored smaller), but close
    assert small.kv_bytes < exact.kv_bytes * (0.3 if types[0] == "q8_0" else 0.55)
    names = small.slot_state(1, 40)
    assert ("blk.0.k.scale" in names) == (types[0] == "q8_0") and names["blk.0.k"].shape[1] == 40


def test_cache_type_flags():
    args = build_parser().parse_args(["serve", "-ctk", "q8_0", "--cache-type-v", "f16"])
    assert head_config(args, {}).model.kv_types == ("q8_0", "f16")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--cache-type-k", "q4_0"])
    with pytest.raises(UserError, match="--cache-type-v must be one of"):  # values given through the API
        check_cache_type("int4", "--cache-type-v")


def test_a_peer_caches_in_the_heads_kv_types(tiny_model, tmp_path):
    """The head's --cache-type-k/-v reach its peer through LOAD_STAGE (a peer started without them):
    the peer's KV is q8_0-sized, and greedy text through the split equals a solo head's with the same types."""
    from rpc_workers import greedy, head, peer

    model = tiny_model("llama", head_dim=32)
    q8 = ("-ctk", "q8_0", "-ctv", "q8_0", "--dtype", "float32")
    solo, p = head(model, tmp_path, (), *q8, ctx=64), peer(model, tmp_path, "--dtype", "float32")
    split = head(model, tmp_path, [p], "--split", "1/1", *q8, ctx=64)
    try:
        for w in (solo, p, split):
            w.wait_ready()
        stage = p.status()["stages"][0]
        positions = 2 * 64 * (stage["layers"][1] - stage["layers"][0])  # 2 slots of 64, per layer
        assert stage["kv_bytes"] == positions * 2 * (2 * 32) * 34 // 32  # K and V, 2 KV heads x 32, 34 bytes per 32
        for prompt in ("the quick brown fox", "w1 w2 w3 w4 w5 w6"):
            assert greedy(split, prompt, 12)[0] == greedy(solo, prompt, 12)[0]
    finally:
        for w in (solo, p, split):
            w.stop()
