"""The actor API, with the names of Meta's Monarch `monarch.actor`.

Spawn processes with `this_host().spawn_procs(per_host={...})`, actors with `procs.spawn(...)`, and call
endpoints with `call`, `call_one`, `choose`, `broadcast` and `stream`. Monarch's transport and RDMA
switches are here with what they mean for this runtime: the control plane is TCP, MeshTensors live in
the workers' CPU memory and move between them over MPI, and there is no GPUDirect RDMA buffer.
"""
from __future__ import annotations

import enum

from monarch import config
from monarch.cluster.agent import run_worker_loop_forever
from monarch.cluster.attach import attach_to_workers
from monarch.cluster.hosts import HostMesh, this_host
from monarch.errors import ActorError, MonarchError, SupervisionError
from monarch.runtime.actors.actor_mesh import ActorMesh, EndpointRef
from monarch.runtime.actors.context import Context, context, current_actor_name
from monarch.runtime.actors.controllers import get_or_spawn_controller
from monarch.runtime.actors.endpoint import Actor, Endpoint, concurrent_endpoint, endpoint
from monarch.runtime.actors.host_mesh import local_proc_mesh, proc_mesh, shutdown_context, sim_proc_mesh, this_proc
from monarch.runtime.actors.ports import Accumulator, Channel, Port, PortReceiver, RankedPortReceiver, send
from monarch.runtime.actors.proc_mesh import ProcMesh
from monarch.runtime.control.client import current_rank, current_size
from monarch.runtime.control.commands import MeshFailure
from monarch.runtime.control.futures import Future, ValueMesh
from monarch.runtime.control.handlers.supervise import unhandled_fault_hook
from monarch.runtime.debug.console import DebugController, debug_controller
from monarch.shape import Extent, Point, Shape


class ChannelTransport(enum.Enum):
    """Monarch's control-plane transports; this runtime's control plane is TCP (the Tcp* members)."""
    Unix = "ipc"
    TcpWithHostname = "tcp"
    TcpWithLocalhost = "tcp-localhost"
    MetaTlsWithIpV6 = "metatls"
    MetaTlsWithHostname = "metatls-hostname"
    Tls = "tls"


_TCP = (ChannelTransport.TcpWithHostname, ChannelTransport.TcpWithLocalhost)


def enable_transport(transport: ChannelTransport | str) -> None:
    """Monarch's choice of control-plane transport. TCP is what this runtime speaks (it binds loopback for
    a mesh on this host and the route's address for other hosts; MONARCH_HOST / MONARCH_ADVERTISE set them),
    so "tcp" and the Tcp* members are accepted; the others raise, naming what to use instead."""
    chosen = transport if isinstance(transport, ChannelTransport) else \
        next((t for t in ChannelTransport if t.value == transport), None)
    if chosen in _TCP:
        return
    raise MonarchError(f"enable_transport({transport!r}): this runtime's control plane is TCP only (authenticated, "
                       "loopback unless MONARCH_HOST says otherwise); use 'tcp', or set MONARCH_HOST / "
                       "MONARCH_ADVERTISE for an explicit address")


def gpu_direct_rdma_supported() -> bool:
    """Whether actors can hand GPU memory to RDMA here: never in this runtime (MeshTensors live in CPU
    memory and move over MPI; actor messages go through the control plane)."""
    return False


__all__ = [
    "Accumulator", "Actor", "ActorError", "ActorMesh", "Channel", "ChannelTransport", "Context", "DebugController",
    "Endpoint", "EndpointRef", "Extent", "Future", "HostMesh", "MeshFailure", "Point", "Port", "PortReceiver",
    "ProcMesh", "RankedPortReceiver", "Shape", "SupervisionError", "ValueMesh", "attach_to_workers",
    "concurrent_endpoint", "config", "context", "current_actor_name", "current_rank", "current_size",
    "debug_controller", "enable_transport", "endpoint", "get_or_spawn_controller", "gpu_direct_rdma_supported",
    "local_proc_mesh", "proc_mesh", "run_worker_loop_forever", "send", "shutdown_context", "sim_proc_mesh",
    "this_host", "this_proc", "unhandled_fault_hook",
]
