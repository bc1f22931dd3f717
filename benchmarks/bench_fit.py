"""Does a model fit a pair of cards? A head and one peer as two processes on this machine's GPU, a
layer split, each process's device memory (NVML's per-process reading, /status `process.gpu_memory`,
the CUDA context included) against the card it stands for, and decode through the split.

    python benchmarks/bench_fit.py --model M.gguf --split 40/24 --cards 16,12 [--ctx 8192] [-n 64]
                                   [--llama-cpp DIR] [--cold] [--restart]
                                   [-- extra `serve` flags, e.g. -ctk q8_0 -ctv q8_0 --spec-type mtp]

`--llama-cpp DIR` (a build with ggml-rpc-server: ../shared/tools/build-llama-cpp.sh) first runs
llama.cpp's own split of the same file the same way: `ggml-rpc-server` and `llama-server --rpc ...
-ngl 99 -ts PEER,HEAD` with the same flags (ours translated: `--spec-type mtp --draft-max K` is its
`--spec-type draft-mtp --spec-draft-n-max K`), each process's NVML memory, its ready time and the
same decode. llama.cpp puts RPC devices first, so its RPC server holds the first PEER layers and
llama-server the last HEAD layers with the output head and the MTP block: llama-server stands for
the card that holds the output (our head, or with `--output-stage last` our peer).

The original system runs a 27B Q5_K_M over a 16 GB and a 12 GB card (11.06 GB + 6.46 GB of
weights). Issue 14's pair (head <= 15.0 GiB, peer <= 11.0 GiB on one H200):

    python -c "from hydra_console.engine.synth import write_synthetic as w; w('/tmp/d26b.gguf', 'llama', qtype='Q5_K',
               n_layers=64, n_embd=5120, n_head=40, n_head_kv=8, n_ff=20480, vocab_size=152064, n_ctx=8192)"
    python benchmarks/bench_fit.py --model /tmp/d26b.gguf --split 40/24 --ctx 8192 -- -ctk q8_0 -ctv q8_0 --no-compile

Prints one JSON object; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from bench_api import ENGINE, Server, free_port  # benchmarks/ is the script's directory
from vs_llama_cpp import device_memory

from hydra_console.contracts.fit import DEFAULT_HEADROOM_GIB
from hydra_console.contracts.footprint import model_tensors, rollback_depth
from hydra_console.contracts.split import parse_split
from hydra_console.engine.cli import build_parser
from hydra_console.engine.cli_config import head_config
from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.workers.head_pipeline import head_footprint, max_run_of

OWNERS = Path(__file__).with_name("memory_owners.py")

PROMPT = "The history of the city begins with a small settlement on the river, where"


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
    """NVML's reading and where it goes: the stage's weights and KV + recurrent state, what else
    torch's allocator holds in live tensors (graphs' pools, scratch, MTP, logits), what it keeps
    cached, and what lies outside it (CUDA context, kernels)."""
    process = doc.get("process") or {}
    used, reserved, live = (process.get(k) for k in ("gpu_memory", "device_reserved", "device_allocated"))
    stages = [s for s in doc.get("stages") or [] if s.get("weight_bytes") is not None]
    gib = lambda n: None if n is None else round(n / 2**30, 3)  # noqa: E731
    held = sum(s["weight_bytes"] + s["kv_bytes"] for s in stages)
    return {
        "gpu_memory_gib": gib(used),
        "source": process.get("gpu_source"),
        "where_gib": {
            "weights": gib(sum(s["weight_bytes"] for s in stages)),
            "kv_and_state": gib(sum(s["kv_bytes"] for s in stages)),
            "other_live": gib(None if live is None else live - held),
            "allocator_cache": gib(None if live is None or reserved is None else reserved - live),
            "outside_torch": gib(None if used is None or reserved is None else used - reserved),
        },
        "stages": [{k: s.get(k) for k in ("layers", "weight_bytes", "kv_bytes")} for s in stages],
    }


def llama_flags(extra: list[str]) -> list[str]:
    """Our serve flags as llama-server takes them: the MTP drafter's names differ; ours alone dropped."""
    out, it = [], iter(extra)
    for a in it:
        if a == "--no-compile":
            continue
        if a == "--output-stage":
            next(it)
        elif a == "--spec-type":
            kind = next(it)
            out += ["--spec-type", "draft-mtp" if kind == "mtp" else kind]
        elif a == "--draft-max":
            out += ["--spec-draft-n-max", next(it)]
        else:
            out.append(a)
    return out


