"""Speculative decoding: tokens per target forward, acceptance and decode speed-up over `off`.

    python benchmarks/bench_spec.py [--model PATH | --synth qwen35|qwen35-bigram] [--device cpu] [--dtype auto]
                                    [--n-gen 128] [--spec-type ngram|mtp] [--draft-max 3] [--draft-p-min 0.75] [--draft-adaptive auto]
                                    [--reps 3] [--split 9/9] [--output-stage head|last] [--link-rtt-ms 0 2 10]
                                    [--workloads repetitive,prose] [--threads N] [--json]

Workloads on one slot: a repetitive one (rewrite a code block with one change: the continuation
copies the prompt, so prompt lookup drafts well), free prose greedy, and free prose at temperature 0.8.
Each runs with `--spec-type off` and with n-gram drafting, solo and (with `--split`) through a head
+ one `hydra-engine peer` process on loopback, once per `--link-rtt-ms`: 0 connects directly, X > 0
through `benchmarks/link.py`, a forwarder that delays each direction by X/2 ms (an emulated network
between head and peer; `peer_rtt_ms` is the PING round trip the head measures through it). Prints, per row: generated tokens per target forward,
acceptance, decode tok/s (median of the reps) with the speed-up over off (median of paired ratios:
`off` and n-gram runs alternate, so load from other processes hits both alike), and CPU ms per
generated token (head + peer) with the speed-up in CPU time, which other processes barely move.
First, per pipeline, the cost of one forward with 1 token vs draft-max+1 tokens. `same` says whether
every speculative output equalled the plain one (greedy only). Last, a summary table per workload:
tokens per target forward, acceptance and decode speed-up over `off` for every pipeline.

`--spec-type mtp` drafts with the model's own MTP block (a qwen35 GGUF with `blk.N.nextn.*`); the
engine then runs the block over every forward's tokens (as llama.cpp does), `off` rows included.
It also prints the mechanics: one MTP draft step's cost relative to a trunk decode step (beside
the share of a trunk step's weight bytes it reads: its floor where both are bandwidth-bound), and the
verify cost for k = 1..draft-max. `--synth` writes a small synthetic qwen35 with an MTP block:
`qwen35` has random weights (acceptance means nothing: use `--draft-p-min 0` to draft at all),
`qwen35-bigram` is built so that its MTP block predicts exactly the trunk's next token (acceptance ~1:
what MTP drafting buys when drafts are right). Adaptive vs fixed draft lengths by acceptance level
and number of streams: `bench_spec_adaptive.py`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from ready import wait_ready

from hydra_console.engine.cli import build_parser
from hydra_console.engine.cli_config import head_config
from hydra_console.engine.default_model import model_path
from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.model import ModelConfig, graph_run_lengths
from hydra_console.engine.serving.runtime import DEFAULT_BATCH_TOKENS, Engine, Request
from hydra_console.engine.serving.sampling_params import SamplingParams
from hydra_console.engine.spec import SpecConfig, build_speculator
from hydra_console.engine.synth import write_synthetic
from hydra_console.engine.text.tokenizer import Tokenizer
from hydra_console.engine.workers.head_pipeline import build_pipeline, max_run_of

CODE = """def total_price(items, tax_rate):
    total = 0
    for item in items:
        price = item["price"] * item["quantity"]
        if item.get("discount"):
            price = price * (1 - item["discount"])
        total = total + price
    return total * (1 + tax_rate)


def cheapest(items):
    best = None
    for item in items:
        if best is None or item["price"] < best["price"]:
            best = item
    return best
