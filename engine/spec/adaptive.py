"""Adaptive draft length: per slot, how many tokens to draft so that a decode step's expected output
per unit of its measured cost is the highest, 0 (plain decode) included.

The model, per slot s: `p[s][i]`, the chance that draft token i is accepted given that tokens
0..i-1 were (an EWMA per position, `SlotAcceptance`); drafting k tokens then adds
`g[s][j] = p[s][0] * ... * p[s][j-1]` expected tokens for each j <= k, gains that never grow with j.
Per batch of n decoding slots, `StepCosts` holds the measured seconds of a step that verifies T
tokens (n plain tokens plus the drafts, drafting included), per (n, T). `choose` then takes, for
each T, the T - n largest gains over all slots (a prefix of each slot's: they never grow) and keeps
the T with the most expected tokens per second: with several streams a draft must pay for what it
adds to everyone's step, so speculation never loses to plain decode by the model's own numbers.

Costs not measured lately are guessed (`StepCosts.curve`) so that the ends get tried and what
lies between is interpolated; a slot left at k = 0 drafts one token every `PROBE_EVERY` steps (doubling while its
probes fail, up to `PROBE_MAX`) so that acceptance that rises gets drafts back. Everything that
depends on time is `StepCosts`' input: `choose` is a plain function of given costs and acceptances.
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
    """Draft lengths for n slots: `acceptance[s]` per position, `k_max[s]` each slot's cap, `cost[j]`
    the cost of a step of n + j tokens (any unit; cost[0] = plain decode). Maximises expected
    tokens (n plus the accepted gains) over cost. `verified(k)`: the tokens a k-token draft's
    verify runs (more than k where it is padded to a length the graphs replay: a slot's first draft
    token then costs its whole padded run, the next ones nothing more)."""
    n = len(acceptance)
    ranked = sorted(
        ((g, j, s) for s, (p, k) in enumerate(zip(acceptance, k_max)) for j, g in enumerate(gains(p, k))),
        key=lambda x: (-x[0], x[1], x[2]),
    )
    rates, expected, ks, tokens = [n / cost[0]], float(n), [0] * n, 0
    for g, _, s in ranked:
        ks[s] += 1
        tokens += verified(ks[s]) - verified(ks[s] - 1)
        if tokens >= len(cost):
            break
        expected += g
        rates.append(expected / cost[tokens])
    # The fewest tokens within GAIN_MARGIN of the best rate: noise in the costs never tips k up.
    best = next(j for j, r in enumerate(rates) if r * (1 + GAIN_MARGIN) >= max(rates))
    ks = [0] * n
    for _, _, s in ranked[:best]:
        ks[s] += 1
    return ks


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
    """One slot's EWMA of accepted / drafted per draft position (`p`), its last chosen k, and its
    probe schedule while it drafts nothing."""

    s: list[float]
    t: list[float]
    k: int = 0
    idle: int = 0  # steps since its last draft
    wait: int = PROBE_EVERY
    probing: bool = False
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
        if self.probing:  # a failed probe waits twice as long for the next
            self.wait = PROBE_EVERY if n_accepted else min(2 * self.wait, PROBE_MAX)
            self.probing = False


class AdaptiveDrafts:
    """The engine's adaptive policy state: per-slot acceptance, the server's acceptance (a new slot's
    prior) and the step costs. `plan` picks k per slot; `record` and `timed` feed it."""

    def __init__(self, n_max: int):
        self.n_max = n_max
        self.slots: dict[int, SlotAcceptance] = {}
        self.costs = StepCosts()
        self.server = SlotAcceptance([OPTIMISM] * n_max, [1.0] * n_max)
        self._lock = threading.Lock()  # /status reads while the engine writes

    def start(self, slot: int) -> None:
        with self._lock:
            self._start(slot)

    def _start(self, slot: int) -> SlotAcceptance:
        # A new request starts from the server's acceptance and its probe wait: short requests on text
        # the block never gets right would otherwise each pay the first, shortest waits.
        st = SlotAcceptance([PRIOR * x for x in self.server.p], [PRIOR] * self.n_max, wait=self.server.wait)
        self.slots[slot] = st
        return st

    def release(self, slot: int) -> None:
        with self._lock:
            self.slots.pop(slot, None)

    def plan(self, slots: list[int], caps: list[int], verified=lambda k: k) -> list[int]:
        """k per slot (`caps`: each slot's most; `verified`: see `choose`); a slot at 0 for its probe
        wait drafts one token."""
        with self._lock:
            states = [self.slots.get(s) or self._start(s) for s in slots]
            curve = self.costs.curve(len(slots), sum(verified(c) for c in caps))
            ks = choose([st.p for st in states], caps, curve, verified)
            for i, (st, cap) in enumerate(zip(states, caps)):
                st.idle = 0 if ks[i] else st.idle + 1
                if not ks[i] and cap and st.idle >= st.wait:
                    ks[i], st.idle, st.probing = 1, 0, True
                st.k = ks[i]
            return ks

    def record(self, slot: int, n_drafted: int, n_accepted: int) -> None:
        with self._lock:
            st = self.slots.get(slot)
            if st is not None:
                probe = st.probing
                st.record(n_drafted, n_accepted)
                if probe:
                    self.server.wait = st.wait
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
