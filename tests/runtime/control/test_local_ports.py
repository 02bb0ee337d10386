"""A mesh on this host stays on loopback: its workers listen on no other address (MPI's UCX and libfabric
network modules are held to the loopback interface), and they do not keep Hydra's control port, which
Hydra opens on every interface, open after mpiexec.
"""
from __future__ import annotations

import ipaddress
import os

from processes import listening

from monarch.actor import Actor, ProcMesh, endpoint

T = 30.0


class Pid(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()


def test_workers_of_a_local_mesh_listen_on_loopback_only(procs: ProcMesh) -> None:
    pids = procs.spawn("ports", Pid).pid.call().get(timeout=T).values()
    for pid in pids:
        sockets = listening(pid)
        assert all(ipaddress.ip_address(a).is_loopback for a, _ in sockets), (pid, sockets)
