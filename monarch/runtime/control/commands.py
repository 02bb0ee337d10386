"""Control-plane messages: frozen dataclasses, the only things that travel between processes.

Controller -> worker: SpawnActor, Call, Reply (answers to a worker's own calls), RunProgram, InstallProgram,
InvokeProgram, ShipTelemetry, Stop, Supervise, Heartbeat, PortSend. Worker -> controller: Hello, Reply,
Forward, Busy, ActorFault, Escalate, PortSend, the requests GetController, SpawnProcs, SpawnActors and
StopProcs, and empty frames as heartbeats. Monitor -> controller: ProcExit. Payloads a user
supplies (classes, arguments, return values) stay opaque bytes so that one bad payload fails one call,
never the connection. A rank paused in pdb sends DebugPaused and DebugResumed, and reads DebugInput.
"""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Any

from monarch.shape import Shape

CONTROLLER = 0  # the `reply_to` address of the controller itself; workers get addresses >= 1
LAUNCHER = -1  # the `rank` of a MeshFailure of the mesh's launcher (mpiexec) rather than of a worker


@dataclass(frozen=True)
class Hello:
    """First frame of a worker after the handshake."""
    pid: int
    host: str
    monitor: int = 0  # the pid of its monitor (its parent), the process the launcher started
    gpus: int = 0  # the GPUs it may use (bootstrap.visible_gpus)


@dataclass(frozen=True)
class Busy:
    """A worker is about to run something that may hold the GIL (so stop its heartbeats) for up to `seconds`,
    e.g. loading torch's libraries on the first tensor program: the controller does not fail it for that long
    (or until the next Busy: `Busy(0)` ends the excuse)."""
    seconds: float
    what: str


@dataclass(frozen=True)
class SpawnActor:
    """Construct actor `name` from a pickled class and arguments; `shape` is the actor mesh's view;
    `context`: a pickled dict of what the actor's context() tells (its creator, its proc mesh)."""
    name: str
    cls: bytes
    args: bytes
    shape: Shape
    context: bytes = b""


@dataclass(frozen=True)
class PortRef:
    """Where a Port's messages go: a reply slot of a call (`reply`: called mesh id, reply_to, call_id,
    replying rank), or a channel receiver `port` in the controller (owner None) or on a worker (mesh id, rank)."""
    port: int = 0
    owner: tuple[int, int] | None = None
    reply: tuple[int, int, int, int] | None = None
    rank: int | None = None  # the sender's rank, for a ranked receiver


@dataclass(frozen=True)
class Call:
    """Run `endpoint` of actor `actor`; the reply goes to address `reply_to` under `call_id`."""
    call_id: int
    reply_to: int
    actor: str
    endpoint: str
    args: bytes
    want_reply: bool = True
    sender: str = ""  # "mesh[rank]" of the calling actor's process; "" for the controller
    view: tuple | None = None  # the called view's Shape fields (context().message_rank); None: the whole mesh
    port: PortRef | None = None  # where the answers go instead of a reply (send(..., port=))


@dataclass(frozen=True)
class Reply:
    """The outcome of one Call on one rank: a pickled value, or a pickled exception when not ok."""
    call_id: int
    reply_to: int
    rank: int
    ok: bool
    value: bytes


@dataclass(frozen=True)
class Forward:
    """A call that an actor makes on another actor mesh, routed by the controller."""
    mesh_id: int
    shape: Shape
    call: Call


@dataclass(frozen=True)
class RunProgram:
    """Run one rank program (tensor-engine instructions) for the mesh view `view`.

    The program is the pickled instruction tuple `shared` (common to every rank) with `patches`
    (index, instruction) applied. When `call_id` is set the worker replies once the program ran: with
    the value of buffer `fetch` (0: none), or with the first error since the previous reply.
    """
    view: Shape
    shared: bytes
    patches: tuple[tuple[int, Any], ...]
    call_id: int = 0
    fetch: int = 0


