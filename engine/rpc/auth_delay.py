"""Guessing the token costs time: each failed proof is logged with its address, and that address's
next connections wait before their first byte is read, AUTH_DELAY_S doubling per failure up to
AUTH_DELAY_MAX_S (loopback included: a local attacker guesses too); a success or AUTH_FORGET_S
without failures forgets the address. Used by the listener's selector thread only."""

from __future__ import annotations

import logging
import time

log = logging.getLogger("hydra.rpc")

AUTH_DELAY_S, AUTH_DELAY_MAX_S = 0.25, 30.0  # the wait after the first failed proof, and its cap
AUTH_FORGET_S = 600.0


class AuthDelay:
    def __init__(self):
        self._failed: dict[str, tuple[int, float]] = {}  # ip -> (failed proofs in a row, last one)

    def hold_until(self, ip: str, now: float) -> float:
        """When a new connection from `ip` may be read (0: at once)."""
        failures, last = self._failed.get(ip, (0, 0.0))
        if not failures:
            return 0.0
        if now - last > AUTH_FORGET_S:
            del self._failed[ip]
            return 0.0
        return last + _delay(failures)

    def failed(self, ip: str, why: Exception) -> None:
        failures = self._failed.get(ip, (0, 0.0))[0] + 1
        self._failed[ip] = (failures, time.monotonic())
        log.warning(
            "RPC authentication from %s failed (%s; %d in a row): its next connections wait %.2g s",
            ip,
            why,
            failures,
            _delay(failures),
        )

    def forget(self, ip: str) -> None:
        self._failed.pop(ip, None)


def _delay(failures: int) -> float:
    return min(AUTH_DELAY_S * 2 ** (failures - 1), AUTH_DELAY_MAX_S)
