"""A launcher (mpiexec) killed under a running mesh is reported as the launcher, with its exit status, in the
SupervisionError of every pending and later call and in the failures table."""
from __future__ import annotations

import os
import signal
import time

import pytest

import monarch
from monarch.actor import Actor, endpoint, this_host
from monarch.errors import SupervisionError

T = 30
pytestmark = pytest.mark.slow


class Sleeper(Actor):
    @endpoint
    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


def test_kill_9_of_mpiexec_names_the_launcher() -> None:
    with this_host().spawn_procs(per_host={"gpus": 2}, name="orphaned") as procs:
        sleepers = procs.spawn("sleepers", Sleeper)
        assert sleepers.sleep.call(0).get(timeout=T).values() == [0, 0]
        pending = sleepers.sleep.call(60)
        launcher = procs._mesh.proc.pid
        os.kill(launcher, signal.SIGKILL)
        with pytest.raises(SupervisionError) as info:
            pending.get(timeout=T)
        text = str(info.value)
        assert f"the launcher mpiexec, pid {launcher}, killed by signal 9 (SIGKILL)" in text, text
        assert "rank -1" not in text and info.value.rank == -1
        with pytest.raises(SupervisionError, match="launcher mpiexec"):
            sleepers.sleep.call(0).get(timeout=T)
    rows = monarch.sql("SELECT what, detail FROM failures WHERE mesh = 'orphaned' AND kind = 'supervision'")
    assert rows == [("the launcher mpiexec", "killed by signal 9 (SIGKILL)")]
