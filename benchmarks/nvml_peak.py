"""Run a command and print the GPU's peak memory above its idle reading while it ran.

    python benchmarks/nvml_peak.py [--device 0] [--interval-ms 10] -- CMD ARGS...

Polls NVML's used memory of the card (the CUDA context and everything outside torch's allocator
included, as a per-process reading would be on an otherwise idle card) every `--interval-ms`, so a
peak between two of the command's own reports is caught. Issue 14 compares this with llama.cpp's
process on the same kind of card (docs/PERF.md).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import pynvml


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--interval-ms", type=float, default=10.0)
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the command to run after --")
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(args.device)
    except pynvml.NVMLError as e:
        print(f"nvml_peak: no NVIDIA device {args.device} to read ({e})", file=sys.stderr)
        return 2
    idle = peak = pynvml.nvmlDeviceGetMemoryInfo(handle).used
    proc = subprocess.Popen(command)
    while proc.poll() is None:
        peak = max(peak, pynvml.nvmlDeviceGetMemoryInfo(handle).used)
        time.sleep(args.interval_ms / 1e3)
    print(
        f"NVML peak above idle: {(peak - idle) / 2**20:.0f} MiB (idle {idle / 2**20:.0f} MiB), "
        f"command exit {proc.returncode}",
        flush=True,
    )
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
