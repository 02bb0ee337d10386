"""Mesh lifecycles and references on real worker processes: stop/shutdown/initialized return Futures (get and
await), ActorMesh.stop, generic ActorMesh, any per_host dim names, ProcMesh/HostMesh pickle as references,
and actors that spawn actors and proc meshes (the controller records each mesh's owner)."""
from __future__ import annotations

import asyncio
import gc
import os
import pickle
import time
import typing

import cloudpickle
import pytest
import torch

from monarch.actor import (Actor, ActorError, ActorMesh, Future, HostMesh, ProcMesh, SupervisionError, context,
                           endpoint, this_host, this_proc)
from monarch.errors import MeshError
from monarch.runtime.control.commands import Owner
from monarch.runtime.control.controller import controller

T = 30  # seconds: generous bound for every wait


class Counter(Actor):
    def __init__(self, start: int) -> None:
        self.n = start

    @endpoint
    def incr(self) -> int:
        self.n += 1
        return self.n

    @endpoint
    def whoami(self) -> tuple[list[int], str | None]:
        creator = context().actor_instance.creator
        return this_proc().pids, creator.name if creator is not None else None


class Stoppable(Actor):
    """An endpoint named like ActorMesh.stop: as in Monarch, the endpoint wins."""

    @endpoint
    def stop(self) -> str:
        return "the endpoint"


class Spawner(Actor):
    """Spawns actors on meshes it is given, and proc meshes of its own."""

    @endpoint
    def spawn_on(self, procs: ProcMesh, name: str) -> tuple[list[int], ActorMesh[Counter]]:
        counters = procs.spawn(name, Counter, 100)
        return counters.incr.call().get(timeout=T).values(), counters

    @endpoint
    def make(self, host: HostMesh, name: str) -> tuple[ProcMesh, ActorMesh[Counter]]:
        self.sub = host.spawn_procs(per_host={"gpus": 1}, name=name)
        self.worker = self.sub.spawn("worker", Counter, 5)
        return self.sub, self.worker


class AsyncSpawner(Actor):
    """Spawns a proc mesh and actors on it in one async endpoint, calls and stops them in later ones."""

    @endpoint
    async def make(self, host: HostMesh, name: str) -> tuple[bool, None, ProcMesh, ActorMesh[Counter]]:
        self.sub = host.spawn_procs(per_host={"gpus": 1}, name=name)
        self.worker = self.sub.spawn("worker", Counter, 5)
        return await self.sub.initialized, await self.worker.initialized, self.sub, self.worker

    @endpoint
    async def use(self) -> int:
        return await self.worker.incr.call_one()

    @endpoint
    async def stop_sub(self) -> tuple[bool, None]:
        stopping = self.sub.stop()
        return isinstance(stopping, Future), await stopping


def test_stop_returns_a_future_and_stopping_is_idempotent() -> None:
    mesh = this_host().spawn_procs(per_host={"hosts": 1, "gpus": 2}, name="lifecycle")  # any dim names
    assert mesh.extent == {"hosts": 1, "gpus": 2} and mesh.initialized.get(timeout=T) is True
    counters = mesh.spawn("counters", Counter, 1)
    assert counters.incr.call().get(timeout=T).values() == [2, 2]
    owner = mesh.slice(gpus=0).spawn("owner", Spawner)
    child, _ = owner.make.call_one(this_host(), "child").get(timeout=T)
    stopping = mesh.stop()
    assert isinstance(stopping, Future) and stopping.get(timeout=T) is None
    assert not mesh.running and not child.running  # the proc mesh its actor spawned stopped with it
    assert child._mesh.id not in controller().meshes
    again = mesh.stop()
    assert again.get(timeout=T) is None and again.done()
    with pytest.raises(SupervisionError, match="stopped"):
        mesh.spawn("late", Counter, 0)
    with pytest.raises(SupervisionError, match="stopped"):
        counters.incr.call().get(timeout=T)
    with mesh:  # the context manager's exit stops again: nothing happens
        pass


