"""Per-layer timing of a stage on a short probe: what the split advisor weighs.

The probe runs on positions its slot does not hold yet (at or past the slot's length), so it writes
KV only where the slot's next real token writes before anything reads it: no request loses
anything. Each layer is timed alone, eagerly, between device syncs; those shares are then scaled
to the stage's real path (CUDA graphs included) timed whole, so the numbers add up to what a
forward costs. A recurrent (DeltaNet) stage is refused: its state would advance.
"""

from __future__ import annotations

import statistics
import time

import torch

from ..contracts.rpc import ProbeRequest
from .errors import UserError

# The probe's size is bounded by its request's layout (contracts.rpc.ProbeRequest: tokens, reps).


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, reps: int, device: torch.device) -> float:
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def probe_stage(stage, slot: int, position: int, tokens: int, reps: int, delay_s: float = 0.0) -> dict:
    """{"decode_ms": [...], "prefill_ms": [...]} per layer of `stage`, measured on `slot` from
    `position` (a `tokens`-long prefill, then one decode token after it). `delay_s` is the
    worker's injected per-layer delay (a test flag), paid as a forward pays it."""
    if stage.recurrent:
        raise UserError(
            "the split advisor cannot probe recurrent (DeltaNet) layers: running them would advance a slot's state"
        )
    if not 0 <= slot < stage.n_slots:
        raise UserError(f"probe slot {slot} does not exist ({stage.n_slots} slots)")
    if position < 0 or position + tokens + 1 > stage.n_ctx:
        raise UserError(f"no room for a {tokens}-token probe at position {position} of a {stage.n_ctx}-token context")
    layers = list(stage.layers)
    if not layers:
        return {"decode_ms": [], "prefill_ms": []}
    gen = torch.Generator().manual_seed(0)
    out = {}
    for name, n, p0 in (("prefill_ms", tokens, position), ("decode_ms", 1, position + tokens)):
        h = torch.randn(n, stage.cfg.n_embd, generator=gen).to(stage.device)
        slots = torch.full((n,), slot, dtype=torch.long)
        positions = torch.arange(p0, p0 + n, dtype=torch.long)

        def one(il):
            stage.run_layer(il, h, slots, positions)
            time.sleep(delay_s)

        def whole():
            stage.run_layers(h, slots, positions)
            time.sleep(delay_s * len(layers))

        whole()  # warm-up: first-use allocations and graph capture stay out of the numbers
        per = [median_ms(lambda il=il: one(il), reps, stage.device) for il in layers]
        total = median_ms(whole, reps, stage.device)
        scale = total / sum(per) if sum(per) > 0 else 1.0
        out[name] = [round(ms * scale, 4) for ms in per]
    return out


def probe_pipeline(local, remotes: list, head_range, slot: int, position: int, tokens: int, reps: int) -> dict:
    """The split advisor's measurement of a split pipeline (the caller holds it, its peers' replies
    read): every stage times its own layers (contracts.rpc.PipelineProbe, without the head's
    footprint, which its StageHost adds), then whole decode steps on `slot` past `position` give
    each hop's wire time and the step as it runs."""
    request = ProbeRequest(slot=slot, position=position, tokens=tokens, reps=reps)
    stages = [
        {
            "name": "head",
            "layers": list(head_range),
            "device": str(local.device),
            **probe_stage(local, slot, position, tokens, reps),
        }
    ]
    stages += [{"name": r.addr, **r.time_layers(request).to_json()} for r in remotes]
    token = torch.zeros(1, dtype=torch.long)
    slots, positions = torch.full((1,), slot, dtype=torch.long), torch.tensor([position + tokens])
    hops: list[list[float]] = [[] for _ in remotes]

    def step():
        h = local.run_layers(local.embed(token), slots, positions)
        for i, remote in enumerate(remotes):
            h = remote.run_layers(h, slots, positions)
            hops[i].append(remote.rtt_ms)
        return output(h)

    # The output head where it is: the head's, or (--output-stage last) the last peer's, which the
    # probe leaves out (paid per token whatever the split, as the embedding).
    output = local.logits if local.has_head else lambda h: h
    step_ms = median_ms(step, reps, local.device)
    fixed_ms = median_ms(lambda: output(local.embed(token).to(local.device)), reps, local.device)
    for stage, times in zip(stages[1:], hops):
        stage["hop_ms"] = round(statistics.median(times), 4)
    return {"tokens": tokens, "stages": stages, "fixed_ms": round(fixed_ms, 4), "step_ms": round(step_ms, 4)}
