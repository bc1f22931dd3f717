"""The split against the cards: each stage's need (contracts/footprint.py, as its worker will hold
it: the output head and the MTP block on the head's stage, or on the last peer's with the profile's
`output_stage = "last"`, at the profile's context, KV types and draft depth) against its card's
capacity less the headroom (contracts/fit.py), and, where a split does not fit, the split that does
(and whether it would fit as it is with the output head on the last peer).

Which fitting split. Hydra's decode step is the sum of every stage's layers (split_advisor.py), so
with no timings every card is taken as equally fast per layer and every fitting split predicts the
same step: the proposal is then the fitting split that moves the fewest layers from the one asked
for. With the advisor's measurements it is the fastest fitting split (split_advisor.advise given
`Planner.fits_for`). A split that cannot fit is refused before anything loads, by
`CardPlan.refusal`: at the profile's start, on the split editor's apply and on every other apply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..contracts.default_model import default_model_path
from ..contracts.errors import UserError
from ..contracts.fit import StageFit, gib, headroom_bytes, refusal
from ..contracts.split import even_split, ranges, split_arg
from .cards import card_capacity, card_index, nvml_totals, on_gpu
from .split_advisor import best_split
from .split_plan import ModelShape, output_stage_of, worker_memory


@dataclass(frozen=True)
class CardPlan:
    counts: list[int]
    stages: list[StageFit]
    proposal: list[int] | None  # a split that fits where `counts` does not; None: none needed or none fits
    proposal_stages: list[StageFit] | None
    output_stage: str = "head"  # where the output head (and the MTP block) lives: "head" | "last"
    # Where `counts` does not fit with the output head on the head: its plan with the output head on
    # the last peer (`output_stage = "last"`), if it fits so.
    alternative: CardPlan | None = None

    @property
    def fits(self) -> bool | None:
        """False: a stage does not fit its card; None: a card's size is unknown; else True."""
        verdicts = [s.fits for s in self.stages]
        return False if False in verdicts else None if None in verdicts else True

    @property
    def refusal(self) -> str | None:
        """Why the split cannot run, with each stage's need and its card's capacity, and the split
        that fits (if any); None when nothing is known not to fit."""
        why = refusal(self.stages)
        if why is None:
            return None
        fix = f"; {split_arg(self.proposal)} fits" if self.proposal else "; no split fits these cards"
        alt = self.alternative
        if alt is not None:
            last = alt.stages[-1]
            what = "the output head and MTP block" if last.mtp else "the output head"
            needs = ", ".join(f"{s.name} {gib(s.need)}" for s in alt.stages)
            fix += f'; with output_stage = "last" ({what} on {last.name}) {split_arg(alt.counts)} fits: {needs}'
        return f"split {split_arg(self.counts)} does not fit: {why}{fix}"

    def to_json(self) -> dict:
        return {
            "split": split_arg(self.counts),
            "output_stage": self.output_stage,
            "fits": self.fits,
            "stages": [s.to_json() for s in self.stages],
            "refusal": self.refusal,
            "proposal": split_arg(self.proposal) if self.proposal else None,
            "proposal_stages": [s.to_json() for s in self.proposal_stages] if self.proposal_stages else None,
            "alternative": self.alternative.to_json() if self.alternative else None,
        }


