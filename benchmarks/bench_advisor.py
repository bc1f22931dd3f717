"""The split advisor end to end on real workers: predicted against achieved decode.

    python benchmarks/bench_advisor.py [--model PATH] [--device cpu] [--layer-delay-ms 0] [-n 32] [-r 3]

Starts a `hydra-engine peer` (optionally slowed by the hidden --layer-delay-ms test flag) and a
head driving it at the even split, asks the head's PROBE, measures greedy decode (ms per token from
the completions' own timings, `-r` completions of `-n` tokens), applies the advisor's proposal
through CONFIGURE, and measures again. Prints numbers, asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile

import httpx

from hydra_console.app import control_client
from hydra_console.app.split_advisor import advise
from hydra_console.contracts.rpc import Op
from hydra_console.contracts.split import split_arg
from hydra_console.engine.default_model import default_model_path

sys.path.insert(0, os.path.dirname(__file__))
from ready import wait_ready  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ms_per_token(port: int, n: int, reps: int) -> float:
    times = []
    for _ in range(reps):
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            timeout=600,
            json={
                "prompt": "The history of the",
                "max_tokens": n,
                "temperature": 0,
                "ignore_eos": True,
                "cache_prompt": False,
            },
        )
        r.raise_for_status()
        times.append(r.json()["timings"]["predicted_per_token_ms"])
    return statistics.median(times)


def probe(rpc: int) -> dict:
    reply = control_client.request_sync(
        "127.0.0.1", rpc, Op.PROBE, json.dumps({"tokens": 32, "reps": 3}).encode(), timeout=600
    )
    if not reply.ok:
        raise SystemExit(f"PROBE refused: {reply.meta}")
    return reply.meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layer-delay-ms", type=float, default=0.0, help="slow the peer on purpose (ms per layer run)")
    ap.add_argument("-n", type=int, default=32, help="tokens per completion")
    ap.add_argument("-r", type=int, default=3, help="completions per measurement")
    args = ap.parse_args()
    model = args.model or str(default_model_path())
    engine = [sys.executable, "-m", "hydra_console.engine.cli"]
    hp, hr, pp, pr = (free_port() for _ in range(4))
    log = tempfile.mkdtemp(prefix="hydra-advisor-")
    procs = []
    try:
        peer_argv = [
            *engine,
            "peer",
            "--model",
            model,
            "--device",
            args.device,
            "--port",
            str(pp),
            "--rpc-port",
            str(pr),
            "--layer-delay-ms",
            str(args.layer_delay_ms),
        ]
        procs.append(subprocess.Popen(peer_argv, stdout=open(f"{log}/peer.log", "w"), stderr=subprocess.STDOUT))
        wait_ready(pp, "peer", proc=procs[0])
        head_argv = [
            *engine,
            "serve",
            "--model",
            model,
            "--device",
            args.device,
            "--port",
            str(hp),
            "--rpc-port",
            str(hr),
            "--parallel",
            "1",
            "--ctx",
            "512",
            "--peer",
            f"127.0.0.1:{pr}",
        ]
        procs.append(subprocess.Popen(head_argv, stdout=open(f"{log}/head.log", "w"), stderr=subprocess.STDOUT))
        wait_ready(hp, "head", budget_s=300, proc=procs[1])

        advice = advise(probe(hr))
        cur = advice.current
        before = ms_per_token(hp, args.n, args.r)
        print(
            f"running {split_arg(cur.counts)}: predicted {cur.step_ms:.1f} ms/token, probe's whole step "
            f"{advice.measured_step_ms:.1f} ms, completions {before:.1f} ms/token"
        )
        for st in advice.stages:
            print(
                f"  {st.name:<18} {st.device:<6} layers [{st.layers[0]},{st.layers[1]}) decode {st.mean_ms():.2f} ms/layer, "
                f"prefill {st.mean_ms('prefill'):.2f} ms/layer, hop {st.hop_ms:.2f} ms"
            )
        if not advice.proposal:
            print(
                f"no proposal: the best split {split_arg(advice.best.counts)} is within 5 % ({advice.best.step_ms:.1f} ms)"
            )
            return
        reply = control_client.request_sync(
            "127.0.0.1", hr, Op.CONFIGURE, json.dumps({"split": split_arg(advice.proposal)}).encode(), timeout=600
        )
        if not reply.ok:
            raise SystemExit(f"CONFIGURE refused: {reply.meta}")
        after = ms_per_token(hp, args.n, args.r)
        again = advise(probe(hr))
        print(
            f"applied {split_arg(advice.proposal)}: predicted {advice.best.step_ms:.1f} ms/token, probe's whole step "
            f"{again.measured_step_ms:.1f} ms, completions {after:.1f} ms/token "
            f"(speed-up predicted {cur.step_ms / advice.best.step_ms:.2f}x, achieved {before / after:.2f}x)"
        )
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait(30)


if __name__ == "__main__":
    main()
