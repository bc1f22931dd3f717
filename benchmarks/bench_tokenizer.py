"""Tokenizer speed on the default model: load from the GGUF, and encode ~2,000 tokens of prose.

    python benchmarks/bench_tokenizer.py [--model PATH] [--tokens 2000] [--repeat 5]

Prints: from_gguf time, the first encode (builds the lookup tables), encode with an empty word
cache (new text), encode with a warm cache (repeated text), decode, all in ms.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time

from hydra_console.engine.default_model import default_model_path
from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.text.tokenizer import Tokenizer


def prose(tok: Tokenizer, n_tokens: int) -> str:
    """English prose from standard-library docstrings, cut at about n_tokens tokens."""
    import argparse as a
    import email.message as e
    import logging as lg
    import subprocess as s
    import textwrap as t

    docs = []
    for mod in (lg, s, a, e, t):
        docs += [
            inspect.getdoc(obj) or ""
            for _, obj in inspect.getmembers(mod)
            if inspect.isclass(obj) or inspect.isfunction(obj)
        ]
    text = "\n\n".join(d for d in docs if len(d) > 200)
    # ~4 characters a token; trim to the wanted count
    text = text[: n_tokens * 5]
    while len(tok.encode(text, add_special=False)) > n_tokens:
        text = text[: int(len(text) * 0.97)]
    return text


def ms(f, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        f()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF file (default: the embedded Gemma 3 270M)")
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()

    path = args.model or default_model_path()
    t0 = time.perf_counter()
    g = GGUFFile(path)
    t_gguf = (time.perf_counter() - t0) * 1000
    t_load = ms(lambda: Tokenizer.from_gguf(g), args.repeat)

    tok = Tokenizer.from_gguf(g)
    sample = "The quick brown fox jumps over the lazy dog."
    t_first = ms(lambda: tok.encode(sample), 1)
    text = prose(tok, args.tokens)
    ids = tok.encode(text)

    def cold():
        tok._word_cache.clear()
        tok.encode(text)

    t_cold = ms(cold, args.repeat)
    t_warm = ms(lambda: tok.encode(text), args.repeat)
    t_dec = ms(lambda: tok.decode(ids), args.repeat)
    print(f"model: {path} ({tok!r})")
    print(f"GGUFFile open:                 {t_gguf:8.1f} ms")
    print(f"Tokenizer.from_gguf:           {t_load:8.1f} ms")
    print(f"first encode (builds tables):  {t_first:8.1f} ms")
    print(f"encode {len(ids)} tokens ({len(text)} chars), empty word cache: {t_cold:8.1f} ms")
    print(f"encode {len(ids)} tokens, warm word cache:                    {t_warm:8.1f} ms")
    print(f"decode {len(ids)} tokens:                                     {t_dec:8.1f} ms")


if __name__ == "__main__":
    main()
