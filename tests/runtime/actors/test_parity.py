"""Monarch's actor semantics on real meshes: validation, async endpoints that call actors of their own
process, concurrent endpoints, context(), ports and channels, explicit response ports, send(),
Accumulator, and supervision (which failures stop an actor and reach the client's unhandled_fault_hook).
"""
from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from monarch.actor import (Accumulator, Actor, ActorError, ActorMesh, Channel, MeshFailure, Port, ProcMesh,
                           concurrent_endpoint, context, current_actor_name, current_rank, endpoint,
                           get_or_spawn_controller, send)

T = 30.0
ROOT = Path(__file__).resolve().parents[3]


class Mixed(Actor):
    @endpoint
    def a(self) -> int:
        return 1

    @endpoint
    async def b(self) -> int:
        return 2


class Leaf(Actor):
    def __init__(self) -> None:
        self.n = 0

    @endpoint
    async def bump(self) -> int:
        self.n += 1
        await asyncio.sleep(0.01)
        return self.n


class Caller(Actor):
    """Async endpoints that await calls to another actor on the same worker processes."""

    @endpoint
    async def via(self, leaf: ActorMesh) -> list[int]:
        one = await leaf.slice(**dict(current_rank())).bump.call_one()
        every = await leaf.bump.call()
        return [one, *sorted(every.values())]


class Gate(Actor):
    def __init__(self) -> None:
        self.opened = asyncio.Event()
        self.started: list[int] = []

    @concurrent_endpoint
    async def wait(self, i: int) -> int:
        self.started.append(i)
        await asyncio.wait_for(self.opened.wait(), 20)
        return i

    @endpoint
    async def open(self) -> list[int]:
        self.opened.set()
        return list(self.started)


class Echo(Actor):
    def __init__(self) -> None:
        self.held: list[Port] = []

    @endpoint
    def who(self) -> dict:
        ctx = context()
        ins = ctx.actor_instance
        return {"rank": dict(ins.rank), "name": ins.name, "id": ins.actor_id, "cls": ins.class_name,
                "creator": ins.creator, "message_rank": dict(ctx.message_rank), "current": current_actor_name()}

    @endpoint
    def tell(self, port: Port, values: list[int]) -> None:
        for v in values:
            port.send(v)

    @endpoint
    def value(self) -> int:
        return current_rank().rank * 10

    @endpoint(explicit_response_port=True)
    def later(self, port: Port, x: int) -> None:
        self.held.append((port, x))

    @endpoint
    def release(self) -> int:
        for port, x in self.held:
            port.send(x + 1)
        n, self.held = len(self.held), []
        return n

    @endpoint(explicit_response_port=True)
    def refuse(self, port: Port, why: str) -> None:
        port.exception(ValueError(why))

    @endpoint(explicit_response_port=True)
    def broken(self, port: Port) -> None:
        raise RuntimeError("escaped the port")

    @endpoint
    def fail(self, why: str) -> None:
        raise ValueError(why)

    @endpoint
    def exit(self) -> None:
        raise SystemExit(3)


class BadInit(Actor):
    def __init__(self) -> None:
        raise RuntimeError("no construction")

    @endpoint
    def ping(self) -> int:
        return 1


class Registry(Actor):
    def __init__(self, tag: str) -> None:
        self.tag, self.items = tag, []

    @endpoint
    def add(self, x: int) -> tuple[str, int]:
        self.items.append(x)
        return self.tag, len(self.items)


class UsesRegistry(Actor):
    @endpoint
    def put(self, x: int) -> tuple[str, int]:
        registry = get_or_spawn_controller("registry", Registry, "from an actor").get(timeout=T)
        return registry.add.call_one(x).get(timeout=T)


