"""Workers import torch on a background thread while they start (MONARCH_PRELOAD_TORCH): actors answer meanwhile,
a tensor op right after the spawn works, and with the flag off a worker that runs only actors never loads torch.
(This module imports torch only inside the tensor test: its actors are unpickled by reference on the workers.)
"""
from __future__ import annotations

import os
import time

import pytest

from monarch.actor import Actor, endpoint, this_host
from monarch.runtime.telemetry.events import imported
from monarch.runtime.worker import preloads_torch

TIMEOUT = 120.0  # importing torch on a loaded 2-core machine takes seconds per worker


class Probe(Actor):
    @endpoint
    def torch_imported(self) -> bool:
        return imported("torch") is not None

    @endpoint
    def pid(self) -> int:
        return os.getpid()


def test_actors_answer_while_the_workers_import_torch() -> None:
    with this_host().spawn_procs(per_host={"procs": 2}, env={"MONARCH_PRELOAD_TORCH": "on"}) as procs:
        probe = procs.spawn("probe", Probe)
        pids = set(probe.pid.call().get(timeout=TIMEOUT).values())
        deadline = time.monotonic() + TIMEOUT
        while not all(probe.torch_imported.call().get(timeout=TIMEOUT).values()):  # each call answered meanwhile
            assert time.monotonic() < deadline, "the workers did not import torch in the background"
            time.sleep(0.05)
        assert set(probe.pid.call().get(timeout=TIMEOUT).values()) == pids  # the same workers, none restarted
        assert procs.running


def test_a_tensor_op_right_after_spawn_waits_for_the_preload() -> None:
    import torch
    with this_host().spawn_procs(per_host={"procs": 2}, env={"MONARCH_PRELOAD_TORCH": "on"}) as procs:
        with procs.activate():
            assert torch.arange(4.0).mul(2).sum().item() == 12.0
        assert all(procs.spawn("probe", Probe).torch_imported.call().get(timeout=TIMEOUT).values())


def test_without_preload_an_actor_only_worker_never_loads_torch() -> None:
    with this_host().spawn_procs(per_host={"procs": 2}, env={"MONARCH_PRELOAD_TORCH": "off"}) as procs:
        probe = procs.spawn("probe", Probe)
        for _ in range(5):
            assert not any(probe.torch_imported.call().get(timeout=TIMEOUT).values())
            time.sleep(0.1)


@pytest.mark.parametrize("ranks_here", [1, 2, 64])
def test_auto_preloads_where_each_worker_has_two_cores(monkeypatch: pytest.MonkeyPatch, ranks_here: int) -> None:
    monkeypatch.setenv("MONARCH_PRELOAD_TORCH", "auto")
    monkeypatch.setenv("MPI_LOCALNRANKS", str(ranks_here))
    assert preloads_torch() == (len(os.sched_getaffinity(0)) >= 2 * ranks_here)
    monkeypatch.setenv("MONARCH_PRELOAD_TORCH", "off")
    assert not preloads_torch()
