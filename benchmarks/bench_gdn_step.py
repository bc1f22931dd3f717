"""qwen35 decode and verify steps through one Gated DeltaNet layer on CUDA: the torch form of
`DeltaNet.step` (model/deltanet.py) against its Triton kernels (`kernels/triton_gdn_step.py`).

    python benchmarks/bench_gdn_step.py [--per-slot 1,4] [--slots 1] [--depth 3] [--compile] [--sweep] [--json]

The layer is Qwen3.5-27B's (hidden 5120, 48 V heads on 16 Q/K heads, head dims 128, BF16 weights of a
synthetic file; `--v-heads`, `--k-heads`, `--dim`), with the CUDA graphs' padding slot and `--depth`
checkpoints per slot. For each m tokens per slot (1: decode; k + 1: a verify of k drafted tokens) it
times the whole step (input product, conv, gates, the rule, gated norm, output product) both ways,
eagerly and as a CUDA graph replay (how the decode graphs serve it; `--compile`: torch.compile'd
first, as served by default), and the kernels alone (`hydra::gated_delta_step` in a graph, with the
bandwidth its state traffic implies: the state read and written once, min(m, depth) checkpoints
written). Steps rotate over `--copies` layers' states, so the states do not sit in L2 (the model has
48 such layers). It prints both times, their ratio, each path's verify / decode ratio (the 27B's
target for a 4-token verify: <= 1.15 of a one-token step, issue 38), per-step totals over `--layers`
DeltaNet layers (the 27B has 48), and the kernels' largest difference from the torch form.
`--sweep` first times the rule kernel's launch settings (`triton_gdn_step.CONFIG`) at each m; the
table uses the fastest at the last m.
"""

from __future__ import annotations

import argparse
import itertools
import json
from types import SimpleNamespace

import torch
import triton
from bench_delta_rule import layer_stage

from hydra_console.engine.kernels import triton_gdn_step
from hydra_console.engine.model import deltanet
from hydra_console.engine.model.deltanet import DeltaNet
from hydra_console.engine.model.graphs import capture


def graph_ms(step, reps: int) -> float:
    """Median ms of one step() as a CUDA graph replay."""
    graph, _ = capture(step, torch.device("cuda"), None)
    return triton.testing.do_bench(graph.replay, warmup=10, rep=reps, return_mode="median")


def eager_ms(step, reps: int) -> float:
    step()
    return triton.testing.do_bench(step, warmup=10, rep=reps, return_mode="median")


def layers(stage, args) -> list[DeltaNet]:
    """`--copies` DeltaNet layers on the stage's weights, each with its own states (random, small)."""
    nets = []
    for _ in range(args.copies):
        net = DeltaNet(stage.cfg, stage.weights, "blk.0.", args.slots, args.depth, True)
        net.conv_rows.normal_()
        net.ssm_rows.normal_(std=0.05)
        nets.append(net)
    return nets


def bench(m: int, stage, nets, args) -> dict:
    B = args.slots
    x = torch.randn(B * m, stage.cfg.n_embd, device="cuda", dtype=torch.bfloat16)
    slots = torch.arange(B, device="cuda").repeat_interleave(m)
    row = {"per_slot": m}
    # the kernels against the torch form, from the same states (all rows but the padding slot's)
    net, outs = nets[0], {}
    start = (net.conv_rows.clone(), net.ssm_rows.clone())
    for kernel in (False, True):
        deltanet.TRITON_PREFILL = kernel
        net.conv_rows.copy_(start[0])
        net.ssm_rows.copy_(start[1])
        outs[kernel] = (net.step(x, slots, m), net.conv_rows.clone(), net.ssm_rows.clone())
    real = torch.arange(net.ssm_rows.shape[0], device="cuda") != args.slots
    row["max_abs_out"] = float((outs[True][0] - outs[False][0]).abs().max())
    row["max_abs_state"] = max(float((outs[True][i] - outs[False][i])[real].abs().max()) for i in (1, 2))

    for name, kernel in (("torch", False), ("kernel", True)):
        deltanet.TRITON_PREFILL = kernel
        steps = [torch.compile(n.step, dynamic=False) if args.compile else n.step for n in nets]

        def every(steps=steps):
            for step in steps:
                step(x, slots, m)

        row[f"{name}_eager_ms"] = eager_ms(every, args.reps) / len(nets)
        row[f"{name}_graph_ms"] = graph_ms(every, args.reps) / len(nets)
    deltanet.TRITON_PREFILL = None

    # the kernels alone, on the layer's input product
    proj = nets[0].w_in(x)
    s = stage.cfg.deltanet

    def op():
        for n in nets:
            triton_gdn_step.gated_delta_step(
                *(proj, slots, n.conv_rows, n.ssm_rows, n.conv, n.dt_bias, n.a, m, n.n_slots, n.rows, n.depth),
                *(s.n_k_heads, stage.cfg.rms_eps),
            )

    row["op_ms"] = graph_ms(op, args.reps) / len(nets)
    state = s.n_v_heads * s.head_k_dim * s.head_v_dim * 4
    row["op_gb_s"] = B * state * (2 + min(m, args.depth)) / (row["op_ms"] * 1e-3) / 1e9
    return row


