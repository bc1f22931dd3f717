"""Does a model fit a pair of cards? A head and one peer as two processes on this machine's GPU, a
layer split, each process's device memory (NVML's per-process reading, /status `process.gpu_memory`,
the CUDA context included) against the card it stands for, and decode through the split.

    python benchmarks/bench_fit.py --model M.gguf --split 40/24 --cards 16,12 [--ctx 8192] [-n 64]
                                   [-- extra `serve` flags, e.g. -ctk q8_0 -ctv q8_0 --spec-type mtp]

The original system runs a 27B Q5_K_M over a 16 GB and a 12 GB card (11.06 GB + 6.46 GB of
weights). Prints one JSON object; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time

import httpx

PROMPT = "The history of the city begins with a small settlement on the river, where"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """One worker process, its log in a temporary file (shown if it dies)."""

    def __init__(self, role: str, argv: list[str]):
        self.port, self.rpc = free_port(), free_port()
        self.log = tempfile.TemporaryFile("w+")
        cmd = [sys.executable, "-m", "hydra_console.engine.cli", role, "--port", str(self.port), "--rpc-port", str(self.rpc), *argv]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float) -> float:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise SystemExit(f"worker exited {self.proc.returncode}:\n{self.log.read()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise SystemExit(f"not ready after {timeout} s")

    def status(self) -> dict:
        return httpx.get(f"{self.url}/status", timeout=10).json()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def decode(url: str, n: int) -> dict:
    """One streamed completion of n tokens: client-side decode rate between the first and last chunk."""
    stamps = []
    body = {"prompt": PROMPT, "max_tokens": n, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:])["choices"][0]["text"]:
                stamps.append(time.perf_counter())
    rate = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else None
    return {"chunks": len(stamps), "decode_tok_s": round(rate, 2) if rate else None}


def memory(doc: dict) -> dict:
    used = (doc.get("process") or {}).get("gpu_memory")
    stages = doc.get("stages") or []
    return {
        "gpu_memory_gib": None if used is None else round(used / 2**30, 3),
        "source": (doc.get("process") or {}).get("gpu_source"),
        "stages": [{k: s.get(k) for k in ("layers", "weight_bytes", "kv_bytes") if k in s} for s in stages],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--split", required=True, help="layers of head / peer, e.g. 40/24")
    ap.add_argument("--cards", default="16,12", help="GB of the head's and the peer's card")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("-n", type=int, default=64, help="tokens decoded through the split")
    ap.add_argument("--timeout", type=float, default=600)
    args, extra = ap.parse_known_args()
    extra = [a for a in extra if a != "--"]
    peer = Proc("peer", ["--model", args.model, "--device", args.device])
    head = None
    try:
        peer.wait_ready(args.timeout)
        head = Proc("serve", ["--model", args.model, "--device", args.device, "--peer", f"127.0.0.1:{peer.rpc}",
                              "--split", args.split, "--ctx", str(args.ctx), "--parallel", "1", *extra])  # fmt: skip
        ready_s = head.wait_ready(args.timeout)
        run = decode(head.url, args.n)
        cards = [float(c) for c in args.cards.split(",")]
        out = {"model": args.model, "split": args.split, "ctx": args.ctx, "serve_flags": extra,
               "head_ready_s": round(ready_s, 1), **run}  # fmt: skip
        for name, proc, card in (("head", head, cards[0]), ("peer", peer, cards[1])):
            m = memory(proc.status())
            used = m["gpu_memory_gib"]
            out[name] = m | {"card_gb": card, "fits": None if used is None else used * 2**30 <= card * 1e9}
        print(json.dumps(out))
    finally:
        for p in (head, peer):
            if p is not None:
                p.stop()


if __name__ == "__main__":
    main()
