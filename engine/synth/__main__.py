"""A named shape's random-weight GGUF, for GPU benchmarks where the real model cannot be copied.

    python -m hydra_console.engine.synth OUT.gguf [--shape qwen35-27b] [--mtp-accuracy A]

The users' 27B takes 1-2 minutes and its whole 18 GB of disk."""

from __future__ import annotations

import argparse
import time

from . import SHAPES, write_synthetic


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen35-27b")
    ap.add_argument("--mtp-accuracy", type=float, default=1.0, help="how often the NextN block drafts right")
    args = ap.parse_args()
    began = time.monotonic()
    write_synthetic(args.out, **SHAPES[args.shape], mtp_accuracy=args.mtp_accuracy)
    print(f"{args.out}: {args.shape} written in {time.monotonic() - began:.0f} s")


if __name__ == "__main__":
    main()
