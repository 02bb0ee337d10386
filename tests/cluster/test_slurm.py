"""Meshes inside a real Slurm allocation: `HostMesh.from_slurm()` under `salloc -N 2`, ranks started as a
job step by `srun --mpi=pmi2` on the allocation's nodes, the errors outside an allocation, and `SlurmJob`,
which submits a job with sbatch and takes its hosts from outside."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
from testbed import Testbed

from monarch.actor import Actor, HostMesh, endpoint
from monarch.errors import SpawnError
from monarch.job import SlurmJob

CONTROLLER = """
    import os, socket, sys, time, torch, monarch
    from monarch import Replicate, Shard
    from monarch.actor import Actor, HostMesh, endpoint, this_host

    class Where(Actor):
        @endpoint
        def where(self):
            return socket.gethostname(), int(os.environ.get("PMI_RANK", -1)), os.environ.get("SLURM_STEP_ID")

    start = time.monotonic()
    hosts = HostMesh.from_slurm()
    print("hosts", hosts.hostnames)
    with hosts.spawn_procs(per_host={"gpus": 2}) as procs:
        print("spawned", round(time.monotonic() - start, 2), procs.extent)
        print("where", sorted(procs.spawn("w", Where).where.call().get(timeout=60).values()))
        from pathlib import Path
        token = procs._mesh.token.hex().encode()
        print("token in environ", any(token in Path(f"/proc/{p}/environ").read_bytes() for p in procs.pids))
        print("token files", list(Path("/dev/shm").glob("monarch-token-*")))
        x = torch.randn(64, 8)
        m = monarch.distribute_tensor(x, procs, [Shard(0), Replicate()])
        print("sum ok", torch.allclose((m * 3).sum(0).full_tensor(), (x * 3).sum(0), atol=1e-5))
    # Hydra inside the allocation: SLURM_PROCID=0 in every worker's environment, PMI_RANK wins
    with this_host().spawn_procs(per_host={"gpus": 2}, env={"SLURM_PROCID": "0"}) as local:
        print("local ranks", [r for _, (_, r, _) in local.spawn("w", Where).where.call().get(timeout=60).items()])
"""


class Where(Actor):
    @endpoint
    def where(self) -> tuple[str, int, str | None]:
        import socket
        return socket.gethostname(), int(os.environ.get("PMI_RANK", -1)), os.environ.get("SLURM_STEP_ID")


def test_from_slurm_inside_salloc(slurm: Testbed) -> None:
    others = slurm.all_pids()
    done = subprocess.run(["salloc", "-N", "2", "--ntasks-per-node=2", "--quiet", sys.executable, "-c",
                           textwrap.dedent(CONTROLLER)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ))
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    lines = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
    hosts = eval(lines["hosts"])
    assert len(hosts) == 2 and set(hosts) <= set(slurm.names), out
    assert lines["spawned"].endswith("{'hosts': 2, 'gpus': 2}"), out
    where = eval(lines["where"])  # [(host, PMI rank, job step)] sorted
    assert [(h, r) for h, r, _ in where] == [(hosts[0], 0), (hosts[0], 1), (hosts[1], 2), (hosts[1], 3)], out
    assert len({s for _, _, s in where}) == 1 and where[0][2] is not None, "one srun job step for the mesh"
    assert lines["sum"] == "ok True", out
    assert "token in environ False" in out and "token files []" in out, out
    assert lines["local"] == "ranks [0, 1]", out
    assert not slurm.strays(others), slurm.strays(others)


def test_from_slurm_outside_an_allocation_says_how(slurm: Testbed, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    with pytest.raises(SpawnError, match="salloc"):
        HostMesh.from_slurm()


def test_slurm_job_from_outside_an_allocation(slurm: Testbed, monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST"):
        monkeypatch.delenv(k, raising=False)
    others = slurm.all_pids()
    job = SlurmJob(meshes={"trainers": 2, "loaders": 1}, time_limit="10")
    try:
        state = job.state()
        assert len(state.trainers.hostnames) == 2 and len(state.loaders.hostnames) == 1
        assert not set(state.trainers.hostnames) & set(state.loaders.hostnames)
        with state.trainers.spawn_procs(per_host={"gpus": 2}) as procs, state.loaders.spawn_procs() as loaders:
            where = procs.spawn("w", Where).where.call().get(timeout=60)
            assert [h for _, (h, _, _) in where.items()] == [h for h in state.trainers.hostnames for _ in (0, 1)]
            assert loaders.spawn("w", Where).where.call_one().get(timeout=60)[0] == state.loaders.hostnames[0]
        again = SlurmJob.attach(job.job_id, {"all": 3}).state().all  # a later controller takes the hosts again
        assert again.hostnames == sorted(state.trainers.hostnames + state.loaders.hostnames)
        with pytest.raises(AttributeError, match="trainers"):
            state.evaluators
    finally:
        job.kill()
    deadline = time.monotonic() + 30
    while subprocess.run(["squeue", "-h", "-j", job.job_id], capture_output=True, text=True).stdout.strip():
        assert time.monotonic() < deadline, "the job outlived kill()"
        time.sleep(0.2)
    assert not slurm.strays(others), slurm.strays(others)
