"""The worker process (`python -m monarch.runtime.worker`, started by mpiexec, srun or the attach agent): wires
the frame loop (control), the actor host (actors), the relayed pdb (debug) and the worker's telemetry, and
holds the worker's one handler table (`handlers`). The tensor engine is created on the first tensor program,
so that a worker's start-up loads neither torch nor the compiler.
"""
from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from monarch.runtime.actors.host import ActorHost
from monarch.runtime.actors.hosting import calling_actor
from monarch.runtime.control import bootstrap
from monarch.runtime.control.client import set_client
from monarch.runtime.control.commands import (Call, DebugInput, Heartbeat, InstallProgram, InvokeProgram, PortSend,
                                              Reply, RunProgram, ShipTelemetry, SpawnActor, Stop, Supervise)
from monarch.runtime.control.worker import Handlers, Worker
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