"""
REWRITE = (
    "Here is a Python module:\n\n```python\n" + CODE + "```\n\nHere is the same module with the variable "
    "`total` renamed to `subtotal` and nothing else changed:\n\n```python\n"
)
PROSE = (
    "The river had flooded twice that spring, and by the time the surveyors arrived the old mill road was "
    "gone. Marta, who had kept the ferry for eleven years,"
)
# name -> (prompt, temperature). Greedy prose from a small pretrained model soon loops, which prompt
# lookup exploits; sampled prose (rejection sampling against a point-mass draft) does not loop.
WORKLOADS = {"repetitive": (REWRITE, 0.0), "prose": (PROSE, 0.0), "prose-t0.8": (PROSE, 0.8)}
# --synth: a small qwen35 (DeltaNet + gated attention, 8 layers) with its MTP block.
SYNTH_SHAPE = dict(
    n_layers=8,
    n_embd=256,
    n_head=8,
    n_head_kv=2,
    head_dim=64,
    n_ff=768,
    ssm_state=64,
    ssm_groups=2,
    ssm_v_heads=4,
    full_attention_interval=4,
    nextn=True,
)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Peer:
    """A `hydra-engine peer` process on loopback."""

    def __init__(self, model: Path, device: str, threads: int | None):
        self.port, self.rpc_port = free_port(), free_port()
        env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
        self.log = tempfile.NamedTemporaryFile(prefix="bench-spec-peer-", suffix=".log", delete=False)
        cmd = [
            sys.executable,
            "-m",
            "hydra_console.engine.cli",
            "peer",
            "--model",
            str(model),
            "--device",
            device,
            "--port",
            str(self.port),
            "--rpc-port",
            str(self.rpc_port),
        ]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.ps = psutil.Process(self.proc.pid)
        wait_ready(self.port, f"peer (log: {self.log.name})", 120, self.proc)

    def cpu_s(self) -> float:
        t = self.ps.cpu_times()
        return t.user + t.system

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=15)


class Link:
    """`benchmarks/link.py` in its own process (its forwarding CPU is not the head's), forwarding
    to the peer's RPC port with `rtt_ms / 2` of delay each way."""

    def __init__(self, peer: Peer, rtt_ms: float):
        cmd = [
            sys.executable,
            str(Path(__file__).with_name("link.py")),
            "--to",
            f"127.0.0.1:{peer.rpc_port}",
            "--delay-ms",
            str(rtt_ms / 2),
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline().split()  # "listening HOST:PORT"
        if len(line) != 2:
            self.proc.kill()
            raise SystemExit(f"link.py did not start (exit {self.proc.wait()})")
        self.addr = line[1]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=15)


def make_engine(args, g, peer_addr: str | None) -> Engine:
    argv = [
        "serve",
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--parallel",
        str(args.slots),
        "--ctx",
        str(args.ctx),
        "--peer-wait",
        "60",
    ]
    argv += ["--no-compile"] if args.no_compile else []
    # the stages keep the recurrent checkpoints (and capture the verify graphs) of this draft length
    argv += ["--spec-type", args.spec_type, "--draft-max", str(args.draft_max)]
    if peer_addr:
        argv += ["--peer", peer_addr, "--split", args.split] if args.split else ["--peer", peer_addr]
        argv += ["--output-stage", args.output_stage]
    cfg = head_config(build_parser().parse_args(argv), {})
    pipeline = build_pipeline(cfg, g, ModelConfig.from_gguf(g))
    speculator = None
    if args.spec_type == "mtp":  # the MTP block lives beside the head stage, or the last peer's
        adaptive = {"auto": None, "on": True, "off": False}[args.draft_adaptive]
        spec = SpecConfig("mtp", n_max=args.draft_max, p_min=args.draft_p_min, adaptive=adaptive)
        speculator = build_speculator(
            spec, None, g, cfg.model, args.slots, head=pipeline.local, remote_output=pipeline.output_remote
        )
    # As a server's start does (workers/head.py): every graph the runs replay is captured before any is timed.
    pipeline.local.warm_up(graph_run_lengths(max_run_of(cfg.spec)), prefill_tokens=cfg.batch_tokens)
    return Engine(pipeline, Tokenizer.from_gguf(g), args.slots, args.ctx, speculator=speculator).start()


def count_forwards(engine: Engine) -> list[int]:
    """Wrap the pipeline's forward with a call counter (the target forwards)."""
    calls = [0]
    forward = engine.pipeline.forward

    def counted(*a, **kw):
        calls[0] += 1
        return forward(*a, **kw)

    engine.pipeline.forward = counted
    return calls


def cpu_s(peer: Peer | None) -> float:
    """CPU seconds used so far by this process (the head) and the peer: unlike wall time, barely
    moved by other processes competing for the cores."""
    return time.process_time() + (peer.cpu_s() if peer else 0.0)


def run_once(engine, calls, prompt: list[int], spec: SpecConfig, n_gen: int, temp: float, peer) -> dict:
    before = calls[0]
    ids, final, cpu_first = [], None, None
    params = SamplingParams(temperature=temp, seed=1234)
    req = Request(prompt, params, max_tokens=n_gen, ignore_eos=True, spec=spec)
    for ev in engine.generate(req, timeout=600):
        if ev.tokens and cpu_first is None:
            cpu_first, n_first = cpu_s(peer), len(ev.tokens)
        ids += [t.id for t in ev.tokens]
        final = ev
    cpu_decode = cpu_s(peer) - cpu_first
    t = final.timings
    prefill_forwards = -(-len(prompt) // DEFAULT_BATCH_TOKENS)  # the last one samples the first token
    decode_forwards = calls[0] - before - prefill_forwards
    return {
        "ids": ids,
        "tok_s": t["predicted_per_second"],
        "decode_forwards": decode_forwards,
        "cpu_ms_per_tok": 1e3 * cpu_decode / max(len(ids) - n_first, 1),
        "draft_n": t["draft_n"],
        "accepted": t["draft_n_accepted"],
    }


def forward_costs(engine: Engine, prompt: list[int], k: int, peer, slots: int = 1, n: int = 15) -> dict:
    """One target forward of `slots` slots with 1 token each (plain decode) and with j+1 tokens and
    j+1 logit rows each (a verify of j drafts, j = 1..k), alternating, n each: wall ms (min, median)
    and CPU ms (median, head + peer); with an MTP drafter, one draft step: the engine's own greedy
    chain of k steps for every slot (`MtpDrafter.draft_batch`, the block on one token + its head +
    the pick, per step), over k.

    The cost ratios are of CPU time on a CPU head (other processes barely move it) and of wall time
    on a GPU, each call synchronized: a forward only queues the GPU's work, so its CPU time is the
    host's launch cost, not the step's. On a GPU the kernels' own time per call (torch.profiler)
    is printed beside it: wall well above it means the host, not the GPU, sets the step's pace."""
    import torch

    from hydra_console.engine.spec.drafter import DraftRequest

    fwd = engine.pipeline.forward
    cuda = engine.pipeline.local.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    P = len(prompt)
    as_t = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    for slot in range(slots):
        fwd(as_t(prompt), torch.full((P,), slot), torch.arange(P), as_t([P - 1]))
    at = [P]  # each forward keeps its first token, as a verify does: the recurrent state never rolls back past it

    def forward(m: int) -> None:  # rows slot-major, as the engine batches a step
        positions = torch.arange(at[0], at[0] + m).repeat(slots)
        fwd(as_t(prompt[:m] * slots), torch.arange(slots).repeat_interleave(m), positions, torch.arange(m * slots))
        at[0] += 1

    mtp = engine.spec.mtp
    calls = {m: functools.partial(forward, m) for m in range(1, k + 2)}
    if mtp is not None:
        calls["draft"] = lambda: mtp.draft_batch([DraftRequest(s, prompt[: at[0]], k) for s in range(slots)])
        if getattr(mtp, "graphs", None) is not None:  # the same chain queued op by op, for comparison
            requests = [DraftRequest(s, prompt, k) for s in range(slots)]
            calls["draft_eager"] = functools.partial(eager_draft, mtp, requests)
    wall = {c: [] for c in calls}
    cpu = {c: [] for c in calls}
    for _ in range(n):
        for c, call in calls.items():
            sync()
            t0, c0 = time.perf_counter(), cpu_s(peer)
            call()
            sync()
            wall[c].append((time.perf_counter() - t0) * 1e3)
            cpu[c].append((cpu_s(peer) - c0) * 1e3)
    med = statistics.median
    cost = {c: med(wall[c] if cuda else cpu[c]) for c in calls}
    out = {
        "decode_ms_min": round(min(wall[1]), 2),
        "decode_ms_median": round(med(wall[1]), 2),
        "verify_ms_min": round(min(wall[k + 1]), 2),
        "verify_ms_median": round(med(wall[k + 1]), 2),
        "decode_cpu_ms": round(med(cpu[1]), 2),
        "verify_cpu_ms": round(med(cpu[k + 1]), 2),
        "cost_of": "wall" if cuda else "cpu",
        "verify_cost_ratio": round(cost[k + 1] / cost[1], 3),
        "verify_cost_ratio_by_k": {j: round(cost[j + 1] / cost[1], 3) for j in range(1, k + 1)},
        # the run lengths the stage's graphs replay (None: any); a verify of another length ran eagerly here,
        # where the engine pads it to a replayed one
        "graph_run_lengths": engine.pipeline.graph_run_lengths,
    }
    if mtp is not None:
        out["mtp_step_ms"] = round(cost["draft"] / k, 3)
        out["mtp_step_cost_ratio"] = round(cost["draft"] / k / cost[1], 3)
        out["mtp_kv_bytes"] = engine.spec.drafter_kv_bytes
        if "draft_eager" in cost:
            out["mtp_step_eager_ms"] = round(cost["draft_eager"] / k, 3)
    if cuda:
        kernels = {c: kernel_ms(call) for c, call in calls.items()}
        out["kernel_ms"] = {str(c): round(sum(by_name.values()), 3) for c, by_name in kernels.items()}
        one, verify = kernels[1], kernels[k + 1]
        growth = {name: verify.get(name, 0.0) - one.get(name, 0.0) for name in one.keys() | verify.keys()}
        # where a verify's extra time goes: the kernels that grow most from 1 token to k + 1
        out["verify_kernel_growth_ms"] = {
            name[:70]: [round(one.get(name, 0.0), 3), round(verify.get(name, 0.0), 3)]
            for name in sorted(growth, key=growth.get, reverse=True)[:10]
        }
    out["kv_bytes"] = engine.pipeline.local.kv_bytes  # the head's KV + recurrent state (with checkpoints)
    return out


def eager_draft(mtp, requests) -> None:
    graphs, mtp.graphs = mtp.graphs, None
    try:
        mtp.draft_batch(requests)
    finally:
        mtp.graphs = graphs


def kernel_ms(call, n: int = 5) -> dict[str, float]:
    """The GPU kernels' own ms in one `call` by kernel name (the mean of n, from torch.profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            call()
        torch.cuda.synchronize()
    return {e.key: e.self_device_time_total / n / 1e3 for e in prof.key_averages() if e.self_device_time_total}


def peer_rtt_ms(engine: Engine, n: int = 20) -> float | None:
    """Median PING round trip to the (first) peer, as the head sees it; None when solo."""
    if not engine.pipeline.remotes:
        return None
    rtts = [r for r in (engine.pipeline.remotes[0].ping() for _ in range(n)) if r is not None]
    return round(statistics.median(rtts), 2) if rtts else None


def draft_read_ratio(g: GGUFFile) -> float | None:
    """Weight bytes one MTP draft step reads (the NextN block and the output head) over those a trunk
    decode step reads (every trunk layer and the output head): where both steps run at one bandwidth,
    the floor of the measured `mtp_step_cost_ratio`. None without a NextN block."""
    cfg = ModelConfig.from_gguf(g)  # n_layers: the trunk's, the NextN blocks past them
    head = g.tensors["token_embd.weight" if cfg.tied else "output.weight"].nbytes
    layers = [(int(name.split(".")[1]), t.nbytes) for name, t in g.tensors.items() if name.startswith("blk.")]
    nextn = sum(n for il, n in layers if il >= cfg.n_layers)
    return (nextn + head) / (sum(n for il, n in layers if il < cfg.n_layers) + head) if nextn else None


def bench(engine: Engine, tok: Tokenizer, g: GGUFFile, args, where: str, peer: Peer | None = None) -> list[dict]:
    """Per workload: `off` and n-gram runs alternate rep by rep, so load from other processes hits
    both alike; the speed-up is the median of the paired ratios."""
    costs = {
        "peer_rtt_ms": peer_rtt_ms(engine),
        **forward_costs(engine, tok.encode(REWRITE), args.draft_max, peer, args.slots),
    }
    if "mtp_step_ms" in costs:
        costs["mtp_read_ratio"] = round(draft_read_ratio(g), 4)
    if not args.json:
        if costs["peer_rtt_ms"] is not None:
            print(f"{where:10} peer PING round trip {costs['peer_rtt_ms']} ms (median)", flush=True)
        print(
            f"{where:10} forward, 1 token: {costs['decode_ms_min']} ms min, {costs['decode_ms_median']} median, "
            f"{costs['decode_cpu_ms']} CPU ms; {args.draft_max + 1} tokens: {costs['verify_ms_min']} ms min, "
            f"{costs['verify_ms_median']} median, {costs['verify_cpu_ms']} CPU ms: "
            f"verify/decode {costs['cost_of']} cost x{costs['verify_cost_ratio']} (by k: {costs['verify_cost_ratio_by_k']}"
            + (
                f"; graphs replay runs of {lengths} tokens, others ran eagerly)"
                if (lengths := costs["graph_run_lengths"])
                else ")"
            ),
            flush=True,
        )
        if "mtp_step_ms" in costs:
            print(
                f"{where:10} MTP draft step ({costs['cost_of']}): {costs['mtp_step_ms']} ms = x{costs['mtp_step_cost_ratio']} "
                f"of a trunk decode step, reading x{costs['mtp_read_ratio']} of its weight bytes "
                f"(eager chain: {costs.get('mtp_step_eager_ms', '-')} ms); MTP KV {costs['mtp_kv_bytes']} B, head KV + state {costs['kv_bytes']} B",
                flush=True,
            )
        if "kernel_ms" in costs:
            print(
                f"{where:10} GPU kernel ms per call (1 token, .., k+1 tokens, draft chain): {costs['kernel_ms']}",
                flush=True,
            )
            for name, (one, verify) in costs["verify_kernel_growth_ms"].items():
                print(f"{where:10}   {one:7.3f} -> {verify:7.3f} ms  {name}", flush=True)
    calls = count_forwards(engine)
    specs = {
        "off": SpecConfig(),
        args.spec_type: SpecConfig(args.spec_type, n_max=args.draft_max, p_min=args.draft_p_min),
    }
    rows = []
    for name in args.workloads:
        text, temp = WORKLOADS[name]
        prompt = tok.encode(text)
        run_once(engine, calls, prompt, specs["off"], 8, temp, peer)  # warm-up
        runs = {k: [] for k in specs}
        for _ in range(args.reps):
            for kind, spec in specs.items():
                runs[kind].append(run_once(engine, calls, prompt, spec, args.n_gen, temp, peer))
        base_ids = runs["off"][0]["ids"]
        for kind, spec in specs.items():
            rs, r = runs[kind], runs[kind][0]
            ratios = [x["tok_s"] / o["tok_s"] for x, o in zip(rs, runs["off"])]
            cpu_ratios = [o["cpu_ms_per_tok"] / x["cpu_ms_per_tok"] for x, o in zip(rs, runs["off"])]
            ms_per_fwd = [1e3 * len(x["ids"]) / x["tok_s"] / max(x["decode_forwards"], 1) for x in rs]
            rows.append(
                {
                    "pipeline": where,
                    "workload": name,
                    "spec": kind,
                    "draft_max": spec.n_max if spec.active else 0,
                    "n_prompt": len(prompt),
                    "n_gen": len(r["ids"]),
                    "decode_tok_s": round(statistics.median(x["tok_s"] for x in rs), 2),
                    "ms_per_forward": round(statistics.median(ms_per_fwd), 1),
                    "tokens_per_forward": round((len(r["ids"]) - 1) / max(r["decode_forwards"], 1), 3),
                    "acceptance": round(r["accepted"] / r["draft_n"], 3) if r["draft_n"] else None,
                    "draft_n": r["draft_n"],
                    "draft_n_accepted": r["accepted"],
                    "speedup": round(statistics.median(ratios), 2),
                    "cpu_ms_per_token": round(statistics.median(x["cpu_ms_per_tok"] for x in rs), 1),
                    "speedup_cpu_time": round(statistics.median(cpu_ratios), 2),
                    "same_output": all(x["ids"] == base_ids for x in rs) if temp == 0 else None,
                    "reps_tok_s": [round(x["tok_s"], 2) for x in rs],
                    **costs,
                }
            )
            if not args.json:
                x = rows[-1]
                acc = f"{x['acceptance']:.3f}" if x["acceptance"] is not None else "    -"
                print(
                    f"{where:10} {name:11} {kind:6} {x['tokens_per_forward']:5.2f} tok/fwd  acc {acc}  "
                    f"{x['decode_tok_s']:7.2f} tok/s (x{x['speedup']:.2f} wall)  {x['cpu_ms_per_token']:7.1f} CPU ms/tok "
                    f"(x{x['speedup_cpu_time']:.2f} CPU)  same={x['same_output']}  reps={x['reps_tok_s']}",
                    flush=True,
                )
    return rows


def summary(rows: list[dict]) -> str:
    """Markdown: per workload and pipeline, the drafter's tokens per forward, acceptance, speed-up."""
    kind = rows[1]["spec"] if len(rows) > 1 else "spec"
    out = [
        f"| workload | pipeline | peer RTT ms | ms/fwd off | ms/fwd {kind} | tok/fwd | acceptance | off tok/s "
        f"| {kind} tok/s | speed-up (wall) | speed-up (CPU time) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for off, ng in zip(rows[::2], rows[1::2]):
        rtt = "-" if ng["peer_rtt_ms"] is None else f"{ng['peer_rtt_ms']:.2f}"
        acc = "-" if ng["acceptance"] is None else f"{ng['acceptance']:.3f}"
        out.append(
            f"| {ng['workload']} | {ng['pipeline']} | {rtt} | {off['ms_per_forward']} | {ng['ms_per_forward']} "
            f"| {ng['tokens_per_forward']:.2f} | {acc} | {off['decode_tok_s']:.1f} | {ng['decode_tok_s']:.1f} "
            f"| x{ng['speedup']:.2f} | x{ng['speedup_cpu_time']:.2f} |"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF file (default: the embedded Gemma 3 270M)")
    ap.add_argument(
        "--synth",
        choices=["qwen35", "qwen35-bigram"],
        help="instead of --model: a small synthetic qwen35 with an MTP block",
    )
    ap.add_argument("--spec-type", choices=["ngram", "mtp"], default="ngram", help="the drafter compared with off")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--draft-max", type=int, default=3)
    ap.add_argument("--draft-p-min", type=float, default=0.75, help="MTP: stop drafting below this draft probability")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--slots", type=int, default=1, help="slots of the forward and draft costs (the decode runs use one)"
    )
    ap.add_argument(
        "--draft-adaptive", choices=["auto", "on", "off"], default="auto", help="MTP: the serve flag of that name"
    )
    ap.add_argument("--split", default=None, help="also run head + one peer with this split, e.g. 9/9")
    ap.add_argument(
        "--output-stage",
        choices=["head", "last"],
        default="head",
        help="with --split: the serve flag (last: the peer holds the output head and the MTP block)",
    )
    ap.add_argument(
        "--link-rtt-ms",
        type=float,
        nargs="+",
        default=[0.0],
        help="with --split: one split run per round trip time, 0 = direct loopback (default: 0)",
    )
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list of {', '.join(WORKLOADS)}")
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the head and the peer")
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--no-compile",
        action="store_true",
        help="CUDA: graphs without torch.compile (a 64-layer compile takes minutes)",
    )
    args = ap.parse_args()
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in args.workloads if w not in WORKLOADS]
    if unknown or not args.workloads:
        ap.error(f"--workloads {', '.join(unknown) or '(none)'}: choose from {', '.join(WORKLOADS)}")
    if any(r < 0 for r in args.link_rtt_ms):
        ap.error("--link-rtt-ms must be >= 0")
    if any(args.link_rtt_ms) and not args.split:
        ap.error("--link-rtt-ms needs --split (it delays the head's link to its peer)")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    if args.synth and args.model:
        ap.error("--synth writes its own model: leave out --model")
    if args.synth:
        tmp = Path(tempfile.mkdtemp(prefix="bench-spec-"))
        path = write_synthetic(
            tmp / f"{args.synth}.gguf", "qwen35", bigram=args.synth.endswith("bigram"), **SYNTH_SHAPE
        )
    else:
        path = model_path(args.model)
    g = GGUFFile(path)
    tok = Tokenizer.from_gguf(g)
    rows = []
    engine = make_engine(args, g, None)
    try:
        rows += bench(engine, tok, g, args, "solo")
    finally:
        engine.stop()
    if args.split:
        peer = Peer(path, args.device, args.threads)
        try:
            for rtt in args.link_rtt_ms:
                link = Link(peer, rtt) if rtt else None
                try:
                    engine = make_engine(args, g, link.addr if link else f"127.0.0.1:{peer.rpc_port}")
                    try:
                        rows += bench(engine, tok, g, args, f"split@{rtt:g}ms" if rtt else "split", peer)
                    finally:
                        engine.stop()
                        engine.pipeline.stop()
                finally:
                    if link:
                        link.stop()
        finally:
            peer.stop()
    if args.json:
        print(
            json.dumps(
                {
                    "model": path.name,
                    "device": args.device,
                    "dtype": args.dtype,
                    "loadavg": os.getloadavg(),
                    "rows": rows,
                },
                indent=1,
            )
        )
    else:
        print(summary(rows))
        print(f"load average after: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
