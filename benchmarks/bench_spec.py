"""Speculative decoding: tokens per target forward, acceptance and decode speed-up over `off`.

    python benchmarks/bench_spec.py [--model PATH] [--device cpu] [--n-gen 128] [--draft-max 3]
                                    [--reps 3] [--split 9/9] [--json]

Two greedy workloads on one slot: a repetitive one (rewrite a code block with one change: the
continuation copies the prompt, so prompt lookup drafts well) and a non-repetitive one (free prose).
Each runs with `--spec-type off` and with n-gram drafting, solo and (with `--split`) through a head
+ one `hydra-engine peer` process on loopback. Prints, per row: decode tok/s (median of the reps),
target forwards per generated token, acceptance, mean accepted length and the speed-up over off
(same workload, same pipeline). Outputs with and without speculation are checked to be equal.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import httpx

from hydra_console.engine.default_model import default_model_path
from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.model import ModelConfig
from hydra_console.engine.pipeline import build_pipeline
from hydra_console.engine.runtime import DEFAULT_BATCH_TOKENS, Engine, Request
from hydra_console.engine.sampling import SamplingParams
from hydra_console.engine.speculative import SpecConfig
from hydra_console.engine.tokenizer import Tokenizer

CODE = '''def total_price(items, tax_rate):
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
'''
WORKLOADS = {
    "repetitive": "Here is a Python module:\n\n```python\n" + CODE + "```\n\nHere is the same module with the "
    "variable `total` renamed to `subtotal` and nothing else changed:\n\n```python\n",
    "prose": "The river had flooded twice that spring, and by the time the surveyors arrived the old mill "
    "road was gone. Marta, who had kept the ferry for eleven years,",
}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Peer:
    """A `hydra-engine peer` process on loopback."""

    def __init__(self, model: Path, device: str):
        self.port, self.rpc_port = free_port(), free_port()
        self.log = tempfile.NamedTemporaryFile(prefix="bench-spec-peer-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "hydra_console.engine.cli", "peer", "--model", str(model), "--device", device,
               "--port", str(self.port), "--rpc-port", str(self.rpc_port)]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"peer exited {self.proc.returncode}; log: {self.log.name}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise SystemExit(f"peer not ready after 120 s; log: {self.log.name}")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=15)


def make_engine(args, g, peer: Peer | None) -> Engine:
    ns = SimpleNamespace(device=args.device, dtype=args.dtype, peer=[f"127.0.0.1:{peer.rpc_port}"] if peer else [],
                         split=args.split if peer else None, peer_wait=60.0, fallback_solo=False,
                         auth_token=None, max_frame=1 << 30)  # fmt: skip
    pipeline = build_pipeline(ns, g, ModelConfig.from_gguf(g), n_slots=1, n_ctx=args.ctx)
    return Engine(pipeline, Tokenizer.from_gguf(g), 1, args.ctx).start()


def count_forwards(engine: Engine) -> list[int]:
    """Wrap the pipeline's forward with a call counter (the target forwards)."""
    calls = [0]
    forward = engine.pipeline.forward

    def counted(*a, **kw):
        calls[0] += 1
        return forward(*a, **kw)

    engine.pipeline.forward = counted
    return calls


def run_once(engine: Engine, calls: list[int], prompt: list[int], spec: SpecConfig, n_gen: int) -> dict:
    before = calls[0]
    ids, final = [], None
    req = Request(prompt, SamplingParams(temperature=0.0), max_tokens=n_gen, ignore_eos=True, spec=spec)
    for ev in engine.generate(req, timeout=600):
        ids += [t.id for t in ev.tokens]
        final = ev
    t = final.timings
    prefill_forwards = -(-len(prompt) // DEFAULT_BATCH_TOKENS)  # the last one samples the first token
    decode_forwards = calls[0] - before - prefill_forwards
    return {"ids": ids, "tok_s": t["predicted_per_second"], "decode_forwards": decode_forwards,
            "draft_n": t["draft_n"], "accepted": t["draft_n_accepted"]}  # fmt: skip


def bench(engine: Engine, tok: Tokenizer, args, where: str) -> list[dict]:
    calls = count_forwards(engine)
    rows = []
    for name, text in WORKLOADS.items():
        prompt = tok.encode(text)
        run_once(engine, calls, prompt, SpecConfig(), 8)  # warm-up
        base = None
        for spec in (SpecConfig(), SpecConfig("ngram", n_max=args.draft_max)):
            runs = [run_once(engine, calls, prompt, spec, args.n_gen) for _ in range(args.reps)]
            r = runs[0]
            tok_s = statistics.median(x["tok_s"] for x in runs)
            if base is None:
                base = (r["ids"], tok_s)
            drafts = engine.spec_stats.drafts
            rows.append({
                "pipeline": where, "workload": name, "spec": spec.type, "draft_max": spec.n_max if spec.active else 0,
                "n_prompt": len(prompt), "n_gen": len(r["ids"]), "decode_tok_s": round(tok_s, 2),
                "tokens_per_forward": round((len(r["ids"]) - 1) / max(r["decode_forwards"], 1), 3),
                "acceptance": round(r["accepted"] / r["draft_n"], 3) if r["draft_n"] else None,
                "draft_n": r["draft_n"], "draft_n_accepted": r["accepted"],
                "speedup": round(tok_s / base[1], 2), "same_output": r["ids"] == base[0],
                "reps_tok_s": [round(x["tok_s"], 2) for x in runs], "spec_drafts_total": drafts,
            })  # fmt: skip
            if not args.json:
                x = rows[-1]
                print(f"{where:6} {name:11} {x['spec']:6} {x['decode_tok_s']:8.2f} tok/s  "
                      f"{x['tokens_per_forward']:5.2f} tok/fwd  acc {x['acceptance'] if x['acceptance'] is not None else '-':>5}  "
                      f"x{x['speedup']:.2f}  same={x['same_output']}", flush=True)  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF file (default: the embedded Gemma 3 270M)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--draft-max", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--split", default=None, help="also run head + one peer with this split, e.g. 9/9")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    path = Path(args.model) if args.model else default_model_path()
    g = GGUFFile(path)
    tok = Tokenizer.from_gguf(g)
    rows = []
    engine = make_engine(args, g, None)
    try:
        rows += bench(engine, tok, args, "solo")
    finally:
        engine.stop()
    if args.split:
        peer = Peer(path, args.device)
        try:
            engine = make_engine(args, g, peer)
            try:
                rows += bench(engine, tok, args, "split")
            finally:
                engine.stop()
                engine.pipeline.stop()
        finally:
            peer.stop()
    if args.json:
        print(json.dumps({"model": path.name, "device": args.device, "dtype": args.dtype, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
