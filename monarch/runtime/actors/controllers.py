"""`get_or_spawn_controller(name, Class, *args)`: one actor per name in the whole process tree (Monarch's
controllers: a replay buffer, a store, a coordinator every actor can find by name).

Whoever asks first (the client or any actor) makes the controller of the client spawn it, alone on a
one-process mesh of this host (control/handlers/requests.py); every later ask, from anywhere, gets the same actor
mesh. The client owns it. The controller answers with the mesh's ProcsInfo; the ActorMesh is made here.
"""
from __future__ import annotations

from functools import partial
from typing import Any

from monarch.runtime.actors.actor_mesh import ActorMesh
from monarch.runtime.actors.endpoint import endpoints_of
from monarch.runtime.actors.proc_mesh import ProcMesh, ask
from monarch.runtime.control import codec
from monarch.runtime.control.commands import GetController, ProcsInfo
from monarch.runtime.control.futures import CallState, Future, one_result


def get_or_spawn_controller(name: str, actor_cls: type, *args: Any, **kwargs: Any) -> Future[ActorMesh[Any]]:
    """The singleton actor mesh `name` of this process tree, spawned as `actor_cls(*args, **kwargs)` on
    first use; a Future of it (`.get()` or `await`)."""
    endpoints = frozenset(endpoints_of(actor_cls))  # a class that is no actor is refused before anything starts
    op = GetController(name, codec.dumps(actor_cls), codec.dumps((args, kwargs)), actor_cls.__name__,
                       codec.dumps(_context))
    return ask(op, partial(_actor_mesh, name, actor_cls.__name__, endpoints))


def _context(info: ProcsInfo) -> bytes:
    """What the singleton's context() tells (run by the controller): no creator, its proc mesh."""
    return codec.dumps({"creator": None, "proc_mesh": ProcMesh(info)})


def _actor_mesh(name: str, cls_name: str, endpoints: frozenset[str], state: CallState) -> ActorMesh[Any]:
    info: ProcsInfo = one_result(state)
    return ActorMesh(info.mesh_id, name, cls_name, endpoints, info.shape)