@pytest.fixture
def singletons() -> Iterator[None]:
    """Controllers live as long as the client; the test stops the ones it made."""
    from monarch.runtime.control.handlers import requests
    from monarch.runtime.control.controller import controller
    yield
    for mesh_id in list(requests._singletons.values()):
        ctl = controller()
        if mesh_id in ctl.meshes:
            ctl.lifecycle.stop(ctl.meshes[mesh_id])
    requests._singletons.clear()


@pytest.mark.usefixtures("singletons")
def test_get_or_spawn_controller_is_one_actor_for_the_whole_process_tree(procs: ProcMesh) -> None:
    registry = get_or_spawn_controller("registry", Registry, "from the client").get(timeout=T)
    assert registry.add.call_one(0).get(timeout=T) == ("from the client", 1)
    got = procs.spawn("registry_users", UsesRegistry).put.call(1).get(timeout=T).values()
    assert sorted(n for _, n in got) == [2, 3, 4, 5] and {tag for tag, _ in got} == {"from the client"}
    again = get_or_spawn_controller("registry", Registry, "ignored").get(timeout=T)
    assert again.add.call_one(2).get(timeout=T) == ("from the client", 6)


def test_an_actor_mixing_sync_and_async_endpoints_is_refused(procs: ProcMesh) -> None:
    with pytest.raises(ValueError, match="mixes sync endpoints"):
        procs.spawn("mixed", Mixed)


def test_async_endpoints_await_actors_of_their_own_process(procs: ProcMesh) -> None:
    leaf, caller = procs.spawn("leaf", Leaf), procs.spawn("caller", Caller)
    out = caller.via.call(leaf).get(timeout=T)
    for got in out.values():
        assert len(got) == 5 and got[0] >= 1
    assert sorted(leaf.bump.call().get(timeout=T).values()) == [6, 6, 6, 6]  # 1 + 4 + this one, per rank


def test_a_concurrent_endpoint_lets_later_messages_run_and_keeps_start_order(procs: ProcMesh) -> None:
    gate = procs.spawn("gate", Gate).slice(dp=0, tp=0)
    waits = [gate.wait.call_one(i) for i in range(3)]
    assert gate.open.call_one().get(timeout=T) == [0, 1, 2]
    assert [w.get(timeout=T) for w in waits] == [0, 1, 2]


def test_context_names_the_actor_and_the_message_rank(procs: ProcMesh) -> None:
    echo = procs.spawn("echo_ctx", Echo)
    got = echo.slice(dp=1, tp=0).who.call_one().get(timeout=T)
    assert got["rank"] == {"dp": 1, "tp": 0} and got["name"] == "echo_ctx" == got["current"]
    assert got["message_rank"] == {}  # its point in the one-actor view it was called on
    row = echo.slice(dp=1).who.call().get(timeout=T)
    assert [v["message_rank"] for v in row.values()] == [{"tp": 0}, {"tp": 1}]
    assert [v["message_rank"] for v in echo.who.call().get(timeout=T).values()] == [
        v["rank"] for v in echo.who.call().get(timeout=T).values()]
    assert got["cls"].endswith("Echo") and got["creator"] is None and "echo_ctx" in got["id"]
    assert current_actor_name() == "client" and context().actor_instance.name == "client"


def test_a_channel_port_given_to_an_actor_delivers_in_order(procs: ProcMesh) -> None:
    echo = procs.spawn("echo_port", Echo).slice(dp=0, tp=1)
    port, receiver = Channel.open()
    echo.tell.call_one(port, [3, 1, 2]).get(timeout=T)
    assert [receiver.recv().get(timeout=T) for _ in range(3)] == [3, 1, 2]
    once, first = Channel.open(once=True)
    echo.tell.call_one(once, [7, 8]).get(timeout=T)
    assert first.recv().get(timeout=T) == 7


