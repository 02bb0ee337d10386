"""Limits that fail one call or one spawn with a clear error, never the mesh: MONARCH_MAX_LOCAL_PROCS and
MONARCH_MAX_FRAME (checked by the sender, for arguments, return values, forwarded calls and tensor programs)."""
from __future__ import annotations

import os
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import owned_processes
from monarch.actor import this_host
from monarch.errors import SpawnError
from monarch.runtime.controller import controller

T = 30


def test_absurd_local_spawn_is_refused_before_mpiexec_starts() -> None:
    before = set(controller().meshes)
    t0 = time.monotonic()
    with pytest.raises(SpawnError) as info:
        this_host().spawn_procs(per_host={"dp": 1000})
    assert time.monotonic() - t0 < 1
    limit = 16 * (os.cpu_count() or 1)
    assert "1000" in str(info.value) and str(limit) in str(info.value) and "MONARCH_MAX_LOCAL_PROCS" in str(info.value)
    assert set(controller().meshes) == before and not owned_processes(os.getpid())


@settings(max_examples=20, deadline=None)
@given(limit=st.integers(1, 8), sizes=st.lists(st.integers(1, 6), min_size=1, max_size=3))
def test_local_mesh_over_the_flag_is_refused(limit: int, sizes: list[int]) -> None:
    n = 1
    for s in sizes:
        n *= s
    if n <= limit:
        return  # a mesh within the limit would start processes; other tests spawn those
    os.environ["MONARCH_MAX_LOCAL_PROCS"] = str(limit)
    try:
        with pytest.raises(SpawnError, match=f"{n} worker processes .* limit of {limit} .*MONARCH_MAX_LOCAL_PROCS"):
            this_host().spawn_procs(per_host={f"d{i}": s for i, s in enumerate(sizes)})
    finally:
        del os.environ["MONARCH_MAX_LOCAL_PROCS"]
