"""Whether a stage fits its card: one rule and one wording for the console's split plan (editor,
advisor, profile start, `--once --json`) and for the workers' own check before they allocate (the
head given `--split`, a peer given LOAD_STAGE), so both refuse a split with the same numbers.

A stage fits when its footprint (contracts/footprint.py) plus the headroom is at most the card's
capacity. The headroom is what the stage must leave: the driver, a desktop and the estimate's error
(a real card loses ~0.5 GiB before any worker starts). The console plans against a card's size
(`card_gb` in the profile, NVML's total, a running worker's /status); a worker checks what is free
on its device at the moment it loads, its own CUDA context already counted there.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30
DEFAULT_HEADROOM_GIB = 0.5  # the profile's `headroom_gb`, the workers' `--headroom-gb`


def gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def headroom_bytes(gb: float) -> int:
    return int(gb * GIB)


@dataclass(frozen=True)
class StageFit:
    """One stage against its card. `capacity` None: unknown (no `card_gb`, no NVML, not running),
    so nothing is refused for it."""

    name: str  # the worker: "head", "peer1"
    layers: tuple[int, int]
    need: int  # bytes the stage takes (its footprint)
    capacity: int | None  # bytes of its card (the console) or free on its device now (a worker)
    headroom: int
    source: str = ""  # where `capacity` comes from: "card_gb", "nvml", "status", "free on cuda:0", …
    mtp: bool = False  # the stage holds the MTP block (the output head's stage, with `--spec-type mtp`)

    @property
    def fits(self) -> bool | None:
        return None if self.capacity is None else self.need + self.headroom <= self.capacity

    def reason(self) -> str:
        """ "head needs 15.9 GiB + 0.5 GiB headroom, card has 15.0 GiB (card_gb)"."""
        a, b = self.layers
        what = f"layers [{a},{b})" + (" + the MTP block" if self.mtp else "")
        has = f"card has {gib(self.capacity)}" if self.capacity is not None else "card size unknown"
        return f"{self.name} needs {gib(self.need)} for {what} + {gib(self.headroom)} headroom, {has}" + (
            f" ({self.source})" if self.source else ""
        )

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "layers": list(self.layers),
            "need_bytes": self.need,
            "headroom_bytes": self.headroom,
            "capacity_bytes": self.capacity,
            "capacity_source": self.source or None,
            "mtp": self.mtp,
            "fits": self.fits,
            "reason": self.reason(),
        }


def refusal(fits: list[StageFit]) -> str | None:
    """Every stage that does not fit, each with its need and its card's capacity; None if all fit."""
    over = [f.reason() for f in fits if f.fits is False]
    return "; ".join(over) if over else None
