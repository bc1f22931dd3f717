"""The Triton decode-attention kernel (`hydra::decode_attention`) against attention in float64 over the
cache as `KVCache.read_run` dequantizes it: every cache type, GQA, sliding windows, split-K, reserved
and pooled blocks. On CPU it runs under Triton's interpreter (TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch
from kernel_device import KERNEL_DEVICE, needs_kernels

from hydra_console.engine.model.kv_blocks import KV_BLOCK, KVBlocks
from hydra_console.engine.model.kv_cache import KVCache

pytestmark = needs_kernels


def _filled(n_slots, n_kv, n_ctx, head_dim, dtype, types, lengths, pooled, seed=0):
    """A cache whose slots hold `lengths` random positions (and poison beyond them, which must not be
    read). Pooled: the slots grow a block at a time in turn, so each one's blocks are scattered."""
    g = torch.Generator().manual_seed(seed)
    if pooled:
        blocks = KVBlocks.pool(n_slots, n_ctx, n_slots * -(-n_ctx // KV_BLOCK) * KV_BLOCK, KERNEL_DEVICE)
        for end in range(KV_BLOCK, n_ctx + KV_BLOCK, KV_BLOCK):
            for slot in range(n_slots):
                blocks.fit({slot: min(end, n_ctx)})
    else:
        blocks = KVBlocks.reserved(n_slots, n_ctx, KERNEL_DEVICE)
    kv = KVCache(blocks, n_kv, head_dim, compute=dtype, device=KERNEL_DEVICE, k_type=types[0], v_type=types[1])
    for slot in range(n_slots):
        k, v = (torch.randn(n_ctx, n_kv, head_dim, generator=g) for _ in range(2))
        k[lengths[slot] :], v[lengths[slot] :] = 1e4, -1e4
        kv.scatter(
            torch.full((n_ctx,), slot, device=KERNEL_DEVICE),
            torch.arange(n_ctx, device=KERNEL_DEVICE),
            k.to(KERNEL_DEVICE),
            v.to(KERNEL_DEVICE),
        )
    return kv


def _reference(kv, q, slots, positions, window, scale):
    """float64 attention of each row over its slot's visible positions, as read_run dequantizes them."""
    out = []
    for b, (slot, pos) in enumerate(zip(slots.tolist(), positions.tolist())):
        start = max(0, pos + 1 - window) if window else 0
        keys, vals = (t.double() for t in kv.read_run(slot, start, pos + 1))  # [n_kv, n, d]
        group = q.shape[1] // keys.shape[0]
        keys, vals = keys.repeat_interleave(group, 0), vals.repeat_interleave(group, 0)
        p = torch.softmax(torch.einsum("hd,hnd->hn", q[b].double(), keys) * scale, dim=-1)
        out.append(torch.einsum("hn,hnd->hd", p, vals))
    return torch.stack(out)


def _run(kv, q, slots, positions, window, scale, splits):
    from hydra_console.engine.kernels.triton_attention import decode_attention

    return decode_attention(q, *kv.stored(), slots, positions, kv.blocks.table, kv.blocks.n_ctx, window, scale, splits)


def _check(got, want, dtype, what):
    err = (got.double() - want).abs().max().item()
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}[dtype]
    print(f"{what}: max abs err {err:.2e}")
    assert got.dtype == dtype and err < tol, (what, err)


CASES = [  # (compute dtype, K type, V type, n_head, n_kv, head_dim)
    (torch.float32, "auto", "auto", 4, 2, 64),
    (torch.float32, "q8_0", "q8_0", 8, 2, 64),
    (torch.bfloat16, "auto", "q8_0", 4, 1, 256),  # Gemma 3 270M's heads
    (torch.float16, "q8_0", "f16", 6, 2, 96),  # a head size that is not a power of two
]


@pytest.mark.parametrize(
    "dtype, k_type, v_type, n_head, n_kv, head_dim",
    CASES,
    ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}x{c[4]}x{c[5]}".replace("torch.", "") for c in CASES],
)
@pytest.mark.parametrize("window, splits, pooled", [(0, 1, False), (0, 3, True), (37, 2, True)])
def test_kernel_matches_float64_attention(dtype, k_type, v_type, n_head, n_kv, head_dim, window, splits, pooled):
    lengths = [300, 1, 64, 129]
    kv = _filled(4, n_kv, 320, head_dim, dtype, (k_type, v_type), lengths, pooled)
    slots = torch.tensor([2, 0, 3, 1, 0], device=KERNEL_DEVICE)  # slot 0 twice: rows need not be distinct slots
    positions = torch.tensor([lengths[s] - 1 for s in slots.tolist()], device=KERNEL_DEVICE)
    q = torch.randn(5, n_head, head_dim, generator=torch.Generator().manual_seed(1)).to(KERNEL_DEVICE, dtype)
    scale = head_dim**-0.5
    got = _run(kv, q, slots, positions, window, scale, splits)
    _check(
        got,
        _reference(kv, q, slots, positions, window, scale),
        dtype,
        f"{dtype} K {k_type} V {v_type} heads {n_head}/{n_kv}x{head_dim} window {window} splits {splits} "
        f"{'pooled' if pooled else 'reserved'}",
    )


