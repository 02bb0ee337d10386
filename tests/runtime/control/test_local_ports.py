"""A mesh on this host stays on loopback: its workers listen on no other address (MPI's UCX and libfabric
network modules are held to the loopback interface), and they do not keep Hydra's control port, which
Hydra opens on every interface, open after mpiexec.
"""
from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path

from monarch.actor import Actor, ProcMesh, endpoint

T = 30.0


class Pid(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd) if fd.is_symlink() else ""
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                raw, port = fields[1].split(":")
                packed = bytes.fromhex(raw)
                packed = b"".join(packed[i:i + 4][::-1] for i in range(0, len(packed), 4))  # little-endian words
                found.append((socket.inet_ntop(family, packed), int(port, 16)))
    return found


def test_workers_of_a_local_mesh_listen_on_loopback_only(procs: ProcMesh) -> None:
    pids = procs.spawn("ports", Pid).pid.call().get(timeout=T).values()
    for pid in pids:
        sockets = listening(pid)
        assert all(ipaddress.ip_address(a).is_loopback for a, _ in sockets), (pid, sockets)