class Planner:
    """The cards of one profile's workers and the model's shape, at the profile's slots and context."""

    def __init__(
        self,
        shape: ModelShape,
        profile,
        workers: list,
        totals: dict[int, int] | None = None,
        output: str | None = None,
    ):
        """`workers`: (WorkerSpec, its last /status or None) in pipeline order, head first; `output`:
        where the output head lives, "head" or "last" (None: the profile's `output_stage`)."""
        totals = nvml_totals() if totals is None else totals
        self.shape, self.profile, self.workers, self.totals = shape, profile, workers, totals
        self.output_stage = output or output_stage_of(profile)
        last = len(workers) - 1 if self.output_stage == "last" else 0
        self.names = [spec.name for spec, _ in workers]
        self.memory = [
            worker_memory(profile, spec, status, output=i == last, gpu=on_gpu(spec, status, totals))
            for i, (spec, status) in enumerate(workers)
        ]
        self.cards = [card_capacity(spec, status, totals) for spec, status in workers]
        # Which card each GPU worker uses (its host and GPU index): workers on one card share it. A
        # worker the profile gives `card_gb` has that card to itself.
        self.card_ids = [
            (spec.host if not spec.is_local else "local", card_index(spec.device))
            if m.device == "cuda" and spec.card_gb is None
            else None
            for (spec, _), m in zip(workers, self.memory)
        ]
        self.headroom = headroom_bytes(profile.headroom_gb)
        self._needs: dict[tuple[int, int, int], int] = {}
        self._bounds: dict[tuple, int] = {}  # fits_for's binary searches

    @property
    def known(self) -> bool:
        """Whether any card's size is known (else no plan refuses anything)."""
        return any(capacity is not None for capacity, _ in self.cards)

    def need(self, i: int, a: int, b: int) -> int:
        """Bytes worker i takes for layers [a, b) (one stage's estimate; memoised for the search)."""
        if (i, a, b) not in self._needs:
            self._needs[i, a, b] = self._estimate(i, a, b)
        return self._needs[i, a, b]

    def _estimate(self, i: int, a: int, b: int) -> int:
        w = self.memory[i]
        est = self.shape.tensors.stage(
            a,
            b,
            head=i == 0,
            output=w.output,
            device=w.device,
            dtype=w.dtype,
            n_slots=self.profile.parallel,
            n_ctx=self.profile.ctx,
            kv_types=w.kv_types,
            gpu_weights=w.gpu_weights,
            mtp=w.mtp,
            depth=w.depth,
        )
        runtime = w.runtime_bytes if w.runtime_bytes is not None and est.runtime_bytes else est.runtime_bytes
        return est.total - est.runtime_bytes + runtime

    def _sharers(self, counts: list[int]) -> list[tuple[int, list[str]]]:
        """Per stage: the bytes the other stages on its card take in `counts`, and their names (a
        head and a peer on one GPU share it; `card` None: a CPU worker shares nothing)."""
        needs = [self.need(i, *r) for i, r in enumerate(ranges(counts))]
        out = []
        for i, card in enumerate(self.card_ids):
            others = [j for j, c in enumerate(self.card_ids) if j != i and card is not None and c == card]
            out.append((sum(needs[j] for j in others), [self.names[j] for j in others]))
        return out

    def fits_for(self, counts: list[int]) -> Callable[[int, int, int], bool]:
        """`fits(k, a, b)`: whether stage k's card holds layers [a, b) with the headroom, the other
        stages on its card as in `counts` (for split_advisor.best_split's search). A stage's need
        grows with its range, so every end from one start (and every start to the model's end) is
        answered by one binary search instead of an estimate per boundary."""
        sharers, n = self._sharers(counts), self.shape.n_layers

        def room(k: int, a: int, b: int) -> bool:
            return self.need(k, a, b) + sharers[k][0] + self.headroom <= self.cards[k][0]

        def fits(k: int, a: int, b: int) -> bool:
            if self.cards[k][0] is None:
                return True
            if b == n:  # the longest range to the end that fits
                return a >= n - _last(lambda m: room(k, n - m, n), 0, n, ("start", k, sharers[k][0]), self._bounds)
            # the longest range from layer a that fits
            return b <= _last(lambda e: room(k, a, e), a, n, ("end", k, a, sharers[k][0]), self._bounds)

        return fits

    def stages(self, counts: list[int]) -> list[StageFit]:
        out = []
        for i, (r, (others, who)) in enumerate(zip(ranges(counts), self._sharers(counts))):
            capacity, source = self.cards[i]
            if who and capacity is not None:  # what the card has left for this stage
                capacity -= others
                source += f", less {gib(others)} of {', '.join(who)} on it"
            out.append(
                StageFit(self.names[i], r, self.need(i, *r), capacity, self.headroom, source, self.memory[i].mtp)
            )
        return out

    def fitting(self, counts: list[int]) -> list[int] | None:
        """The fitting split that moves the fewest layers from `counts` (with no timings every card
        is taken as equally fast per layer, so every fitting split predicts the same step); every
        stage keeps a layer. None when none fits (stages sharing a card are searched with the
        others' share as in `counts`, then the split found is checked whole)."""
        costs = [[0.0 if a <= il < b else 1.0 for il in range(self.shape.n_layers)] for a, b in ranges(counts)]
        found = best_split(costs, [0.0] * len(counts), min_layers=[1] * len(counts), fits=self.fits_for(counts))
        return found.counts if found and not refusal(self.stages(found.counts)) else None

    def plan(self, counts: list[int]) -> CardPlan:
        stages = self.stages(counts)
        proposal = self.fitting(counts) if refusal(stages) else None
        alternative = self._output_last(counts) if refusal(stages) else None
        proposed = self.stages(proposal) if proposal else None
        return CardPlan(list(counts), stages, proposal, proposed, self.output_stage, alternative)

    def _output_last(self, counts: list[int]) -> CardPlan | None:
        """The plan of `counts` with the output head (and the MTP block) on the last peer, where the
        output is on the head now and `counts` fits so; else None."""
        if self.output_stage == "last" or len(self.names) < 2:
            return None
        stages = Planner(self.shape, self.profile, self.workers, self.totals, output="last").stages(counts)
        return None if refusal(stages) else CardPlan(list(counts), stages, None, None, "last")


