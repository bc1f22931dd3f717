"""Adaptive draft length: how many tokens every decoding slot drafts this step, so that the step's
expected output per unit of its measured cost is the highest, 0 (plain decode) included.

The model, per slot s: `p[s][i]`, the chance that draft token i is accepted given that tokens
0..i-1 were (an EWMA per position, `SlotAcceptance`); drafting k tokens then adds
`g[s][j] = p[s][0] * ... * p[s][j-1]` expected tokens for each j <= k. Per batch of n decoding
slots, `StepCosts` holds the measured seconds of a step that verifies T tokens (n plain tokens plus
the drafts, drafting included), per (n, T). `choose` gives every slot the same run length K (its own
cap where that is less) and keeps the K with the most expected tokens per second: with several
streams a draft must pay for what it adds to everyone's step, so speculation never loses to plain
decode by the model's own numbers. One length for all: a step whose slots run different lengths
costs more than its tokens say (the recurrent layers' mixed-length form; on a GPU, out of the
graphs), which per-slot lengths measured as a 4 % loss to plain decode at 4 streams (docs/PERF.md).

Costs not measured lately are guessed (`StepCosts.curve`) so that the ends get tried and what
lies between is interpolated; while K stays 0, every slot drafts one token after `PROBE_EVERY` steps
(the wait doubling after each probe, up to `PROBE_MAX`, until drafting pays again) so that acceptance
that rises gets drafts back.
Everything that depends on time is `StepCosts`' input: `choose` is a plain function of given costs
and acceptances.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from dataclasses import dataclass

DECAY = 0.8  # per verify: a slot's acceptance follows its last ~5 drafts
GLOBAL_DECAY = 0.98  # the server's acceptance (a new slot's prior) follows its last ~50
PRIOR = 2.0  # pseudo-drafts a new slot's estimate starts with, at the server's acceptance
OPTIMISM = 0.9  # the server's acceptance before any draft: draft first, learn after
COST_WINDOW = 5  # a cost cell is the median of its last measurements
STALE = 64  # steps of n slots after which a cost cell of n slots not measured since is guessed again
PROBE_EVERY = 16  # steps a slot left at k = 0 waits before drafting one token
PROBE_MAX = 128  # the wait doubles while probes fail, up to this
GAIN_MARGIN = 0.02  # more tokens must win by this much


def gains(p: list[float], k_max: int) -> list[float]:
    """Expected tokens each of the first k_max draft positions adds (the products of `p`)."""
    out, acc = [], 1.0
    for i in range(k_max):
        acc *= p[i] if i < len(p) else (p[-1] if p else 0.0)
        out.append(acc)
    return out


def choose(acceptance: list[list[float]], k_max: list[int], cost: list[float], verified=lambda k: k) -> list[int]:
    """Draft lengths for n slots, one run length K for all (a slot's cap `k_max[s]` where less):
    `acceptance[s]` per position, `cost[j]` the cost of a step of n + j tokens (any unit; cost[0] =
    plain decode). Maximises expected tokens (n plus the accepted gains) over cost. `verified(k)`:
    the tokens a k-token draft's verify runs (more than k where it is padded to a length the graphs
    replay)."""
    n = len(acceptance)
    slot_gains = [gains(p, k) for p, k in zip(acceptance, k_max)]
    rates = []
    for run in range(max(k_max, default=0) + 1):
        ks = [min(run, k) for k in k_max]
        tokens = sum(verified(k) for k in ks)
        if tokens >= len(cost):
            break
        rates.append((n + sum(sum(g[:k]) for g, k in zip(slot_gains, ks))) / cost[tokens])
    # The shortest run within GAIN_MARGIN of the best rate: noise in the costs never tips K up.
    best = next(run for run, r in enumerate(rates) if r * (1 + GAIN_MARGIN) >= max(rates))
    return [min(best, k) for k in k_max]


class StepCosts:
    """Seconds of a decode step by (slots decoding n, tokens verified T): each cell the median of its
    last `COST_WINDOW` measurements (one slow step, a page fault or a neighbour's burst, moves it
    little); `curve` gives the costs `choose` takes, guessing the unmeasured ones."""

    def __init__(self):
        self._s: dict[tuple[int, int], tuple[deque, int]] = {}  # (n, T) -> (recent seconds, n's step last measured)
        self._steps: dict[int, int] = {}  # steps measured per n

    def record(self, n: int, tokens: int, seconds: float) -> None:
        step = self._steps[n] = self._steps.get(n, 0) + 1
        recent = self._s[(n, tokens)][0] if (n, tokens) in self._s else deque(maxlen=COST_WINDOW)
        recent.append(seconds)
        self._s[(n, tokens)] = (recent, step)

    def curve(self, n: int, extra: int) -> list[float]:
        """Costs of n + j tokens for j = 0..extra from the cells measured in the last `STALE` steps of
        n slots: between two, interpolated; above the largest, its cost (bigger steps get tried);
        below the smallest, its cost scaled down by tokens (smaller ones, plain decode, get tried);
        none: all the same. A cell not measured for `STALE` steps is guessed again, so one measured
        in a bad moment is tried again."""
        now = self._steps.get(n, 0)
        known = {}
        for j in range(extra + 1):
            cell = self._s.get((n, n + j))
            if cell is not None and now - cell[1] < STALE:
                known[j] = statistics.median(cell[0])
        if not known:
            return [1.0] * (extra + 1)
        js = sorted(known)
        out = []
        for j in range(extra + 1):
            lo = max((x for x in js if x <= j), default=None)
            hi = min((x for x in js if x >= j), default=None)
            if lo is None:
                out.append(known[hi] * (n + j) / (n + hi))
            elif hi is None or hi == lo:
                out.append(known[lo])
            else:
                out.append(known[lo] + (known[hi] - known[lo]) * (j - lo) / (hi - lo))
        return out

    def table(self) -> dict[tuple[int, int], float]:
        return {k: statistics.median(v) for k, (v, _) in self._s.items()}


@dataclass
class SlotAcceptance:
    """One slot's EWMA of accepted / drafted per draft position (`p`), its last k and its totals."""

    s: list[float]
    t: list[float]
    k: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def p(self) -> list[float]:
        return [a / b if b > 0 else 0.0 for a, b in zip(self.s, self.t)]

    def record(self, n_drafted: int, n_accepted: int, decay: float = DECAY) -> None:
        """Positions 0..n_accepted-1 were accepted, position n_accepted (if drafted) rejected; those
        after it tell nothing."""
        for i in range(min(n_drafted, n_accepted + 1, len(self.s))):
            self.s[i] = decay * self.s[i] + (1.0 if i < n_accepted else 0.0)
            self.t[i] = decay * self.t[i] + 1.0
        self.drafted += n_drafted
        self.accepted += n_accepted


