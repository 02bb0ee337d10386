"""The seed stream of random ops on MeshTensors, so that `monarch.manual_seed(s)` makes them reproducible.

Every random op draws one seed when it is recorded; each rank then computes its piece of one global
random tensor from that seed, so the values depend on the seed and the draw, never on the placement.
`get_state` / `set_state` save and resume the stream (a checkpoint's RNG state).
"""
from __future__ import annotations

import secrets

_state: list[int] = [secrets.randbits(31), 0]  # seed, draws since it was set


def manual_seed(seed: int) -> None:
    """Make every later random op reproducible: the i-th draw after this depends only on seed and i."""
    _state[0], _state[1] = int(seed), 0


def next_seed() -> int:
    seed, i = _state
    _state[1] = i + 1
    return (seed * 1_000_003 + i) % (1 << 63)


def get_state() -> tuple[int, int]:
    """(seed, draws so far): the stream resumes exactly from it with `set_state`."""
    return _state[0], _state[1]


def set_state(state: tuple[int, int]) -> None:
    _state[0], _state[1] = int(state[0]), int(state[1])
