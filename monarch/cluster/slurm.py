"""Meshes inside a Slurm allocation: the allocation's nodes, ranks started by `srun --mpi=pmi2` (no ssh).

`HostMesh.from_slurm()` reads the allocation from the environment salloc/sbatch set (`SlurmJob`, in job.py,
submits one from outside and waits for it); each proc mesh is one job step that may share the allocation's CPUs
with other steps (`--overlap`), so several meshes can run at once, and may have more ranks than the
allocation has tasks or CPUs (`--overcommit`: per_host counts processes, e.g. one per GPU, not CPUs).
Ranks learn their rank from PMI (PMI_RANK wins over SLURM_PROCID, see bootstrap.py).
"""
from __future__ import annotations

import shutil
import signal
import subprocess

from monarch import config
from monarch.cluster import net
from monarch.errors import SpawnError
from monarch.runtime.control import launch
from monarch.shape import Shape


def tool(name: str) -> str:
    found = shutil.which(name)
    if not found:
        raise SpawnError(f"{name} is not on PATH: HostMesh.from_slurm() runs inside a Slurm allocation, on a "
                         "host with Slurm's client commands")
    return found


def allocation() -> tuple[str, list[str]]:
    """(job id, node names) of the allocation this process runs in."""
    job, nodelist = config.external("SLURM_JOB_ID"), config.external("SLURM_JOB_NODELIST")
    if not job or not nodelist:
        raise SpawnError("HostMesh.from_slurm() needs a Slurm allocation (SLURM_JOB_ID and SLURM_JOB_NODELIST "
                         "are not set): run the script under `salloc -N <hosts>` or in an sbatch script")
    return job, expand(nodelist)


def expand(nodelist: str) -> list[str]:
    """Node names of a Slurm node list such as `node[1-3,7]`, in Slurm's order."""
    try:
        out = subprocess.run([tool("scontrol"), "show", "hostnames", nodelist], capture_output=True, text=True,
                             check=True, timeout=30).stdout
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        raise SpawnError(f"scontrol could not expand the node list {nodelist!r}: {e}") from None
    return out.split()


class SlurmLauncher:
    """Ranks on nodes of allocation `job`, one srun job step per mesh; node i runs ranks i*k .. i*k+k-1."""
    local = False
    kill_signal = signal.SIGTERM  # srun forwards it and ends the step on every node; SIGKILL would not

    def __init__(self, job: str, hosts: list[str]) -> None:
        self.job, self.hosts = job, list(hosts)

    def route(self) -> str:
        return net.route_to(self.hosts[0])

    def command(self, shape: Shape, worker: list[str], advertise: str) -> list[str]:
        per_host = len(shape) // len(self.hosts)
        return [tool("srun"), "--mpi=pmi2", "--overlap", "--overcommit", f"--jobid={self.job}",
                f"--nodes={len(self.hosts)}", f"--ntasks={len(shape)}", f"--ntasks-per-node={per_host}",
                f"--nodelist={','.join(self.hosts)}",
                "--distribution=block", "--kill-on-bad-exit=0", "--input=none", "--job-name=monarch", *worker]

    def start(self, cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        return launch.start(cmd, env)

    def hand_over(self, token: str, directory: str, per_host: int) -> None:
        """One srun step with a task per node and the token on its stdin (broadcast to every task); each
        task writes the files of its node's ranks, picked by the node's name (SLURMD_NODENAME)."""
        cases = " ".join(f"{h}) rs='{' '.join(str(i * per_host + j) for j in range(per_host))}';;"
                         for i, h in enumerate(self.hosts))
        script = f"case $SLURMD_NODENAME in {cases} *) exit 3;; esac; " + launch.token_script(directory, "$rs")
        cmd = [tool("srun"), "--overlap", "--overcommit", f"--jobid={self.job}", f"--nodes={len(self.hosts)}",
               f"--ntasks={len(self.hosts)}", "--ntasks-per-node=1", f"--nodelist={','.join(self.hosts)}",
               "--input=all", "--job-name=monarch-token", "sh", "-c", script]
        try:
            done = subprocess.run(cmd, input=token, capture_output=True, text=True, timeout=config.spawn_timeout())
        except subprocess.TimeoutExpired:
            raise SpawnError(f"handing the mesh token to {self.hosts} with srun took over "
                             f"{config.spawn_timeout()} s (MONARCH_SPAWN_TIMEOUT)") from None
        if done.returncode:
            raise SpawnError(f"could not hand the mesh token to the allocation's nodes {self.hosts} with srun "
                             f"(job {self.job}): {done.stderr.strip()}")

    def release(self) -> None:
        return None  # nothing is held between meshes

    def subset(self, hosts: list[str]) -> SlurmLauncher:
        return SlurmLauncher(self.job, hosts)
