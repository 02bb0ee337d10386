"""`get_or_spawn_controller(name, Class, *args)`: one actor per name in the whole process tree (Monarch's
controllers: a replay buffer, a store, a coordinator every actor can find by name).

Whoever asks first (the client or any actor) makes the controller of the client spawn it, alone on a
one-process mesh of this host; every later ask, from anywhere, gets the same ActorMesh. The client
owns it. Asked from an actor, the request goes to the controller like a mesh request.
"""
from __future__ import annotations

import threading
from typing import Any

from monarch.runtime.actors import requests
from monarch.runtime.actors.actor_mesh import ActorMesh
from monarch.runtime.actors.proc_mesh import ProcMesh, ask
from monarch.runtime.control import codec
from monarch.runtime.control import controller as ctl_module
from monarch.runtime.control.commands import GetController, Owner
from monarch.runtime.control.futures import Future

_lock = threading.Lock()
_spawned: dict[str, tuple[ProcMesh, ActorMesh[Any]]] = {}


def get_or_spawn_controller(name: str, actor_cls: type, *args: Any, **kwargs: Any) -> Future[ActorMesh[Any]]:
    """The singleton actor mesh `name` of this process tree, spawned as `actor_cls(*args, **kwargs)` on
    first use; a Future of it (`.get()` or `await`)."""
    return ask(GetController(name, codec.dumps(actor_cls), codec.dumps((args, kwargs)), actor_cls.__name__))


def _get(ctl: Any, op: GetController, owner: Owner | None) -> ActorMesh[Any]:
    """On the controller (a request thread for an actor's ask): the existing controller, or a new one."""
    from monarch.runtime.actors.host_mesh import this_host
    with _lock:
        found = _spawned.get(op.name)
        if found is not None and found[0].running:
            return found[1]
        actor_cls = codec.loads(op.cls)
        args, kwargs = codec.loads(op.args)
        procs = this_host().spawn_procs(per_host={"procs": 1}, name=f"controller_{op.name}")
        mesh = procs.spawn(op.name, actor_cls, *args, **kwargs)
        _spawned[op.name] = (procs, mesh)
        return mesh


requests.RUN[GetController] = _get
ctl_module.HANDLERS[GetController] = requests.serve