def test_a_padding_row_attends_to_itself_only():
    """A CUDA graph's padding row (the padding slot, a position past the context) reads its own K/V,
    not the n_ctx positions before it: its output is its V, whatever the slot's block holds."""
    n_ctx, n_kv, head_dim = 96, 2, 32
    blocks = KVBlocks.reserved(2, n_ctx, KERNEL_DEVICE, padding=4)
    kv = KVCache(blocks, n_kv, head_dim, compute=torch.float32, device=KERNEL_DEVICE)
    g = torch.Generator().manual_seed(3)
    k, v = (torch.randn(n_ctx, n_kv, head_dim, generator=g).to(KERNEL_DEVICE) for _ in range(2))
    kv.scatter(
        torch.zeros(n_ctx, dtype=torch.long, device=KERNEL_DEVICE), torch.arange(n_ctx, device=KERNEL_DEVICE), k, v
    )
    pad = torch.tensor([blocks.pad_slot, 1], device=KERNEL_DEVICE)
    positions = torch.tensor([n_ctx + 2, 5], device=KERNEL_DEVICE)
    k1, v1 = (torch.randn(2, n_kv, head_dim, generator=g).to(KERNEL_DEVICE) for _ in range(2))
    kv.scatter(pad, positions, k1, v1)
    q = torch.randn(2, 4, head_dim, generator=g).to(KERNEL_DEVICE)
    got = _run(kv, q, pad, positions, 0, head_dim**-0.5, 2)
    torch.testing.assert_close(got[0], v1[0].repeat_interleave(2, 0))
    _check(got[1:], _reference(kv, q[1:], pad[1:], positions[1:], 0, head_dim**-0.5), torch.float32, "slot 1 beside it")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and torch.compile's Triton backend")
@pytest.mark.parametrize("types", [("auto", "auto"), ("q8_0", "q8_0")])
@pytest.mark.parametrize("compiled, kv_pool", [(False, None), (True, None), (False, 4 * KV_BLOCK)])
def test_graphed_stage_decode_through_the_kernel_equals_eager(tiny_model, types, compiled, kv_pool):
    """A CUDA stage's captured decode step (the kernel) against the eager one (SDPA over `read_run`):
    three slots of different lengths, one across a pooled block boundary, past Gemma 3's sliding window of 8."""
    from stages import load

    path = tiny_model("gemma3", head_dim=32)  # q8_0 needs heads of whole 32-value blocks
    kw = dict(device="cuda", n_slots=3, n_ctx=320, kv_types=types, kv_pool=kv_pool)
    graphed, eager = load(path, compile_decode=compiled, **kw), load(path, **kw)
    eager.graphs = None
    prompts = {0: list(range(2, 142)), 1: [5], 2: list(range(40, 46))}
    for stage in (graphed, eager):
        for slot, prompt in prompts.items():
            stage.run_layers(
                stage.embed(torch.tensor(prompt)), torch.full((len(prompt),), slot), torch.arange(len(prompt))
            )
    positions = torch.tensor([len(p) for p in prompts.values()])
    for step in range(12):
        tokens = torch.tensor([60 + step, 70 + step, 80 + step])
        a, b = (s.run_layers(s.embed(tokens), torch.tensor([0, 1, 2]), positions + step) for s in (graphed, eager))
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert (3, 1) in graphed.graphs.graphs  # the steps replayed a captured graph
