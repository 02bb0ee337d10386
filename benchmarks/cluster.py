"""Meshes across hosts: spawn time (ssh and srun), call_one round trip, a 64 MiB all_reduce, a 64 MiB RDMABuffer
read and to_mesh, and workspace sync, each beside a baseline measured in the same run between the same test hosts.

Run as root: `.venv/bin/python benchmarks/cluster.py [--calls 500] [--reps 5]`. It builds the cluster tier's test
hosts (tests/cluster/testbed.py: network namespaces on a bridge, veth links, real sshd, slurmd and slurmctld;
MPICH's OFI netmod so bytes cross the veths) and tears them down at the end. Baselines: a local mesh's spawn;
a raw TCP ping-pong (1 byte, TCP_NODELAY) between the controller and the second host for the round trip; a raw
TCP stream of the same bytes from the first host to the second (the link's ceiling) for the all_reduce, the
RDMABuffer read (over the owner's TCP door, and over MPI RMA windows joined on demand, MPICH's OFI netmod) and
to_mesh (TCP doors: the test hosts share a kernel, so the ranks are told MONARCH_RDMA_BACKEND=tcp, which hosts
without RDMA devices would pick); the
same all_reduce between two ranks of one host; shutil.copytree, rsync (one local copy) and rsync over the test
hosts' ssh to both hosts at once (the same work) for the sync (workspace_sync.py). `--only sync` runs the
sync rows alone.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from actors import cpu_model, os_name
from workspace_sync import measure, print_table

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "cluster"))
from testbed import Testbed, can_run, can_slurm  # noqa: E402

import monarch  # noqa: E402
from monarch import Replicate, Shard  # noqa: E402
from monarch.actor import Actor, HostMesh, ProcMesh, endpoint, this_host  # noqa: E402
from monarch.rdma import RDMABuffer  # noqa: E402

TIMEOUT = 120.0
MIB64 = 64 << 20


class Ping(Actor):
    @endpoint
    def ping(self) -> int:
        return 1


class Share(Actor):
    """Holds 64 MiB in an RDMABuffer, or times reading one (median seconds of `reps`)."""

    @endpoint
    def share(self) -> RDMABuffer:
        self.data = torch.ones(MIB64, dtype=torch.uint8)
        return RDMABuffer(self.data)

    @endpoint
    def read(self, buf: RDMABuffer, reps: int, backend: str) -> float:
        out, times = torch.empty(buf.size(), dtype=torch.uint8), []
        os.environ["MONARCH_RDMA_BACKEND"] = backend  # read per transfer, in this (the reading) process
        for _ in range(reps + 1):
            t = time.perf_counter()
            buf.read_into(out, timeout=TIMEOUT).get(timeout=TIMEOUT)
            times.append(time.perf_counter() - t)
        return statistics.median(times[1:])


def spawn_to_first_answer(hosts: HostMesh, name: str) -> float:
    t0 = time.perf_counter()
    procs = hosts.spawn_procs(per_host={"gpus": 2}, name=name)
    procs.spawn("ping", Ping).ping.call().get(timeout=TIMEOUT)
    took = time.perf_counter() - t0
    procs.stop()
    return took


def slurm_allocation() -> tuple[str, str]:
    out = subprocess.run(["salloc", "-N", "2", "--no-shell"], capture_output=True, text=True, timeout=60).stderr
    job = next(w for w in out.split() if w.isdigit())
    nodes = subprocess.run(["squeue", "-h", "-j", job, "-o", "%N"], capture_output=True, text=True,
                           timeout=30).stdout.strip()
    return job, nodes


ECHO = """
import socket, sys
s = socket.create_server(("0.0.0.0", int(sys.argv[1])))
print("ready", flush=True)
c, _ = s.accept()
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
if sys.argv[2] == "echo":
    while (b := c.recv(1)):
        c.sendall(b)
else:
    n = 0
    while (b := c.recv(1 << 20)):
        n += len(b)
    c.sendall(str(n).encode())
