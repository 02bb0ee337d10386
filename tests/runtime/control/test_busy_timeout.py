"""A wait given up (timeout, or Ctrl-C in a notebook) leaves the remote call running: a later call to the same
actor that times out behind it says which endpoint the actor is still busy with, and since when."""
from __future__ import annotations

import re
import signal
import time
from collections.abc import Iterator

import pytest

from monarch.actor import Actor, ActorMesh, endpoint, this_host
from monarch.runtime.control import futures

T = 30


class Slow(Actor):
    @endpoint
    def crunch(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    @endpoint
    def ping(self) -> str:
        return "pong"


@pytest.fixture(scope="module")
def slow() -> Iterator[ActorMesh]:
    with this_host().spawn_procs(per_host={"gpus": 2}, name="busy") as procs:
        yield procs.spawn("slow", Slow)


def _interrupt_after(seconds: float) -> None:
    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt
    signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)


@pytest.mark.parametrize("abandon", ["timeout", "ctrl-c"])
def test_timeout_names_the_call_the_actor_is_still_busy_with(slow: ActorMesh, abandon: str) -> None:
    crunch = slow.crunch.call(2.5)
    try:
        if abandon == "timeout":
            with pytest.raises(TimeoutError):
                crunch.get(timeout=0.2)
        else:
            _interrupt_after(0.2)
            with pytest.raises(KeyboardInterrupt):
                crunch.get(timeout=T)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
    ping = slow.slice(gpus=1).ping.call_one()
    with pytest.raises(TimeoutError) as info:
        ping.get(timeout=1)
    text = str(info.value)
    assert "slow.ping did not answer within 1 s" in text and "still busy with slow.crunch" in text, text
    age = float(re.search(r"called (\d+\.\d) s ago", text).group(1))
    assert 1.0 <= age < 2.5 and "rank(s) [1]" in text and "Ctrl-C" in text, text
    assert crunch.get(timeout=T).values() == [2.5, 2.5] and ping.get(timeout=T) == "pong"


def test_a_timeout_with_nothing_ahead_says_only_that(slow: ActorMesh) -> None:
    with pytest.raises(TimeoutError) as info:
        slow.crunch.call(1.0).get(timeout=0.1)
    assert str(info.value) == "slow.crunch did not answer within 0.1 s"
    assert slow.ping.call().get(timeout=T).values() == ["pong", "pong"]


def test_the_first_long_wait_says_once_what_it_waits_for(slow: ActorMesh, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """As a mesh's first tensor op waits for its workers to import torch: after 2 s, one line on stderr."""
    monkeypatch.setattr(futures, "_noticed", [], raising=False)
    assert slow.crunch.call(0.1).get(timeout=T).values() == [0.1, 0.1]
    assert "still waiting" not in capsys.readouterr().err, "a short wait says nothing"
    assert slow.crunch.call(2.5).get(timeout=T).values() == [2.5, 2.5]
    err = capsys.readouterr().err
    assert err.count("still waiting") == 1 and "slow.crunch" in err and "after 2 s" in err, err
    slow.crunch.call(2.5).get(timeout=T)
    assert "still waiting" not in capsys.readouterr().err, "once"