class AdaptiveDrafts:
    """The engine's adaptive policy state: per-slot acceptance, the server's acceptance (a new slot's
    prior), the step costs and the probe schedule. `plan` picks k per slot; `record` and `timed`
    feed it."""

    def __init__(self, n_max: int):
        self.n_max = n_max
        self.slots: dict[int, SlotAcceptance] = {}
        self.costs = StepCosts()
        self.server = SlotAcceptance([OPTIMISM] * n_max, [1.0] * n_max)
        self.idle = 0  # steps since the last that drafted
        self.wait = PROBE_EVERY  # steps at k = 0 before a probe
        self._lock = threading.Lock()  # /status reads while the engine writes

    def start(self, slot: int) -> None:
        with self._lock:
            self._start(slot)

    def _start(self, slot: int) -> SlotAcceptance:
        st = SlotAcceptance([PRIOR * x for x in self.server.p], [PRIOR] * self.n_max)
        self.slots[slot] = st
        return st

    def release(self, slot: int) -> None:
        with self._lock:
            self.slots.pop(slot, None)

    def plan(self, slots: list[int], caps: list[int], verified=lambda k: k) -> list[int]:
        """k per slot (`caps`: each slot's most; `verified`: see `choose`). After `wait` steps at 0,
        every slot drafts one token: a probe, after which the wait doubles; it is back to
        `PROBE_EVERY` once the acceptances make drafting pay again. A probe that is right now and
        then (low acceptance) does not bring the wait down: each probe step costs a verify, and at
        `PROBE_EVERY` they cost a one-stream CPU engine ~4-6 % by its measured step costs (docs/PERF.md,
        session 25)."""
        with self._lock:
            states = [self.slots.get(s) or self._start(s) for s in slots]
            curve = self.costs.curve(len(slots), sum(verified(c) for c in caps))
            ks = choose([st.p for st in states], caps, curve, verified)
            if any(ks):
                self.idle, self.wait = 0, PROBE_EVERY
            else:
                self.idle += 1
            if self.idle >= self.wait and any(caps):
                ks = [min(1, c) for c in caps]
                self.idle, self.wait = 0, min(2 * self.wait, PROBE_MAX)
            for st, k in zip(states, ks):
                st.k = k
            return ks

    def record(self, slot: int, n_drafted: int, n_accepted: int) -> None:
        with self._lock:
            st = self.slots.get(slot)
            if st is not None:
                st.record(n_drafted, n_accepted)
            self.server.record(n_drafted, n_accepted, GLOBAL_DECAY)

    def timed(self, n: int, tokens: int, seconds: float) -> None:
        with self._lock:
            self.costs.record(n, tokens, seconds)

    def snapshot(self) -> list[dict]:
        """Per slot: the k its last step drafted, its estimated acceptance by position, its totals."""
        with self._lock:
            return [
                {
                    "slot": s,
                    "k": st.k,
                    "acceptance": [round(x, 3) for x in st.p],
                    "drafted": st.drafted,
                    "accepted": st.accepted,
                }
                for s, st in sorted(self.slots.items())
            ]