def _last(ok: Callable[[int], bool], lo: int, hi: int, key: tuple, memo: dict) -> int:
    """The largest x in [lo, hi] with ok(x), ok true up to some x and false past it; lo - 1 if none."""
    if key not in memo:
        found, left, right = lo - 1, lo, hi
        while left <= right:
            mid = (left + right) // 2
            if ok(mid):
                found, left = mid, mid + 1
            else:
                right = mid - 1
        memo[key] = found
    return memo[key]


class CardPlans:
    """A console's split plans: the model's shape read once (or given by whoever read it), the
    planner kept while what it depends on stays (its memoised needs with it)."""

    def __init__(self, profile, shape: ModelShape | None = None):
        self.profile, self.shape = profile, shape
        self._planner: tuple[tuple, Planner] | None = None

    def planner(self, workers: list, *, require_card: bool) -> Planner | None:
        """`workers`: (WorkerSpec, /status or None), head first. None when `require_card` and no
        card's size is known (the model is not read for nothing). A model that cannot be read
        raises UserError."""
        totals = nvml_totals()
        if require_card and all(card_capacity(spec, st, totals)[0] is None for spec, st in workers):
            return None
        if self.shape is None:
            self.shape = ModelShape.from_gguf(self.profile.model or default_model_path())
        planner = Planner(self.shape, self.profile, workers, totals)
        key = (planner.names, planner.memory, planner.cards, planner.card_ids, planner.headroom)
        key += (self.profile.ctx, self.profile.parallel)
        if self._planner is None or self._planner[0] != key:
            self._planner = (key, planner)
        return self._planner[1]

    def plan(self, workers: list, counts: list[int] | None, *, require_card: bool) -> CardPlan | None:
        """The plan of `counts` (None: the engine's even split) on these workers' cards."""
        planner = self.planner(workers, require_card=require_card)
        if planner is None:
            return None
        return planner.plan(counts or even_split(planner.shape.n_layers, len(workers)))

    def refusal(self, workers: list, counts: list[int] | None) -> str | None:
        """Why `counts` cannot run on these cards, where a card's size is known; None otherwise, and
        when the model cannot be read here (the worker reads it and says what is wrong)."""
        try:
            plan = self.plan(workers, counts, require_card=True)
        except UserError:
            return None
        return plan.refusal if plan else None