def llama_split(args, extra: list[str]) -> dict:
    """llama.cpp's split of the same file on this machine (see the module doc)."""
    root = Path(args.llama_cpp) / "bin"
    head, peer = args.split.split("/")
    rpc_port = free_port()
    log = tempfile.TemporaryFile("w+")
    rpc = subprocess.Popen(
        [str(root / "ggml-rpc-server"), "-H", "127.0.0.1", "-p", str(rpc_port)], stdout=subprocess.DEVNULL, stderr=log
    )
    server = Server(
        ["-m", args.model, "--rpc", f"127.0.0.1:{rpc_port}", "-ngl", "99", "-ts", f"{peer},{head}"]
        + ["-c", str(args.ctx), "-np", "1", *llama_flags(extra)],
        [str(root / "llama-server")],
        rpc=False,
    )
    try:
        deadline = time.monotonic() + 60
        while True:  # the RPC server listens before llama-server connects to it
            try:
                socket.create_connection(("127.0.0.1", rpc_port), timeout=1).close()
                break
            except OSError:
                if rpc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise SystemExit(f"ggml-rpc-server did not listen: {log.read()[-2000:]}") from None
                time.sleep(0.1)
        ready_s = server.start(args.timeout)
        run = decode(server.base, args.n)
        gib = lambda pid: None if (b := device_memory(pid)) is None else round(b / 2**30, 3)  # noqa: E731
        return {
            "flags": server.argv[1:],
            "ready_s": round(ready_s, 1),
            **run,
            "llama_server_gib": gib(server.proc.pid),  # the last HEAD layers, the output head, the MTP block
            "rpc_server_gib": gib(rpc.pid),  # the first PEER layers
        }
    finally:
        server.stop()
        rpc.terminate()
        rpc.wait(timeout=30)


def estimates(model: str, head_argv: list[str]) -> list:
    """contracts/footprint.py's estimate of the head's and the peer's process: the head's own
    (`head_footprint`, what it checks before loading) from its argv read by the engine's CLI, and
    the peer's stage for the same settings (with `--output-stage last`, its output head and MTP block)."""
    cfg = head_config(build_parser().parse_args(head_argv), {})
    g = GGUFFile(model)
    tensors = model_tensors(g.metadata, g.tensors)
    head, peer = parse_split(cfg.split, tensors.n_layers, 2)
    m = cfg.model
    last = cfg.output_stage == "last"  # the peer holds the output head and the MTP block
    peer = tensors.stage(
        *peer,
        head=False,
        output=last,
        mtp=last and cfg.spec.type == "mtp",
        device="cuda",
        dtype=m.dtype,
        n_slots=cfg.parallel,
        n_ctx=m.ctx,
        kv_types=m.kv_types,
        kv_pool=m.kv_pool,
        depth=rollback_depth(max_run_of(cfg.spec)),
    )
    return [head_footprint(cfg, g, head, "cuda", m.dtype), peer]