def sweep(m: int, stage, nets, args) -> None:
    """The fastest rule-kernel launch at m tokens per slot, left in `CONFIG`."""
    x = torch.randn(args.slots * m, stage.cfg.n_embd, device="cuda", dtype=torch.bfloat16)
    slots = torch.arange(args.slots, device="cuda").repeat_interleave(m)
    proj, s, n = nets[0].w_in(x), stage.cfg.deltanet, nets[0]
    times = {}
    for bv, warps in itertools.product((4, 8, 16, 32, 64), (1, 2, 4, 8)):
        triton_gdn_step.CONFIG.update(bv=bv, warps=warps)

        def op():
            triton_gdn_step.gated_delta_step(
                *(proj, slots, n.conv_rows, n.ssm_rows, n.conv, n.dt_bias, n.a, m, n.n_slots, n.rows, n.depth),
                *(s.n_k_heads, stage.cfg.rms_eps),
            )

        try:
            times[bv, warps] = graph_ms(op, args.reps)
        except Exception as err:  # a launch that does not fit (registers) or compile here
            print(f"  m={m} bv={bv} warps={warps}: {type(err).__name__}: {str(err)[:200]}")
    best = min(times, key=times.get)
    print(f"m={m}: " + ", ".join(f"bv {bv} w {w}: {t * 1e3:.1f} us" for (bv, w), t in sorted(times.items())))
    print(f"m={m} fastest: bv {best[0]}, warps {best[1]}")
    triton_gdn_step.CONFIG.update(bv=best[0], warps=best[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-slot", default="1,4", help="tokens per slot: 1 = decode, k + 1 = a verify")
    ap.add_argument("--slots", type=int, default=1, help="slots in the batch (streams)")
    ap.add_argument("--depth", type=int, default=3, help="checkpoints per slot (--draft-max)")
    ap.add_argument("--v-heads", type=int, default=48)
    ap.add_argument("--k-heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128, help="head_k_dim = head_v_dim")
    ap.add_argument("--copies", type=int, default=8, help="layers whose states the steps rotate over")
    ap.add_argument("--layers", type=int, default=48, help="DeltaNet layers of the model (per-step totals)")
    ap.add_argument("--reps", type=int, default=200, help="ms of timing per number (triton.testing.do_bench)")
    ap.add_argument("--compile", action="store_true", help="torch.compile each path's step before capture")
    ap.add_argument("--sweep", action="store_true", help="time the rule kernel's launch settings first")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    per_slot = [int(m) for m in args.per_slot.split(",")]
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 as served
    if args.compile:  # a trace per layer copy and path
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * args.copies)
    stage = layer_stage(SimpleNamespace(tokens=[64], dim=args.dim, k_heads=args.k_heads, v_heads=args.v_heads))
    nets = layers(stage, args)
    print(
        f"{torch.cuda.get_device_name()}: V heads {args.v_heads}, Q/K heads {args.k_heads}, dims {args.dim}, "
        f"{args.slots} slot(s), depth {args.depth}{', compiled' if args.compile else ''}"
    )
    if args.sweep:
        for m in per_slot:
            sweep(m, stage, nets, args)
    rows = [bench(m, stage, nets, args) for m in per_slot]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(
        f"{'m':>3} {'torch eager':>12} {'kernel eager':>13} {'torch graph':>12} {'kernel graph':>13} {'ratio':>6}"
        f" {'op us':>7} {'op GB/s':>8}  max |Δ| out / state"
    )
    for r in rows:
        print(
            f"{r['per_slot']:>3} {r['torch_eager_ms'] * 1e3:>9.1f} us {r['kernel_eager_ms'] * 1e3:>10.1f} us"
            f" {r['torch_graph_ms'] * 1e3:>9.1f} us {r['kernel_graph_ms'] * 1e3:>10.1f} us"
            f" {r['torch_graph_ms'] / r['kernel_graph_ms']:>5.2f}x {r['op_ms'] * 1e3:>7.1f} {r['op_gb_s']:>8.0f}"
            f"  {r['max_abs_out']:.1e} / {r['max_abs_state']:.1e}"
        )
    for r in rows:
        print(
            f"m={r['per_slot']}, {args.layers} layers (graphs): torch {r['torch_graph_ms'] * args.layers:.2f} ms,"
            f" kernel {r['kernel_graph_ms'] * args.layers:.2f} ms per step"
        )
    one = next((r for r in rows if r["per_slot"] == 1), None)
    for r in rows:
        if one is not None and r is not one:
            print(
                f"verify of {r['per_slot']} / decode step (graphs): torch {r['torch_graph_ms'] / one['torch_graph_ms']:.2f}x,"
                f" kernel {r['kernel_graph_ms'] / one['kernel_graph_ms']:.2f}x"
            )


if __name__ == "__main__":
    main()
