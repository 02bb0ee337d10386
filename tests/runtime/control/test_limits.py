"""Limits that fail one call or one spawn with a clear error, never the mesh: MONARCH_MAX_LOCAL_PROCS and
MONARCH_MAX_FRAME (checked by the sender, for arguments, return values, forwarded calls and tensor programs)."""
from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from processes import owned_processes

import monarch
from monarch.actor import Actor, ActorMesh, ProcMesh, endpoint, this_host
from monarch.errors import MonarchError, SpawnError, TransportError
from monarch.runtime.control import futures
from monarch.runtime.control.controller import controller

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


LIMIT = 4 << 20
BIG = 8 << 20


class Blobs(Actor):
    @endpoint
    def echo(self, x: object) -> object:
        return x

    @endpoint
    def make(self, n: int) -> bytes:
        return bytes(n)

    @endpoint
    def relay(self, target: ActorMesh, n: int) -> str:
        """Call `target` with an argument of n bytes; the error (if any) as text."""
        try:
            return f"{len(target.echo.call_one(bytes(n)).get(timeout=T))} bytes"
        except MonarchError as e:
            return f"{type(e).__name__}: {e}"


@pytest.fixture(scope="module")
def small() -> Iterator[ProcMesh]:
    """A 2-process mesh whose control plane (controller and workers) accepts frames of at most 4 MiB."""
    os.environ["MONARCH_MAX_FRAME"] = str(LIMIT)
    try:
        procs = this_host().spawn_procs(per_host={"gpus": 2}, name="small")
    finally:
        del os.environ["MONARCH_MAX_FRAME"]
    with procs:
        yield procs


@pytest.fixture(scope="module")
def blobs(small: ProcMesh) -> ActorMesh:
    return small.spawn("blobs", Blobs)


def _names_the_limit(e: BaseException) -> None:
    text = str(e)
    assert re.search(r"is 83\d{5} bytes, over the control-plane frame limit of 4194304 bytes \(MONARCH_MAX_FRAME\)",
                     text), text
    assert "MeshTensors" in text and "fetch" in text, text


def _still_answers(blobs: ActorMesh) -> None:
    assert blobs.echo.call(7).get(timeout=T).values() == [7, 7]


def test_oversize_argument_fails_the_call_not_the_mesh(blobs: ActorMesh) -> None:
    with pytest.raises(TransportError) as info:
        blobs.slice(gpus=0).echo.call_one(bytes(BIG))
    _names_the_limit(info.value)
    assert "blobs.echo" in str(info.value)
    assert not [s for s in futures._unanswered.values() if s.what == "blobs.echo"]  # not a call in flight
    _still_answers(blobs)
    with pytest.raises(TransportError):
        blobs.echo.broadcast(bytes(BIG))
    assert blobs.slice(gpus=1).echo.call_one(bytes(LIMIT // 2)).get(timeout=T) == bytes(LIMIT // 2)


def test_oversize_return_value_fails_the_call_not_the_worker(blobs: ActorMesh) -> None:
    with pytest.raises(TransportError) as info:
        blobs.make.call(BIG).get(timeout=T)
    _names_the_limit(info.value)
    assert "the reply of rank 0" in str(info.value)
    _still_answers(blobs)
    assert len(blobs.slice(gpus=0).make.call_one(LIMIT // 2).get(timeout=T)) == LIMIT // 2


def test_oversize_forwarded_call_fails_in_the_calling_actor(small: ProcMesh, blobs: ActorMesh) -> None:
    caller, target = blobs.slice(gpus=0), blobs.slice(gpus=1)
    answer = caller.relay.call_one(target, BIG).get(timeout=T)
    assert answer.startswith("TransportError: a call of blobs.echo from rank 0"), answer
    _names_the_limit(TransportError(answer))
    assert caller.relay.call_one(target, 1000).get(timeout=T) == "1000 bytes"
    _still_answers(blobs)


def test_oversize_tensor_program_and_fetch_fail_clearly(small: ProcMesh, blobs: ActorMesh) -> None:
    n = BIG // 4  # float32 elements of 8 MiB
    pieces = [torch.full((n // 8,), float(i)) for i in range(8)]  # 1 MiB each, 8 MiB in one program
    whole = torch.ones(n)
    with small.activate():
        spread = [monarch.distribute_tensor(p, small) for p in pieces]
        total = sum(t.sum() for t in spread)
        assert total.item() == sum(i * (n // 8) for i in range(8))  # cut into pieces that fit, run as one
        refused = monarch.distribute_tensor(whole, small)
        with pytest.raises(TransportError) as info:
            refused.sum().item()
        _names_the_limit(info.value)
        with pytest.raises(MonarchError, match="MONARCH_MAX_FRAME"):  # its value is poisoned with the error
            (refused * 2).sum().item()
        big = monarch.zeros(n, mesh=small)  # made on the workers: fine; fetching it in one piece is not
        with pytest.raises(TransportError) as info:
            big.full_tensor()
        _names_the_limit(info.value)
        assert big[:10].full_tensor().tolist() == [0.0] * 10 and (big + 1).sum().item() == n
    _still_answers(blobs)


def test_oversize_compiled_step_argument_fails_that_call(small: ProcMesh, blobs: ActorMesh) -> None:
    big, few = torch.ones(BIG // 4), torch.ones(16)
    with small.activate():
        w = monarch.ones(4, mesh=small)

        @monarch.compile
        def step(x: torch.Tensor) -> torch.Tensor:
            return x.sum() + w.sum()

        assert step(few).item() == 20
        for _ in range(2):  # recorded, then installed: refused both times, and nothing is left half-done
            with pytest.raises(TransportError, match="compile'd step") as info:
                step(big).item()
            _names_the_limit(info.value)
        assert step(few).item() == 20 and step(few).item() == 20
    _still_answers(blobs)
