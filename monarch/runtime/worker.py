"""The worker process (`python -m monarch.runtime.worker`, started by mpiexec, srun or the attach agent): wires
the frame loop (control), the actor host (actors), the relayed pdb (debug) and the worker's telemetry, and
holds the worker's one handler table (`handlers`). The tensor engine is created on the first tensor program,
so that a worker's start-up loads neither torch nor the compiler; where the host has cores to spare, torch
itself is imported on a background thread once the worker connected (MONARCH_PRELOAD_TORCH), so that the
first tensor program does not wait for the whole import and actors do not wait for it at all.
"""
from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterable
from contextlib import suppress
from typing import TYPE_CHECKING, Any

from monarch import config
from monarch.runtime.actors.host import ActorHost
from monarch.runtime.actors.hosting import calling_actor
from monarch.runtime.control import bootstrap
from monarch.runtime.control.client import set_client
from monarch.runtime.control.commands import (Call, DebugInput, Heartbeat, InstallProgram, InvokeProgram, PortSend,
                                              Reply, RunProgram, ShipTelemetry, SpawnActor, Stop, Supervise)
from monarch.runtime.control.worker import IMPORT_GRACE_S, Handlers, Worker
from monarch.runtime.debug.relay import Debugger
from monarch.runtime.telemetry.events import Collector, record_logging

if TYPE_CHECKING:
    from monarch.runtime.engine.service import TensorService


class Tensors:
    """The tensor engine of `worker`'s rank, created (with torch) on the first tensor program."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self._service: TensorService | None = None

    def service(self) -> TensorService:
        if self._service is None:
            from monarch.runtime.engine.service import TensorService  # loads torch: only when a program comes
            self._service = TensorService(self.worker.rank)
        return self._service

    def preload(self) -> None:
        """Start importing torch on a daemon thread (MONARCH_PRELOAD_TORCH): a tensor program that comes meanwhile
        waits for that import instead of starting its own; actors run on, the import yielding the GIL to them."""
        if preloads_torch():
            threading.Thread(target=self._import_torch, name="monarch-preload-torch", daemon=True).start()

    def _import_torch(self) -> None:
        with suppress(OSError), self.worker.busy(IMPORT_GRACE_S, "loading torch"), suppress(ImportError):
            import torch  # noqa: F401 - without torch here, the first tensor program says so

    def run(self, msg: RunProgram) -> None:
        ok, value = self.service().run(msg)
        if msg.call_id:
            self.worker.answer(msg.call_id, ok, value)

    def install(self, msg: InstallProgram) -> None:
        self.service().install(msg)

    def invoke(self, msg: InvokeProgram) -> None:
        self.service().invoke(msg)

    def stored(self) -> Iterable[Any]:
        """What the engine's store holds (nothing before the first program): the telemetry's memory samples."""
        return self._service.engine.store.values() if self._service is not None else ()


def preloads_torch() -> bool:
    """MONARCH_PRELOAD_TORCH: on, off, or auto: on where this host has two cores for each of its workers, so that
    the import (seconds of CPU) does not take the cores that the workers' actors need while the mesh starts."""
    wanted = config.preload_torch()
    if wanted == "auto":
        return len(os.sched_getaffinity(0)) >= 2 * int(config.external("MPI_LOCALNRANKS") or 1)
    return wanted == "on"


def handlers(worker: Worker, host: ActorHost, tensors: Tensors, debugger: Debugger) -> Handlers:
    """The worker's handler table, by message type (Reply runs as it arrives, the rest in order from the inbox)."""
    return {SpawnActor: host.spawn, Call: host.call, Supervise: host.supervise, PortSend: host.deliver,
            Reply: worker.reply, Stop: worker.stop, Heartbeat: worker.heartbeat, ShipTelemetry: worker.ship_telemetry,
            RunProgram: tensors.run, InstallProgram: tensors.install, InvokeProgram: tensors.invoke,
            DebugInput: debugger.stale_input}


def main(argv: list[str]) -> int:
    boot = bootstrap.start(argv)
    worker = Worker(boot.sock, boot.rank, boot.mesh_id)
    tensors = Tensors(worker)
    tensors.preload()
    telemetry = Collector(boot.rank, tensors.stored)
    host = ActorHost(worker, telemetry)
    debugger = Debugger(worker, calling_actor)
    record_logging(boot.rank)
    set_client(worker)
    debugger.install()
    worker.serve(host, telemetry, handlers(worker, host, tensors, debugger))
    worker.flush()
    worker.sender.close()
    boot.sock.close()
    return 0


if __name__ == "__main__":
    bootstrap.leave(main(sys.argv[1:]))
