"""Adaptive busy-polling: how long to spin for the next message before sleeping in the kernel.

On a virtual machine an idle CPU's wake-up costs tens of microseconds, so a process that expects a
message within microseconds spins for it (MONARCH_SPIN_US). When spinning keeps failing (the peer is
slow, or the host is oversubscribed and the spin would take the core the peer needs) it stops,
and probes again now and then.
"""
from __future__ import annotations

_MISSES_BEFORE_BACKOFF = 3
_PROBE_EVERY = 32


class AdaptiveSpin:
    """Spin budget in seconds: the limit while spins pay off, zero after repeated misses."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self._misses = 0
        self._sleeps = 0

    def budget(self) -> float:
        if self._misses < _MISSES_BEFORE_BACKOFF:
            return self.limit
        self._sleeps += 1
        return self.limit if self._sleeps % _PROBE_EVERY == 0 else 0.0

    def hit(self) -> None:
        self._misses = 0

    def miss(self) -> None:
        self._misses = min(self._misses + 1, _MISSES_BEFORE_BACKOFF)
