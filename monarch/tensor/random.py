"""The seed stream of random ops on MeshTensors, so that `monarch.manual_seed(s)` makes them reproducible.

Every random op draws one seed when it is recorded; each rank then computes its piece of one global
random tensor from that seed, so the values depend on the seed and the draw, never on the placement.
"""
from __future__ import annotations

import itertools
import secrets

_state: list = [secrets.randbits(31), itertools.count()]


def manual_seed(seed: int) -> None:
    """Make every later random op reproducible: the i-th draw after this depends only on seed and i."""
    _state[0], _state[1] = int(seed), itertools.count()


def next_seed() -> int:
    return (_state[0] * 1_000_003 + next(_state[1])) % (1 << 63)
