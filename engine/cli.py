"""`hydra-engine serve|peer|generate|bench`: the flag surface of every worker, in one place.

Each subcommand's work lives in the module that owns it; this file only parses flags and
turns a UserError into one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys

from .errors import UserError


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None, help="GGUF file (default: the Gemma 3 270M package)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument("--dtype", default="auto", help="compute dtype: auto, float32, bfloat16, float16")
    p.add_argument("--ctx", type=int, default=4096, help="context length per slot")


def _rpc_args(p: argparse.ArgumentParser, default_host: str = "127.0.0.1") -> None:
    p.add_argument("--rpc-host", default=default_host, help="bind address of the merged RPC port")
    p.add_argument("--rpc-port", type=int, default=None, help="merged RPC port (default: HTTP port + 1)")
    p.add_argument("--max-frame", type=int, default=1 << 30, help="largest accepted RPC frame in bytes")
    p.add_argument(
        "--auth-token",
        default=os.environ.get("HYDRA_TOKEN"),
        help="shared secret both RPC protocols must prove before any command (env HYDRA_TOKEN); "
        "visible in ps: prefer HYDRA_TOKEN or --auth-token-file",
    )
    p.add_argument("--auth-token-file", default=None, help="read the token from this file (mode 0600 or stricter)")


def read_token_file(path: str) -> str:
    """The token in `path`, refused when group or others may read it (a secret file must stay one)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise UserError(f"--auth-token-file {path}: {e.strerror}") from None
    with os.fdopen(fd) as f:
        if os.fstat(fd).st_mode & 0o077:
            raise UserError(f"--auth-token-file {path}: readable by group or others; chmod 600 it")
        token = f.read().strip()
    if not token:
        raise UserError(f"--auth-token-file {path} is empty")
    return token


def _spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec-type", choices=["off", "ngram", "draft", "mtp"], default="off")
    p.add_argument("--model-draft", default=None, help="draft GGUF for --spec-type draft")
    p.add_argument("--draft-max", type=int, default=3)
    p.add_argument("--draft-min", type=int, default=0)
    p.add_argument("--draft-p-min", type=float, default=0.75)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hydra-engine", description="Hydra layer-split LLM engine")
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="stream a completion to stdout")
    _model_args(g)
    g.add_argument("--prompt", "-p", required=True)
    g.add_argument("-n", "--n-predict", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repeat-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")

    b = sub.add_parser("bench", help="prefill and decode throughput")
    _model_args(b)
    b.add_argument("-p", "--n-prompt", type=int, default=512)
    b.add_argument("-n", "--n-gen", type=int, default=128)
    b.add_argument("-r", "--repetitions", type=int, default=3)
    b.add_argument("--json", action="store_true", help="print one JSON object")
    b.add_argument("--llama-bench", default=None, help="path of upstream llama-bench to run on the same file")

    s = sub.add_parser("serve", help="head worker: HTTP API + merged RPC port, drives peers")
    _model_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8080)
    s.add_argument("--parallel", "-np", type=int, default=4, help="slots decoded together")
    s.add_argument("--alias", default=None, help="model name reported by the API")
    _rpc_args(s)
    s.add_argument("--rpc-pool-size", type=int, default=2, help="RPC connection workers (head mode)")
    s.add_argument("--rpc-queue", type=int, default=64, help="RPC connections waiting for a worker")
    s.add_argument("--peer", action="append", default=[], metavar="HOST:PORT", help="peer RPC address, pipeline order")
    s.add_argument("--split", default=None, help="layers per stage, head first: 9/9, 9,9 or proportions")
    s.add_argument("--fallback-solo", action="store_true", help="run all layers locally if peers never come up")
    s.add_argument("--peer-wait", type=float, default=180.0, help="seconds to wait for peers at start")
    _spec_args(s)

    pr = sub.add_parser("peer", help="peer worker: serves its assigned layers over the merged RPC port")
    _model_args(pr)
    pr.add_argument("--host", default="127.0.0.1", help="HTTP bind for /health, /status, /metrics")
    pr.add_argument("--port", type=int, default=8090)
    _rpc_args(pr)
    pr.add_argument("--insecure", action="store_true", help="allow a non-loopback --rpc-host without a token")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "rpc_port", 0) is None:
        args.rpc_port = args.port + 1
    if args.command == "peer" or getattr(args, "peer", None):
        from .openmp import configure_split_worker

        configure_split_worker()  # before the subcommand imports torch
    try:
        if getattr(args, "auth_token_file", None):
            args.auth_token = read_token_file(args.auth_token_file)
        if args.command == "generate":
            from .generate import main as run
        elif args.command == "bench":
            from .bench import main as run
        elif args.command == "serve":
            from .api import serve as run
        else:
            from .rpc.peer import main as run
        return run(args) or 0
    except UserError as e:
        print(f"hydra-engine: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