def test_send_with_a_ranked_port_and_accumulate(procs: ProcMesh) -> None:
    echo = procs.spawn("echo_send", Echo)
    port, receiver = Channel.open_ranked()
    send(echo.value, (), {}, port=port)
    got = sorted(receiver.recv().get(timeout=T) for _ in range(4))
    assert got == [(0, 0), (1, 10), (2, 20), (3, 30)]
    assert Accumulator(echo.value, 5, lambda a, b: a + b).accumulate().get(timeout=T) == 65
    send(echo.value, (), {}, port=port, selection="choose")
    rank, value = receiver.recv().get(timeout=T)
    assert value == rank * 10


def test_an_explicit_response_port_answers_later_or_with_an_error(procs: ProcMesh, faults: list) -> None:
    echo = procs.spawn("echo_explicit", Echo).slice(dp=1, tp=1)
    pending = echo.later.call_one(41)
    time.sleep(0.2)
    assert not pending.done()
    assert echo.release.call_one().get(timeout=T) == 1
    assert pending.get(timeout=T) == 42
    with pytest.raises(ValueError, match="not today"):
        echo.refuse.call_one("not today").get(timeout=T)
    assert echo.value.call_one().get(timeout=T) == 30 and not faults


def wait_for_faults(faults: list[MeshFailure], n: int) -> list[MeshFailure]:
    deadline = time.monotonic() + T
    while len(faults) < n:
        assert time.monotonic() < deadline, f"{len(faults)} supervision events, wanted {n}"
        time.sleep(0.02)
    return faults


def test_an_exception_with_a_caller_goes_to_the_caller_and_the_actor_lives(procs: ProcMesh, faults: list) -> None:
    echo = procs.spawn("echo_lives", Echo).slice(dp=0, tp=0)
    with pytest.raises(ActorError, match="bad"):
        echo.fail.call_one("bad").get(timeout=T)
    assert echo.value.call_one().get(timeout=T) == 0
    time.sleep(0.2)
    assert not faults


@pytest.mark.parametrize("how", ["broadcast", "explicit_port", "base_exception", "init"])
def test_failures_nobody_can_catch_stop_the_actor_and_reach_the_client(procs: ProcMesh, faults: list,
                                                                       how: str) -> None:
    name = f"victim_{how}"
    if how == "init":
        victim = procs.slice(dp=1, tp=1).spawn(name, BadInit)
        detail = "no construction"
    else:
        victim = procs.spawn(name, Echo).slice(dp=1, tp=1)
        if how == "broadcast":
            victim.fail.broadcast("nobody listens")
            detail = "nobody listens"
        elif how == "explicit_port":
            victim.broken.call_one()
            detail = "escaped the port"
        else:
            with pytest.raises(ActorError, match="SystemExit"):
                victim.exit.call_one().get(timeout=T)
            detail = "SystemExit"
    (failure,) = wait_for_faults(faults, 1)
    assert failure.mesh_name == name and failure.rank == 3 and detail in failure.report()
    with pytest.raises(ActorError, match="is stopped"):
        victim.ping.call_one().get(timeout=T) if how == "init" else victim.value.call_one().get(timeout=T)
    time.sleep(0.2)
    assert len(faults) == 1, "one event per failed rank"


SCRIPT = """
import sys, threading
import monarch.actor as ma
from monarch.actor import Actor, endpoint, this_host
class Bad(Actor):
    @endpoint
    def fail(self) -> None:
        raise ValueError("unhandled on purpose")
hooked = threading.Event()
def hook(failure):
    print("hooked:", failure.mesh_name, flush=True)
    hooked.set()
if sys.argv[1] == "replaced":
    ma.unhandled_fault_hook = hook
with this_host().spawn_procs(per_host={"gpus": 1}) as procs:
    procs.spawn("bad", Bad).fail.broadcast()
    hooked.wait(20)  # the default hook ends the client before this returns
print("survived", flush=True)
"""


