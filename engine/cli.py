"""`hydra-engine serve|peer|generate|bench`: every subcommand's flags (their groups: cli_args.py).

This is the entry point: argv and the environment become config objects here (config.py) and
nowhere else. Each subcommand's work lives in the module that owns it; this file parses flags,
builds the config, and turns a UserError into one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
from typing import Mapping

from .cli_args import DefaultsFormatter, headroom_arg, model_args, rpc_args, sampling_defaults, spec_args
from .cli_config import head_config, peer_config
from .config import (
    BODY_BYTES_PER_TOKEN,
    DEFAULT_BATCH_TOKENS,
    DEFAULT_BATCH_TOKENS_GPU,
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_MAX_RESPONSE,
    DEFAULT_PEER_GRACE,
    DEFAULT_PREFILL_PIPELINE,
    ENVIRONMENT,
    MAX_CONNECTIONS_CAP,
    default_cache_dir,
    worker_env,
)
from .embedding import DEFAULT_NORMALIZE, POOLINGS
from .errors import UserError
from .openmp import configure_split_worker


def build_parser() -> argparse.ArgumentParser:
    epilog = "environment:\n" + "\n".join(f"  {name:<18} {doc}" for name, doc in ENVIRONMENT.items())
    ap = argparse.ArgumentParser(
        prog="hydra-engine",
        description="Hydra layer-split LLM engine",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # Every subcommand's --help shows its defaults.
    sub = ap.add_subparsers(
        dest="command",
        required=True,
        parser_class=functools.partial(argparse.ArgumentParser, formatter_class=DefaultsFormatter),
    )

    g = sub.add_parser("generate", help="stream a completion to stdout")
    model_args(g)
    g.add_argument("--prompt", "-p", required=True, help="the prompt text")
    g.add_argument("-n", "--n-predict", type=int, default=64, help="tokens to generate")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-k", type=int, default=0, help="0: off")
    g.add_argument("--top-p", type=float, default=1.0, help="1: off")
    g.add_argument("--min-p", type=float, default=0.0, help="0: off")
    g.add_argument("--repeat-penalty", type=float, default=1.0, help="1: off")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (random without it)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="launch each decoding step before the host reads the previous one (default: on a GPU)",
    )

    b = sub.add_parser("bench", help="prefill and decode throughput")
    model_args(b)
    b.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens (prefill test)")
    b.add_argument("-n", "--n-gen", type=int, default=128, help="generated tokens (decode test)")
    b.add_argument("-r", "--repetitions", type=int, default=3, help="runs per test")
    b.add_argument(
        "-d", "--depth", type=int, default=0, help="context tokens before the decode test (llama-bench's -d)"
    )
    b.add_argument("--json", action="store_true", help="print one JSON object")
    b.add_argument("--llama-bench", default=None, help="path of upstream llama-bench to run on the same file")

    s = sub.add_parser("serve", help="head worker: HTTP API + merged RPC port, drives peers")
    model_args(s)
    headroom_arg(s)
    s.add_argument("--host", default="127.0.0.1", help="HTTP bind address; several comma-separated (127.0.0.1,::1)")
    s.add_argument("--port", type=int, default=8080, help="HTTP port")
    s.add_argument("--parallel", "-np", type=int, default=4, help="slots decoded together")
    s.add_argument(
        "-kvu",
        "--kv-unified",
        action="store_true",
        help="llama-server's: all slots share one KV pool of -c/--ctx-size positions (without -c: --ctx x "
        "--parallel), taken in blocks of 128 as a slot grows and given back when it ends or when an "
        "idle slot's prompt cache is reclaimed; a slot may grow to --ctx, or to the whole pool without "
        "--ctx. Without --kv-unified each slot reserves its context",
    )
    s.add_argument(
        "--alias",
        "-a",
        default=None,
        help="model names, comma-separated: /v1/models lists them as aliases, the first in sorted "
        "order is the model's id (llama-server's); default: the file's name",
    )
    s.add_argument("--tags", default=None, help="model tags, comma-separated (listed by /v1/models)")
    rpc_args(s)
    s.add_argument("--peer", action="append", default=[], metavar="HOST:PORT", help="peer RPC address, pipeline order")
    s.add_argument("--split", default=None, help="layers per stage, head first: 9/9, 9,9 or proportions")
    s.add_argument("--fallback-solo", action="store_true", help="run all layers locally if peers never come up")
    s.add_argument(
        "--output-stage",
        choices=("head", "last"),
        default="head",
        help="where the output head (and the MTP block) live: on the head, or on the last peer as llama.cpp "
        "places them (the head holds ~1.5 GiB less on a 27B; logits, not hidden states, come back from it)",
    )
    s.add_argument("--peer-wait", type=float, default=180.0, help="seconds to wait for peers at start")
    s.add_argument(
        "--peer-grace",
        type=float,
        default=DEFAULT_PEER_GRACE,
        metavar="SECONDS",
        help="a peer lost mid-request (restarted, say) pauses the streams through it for up to this long: "
        "back in time, it is re-attached and they carry on; else they end with 503 "
        f"(default {DEFAULT_PEER_GRACE:g}; 0: at once)",
    )
    s.add_argument(
        "--prefill-pipeline",
        type=int,
        default=DEFAULT_PREFILL_PIPELINE,
        metavar="N",
        help="a long prompt's chunks flow through the stages: the head computes the next chunk while the "
        f"last peer computes this one, at most N chunks unanswered (default {DEFAULT_PREFILL_PIPELINE}; 0: off, "
        "each chunk waits for the peer)",
    )
    s.add_argument(
        "--api-key",
        default=None,
        help="key the HTTP API requires (Authorization: Bearer KEY or X-Api-Key); /health, /status, "
        "/metrics stay public (visible in `ps`: prefer env HYDRA_API_KEY)",
    )
    s.add_argument(
        "--max-body",
        type=int,
        default=None,
        help=f"largest request body in bytes, 413 above (default: max(1 MiB, ctx x {BODY_BYTES_PER_TOKEN}))",
    )
    s.add_argument(
        "--max-queue", type=int, default=64, help="requests waiting beyond the busy slots; more get 503 + Retry-After"
    )
    s.add_argument(
        "--drain-grace",
        type=float,
        default=30.0,
        help="seconds requests in flight may run on after SIGTERM (new ones get 503 + Retry-After); "
        "then they end with 503 'the server is shutting down' and the head stops",
    )
    s.add_argument(
        "--sleep-idle-seconds",
        type=int,
        default=-1,
        help="after this many seconds without a request the head frees its model (weights, KV, drafters) "
        "and reloads it on the next request; /props says is_sleeping (llama-server's); -1: never",
    )
    s.add_argument(
        "--max-n",
        type=int,
        default=None,
        help="choices (n) one request may ask for, 400 above (default: --parallel); a request keeps at "
        "most --parallel - 1 of them in the engine at once, the rest follow as they finish",
    )
    s.add_argument(
        "--max-response",
        type=int,
        default=DEFAULT_MAX_RESPONSE,
        help=f"largest non-streamed response body in bytes (embeddings above all), 400 above (default "
        f"{DEFAULT_MAX_RESPONSE >> 20} MiB)",
    )
    s.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help=f"open HTTP connections in all; more are answered 503 and closed (default: half of ulimit -n, "
        f"at most {MAX_CONNECTIONS_CAP})",
    )
    s.add_argument(
        "--max-client-connections",
        type=int,
        default=None,
        help="open HTTP connections per client address; more are answered 503 and closed (default: at least 8, a "
        "quarter of --max-connections)",
    )
    s.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT,
        help="seconds for a request's headers to arrive (from the connection's start or the previous "
        "response's end: an idle kept-alive connection's life); then the connection is closed",
    )
    s.add_argument(
        "--body-timeout",
        type=float,
        default=DEFAULT_BODY_TIMEOUT,
        help="seconds for a request's body to arrive once its headers have; then 408 and the connection is closed",
    )
    s.add_argument(
        "-n",
        "--n-predict",
        type=int,
        default=1024,
        help="max_tokens of a chat request that sets none (-1: unbounded); without --context-shift "
        "generation ends where the context does; completions keep OpenAI's 16",
    )
    s.add_argument(
        "--context-shift",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="a generating slot whose context is full keeps its first --keep tokens, drops half of the "
        "rest and goes on (llama-server's); off: generation ends there, truncated. Attention-only "
        "models without peers",
    )
    s.add_argument(
        "--keep",
        type=int,
        default=0,
        help="context shift: prompt tokens kept after the BOS (-1: all of the prompt); a request's n_keep overrides",
    )
    s.add_argument(
        "-b",
        "--batch-size",
        type=int,
        default=None,
        help=f"prompt tokens one engine step computes at most (llama-server's logical batch; default "
        f"{DEFAULT_BATCH_TOKENS}, {DEFAULT_BATCH_TOKENS_GPU} on a GPU)",
    )
    s.add_argument(
        "--slot-save-path",
        default=None,
        help="folder for POST /slots/{id}?action=save|restore (llama-server's; off without it)",
    )
    s.add_argument(
        "--embedding",
        "--embeddings",
        action="store_true",
        help="serve /v1/embeddings, /embeddings and /embedding (the final-norm hidden states of the "
        "same model); generation keeps working",
    )
    s.add_argument(
        "--pooling",
        choices=POOLINGS,
        default=None,
        help="embedding pooling (default: the GGUF's pooling_type, else none); rank: a reranker's scores on /rerank",
    )
    s.add_argument(
        "--reranking",
        "--rerank",
        action="store_true",
        help="serve /rerank (and /v1/rerank, /reranking, /v1/reranking) with a reranker's classification "
        "head: --embedding with --pooling rank",
    )
    s.add_argument(
        "--embd-normalize",
        type=int,
        default=DEFAULT_NORMALIZE,
        help="pooled embeddings' normalisation: -1 none, 0 max absolute (int16), 1 taxicab, 2 euclidean, >2 p-norm",
    )
    s.add_argument(
        "--cors-origins",
        default="*",
        help="origins a browser may call from, comma-separated; '*' reflects any Origin with credentials, "
        "'localhost' only local pages (llama-server's)",
    )
    s.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="launch each decoding step before the host reads the previous one's tokens (default: on a "
        "GPU; a CPU computes in the engine's thread, nothing to overlap)",
    )
    s.add_argument(
        "--mixed-steps",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="prompt chunks ride along with the decoding slots' tokens in one step (vLLM's chunked prefill); "
        "off: a step with a prompt runs only prompts (default: on a CPU, off on a GPU)",
    )
    s.add_argument(
        "--slots",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="GET /slots (off: 501, as llama-server's --no-slots)",
    )
    s.add_argument(
        "--metrics",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="GET /metrics (off: 501); on by default, unlike llama-server: the console reads it",
    )
    s.add_argument(
        "--role",
        choices=["head", "prefill"],
        default="head",
        help="prefill: a worker that only prefills: answers PREFILL with the prompt's state (for decode heads)",
    )
    s.add_argument(
        "--prefill-worker",
        default=None,
        metavar="HOST:PORT",
        help="the RPC port of a --role prefill worker: long prompts are prefilled there",
    )
    s.add_argument(
        "--prefill-threshold",
        type=int,
        default=256,
        help="prompts with at least this many tokens to compute go to --prefill-worker",
    )
    s.add_argument(
        "--prefill-deadline",
        type=float,
        default=30.0,
        help="seconds a prefill + transfer may take before the head prefills locally",
    )
    sampling_defaults(s)
    s.add_argument(
        "--chat-template",
        default=None,
        metavar="NAME|JINJA",
        help="chat template instead of the GGUF's: a built-in name (gemma, chatml, llama3) or jinja source",
    )
    s.add_argument("--chat-template-file", default=None, help="read the chat template (jinja) from this file")
    s.add_argument(
        "--reasoning",
        choices=["on", "off", "auto"],
        default="auto",
        help="the template's enable_thinking for every chat (auto: true where the template reacts to it, "
        "as llama-server; a request's chat_template_kwargs wins)",
    )
    s.add_argument(
        "--verbose",
        action="store_true",
        help="llama-server's: every chat response carries __verbose (its prompt), as if the request said verbose",
    )
    s.add_argument(
        "--jinja",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="the chat template is always rendered with jinja; --jinja (llama-server's) makes a --chat-template "
        "that is no built-in name jinja source, even without a {",
    )
    spec_args(s)

    pr = sub.add_parser("peer", help="peer worker: serves its assigned layers over the merged RPC port")
    model_args(pr)
    headroom_arg(pr)
    pr.add_argument("--host", default="127.0.0.1", help="HTTP bind for /health, /status, /metrics")
    pr.add_argument("--port", type=int, default=8090, help="HTTP port")
    rpc_args(pr)
    pr.add_argument("--insecure", action="store_true", help="allow a non-loopback --rpc-host without a token")
    # Tests only: a peer slowed on purpose (ms per layer run), for the split advisor.
    pr.add_argument("--layer-delay-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    env = os.environ if env is None else env
    if args.command in ("serve", "peer"):  # workers log one line per event (and per HTTP request) to stderr
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "peer" or getattr(args, "peer", None):
        configure_split_worker()  # before the subcommand imports torch
    for name, value in worker_env(env).items():
        os.environ.setdefault(name, value)  # before torch is imported; the operator's own setting wins
    try:
        if args.command == "generate":
            from .generate import main as generate

            return generate(args, default_cache_dir(env)) or 0
        if args.command == "bench":
            from .bench import main as bench

            return bench(args, default_cache_dir(env)) or 0
        if args.command == "serve":
            from .workers.head import HeadWorker

            return HeadWorker(head_config(args, env)).serve()
        from .workers.peer import PeerWorker

        return PeerWorker(peer_config(args, env)).serve()
    except UserError as e:
        print(f"hydra-engine: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
