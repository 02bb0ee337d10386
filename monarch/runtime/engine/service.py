"""The worker's tensor engine service: runs RunProgram messages on the Engine and picks each collective's transport.

It maps the program's mesh view to this rank's coordinates and to the world ranks of each collective
group, runs a group's collectives on shared memory when its ranks share this host and on MPI otherwise
(MONARCH_TRANSPORT), or through torch.distributed (CUDA tensors; any with MONARCH_COLLECTIVES=torch), and
packs the reply of a synchronising program (the fetched value, or the first error).
"""
from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch

from monarch import config
from monarch.errors import TransportError
from monarch.program.instr import Comm, Free, Instr, Start
from monarch.program.program import assemble
from monarch.runtime.control import codec
from monarch.runtime.control.bootstrap import mesh_device, visible_gpus
from monarch.runtime.control.commands import InstallProgram, InvokeProgram, RunProgram
from monarch.runtime.engine.engine import Engine, Transport
from monarch.runtime.engine.transport.mpi import MpiTransport
from monarch.runtime.engine.transport.shm import ShmTransport, shares_memory
from monarch.runtime.engine.transport.torchdist import Rendezvous, TorchTransport
from monarch.runtime.telemetry.events import RECORDER, now_us
from monarch.shape import Shape, group_coords


class TensorService:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        torch.set_num_threads(threads_per_worker())
        bind_gpu()
        self.engine = Engine(rank, Transports(self._group, config.transport(), config.collectives()))
        self._view: Shape | None = None
        self._coords: tuple[int, ...] = ()
        self._places: dict[Shape, tuple[tuple[int, ...], str]] = {}
        self.installed: dict[int, tuple[Shape, tuple[Instr, ...]]] = {}

    def _group(self, mdim: int) -> tuple[int, ...]:
        view = self._view
        assert view is not None
        return tuple(view.rank_at(c) for c in group_coords(self._coords, mdim, view.sizes))

    def _place(self, view: Shape) -> tuple[tuple[int, ...], str]:
        hit = self._places.get(view)
        if hit is None:
            point = view.point(view.ranks().index(self.rank))
            hit = self._places[view] = (tuple(point.coords), point.label())
        return hit

    def install(self, msg: InstallProgram) -> None:
        self.installed[msg.pid] = (msg.view, assemble(msg.shared, msg.patches))

    def invoke(self, msg: InvokeProgram) -> None:
        for pid in msg.forget:
            self.installed.pop(pid, None)
        view, program = self.installed[msg.pid]
        self.engine.free(Free(msg.frees))
        self._view = view
        self._coords, label = self._place(view)
        start = now_us()
        outer = self.engine.bind(msg.inputs, msg.feeds)
        try:
            self.engine.run(program, self._coords, label)
        finally:
            self.engine.unbind(msg.outputs, outer)
        if RECORDER.on:
            RECORDER.add("ops", (self.rank, msg.pid, "compiled program", len(program), start, now_us()))

    def run(self, msg: RunProgram) -> tuple[bool, bytes]:
        self._view = msg.view
        self._coords, label = self._place(msg.view)
        start = now_us()
        program = assemble(msg.shared, msg.patches)
        self.engine.run(program, self._coords, label)
        if RECORDER.on:
            RECORDER.add("ops", (self.rank, 0, "eager flush", len(program), start, now_us()))
        if not msg.call_id:
            return True, b""
        try:
            value: Any = self.engine.fetch(msg.fetch)
        except Exception as e:  # noqa: BLE001 - a remote error is the reply
            return False, codec.dumps(e)
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            value = value.cpu()  # the controller gets host tensors (it needs no CUDA)
        elif isinstance(value, torch.Tensor) and value.untyped_storage().nbytes() > value.nbytes:
            value = value.clone()  # a view (a slice) would pickle its whole base tensor
        return True, codec.dumps_data(value)


