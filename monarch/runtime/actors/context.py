"""Who is running: Monarch's `context()` (the actor instance and the message's rank) and `current_actor_name()`
(`this_proc()` is host_mesh.py's, beside `this_host()`).

Each hosted actor has an `Instance` (its rank in the mesh it was spawned on, name, class, id, creator,
proc mesh); while one of its endpoints runs, `context()` returns a `Context` of that instance and of the
rank the message was sent to (its point in the called view). Async endpoints each keep their own (a
ContextVar). On the client, `context()` is the root client's.
"""
from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from monarch.errors import MeshError
from monarch.shape import Extent, Point

_EMPTY = Point((), Extent((), ()))


@dataclass(frozen=True)
class CreatorInstance:
    """The actor that spawned an actor (None for the client): a picklable summary."""
    rank: Point
    name: str
    class_name: str | None
    actor_id: str
    creator: CreatorInstance | None = None

    def __repr__(self) -> str:
        return qualified_name(self)


@dataclass
class Instance:
    """An actor instance: `rank` is its point in the mesh it was spawned on."""
    rank: Point
    name: str
    class_name: str | None
    actor_id: str
    creator: CreatorInstance | None = None
    proc_mesh: Any = None  # the ProcMesh (view) the actor was spawned on, when the spawner gave it

    @property
    def proc(self) -> Any:
        """The singleton proc mesh of this actor's process."""
        if self.proc_mesh is None:
            raise MeshError(f"{self.actor_id} has no proc mesh reference here")
        return self.proc_mesh.slice(**dict(self.rank)) if len(self.rank.extent) else self.proc_mesh

    def as_creator(self) -> CreatorInstance:
        return CreatorInstance(self.rank, self.name, self.class_name, self.actor_id, self.creator)

    def __repr__(self) -> str:
        return qualified_name(self)


@dataclass(frozen=True)
class Context:
    """The running actor (`actor_instance`) and the point of this message in the view it was sent to."""
    actor_instance: Instance
    message_rank: Point


def qualified_name(ins: Instance | CreatorInstance | None) -> str:
    """`<client>.<mod.Trainer trainers{'dp': 1}>`: the chain of creators down to `ins`."""
    names = []
    while ins is not None:
        prefix = f"{ins.class_name} " if ins.class_name else ""
        names.append(f"<{prefix}{ins.name}{dict(ins.rank) if len(ins.rank.extent) else ''}>")
        ins = ins.creator
    return ".".join(reversed(names))


_ROOT = Context(Instance(_EMPTY, "client", None, "client"), _EMPTY)
CURRENT: ContextVar[Context] = ContextVar("monarch_context", default=_ROOT)  # each async task has its own


def context() -> Context:
    """The current actor's context (the root client's outside any actor)."""
    return CURRENT.get()


def current_actor_name() -> str:
    """The name of the running actor (its actor mesh's name), "client" outside actors."""
    return context().actor_instance.name
