"""Meshes inside a real Slurm allocation: `HostMesh.from_slurm()` under `salloc -N 2`, ranks started as a
job step by `srun --mpi=pmi2` on the allocation's nodes, and the errors outside an allocation."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from testbed import Testbed

from monarch.actor import HostMesh
from monarch.errors import SpawnError

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
