"""Waiting for replies: the controller spins only while fewer replies are due than the host has cores, and
calls that switch between spinning and sleeping (call_one, call of 4, broadcasts) keep every reply and the order."""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest

from monarch.actor import Actor, ActorMesh, ProcMesh, endpoint
from monarch.runtime.control.poller import CORES, Poller

T = 30
WAIT_S = 0.2  # how long the poller waits for the event in the spin tests


def _cpu_of_a_wait(expected: int) -> float:
    """Seconds of this thread's CPU spent in Poller.drive while `expected` replies are due and the only event
    comes after WAIT_S (MONARCH_SPIN_US is set far above WAIT_S)."""
    poller = Poller(lambda: 1.0)
    fd = os.eventfd(0, os.EFD_NONBLOCK)
    came: list[int] = []
    poller.watch(fd, lambda: came.append(os.eventfd_read(fd)))
    timer = threading.Timer(WAIT_S, os.eventfd_write, (fd, 1))
    timer.start()
    try:
        t0 = time.thread_time()
        poller.drive(lambda: bool(came), time.monotonic() + T, lambda: expected)
        return time.thread_time() - t0
    finally:
        timer.join(T)
        poller.unwatch(fd)
        os.close(fd)


@pytest.fixture
def long_spin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MONARCH_SPIN_US", str(int(10 * WAIT_S * 1e6)))


def test_a_wait_for_as_many_replies_as_cores_sleeps(long_spin: None) -> None:
    assert _cpu_of_a_wait(CORES) < WAIT_S / 4  # it slept in epoll: the repliers need every core


@pytest.mark.skipif(CORES < 2, reason="one core: the controller never spins")
def test_a_wait_for_one_reply_spins_and_returns_when_it_comes(long_spin: None) -> None:
    t0 = time.monotonic()
    assert _cpu_of_a_wait(1) > 0.0
    assert time.monotonic() - t0 < T


class Counter(Actor):
    def __init__(self) -> None:
        self.seen: list[int] = []

    @endpoint
    def record(self, i: int) -> int:
        self.seen.append(i)
        return len(self.seen)

    @endpoint
    def history(self) -> list[int]:
        return self.seen


@pytest.fixture(scope="module")
def counters(procs: ProcMesh) -> Iterator[ActorMesh[Counter]]:
    yield procs.spawn("poller-counters", Counter)


def test_fan_out_call_one_and_broadcast_interleaved_keep_replies_and_order(counters: ActorMesh[Counter]) -> None:
    one = counters.slice(dp=0, tp=0)
    sent: list[int] = []  # what rank 0 got; the others got all but the call_one values
    for i in range(300):
        sent.append(i)
        others = [i for i in sent if i % 3 != 2]
        if i % 3 == 0:
            assert counters.record.call(i).get(timeout=T).values() == [len(sent)] + [len(others)] * 3
        elif i % 3 == 1:
            counters.record.broadcast(i)
        else:
            assert one.record.call_one(i).get(timeout=T) == len(sent)
    histories = counters.history.call().get(timeout=T)
    assert histories.item(dp=0, tp=0) == sent
    assert [histories.item(dp=d, tp=t) for d, t in ((0, 1), (1, 0), (1, 1))] == [others] * 3