class Transports:
    """Runs each collective on the transport of its group and tensors' device (`collectives`,
    MONARCH_COLLECTIVES): CUDA tensors through torch.distributed's NCCL; CPU tensors through gloo when
    `collectives` is "torch", else on shared memory when all the group's ranks share this host (decided once per
    group, by its members) and on MPI otherwise, which `mode` (MONARCH_TRANSPORT) can force."""

    def __init__(self, group_of: Callable[[int], tuple[int, ...]], mode: str, collectives: str) -> None:
        self.group_of, self.mode, self.collectives = group_of, mode, collectives
        self.mpi = MpiTransport(group_of)
        self.shm = ShmTransport(lambda mdim: self.mpi.comm_for(group_of(mdim)))
        meet = Rendezvous(self.mpi.comm_for, self.local)
        self.torch = {backend: TorchTransport(group_of, meet, backend) for backend in ("gloo", "nccl")}
        self._local: dict[tuple[int, ...], bool] = {}
        self._ran: dict[int, Transport] = {}  # by mesh dim: the transport of its latest collective
        self._staged: dict[str, Staged] = {}  # host transports, by name, carrying CUDA tensors

    def local(self, ranks: tuple[int, ...]) -> bool:
        """Whether all of `ranks` run on this host (collective over them the first time)."""
        local = self._local.get(ranks)
        if local is None:
            local = self._local[ranks] = shares_memory(self.mpi.comm_for(ranks))
        return local

    def pick(self, mdim: int, device: torch.device) -> Transport:
        if device.type == "cuda":
            if self.collectives == "torch" or (self.collectives == "auto" and nccl_usable()):
                return self.torch["nccl"]  # asked for by name: NCCL says itself why it cannot
            host = self.pick(mdim, torch.device("cpu"))
            return self._staged.setdefault(host.name(mdim), Staged(host))
        if self.collectives == "torch":
            return self.torch["gloo"]
        if self.mode == "mpi":
            return self.mpi
        ranks = self.group_of(mdim)
        if self.local(ranks):
            return self.shm
        if self.mode == "shm":
            raise TransportError(f"MONARCH_TRANSPORT=shm, but the ranks {ranks} of mesh dim {mdim} are on more than "
                                 "one host; set MONARCH_TRANSPORT=auto (shared memory within a host, MPI across)")
        return self.mpi

    def name(self, mdim: int) -> str:
        """What ran the latest collective over mesh dim `mdim`."""
        return self._ran[mdim].name(mdim)

    def __call__(self, ins: Comm, x: torch.Tensor, owned: bool = False) -> torch.Tensor:
        t = self._ran[ins.mdim] = self.pick(ins.mdim, x.device)
        return t(ins, x, owned)

    def start(self, ins: Start, flat: torch.Tensor) -> Callable[[], torch.Tensor]:
        t = self._ran[ins.mdim] = self.pick(ins.mdim, flat.device)
        return t.start(ins, flat)


class Staged:
    """A host transport for CUDA tensors where NCCL cannot run them (MONARCH_COLLECTIVES=mpi, GPUs shared by
    ranks, a torch without NCCL): each piece is copied to pinned host memory, reduced or moved there, and
    copied back to the GPU. Correct, and as slow as two extra copies make it."""

    def __init__(self, host: Transport) -> None:
        self.host = host

    def name(self, mdim: int) -> str:
        return f"{self.host.name(mdim)} (staged from cuda)"

    def __call__(self, ins: Comm, x: torch.Tensor, owned: bool = False) -> torch.Tensor:
        return self.host(ins, _pinned(x), True).to(x.device)

    def start(self, ins: Start, flat: torch.Tensor) -> Callable[[], torch.Tensor]:
        finish = self.host.start(ins, _pinned(flat))
        return lambda: finish().to(flat.device)


def _pinned(x: torch.Tensor) -> torch.Tensor:
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    return host.copy_(x)


@functools.cache
def nccl_usable() -> bool:
    """Whether NCCL can run this worker's CUDA collectives: torch has it, and no other rank of this host shares
    this worker's GPU (NCCL refuses two ranks on one device)."""
    import torch.distributed as dist
    shared = int(config.external("MPI_LOCALNRANKS")) > torch.cuda.device_count()
    return dist.is_available() and dist.is_nccl_available() and not shared


def threads_per_worker() -> int:
    """MONARCH_WORKER_THREADS, else this host's cores shared among its workers (MPI_LOCALNRANKS)."""
    n = config.worker_threads()
    if n > 0:
        return n
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // int(config.external("MPI_LOCALNRANKS")))


def bind_gpu() -> None:
    """On a CUDA mesh (bootstrap.mesh_device, the controller's rule too), make this worker's GPU the current
    device: its index among its host's ranks, modulo the GPUs it sees (CUDA_VISIBLE_DEVICES applies)."""
    local_ranks = int(config.external("MPI_LOCALNRANKS"))
    if mesh_device(config.device(), visible_gpus(), local_ranks) != "cuda":
        return
    if not torch.cuda.is_available():
        raise RuntimeError(f"this worker's mesh is a CUDA mesh, but its torch {torch.__version__} cannot use a GPU "
                           f"(CUDA build: {torch.version.cuda}); install a CUDA build of torch on the workers, or "
                           "spawn the mesh with device='cpu'")
    torch.cuda.set_device(int(config.external("MPI_LOCALRANKID")) % torch.cuda.device_count())