@dataclass(frozen=True)
class InstallProgram:
    """Keep a compiled rank program (pickled `shared` instructions with this rank's `patches`) as `pid`."""
    pid: int
    view: Shape
    shared: bytes
    patches: tuple[tuple[int, Any], ...]


@dataclass(frozen=True)
class InvokeProgram:
    """Run installed program `pid` once, in a buffer namespace of its own: free `frees` first; it sees
    this call's buffers under its input ids (`inputs`: (program id, buffer id) pairs) and `feeds`
    under theirs; `outputs` says under which ids its results are kept. The programs `forget` names
    are uninstalled first (the controller dropped them)."""
    pid: int
    inputs: tuple[tuple[int, int], ...]
    outputs: tuple[tuple[int, int], ...]
    feeds: tuple[tuple[int, Any], ...]
    frees: tuple[int, ...] = ()
    forget: tuple[int, ...] = ()


@dataclass(frozen=True)
class ShipTelemetry:
    """Send the telemetry events recorded since the last batch, as the value of a Reply to `call_id`."""
    call_id: int


@dataclass(frozen=True)
class Heartbeat:
    """Send a frame (an empty one if nothing else) whenever nothing was sent for `every` seconds (0: stop)."""
    every: float


@dataclass(frozen=True)
class Stop:
    """Finish the queued work, close the connection and exit cleanly."""


@dataclass(frozen=True)
class MeshFailure:
    """A supervision event: a worker process (or the launcher, rank LAUNCHER) of a mesh died, or actor
    `actor` on one of its ranks failed (`detail`: its error and traceback). What `__supervise__` and
    `monarch.actor.unhandled_fault_hook` receive, and what SupervisionError reports."""
    mesh: str
    rank: int
    coords: str
    pid: int
    status: str
    host: str = ""  # the rank's host, for a mesh that spans hosts; for the launcher, its program
    actor: str = ""  # the failed actor mesh's name; "" when the process failed
    detail: str = ""

    @property
    def mesh_name(self) -> str:
        """The failed mesh: the actor mesh's name for an actor failure, else the proc mesh's."""
        return self.actor or self.mesh

    @property
    def who(self) -> str:
        """`worker rank 1 (gpus=1)`, `worker rank 3 (hosts=1,gpus=1) on host node2` or `the launcher mpiexec`."""
        if self.rank == LAUNCHER:
            return f"the launcher {self.host or 'mpiexec'}"
        who = f"worker rank {self.rank} ({self.coords})" if self.coords else f"worker rank {self.rank}"
        who = f"actor {self.actor!r} on {who}" if self.actor else who
        return f"{who} on host {self.host}" if self.host else who

    def message(self) -> str:
        return f"mesh {self.mesh!r}: {self.who}, pid {self.pid}, {self.status}"

    def report(self) -> str:
        """The whole user-readable report: what failed, where, and the error with its traceback."""
        return self.message() + (f"\n{self.detail}" if self.detail else "")

    def __str__(self) -> str:
        return self.message()


@dataclass(frozen=True)
class Supervise:
    """Give `failure` to the `__supervise__` of actor `actor` (its owner) on the receiving rank; the worker
    answers with Escalate when the actor does not handle it."""
    failure: MeshFailure
    actor: str


@dataclass(frozen=True)
class ActorFault:
    """Worker -> controller: actor `actor` on this rank failed and stopped (its __init__ raised, a broadcast
    or an explicit-port endpoint raised, or a BaseException escaped an endpoint)."""
    actor: str
    status: str
    detail: str


@dataclass(frozen=True)
class Escalate:
    """Worker -> controller: actor `actor` on this rank did not handle `failure` (its __supervise__ returned
    a falsy value, or raised: then it failed too); it goes on to that actor's owner."""
    failure: MeshFailure
    actor: str
    raised: str = ""  # the __supervise__ error, when it raised


@dataclass(frozen=True)
class PortSend:
    """A value (or, when not ok, an exception) sent to a port; routed by the controller."""
    ref: PortRef
    ok: bool
    value: bytes


