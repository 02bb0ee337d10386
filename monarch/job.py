"""Jobs that allocate hosts from a scheduler, with Meta Monarch's names (`monarch.job`).

`SlurmJob(meshes={"trainers": 2}).state().trainers` is a HostMesh over hosts of a job submitted with
sbatch; inside an allocation use `HostMesh.from_slurm()` instead (monarch/cluster/hosts.py, slurm.py).
"""
from __future__ import annotations

from monarch.cluster.hosts import JobState, SlurmJob

__all__ = ["JobState", "SlurmJob"]
