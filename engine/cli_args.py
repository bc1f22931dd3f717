"""The flag groups of `hydra-engine`'s subcommands, each added to every parser that takes it: the
model and its memory (every subcommand), the device headroom and the merged RPC port (`serve`,
`peer`), speculative decoding and the sampling defaults (`serve`); and the help formatter they
share. cli.py builds the subcommands from them.
"""

from __future__ import annotations

import argparse

from ..contracts.fit import DEFAULT_HEADROOM_GIB
from .config import KV_CACHE_TYPES


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """A flag's help ends with its default once: not when its text already names one, nor when
    there is none to name (None, off, an empty list)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False, []) or not action.option_strings:
            return text
        return super()._get_help_string(action)


def model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None, help="GGUF file (default: the Gemma 3 270M package)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--dtype", default="auto", help="compute dtype: auto, float32, bfloat16, float16")
    p.add_argument("--ctx", type=int, default=None, help="context length per slot (default 4096)")
    p.add_argument(
        "-c",
        "--ctx-size",
        type=int,
        default=None,
        help="llama-server's: the context of all slots together (each gets ctx-size / parallel; with "
        "--kv-unified, the shared KV pool)",
    )
    p.add_argument(
        "--gpu-weights",
        choices=["quantized", "dense"],
        default="quantized",
        help="on a GPU, keep GGUF-quantized weights quantized (smallest) or expand them to the compute "
        "dtype (faster decode today where they fit)",
    )
    for kv in ("k", "v"):
        p.add_argument(
            f"--cache-type-{kv}",
            f"-ct{kv}",
            choices=KV_CACHE_TYPES,
            default="auto",
            help=f"{kv.upper()} cache type, as llama.cpp's; q8_0 halves the cache of f16; auto: the compute dtype",
        )
    p.add_argument(
        "--no-compile",
        action="store_true",
        help="on a GPU, capture the decode step in CUDA graphs without torch.compile: a faster start "
        "(no warm-up compile), a slower decode",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="CPU: a token's floats never depend on the batch it runs in (other requests, prompt chunks, the "
        "prompt cache, drafts), so identical greedy requests give identical text; slower prefill (README). "
        "A head passes it to its peers",
    )


def headroom_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--headroom-gb",
        type=float,
        default=DEFAULT_HEADROOM_GIB,
        help="GiB a stage must leave free on its device (the driver, a desktop): a head (--split) or a "
        "peer (LOAD_STAGE) whose stage would not leave it refuses before loading, naming need and free",
    )


def rpc_args(p: argparse.ArgumentParser, default_host: str = "127.0.0.1") -> None:
    p.add_argument("--rpc-host", default=default_host, help="bind address of the merged RPC port")
    p.add_argument("--rpc-port", type=int, default=None, help="merged RPC port (default: HTTP port + 1)")
    p.add_argument("--max-frame", type=int, default=1 << 30, help="largest accepted RPC frame in bytes")
    p.add_argument(
        "--rpc-pool-size",
        type=int,
        default=2,
        help="RPC pool workers: a head's serve each request; a peer's each connection that is not the head's "
        "session, for its life",
    )
    p.add_argument("--rpc-queue", type=int, default=64, help="RPC connections waiting for a pool worker (then dropped)")
    p.add_argument(
        "--auth-token",
        default=None,
        help="shared secret both RPC protocols must prove before any command (visible in `ps`: prefer env "
        "HYDRA_TOKEN or --auth-token-file)",
    )
    p.add_argument("--auth-token-file", default=None, help="read the token from this file (mode 0600 or stricter)")


# llama-server's --spec-type names, as the drafter of ours that does that job (a command copied from
# llama-server's docs runs as written)
LLAMA_SPEC_TYPES = {
    "none": "off",
    "draft-simple": "draft",
    "draft-mtp": "mtp",
    "ngram-simple": "ngram",
    "ngram-map-k": "ngram",
    "ngram-map-k4v": "ngram",
    "ngram-mod": "ngram",
    "ngram-cache": "ngram",
}


def _spec_type(value: str) -> str:
    return LLAMA_SPEC_TYPES.get(value, value)


def spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--spec-type",
        type=_spec_type,
        choices=["off", "ngram", "draft", "mtp"],
        default="off",
        help=f"speculative decoding (llama-server's names too: {', '.join(LLAMA_SPEC_TYPES)})",
    )
    p.add_argument("--model-draft", "--spec-draft-model", "-md", default=None, help="draft GGUF for --spec-type draft")
    p.add_argument("--draft-max", "--spec-draft-n-max", type=int, default=3, help="most tokens drafted per step")
    p.add_argument(
        "--draft-min", "--spec-draft-n-min", type=int, default=0, help="fewest tokens a draft must have to be verified"
    )
    p.add_argument(
        "--draft-p-min",
        "--spec-draft-p-min",
        type=float,
        default=0.75,
        help="draft model: stop drafting below this probability",
    )
    p.add_argument(
        "--spec-draft-sampling",
        choices=["probabilistic", "greedy"],
        default="probabilistic",
        help="at temperature > 0 a draft model or MTP block samples its draft, verified by rejection sampling; "
        "greedy (llama-server's default): it drafts its argmax, checked by the target's own seeded draw, so a "
        "seed gives the same text with or without speculation",
    )
    p.add_argument(
        "--draft-adaptive",
        choices=["auto", "on", "off"],
        default="auto",
        help="per step, every slot drafts the k in [0, --draft-max] that gives the most tokens per second from the "
        "slots' recent acceptance and the measured step costs (0: plain decode); off: always --draft-max. "
        "auto: on for --spec-type mtp on a CPU head (on a GPU its first measured run drafted nothing: docs/PERF.md)",
    )


def sampling_defaults(p: argparse.ArgumentParser) -> None:
    """What a request gets for a sampling field it omits (llama-server's flags; unset: the engine's
    defaults, OpenAI's temperature 1 and no top-k/top-p/min-p/penalty)."""
    p.add_argument("--temperature", "--temp", type=float, default=None, help="default temperature")
    p.add_argument("--top-k", type=int, default=None, help="default top-k (0: off)")
    p.add_argument("--top-p", type=float, default=None, help="default top-p (1: off)")
    p.add_argument("--min-p", type=float, default=None, help="default min-p (0: off)")
    p.add_argument("--repeat-penalty", type=float, default=None, help="default repeat penalty (1: off)")
    p.add_argument("--seed", type=int, default=None, help="default seed (-1 or unset: a random seed per request)")