def phase_seconds(startup_s: dict | None) -> dict:
    """/status `startup_s` (seconds from the process's start to each phase) as each phase's own seconds,
    from the one before it: "stage built" is reading and repacking, "decode graphs" their compile and
    capture, "packed graphs" their capture (docs/PERF.md, session 29)."""
    marks = sorted((startup_s or {}).items(), key=lambda kv: kv[1])
    return {name: round(t - prev, 2) for (name, t), prev in zip(marks, [0.0] + [t for _, t in marks])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--split", required=True, help="layers of head / peer, e.g. 40/24")
    ap.add_argument("--cards", default="16,12", help="GiB of the head's and the peer's card")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("-n", type=int, default=64, help="tokens decoded through the split")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--owners", help="a folder: each process's allocated bytes by source line (memory_owners.py)")
    ap.add_argument("--llama-cpp", help="llama.cpp's build directory: its own split of the file first, side by side")
    ap.add_argument("--cold", action="store_true", help="start with empty caches (a fresh HYDRA_CACHE_DIR)")
    ap.add_argument("--restart", action="store_true", help="then stop both and start again: the warm start")
    args, extra = ap.parse_known_args()
    cold = tempfile.TemporaryDirectory(prefix="hydra-cold-") if args.cold else None
    if cold is not None:  # prepared weights, inductor's and Triton's caches: all under it, removed at the end
        os.environ["HYDRA_CACHE_DIR"] = cold.name
    extra = [a for a in extra if a != "--"]
    llama = llama_split(args, extra) if args.llama_cpp else None

    # The peer takes its KV types and context from the head's LOAD_STAGE; of the serve flags only this one is its own.
    def command(name: str) -> list[str]:
        return [sys.executable, str(OWNERS), str(Path(args.owners) / f"{name}.txt")] if args.owners else ENGINE

    peer = Server(
        [
            "peer",
            "--model",
            args.model,
            "--device",
            args.device,
            *(["--no-compile"] if "--no-compile" in extra else []),
        ],
        command("peer"),
    )
    head_args = [
        "serve",
        "--model",
        args.model,
        "--device",
        args.device,
        "--peer",
        f"127.0.0.1:{peer.rpc_port}",
        "--split",
        args.split,
        "--ctx",
        str(args.ctx),
        "--parallel",
        "1",
        *extra,
    ]
    head = Server(head_args, command("head"))
    try:
        peer.start(args.timeout)
        ready_s = head.start(args.timeout)
        startup_s = head.status().get("startup_s")
        run = decode(head.base, args.n)
        cards = [float(c) for c in args.cards.split(",")]
        out = {
            "model": args.model,
            "split": args.split,
            "ctx": args.ctx,
            "serve_flags": extra,
            "head_ready_s": round(ready_s, 1),
            # seconds from the head's start to each stage and load phase: file opened, its stage built
            # (weights read and repacked), the MTP block (with its graphs), the decode and output head
            # graphs compiled and captured, the packed graphs captured, all graphs warmed, the peer's
            # LOAD_STAGE answered (run beside the head's own), ready
            "head_startup_s": startup_s,
            "head_phase_s": phase_seconds(startup_s),
            # without cached bytecode every start compiles torch's Python sources (docs/PERF.md, session 16)
            "bytecode_cached": not sys.dont_write_bytecode,
            **run,
        }
        for name, proc, card, est in zip(("head", "peer"), (head, peer), cards, estimates(args.model, head_args)):
            m = memory(proc.status())
            used = m["gpu_memory_gib"]
            # a "16 GB" card holds 16 GiB; it fits with the headroom the console plans with (contracts/fit.py)
            room = card - DEFAULT_HEADROOM_GIB
            out[name] = m | {"card_gib": card, "fits_with_headroom": None if used is None else used <= room}
            gib = {
                k: round(getattr(est, k) / 2**30, 3)
                for k in ("weight_bytes", "kv_bytes", "work_bytes", "runtime_bytes")
            }
            out[name]["estimate_gib"] = gib | {"total": round(est.total / 2**30, 3)}
            # the estimate by what holds the bytes (contracts/footprint.py StageBytes.parts)
            out[name]["estimate_parts_gib"] = {k: round(v / 2**30, 3) for k, v in est.parts.items()}
            if used:
                out[name]["estimate_error"] = round(est.total / 2**30 / used - 1, 3)
        if llama is not None:
            out["llama_cpp"] = llama
        if args.owners:
            for proc in (head, peer):
                proc.proc.send_signal(signal.SIGUSR1)
            files = [Path(args.owners) / f"{name}.txt" for name in ("head", "peer")]
            deadline = time.monotonic() + 120  # the snapshot walks every block
            while not all(f.exists() for f in files) and time.monotonic() < deadline:
                time.sleep(0.5)
            time.sleep(2)  # a file that exists may still be being written
        if args.restart:
            head.stop()
            peer.stop()
            peer.start(args.timeout)
            out["restart_ready_s"] = round(head.start(args.timeout), 1)
            out["restart_startup_s"] = head.status().get("startup_s")
            out["restart_phase_s"] = phase_seconds(out["restart_startup_s"])
        print(json.dumps(out))
    finally:
        head.stop()
        peer.stop()
        if cold is not None:
            cold.cleanup()


if __name__ == "__main__":
    main()