"""

STREAM = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
data = bytes(int(sys.argv[3]))
t = time.perf_counter()
c.sendall(data)
c.shutdown(socket.SHUT_WR)
c.recv(64)
print(time.perf_counter() - t)
"""


def server(bed: Testbed, host: str, port: int, mode: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(["ip", "netns", "exec", host, sys.executable, "-c", ECHO, str(port), mode],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def tcp_ping_pong_us(bed: Testbed, n: int) -> float:
    srv = server(bed, "mh2", 5001, "echo")
    import socket
    c = socket.create_connection((bed.address("mh2"), 5001), timeout=TIMEOUT)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    times = []
    for _ in range(n):
        t = time.perf_counter()
        c.sendall(b"x")
        c.recv(1)
        times.append(time.perf_counter() - t)
    c.close()
    srv.wait(timeout=TIMEOUT)
    return statistics.median(times) * 1e6


def tcp_stream_s(bed: Testbed, nbytes: int) -> float:
    srv = server(bed, "mh2", 5002, "sink")
    done = subprocess.run(["ip", "netns", "exec", "mh1", sys.executable, "-c", STREAM, bed.address("mh2"), "5002",
                           str(nbytes)], capture_output=True, text=True, timeout=TIMEOUT, check=True)
    srv.wait(timeout=TIMEOUT)
    return float(done.stdout)


def call_one_us(procs: object, n: int) -> float:
    far = procs.spawn("ping", Ping).slice(hosts=1)  # type: ignore[attr-defined]
    far.ping.call_one().get(timeout=TIMEOUT)
    times = []
    for _ in range(n):
        t = time.perf_counter()
        far.ping.call_one().get(timeout=TIMEOUT)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def all_reduce_s(procs: object, dim: str, reps: int) -> float:
    """Seconds for an all_reduce of a 64 MiB float32 partial sum over mesh dim `dim` (median of `reps`)."""
    x = monarch.distribute_tensor(torch.ones(2, MIB64 // 4), procs, {dim: Shard(0)})
    times = []
    for _ in range(reps + 1):
        partial = x.sum(0)
        partial[0].item()  # the partial sum is computed; only the all_reduce is left
        t = time.perf_counter()
        total = partial.redistribute([Replicate()] * len(procs.extent))  # type: ignore[attr-defined]
        assert total[0].item() == 2.0
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def to_mesh_s(procs: ProcMesh, reps: int) -> float:
    """Seconds to move 64 MiB from the rank on host 1 to the rank on host 2 with to_mesh (median of `reps`)."""
    x = monarch.distribute_tensor(torch.ones(MIB64 // 4), procs.slice(hosts=0))
    times = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        moved = x.to_mesh(procs.slice(hosts=1))
        times.append(time.perf_counter() - t)
        del moved
    return statistics.median(times[1:])


def row(what: str, value: str, baseline: str, base_value: str, ratio: str) -> None:
    print(f"{what:44} {value:>12}   {baseline:44} {base_value:>12}   {ratio}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--only", choices=["all", "sync"], default="all", help="sync: the workspace rows alone")
    a = p.parse_args()
    why = can_run()
    if why:
        sys.exit(f"benchmarks/cluster.py: {why}")
    print(f"monarch cluster benchmark, {time.strftime('%Y-%m-%d')}: 2 test hosts (network namespaces, veth over a "
          "bridge, MPICH OFI netmod)")
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores, {os_name()}, load average {os.getloadavg()[0]:.2f}")
    bed = Testbed(slurm=not can_slurm()).up()
    os.environ.update(bed.env | {"MPIR_CVAR_CH4_NETMOD": "ofi"})
    try:
        run(bed, a)
    finally:
        bed.down()


def run(bed: Testbed, a: argparse.Namespace) -> None:
    hosts = HostMesh(["mh1", "mh2"])
    if a.only == "all":
        run_all(bed, hosts, a)
    with tempfile.TemporaryDirectory(prefix="monarch-bench-") as tmp:
        env = {"MONARCH_WORKSPACE_DIR": str(Path(tmp) / "workspaces")}
        with hosts.spawn_procs(per_host={"gpus": 1}, name="bench-sync", env=env) as procs:
            print(f"\nsync_workspace of about 50 MB to both hosts (sent once per host), medians of {a.reps} rounds:")
            print_table(measure(procs, Path(tmp), ssh=bed.ssh_command, hosts=["mh1", "mh2"], reps=a.reps))


def run_all(bed: Testbed, hosts: HostMesh, a: argparse.Namespace) -> None:
    local = statistics.median(spawn_to_first_answer(this_host(), f"local{i}") for i in range(3))
    ssh = statistics.median(spawn_to_first_answer(hosts, f"ssh{i}") for i in range(3))
    print()
    row("what", "monarch", "baseline (same run)", "", "ratio")
    row("spawn 2 hosts x 2 procs, ssh, to 1st answer", f"{ssh:.2f} s", "spawn 1 host x 2 procs (local)",
        f"{local:.2f} s", f"{ssh / local:.2f}x")
    if bed.slurm:
        job, nodes = slurm_allocation()
        os.environ.update(SLURM_JOB_ID=job, SLURM_JOB_NODELIST=nodes)
        try:
            srun = statistics.median(spawn_to_first_answer(HostMesh.from_slurm(), f"srun{i}") for i in range(3))
        finally:
            subprocess.run(["scancel", job], timeout=30)
            for k in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST"):
                os.environ.pop(k)
        row("spawn 2 hosts x 2 procs, srun, to 1st answer", f"{srun:.2f} s", "spawn 1 host x 2 procs (local)",
            f"{local:.2f} s", f"{srun / local:.2f}x")
    tcp = {"MONARCH_RDMA_BACKEND": "tcp"}  # the test hosts share a kernel: what hosts without one would pick
    with hosts.spawn_procs(per_host={"gpus": 1}, name="bench", env=tcp) as procs:
        rtt, raw = call_one_us(procs, a.calls), tcp_ping_pong_us(bed, a.calls)
        row("call_one round trip, controller <-> host 2", f"{rtt:.0f} us", "raw TCP ping-pong, same path",
            f"{raw:.0f} us", f"{rtt / raw:.1f}x")
        reduce = all_reduce_s(procs, "hosts", a.reps)
        share = procs.spawn("share", Share)
        buf = share.slice(hosts=0).share.call_one().get(timeout=TIMEOUT)
        reads = {be: share.slice(hosts=1).read.call_one(buf, a.reps, be).get(timeout=TIMEOUT) for be in ("tcp", "mpi")}
        moved = to_mesh_s(procs, a.reps)
    stream = tcp_stream_s(bed, MIB64)
    for be, read in reads.items():
        row(f"RDMABuffer.read_into 64 MiB, host 2 <- 1, {be}", f"{read * 1e3:.0f} ms",
            "raw TCP stream 64 MiB host 1 -> host 2", f"{stream * 1e3:.0f} ms",
            f"{read / stream:.2f}x ({MIB64 / read / 1e9:.2f} GB/s)")
    row("to_mesh 64 MiB, host 1's rank -> host 2's", f"{moved * 1e3:.0f} ms", "raw TCP stream 64 MiB host 1 -> host 2",
        f"{stream * 1e3:.0f} ms", f"{moved / stream:.2f}x")
    with this_host().spawn_procs(per_host={"gpus": 2}, name="bench-local") as one_host:
        local_reduce = all_reduce_s(one_host, "gpus", a.reps)
    gbs = MIB64 / reduce / 1e9
    row("all_reduce 64 MiB, 1 rank per host", f"{reduce * 1e3:.0f} ms", "raw TCP stream 64 MiB host 1 -> host 2",
        f"{stream * 1e3:.0f} ms", f"{reduce / stream:.2f}x ({gbs:.2f} GB/s of data)")
    row("", "", "the same all_reduce, 2 ranks of one host", f"{local_reduce * 1e3:.0f} ms",
        f"{reduce / local_reduce:.2f}x")


if __name__ == "__main__":
    main()