@pytest.mark.parametrize("hook", ["default", "replaced"])
def test_an_unhandled_fault_exits_the_client_with_status_1_unless_the_hook_says_otherwise(tmp_path: Path,
                                                                                          hook: str) -> None:
    script = tmp_path / "client.py"
    script.write_text(SCRIPT)
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, str(script), hook], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    if hook == "default":
        assert done.returncode == 1, done.stderr[-2000:]
        assert "Unhandled monarch error" in done.stderr and "unhandled on purpose" in done.stderr
        assert time.monotonic() - t0 < 20, "it exited at the fault, not after the sleep"
        assert "survived" not in done.stdout
    else:
        assert done.returncode == 0, done.stderr[-2000:]
        assert "hooked: bad" in done.stdout and "survived" in done.stdout


class Parent(Actor):
    """Owns a proc mesh and actors it spawned; counts what its __supervise__ gets."""

    def __init__(self, handle: bool) -> None:
        self.handle, self.seen = handle, []

    @endpoint
    def start(self) -> None:
        from monarch.actor import this_host
        self.procs = this_host().spawn_procs(per_host={"gpus": 2}, name="children")
        self.children = self.procs.spawn("children", Echo)

    @endpoint
    def break_children(self) -> None:
        self.children.fail.broadcast("child failure")

    @endpoint
    def seen_failures(self) -> list[tuple[str, int]]:
        return [(f.mesh_name, f.rank) for f in self.seen]

    @endpoint
    def finish(self) -> None:
        self.procs.stop().get(timeout=T)

    def __supervise__(self, failure: MeshFailure) -> bool:
        self.seen.append(failure)
        return self.handle


@pytest.mark.parametrize("handle", [True, False], ids=["handled", "escalated"])
def test_the_owner_supervises_what_it_spawned(procs: ProcMesh, faults: list, handle: bool) -> None:
    parent = procs.slice(dp=0, tp=0).spawn(f"parent_{handle}", Parent, handle)
    parent.start.call_one().get(timeout=T)
    parent.break_children.call_one().get(timeout=T)
    deadline = time.monotonic() + T
    while len(parent.seen_failures.call_one().get(timeout=T)) < 2:
        assert time.monotonic() < deadline, "the owner never heard of both failed ranks"
        time.sleep(0.05)
    assert sorted(parent.seen_failures.call_one().get(timeout=T)) == [("children", 0), ("children", 1)]
    if handle:
        time.sleep(0.3)
        assert not faults, "handled by the owner: the client's hook is not called"
    else:
        assert sorted(f.rank for f in wait_for_faults(faults, 2)) == [0, 1]
    parent.finish.call_one().get(timeout=T)


OLD_NAMES = """
import monarch.actor as ma
from monarch.actor import Actor, endpoint, current_rank
from monarch.errors import MonarchError
class Where(Actor):
    @endpoint
    def where(self) -> dict:
        return dict(current_rank())
mesh = ma.proc_mesh(gpus=2)
assert mesh.extent == {"hosts": 1, "gpus": 2}, mesh.extent
assert mesh.spawn("w", Where).where.call().get(timeout=30).values() == [{"hosts": 0, "gpus": 0}, {"hosts": 0, "gpus": 1}]
local = ma.local_proc_mesh(gpus=1)
ma.enable_transport("tcp")
ma.enable_transport(ma.ChannelTransport.TcpWithHostname)
try:
    ma.enable_transport("ipc")
    raise SystemExit("ipc was accepted")
except MonarchError:
    pass
assert ma.gpu_direct_rdma_supported() is False and ma.config.max_frame() > 0
ma.shutdown_context().get(timeout=30)
assert not mesh.running and not local.running
print("old names ok", flush=True)
"""  # noqa: E501


def test_monarchs_older_names_work(tmp_path: Path) -> None:
    """proc_mesh / local_proc_mesh (a hosts x gpus mesh), enable_transport, gpu_direct_rdma_supported, config and
    shutdown_context (it stops every mesh of the client, hence its own process)."""
    script = tmp_path / "old_names.py"
    script.write_text(OLD_NAMES)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and "old names ok" in done.stdout, done.stderr[-2000:]