def test_await_stop_initialized_and_shutdown_in_async_code() -> None:
    async def main() -> tuple[object, ...]:
        host = this_host()
        mesh = host.spawn_procs(per_host={"gpus": 1}, name="awaited")
        up = await mesh.initialized
        counters = mesh.spawn("counters", Counter, 41)
        ready = await counters.initialized
        value = await counters.incr.call_one()
        stopped = await mesh.stop()
        return up, ready, value, stopped, mesh.running, await host.shutdown(), await mesh.stop()

    assert asyncio.run(asyncio.wait_for(main(), T)) == (True, None, 42, None, False, None, None)


def test_host_mesh_shutdown_returns_a_future_and_stops_its_proc_meshes() -> None:
    host = this_host()
    mesh = host.spawn_procs(per_host={"gpus": 1}, name="hosted")
    done = host.shutdown()
    assert isinstance(done, Future) and done.get(timeout=T) is None and not mesh.running


def test_actor_mesh_stop_and_initialized(procs: ProcMesh) -> None:
    counters = procs.spawn("stoppable", Counter, 1)
    kept = procs.spawn("kept", Counter, 7)
    assert counters.initialized.get(timeout=T) is None
    assert counters.slice(dp=0).stop().get(timeout=T) is None  # only dp=0 stops
    with pytest.raises(SupervisionError, match="'stoppable' on rank 0 was stopped"):
        counters.slice(dp=0, tp=0).incr.call_one().get(timeout=T)
    with pytest.raises(SupervisionError, match="was stopped"):
        counters.slice(dp=0).initialized.get(timeout=T)
    assert counters.slice(dp=1).incr.call().get(timeout=T).values() == [2, 2]
    assert counters.stop().get(timeout=T) is None and counters.stop().get(timeout=T) is None
    with pytest.raises(SupervisionError, match="was stopped"):
        counters.slice(dp=1, tp=1).incr.call_one().get(timeout=T)
    assert kept.incr.call().get(timeout=T).values() == [8, 8, 8, 8]  # other actors of the procs live on


def test_actor_mesh_is_generic_and_endpoints_win_over_its_methods(procs: ProcMesh) -> None:
    def typed(mesh: ActorMesh[Counter]) -> ActorMesh[Counter]:
        return mesh

    assert typing.get_origin(ActorMesh[Counter]) is ActorMesh and typing.get_args(ActorMesh[Counter]) == (Counter,)
    assert typing.get_type_hints(typed)["mesh"] == ActorMesh[Counter]
    counters = typed(procs.spawn("typed", Counter, 0))
    assert isinstance(counters, ActorMesh) and counters.incr.call().get(timeout=T).values() == [1] * 4
    stoppable = procs.spawn("named_stop", Stoppable)
    assert stoppable.slice(dp=0, tp=0).stop.call_one().get(timeout=T) == "the endpoint"


def test_per_host_dims_clash_only_with_the_host_dim_of_several_hosts() -> None:
    with pytest.raises(MeshError, match="names a dim 'hosts'.*rename"):
        HostMesh(["node-a", "node-b"]).spawn_procs(per_host={"hosts": 2})
    with pytest.raises(MeshError, match="size >= 1"):  # really invalid, on any host mesh
        this_host().spawn_procs(per_host={"hosts": 1, "gpus": 0})
    assert HostMesh(["node-a", "node-b"])._procs_shape({"gpus": 2}).labels == ("hosts", "gpus")


def test_proc_and_host_meshes_pickle_as_references(procs: ProcMesh) -> None:
    for dumps in (pickle.dumps, cloudpickle.dumps):
        copy = pickle.loads(dumps(procs))
        assert (copy.name, copy.extent, copy.pids, copy.hostnames) == (procs.name, procs.extent, procs.pids,
                                                                       procs.hostnames)
        assert copy._mesh is procs._mesh and copy.running
        view = pickle.loads(dumps(procs.slice(dp=1)))
        assert view.extent == {"tp": 2} and view.pids == procs.pids[2:]
    counters = pickle.loads(pickle.dumps(procs.slice(tp=1))).spawn("from_copy", Counter, 10)
    assert counters.incr.call().get(timeout=T).values() == [11, 11]
    assert counters.whoami.call().get(timeout=T).values() == [([pid], None) for pid in procs.slice(tp=1).pids]
    host = pickle.loads(pickle.dumps(this_host()))
    assert host.hostnames == ["localhost"] and "localhost" in repr(host)
    remote = HostMesh(["node-a", "node-b"])
    copy = pickle.loads(pickle.dumps(remote))
    assert copy._launcher is remote._launcher and type(copy) is HostMesh  # kept by the controller under a key


