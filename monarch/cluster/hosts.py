"""The host meshes users build, with Meta Monarch's names: the actor layer's HostMesh with a launcher picked here.

`HostMesh(["node1", "node2"])` starts ranks over ssh (ssh.py), `this_host()` forks them on this host,
`HostMesh.from_slurm()` runs them as srun steps of the allocation it is in (slurm.py), and `SlurmJob`
submits a batch job that holds nodes, one HostMesh per named mesh over them. `monarch.actor` and
`monarch.job` re-export them; `attach_to_workers` (attach.py) gives one over attach-mode agents.
"""
from __future__ import annotations

import subprocess
import time
from typing import Any

from monarch.cluster import slurm
from monarch.cluster.ssh import SshLauncher
from monarch.errors import SpawnError
from monarch.runtime.actors import host_mesh
from monarch.runtime.control.launch import Launcher, LocalLauncher


class HostMesh(host_mesh.HostMesh):
    """Hosts that can run workers. `HostMesh(["node1", "node2"])` starts ranks over ssh (MONARCH_SSH);
    a `launcher` says otherwise (the Launcher protocol of runtime/control/launch.py)."""

    def __init__(self, hosts: list[str], launcher: Launcher | None = None) -> None:
        super().__init__(hosts, launcher or default_launcher(hosts))

    @classmethod
    def from_slurm(cls) -> HostMesh:
        """The nodes of the Slurm allocation this process runs in (under salloc or sbatch); proc meshes
        start as job steps with `srun --mpi=pmi2`."""
        job, nodes = slurm.allocation()
        return cls(nodes, slurm.SlurmLauncher(job, nodes))


def default_launcher(hosts: list[str]) -> Launcher:
    """Forked here for `["localhost"]`, Hydra over ssh otherwise."""
    return LocalLauncher() if hosts == ["localhost"] else SshLauncher(hosts)


def this_host() -> HostMesh:
    """The machine the controller runs on."""
    return HostMesh(["localhost"])


class SlurmJob:
    """Hosts allocated by submitting a job from outside an allocation (Meta Monarch's `monarch.job.SlurmJob`):
    `SlurmJob(meshes={"trainers": 2, "loaders": 1}).state().trainers` is a HostMesh over 2 of the job's nodes.
    The batch job only holds the nodes; proc meshes run on them as job steps (`srun --jobid`). It lives until
    `kill()` or its time limit, so that a later controller can use it again (`SlurmJob.attach(job_id, meshes)`)."""

    def __init__(self, meshes: dict[str, int], *, partition: str | None = None, time_limit: str | None = None,
                 slurm_args: tuple[str, ...] = (), job_name: str = "monarch", timeout: float = 300.0) -> None:
        if not meshes or any(int(n) < 1 for n in meshes.values()):
            raise SpawnError(f"SlurmJob needs at least one host per mesh; got {meshes}")
        self.meshes, self.job_id = dict(meshes), ""
        self._args = [*(["--partition", partition] if partition else []),
                      *(["--time", time_limit] if time_limit else []), *slurm_args]
        self._name, self._timeout = job_name, timeout

    @classmethod
    def attach(cls, job_id: str, meshes: dict[str, int]) -> SlurmJob:
        """A job submitted earlier (by this or another controller), to take its hosts again."""
        job = cls(meshes)
        job.job_id = str(job_id)
        return job

    def apply(self) -> None:
        """Submit the job (once): `sbatch` of a script that holds the nodes."""
        if self.job_id:
            return
        nodes = sum(self.meshes.values())
        cmd = [slurm.tool("sbatch"), "--parsable", f"--nodes={nodes}", "--ntasks-per-node=1",
               f"--job-name={self._name}", "--output=/dev/null", *self._args, "--wrap", "exec sleep infinity"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        if done.returncode:
            raise SpawnError(f"sbatch refused the job ({' '.join(cmd)}): {done.stderr.strip()}")
        self.job_id = done.stdout.strip().split(";")[0]

    def state(self) -> JobState:
        """The job's hosts once it runs (applying it first if needed), one HostMesh per mesh name."""
        self.apply()
        nodes = self._wait_running()
        state, start = JobState(), 0
        for name, n in self.meshes.items():
            hosts = nodes[start:start + n]
            start += n
            setattr(state, name, HostMesh(hosts, slurm.SlurmLauncher(self.job_id, hosts)))
        return state

    def kill(self) -> None:
        """Cancel the job: its steps (every proc mesh on it) end and its nodes are released."""
        if self.job_id:
            subprocess.run([slurm.tool("scancel"), self.job_id], capture_output=True, timeout=60)

    def _wait_running(self) -> list[str]:
        deadline = time.monotonic() + self._timeout
        while True:
            out = subprocess.run([slurm.tool("squeue"), "-h", "-j", self.job_id, "-o", "%T %N"], capture_output=True,
                                 text=True, timeout=60).stdout.split()
            if out and out[0] == "RUNNING":
                return slurm.expand(out[1])
            if not out or out[0] in ("FAILED", "CANCELLED", "TIMEOUT", "COMPLETED", "NODE_FAIL", "PREEMPTED"):
                raise SpawnError(f"Slurm job {self.job_id} is {out[0] if out else 'gone'}; submit a new SlurmJob")
            if time.monotonic() > deadline:
                raise SpawnError(f"Slurm job {self.job_id} is still {out[0]} after {self._timeout} s (pending: "
                                 "`squeue -j` says why); wait longer (timeout=) or ask for fewer nodes")
            time.sleep(0.2)


class JobState:
    """The host meshes of a running job, as attributes named like `SlurmJob(meshes=...)`'s keys."""

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"this job has no mesh named {name!r}; its meshes: {sorted(vars(self))}")
