"""The actor API, with the names of Meta's Monarch `monarch.actor`.

Spawn processes with `this_host().spawn_procs(per_host={...})`, actors with `procs.spawn(...)`, and call
endpoints with `call`, `call_one`, `choose`, `broadcast` and `stream`.
"""
from __future__ import annotations

from monarch.cluster.agent import run_worker_loop_forever
from monarch.cluster.attach import attach_to_workers
from monarch.errors import ActorError, SupervisionError
from monarch.runtime.actors.actor_mesh import ActorMesh, EndpointRef
from monarch.runtime.actors.context import Context, context, current_actor_name
from monarch.runtime.actors.controllers import get_or_spawn_controller
from monarch.runtime.actors.endpoint import Actor, Endpoint, concurrent_endpoint, endpoint
from monarch.runtime.actors.host_mesh import HostMesh, this_host, this_proc
from monarch.runtime.actors.ports import Accumulator, Channel, Port, PortReceiver, RankedPortReceiver, send
from monarch.runtime.actors.proc_mesh import ProcMesh
from monarch.runtime.actors.supervision import unhandled_fault_hook
from monarch.runtime.control.client import current_rank, current_size
from monarch.runtime.control.commands import MeshFailure
from monarch.runtime.control.futures import Future, ValueMesh
from monarch.runtime.telemetry.debug_console import DebugController, debug_controller
from monarch.shape import Extent, Point, Shape

__all__ = [
    "Accumulator", "Channel", "Context", "Port", "PortReceiver", "RankedPortReceiver", "concurrent_endpoint",
    "context", "current_actor_name", "get_or_spawn_controller", "send", "this_proc", "unhandled_fault_hook",
    "Actor", "ActorError", "ActorMesh", "Endpoint", "EndpointRef", "Extent", "Future", "HostMesh", "MeshFailure",
    "Point", "ProcMesh", "Shape", "SupervisionError", "ValueMesh", "attach_to_workers", "current_rank", "current_size",
    "DebugController", "debug_controller", "endpoint", "run_worker_loop_forever", "this_host",
]