@dataclass(frozen=True)
class DebugPaused:
    """A rank's pdb (debug/relay.py) waits for a line: where it stands, and what it printed since its last
    line (ending with its prompt). `actor`/`endpoint`: the call that hit the breakpoint ("" outside any)."""
    actor: str
    endpoint: str
    rank: int
    coords: str
    host: str
    filename: str
    function: str
    lineno: int
    output: str


@dataclass(frozen=True)
class DebugResumed:
    """A rank's pdb session ended (continue, quit, or the endpoint returned): the rank runs on."""
    actor: str
    rank: int
    output: str


@dataclass(frozen=True)
class DebugInput:
    """A line for the pdb of `actor` paused on this rank; `resume`: clear its breakpoints and continue."""
    actor: str
    line: str
    resume: bool = False


@dataclass(frozen=True)
class ProcExit:
    """Sent by a rank's monitor when its worker exits abnormally (os.wait status)."""
    rank: int
    pid: int
    wait_status: int
    stderr_tail: str


@dataclass(frozen=True)
class Owner:
    """Who spawned a proc mesh or an actor mesh: actor `actor` on rank `rank` of proc mesh `mesh_id` (the
    controller's record of a mesh keeps it; None there: the client spawned it)."""
    mesh_id: int
    actor: str
    rank: int


@dataclass(frozen=True)
class ProcsInfo:
    """What a ProcMesh reference carries: its job's mesh id, name, whole shape, and each rank's host and pid."""
    mesh_id: int
    name: str
    shape: Shape
    hosts: tuple[str, ...]
    pids: tuple[int, ...]
    device: str = "cpu"  # the device type of its tensors: cpu or cuda


@dataclass(frozen=True)
class GetController:
    """Mesh request (control/handlers/requests.py): the singleton actor mesh `name` of the process tree, spawned as
    `cls(*args)` on a one-process mesh the first time; answered with that mesh's ProcsInfo. `context`: a
    pickled function of that ProcsInfo giving the actors' SpawnActor.context."""
    name: str
    cls: bytes
    args: bytes
    cls_name: str
    context: bytes = b""
    call_id: int = 0
    actor: str = ""


@dataclass(frozen=True)
class SpawnProcs:
    """Mesh request (control/handlers/requests.py): start a proc mesh of `shape` with the launcher kept under key
    `launcher` (0: this host's); answered with its ProcsInfo. `call_id`/`actor`: who asks, from a worker.
    An empty `name` is the controller's next default: procs, procs_1, procs_2, ..."""
    name: str
    shape: Shape
    launcher: int
    env: tuple[tuple[str, str], ...] | None = None
    host: str | None = None
    call_id: int = 0
    actor: str = ""
    device: str = "auto"  # auto, cpu or cuda (MONARCH_DEVICE of its workers)


@dataclass(frozen=True)
class SpawnActors:
    """Mesh request: spawn the actors of `spawn` (class `cls_name`) on proc mesh `mesh_id`; answered with None."""
    mesh_id: int
    spawn: SpawnActor
    cls_name: str
    call_id: int = 0
    actor: str = ""


@dataclass(frozen=True)
class StopProcs:
    """Mesh request: stop proc mesh `mesh_id` and the proc meshes its actors spawned; answered with None."""
    mesh_id: int
    call_id: int = 0
    actor: str = ""


MeshRequest = GetController | SpawnProcs | SpawnActors | StopProcs  # what a client asks of the controller


def describe_status(wait_status: int, stderr_tail: str = "") -> str:
    """`killed by signal 9 (SIGKILL)` or `exited with code 3`, from an os.wait status; an exit with an error
    code also says the last line the process wrote to stderr (a Python exception's type and message)."""
    code = os.waitstatus_to_exitcode(wait_status)
    last = next((ln.strip() for ln in reversed(stderr_tail.splitlines()) if ln.strip()), "")
    return describe_exit(code) + (f" after: {last}" if code > 0 and last else "")


def describe_exit(code: int) -> str:
    """The same from an exit code as subprocess gives it (minus the signal number when killed)."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown"
        return f"killed by signal {-code} ({name})"
    return f"exited with code {code}"
