"""OpenMP's idle spin for the workers of a layer split, set before torch loads libgomp (which reads
its environment once, at load).

After each parallel region libgomp keeps its idle threads spinning for ~3 ms (GOMP_SPINCOUNT
300000) before they sleep. Alone on a machine that is free and keeps the threads hot between
kernels. In a split the head and its peers take turns: on a shared machine each process's
spinning threads steal the cores the other one is computing on, and decode through a loopback
split ran at 0.54-0.59 of solo on 2 cores. Spinning ~0.1 ms covers the gaps between a step's
kernels but not the other process's turn (0.89-0.95 of a solo head with the same setting, `benchmarks/bench_split.py`).
Between machines it costs nothing. Solo workers keep libgomp's default.
"""

from __future__ import annotations

import os

SPLIT_SPINCOUNT = "10000"  # libgomp counts ~100,000 spins per millisecond
WAIT_VARIABLES = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def configure_split_worker() -> bool:
    """Shorten the idle spin of this process (a peer, or a head with peers) unless the operator
    chose a wait policy. Must run before torch is imported; returns whether it set anything."""
    if any(v in os.environ for v in WAIT_VARIABLES):
        return False
    os.environ["GOMP_SPINCOUNT"] = SPLIT_SPINCOUNT
    return True
