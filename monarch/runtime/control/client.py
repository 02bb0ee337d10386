"""Who is sending: the process-wide client (controller or worker) and the running actor's point.

On the controller the client is the Controller, created on first use; inside a worker it is the Worker,
installed at start-up. `current_rank()`/`current_size()` read the point of the endpoint being run.
`tensor_api()` is the declared doorway through which the actor layer reaches the sharded-tensor API.
"""
from __future__ import annotations

from contextvars import ContextVar
from importlib import import_module
from typing import TYPE_CHECKING, Any, Protocol

from monarch.runtime.control.futures import CallState, Inbox, Waiter
from monarch.shape import Extent, Point, Shape

if TYPE_CHECKING:
    from monarch.runtime.control.commands import Call, MeshRequest, PortSend


class Client(Waiter, Protocol):
    """What a mesh reference or a port needs from the process it lives in. `is_controller`: whether this
    process is the controller (it holds the jobs' records and runs mesh requests itself)."""
    is_controller: bool

    def ask(self, op: MeshRequest, state: CallState) -> None:
        """Have the controller run mesh request `op` (control/handlers/requests.py) for the running actor, or for the
        client on the controller; its answer settles `state`."""

    def send(self, mesh_id: int, shape: Shape, call: Call, state: CallState | None) -> None: ...

    def next_call_id(self) -> int: ...

    def send_port(self, msg: PortSend) -> None:
        """Deliver a port's message (here, or through the controller)."""

    def port_owner(self) -> tuple[int, int] | None:
        """Where ports opened here receive: None on the controller, (mesh id, rank) on a worker."""

    def open_port(self, port: int, inbox: Inbox) -> None:
        """Register a channel's receiving end under `port`."""

    def reach_host(self) -> str:
        """The address this process's peers reach it at (a worker: its control connection's local address; the
        controller: the address it advertises, loopback by default): where its data-plane doors listen."""


TENSOR_API = "monarch.runtime.session.api"  # the one module below the actor layer may reach, only here
_tensor_api: list[Any] = []  # registered by that module when it is imported
_client: Client | None = None
POINT: ContextVar[Point] = ContextVar("monarch_point", default=Point((), Extent((), ())))  # current_rank()


def client() -> Client:
    global _client
    if _client is None:
        from monarch.runtime.control.controller import controller
        _client = controller()
    return _client


def set_client(c: Client | None) -> None:
    global _client
    _client = c


def current_rank() -> Point:
    """The calling actor's point in its actor mesh (an empty point on the controller)."""
    return POINT.get()


def current_size() -> dict[str, Any]:
    """Sizes of the calling actor's mesh, by dim name."""
    return dict(POINT.get().extent)


def register_tensor_api(api: Any) -> None:
    """Called by the session's tensor API when it is imported."""
    _tensor_api[:] = [api]


def tensor_api() -> Any:
    """The doorway from the actor layer to the sharded-tensor API (`ProcMesh.activate`, `ProcMesh.rank`):
    the session registers it; the first use imports it (torch and the compiler load only then, so a
    worker that never uses tensors from an actor never loads them)."""
    if not _tensor_api:
        import_module(TENSOR_API)
    assert _tensor_api, f"{TENSOR_API} did not register itself"
    return _tensor_api[0]