def test_an_actor_given_a_mesh_spawns_and_calls_actors_on_it(procs: ProcMesh) -> None:
    spawner = procs.slice(dp=0, tp=0).spawn("spawner", Spawner)
    values, given = spawner.spawn_on.call_one(procs, "given").get(timeout=T)
    assert values == [101] * 4 and given.extent == procs.extent
    assert given.incr.call().get(timeout=T).values() == [102] * 4  # the client calls them too
    assert given.whoami.call().get(timeout=T).values() == [([pid], "spawner") for pid in procs.pids]
    record = controller().meshes[procs._mesh.id]
    assert record.actors["given"] == Owner(procs._mesh.id, "spawner", 0) and record.actors["spawner"] is None
    with pytest.raises(ActorError, match="already has actors named 'given'"):
        spawner.spawn_on.call_one(procs.slice(dp=1), "given").get(timeout=T)


def test_an_actor_spawns_procs_and_actors_then_calls_them_later(procs: ProcMesh) -> None:
    spawner = procs.slice(dp=0, tp=1).spawn("async_spawner", AsyncSpawner)
    up, ready, sub, worker = spawner.make.call_one(this_host(), "sub").get(timeout=T)
    assert (up, ready) == (True, None) and isinstance(sub, ProcMesh) and isinstance(worker, ActorMesh)
    assert sub.running and sub.extent == {"gpus": 1}
    assert controller().meshes[sub._mesh.id].owner == Owner(procs._mesh.id, "async_spawner", 1)
    assert spawner.use.call_one().get(timeout=T) == 6  # a later endpoint calls them
    assert spawner.use.call_one().get(timeout=T) == 7
    assert worker.incr.call_one().get(timeout=T) == 8  # and so does the client
    assert spawner.stop_sub.call_one().get(timeout=T) == (True, None)  # `await procs.stop()` in an endpoint
    assert not sub.running and sub._mesh.id not in controller().meshes
    with pytest.raises(ActorError, match="stopped"):
        spawner.use.call_one().get(timeout=T)


def wait_gone(pids: list[int]) -> bool:
    deadline = time.monotonic() + T
    while any(os.path.exists(f"/proc/{p}") and _alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_default_names_are_unique_and_an_unreferenced_mesh_stops(caplog: pytest.LogCaptureFixture) -> None:
    """As a notebook cell run twice: the first mesh's processes end once nothing refers to it (a ProcMesh or
    an ActorMesh of it), with one warning naming it; a mesh whose actors are still held keeps running."""
    first = this_host().spawn_procs(per_host={"gpus": 1})
    second = this_host().spawn_procs(per_host={"gpus": 2})
    names, pids = (first.name, second.name), (first.pids, second.pids)
    assert names[0] != names[1] and all(n == "procs" or n.startswith("procs_") for n in names), names
    counters = second.spawn("counters", Counter, 0).slice(gpus=1)
    del first, second
    gc.collect()
    assert wait_gone(pids[0]), "the unreferenced mesh's workers still run"
    assert counters.incr.call_one().get(timeout=T) == 1, "its actors hold the second mesh"
    del counters
    gc.collect()
    assert wait_gone(pids[1])
    warned = [r.getMessage() for r in caplog.records if "last reference" in r.getMessage()]
    assert len(warned) == 2 and repr(names[0]) in warned[0] and repr(names[1]) in warned[1], warned


def test_a_mesh_that_ran_tensor_ops_stops_once_unreferenced() -> None:
    """Its MeshTensors hold it while they live; the tensor API's own records of it do not."""
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    pids = procs.pids
    with procs.activate():
        t = torch.ones(4, 2) * 2
    assert t.sum().item() == 16
    del procs
    gc.collect()
    assert t.full_tensor(timeout=T).sum().item() == 16, "its tensors hold the mesh"
    del t
    gc.collect()
    assert wait_gone(pids), "the workers of a mesh nobody refers to still run"
