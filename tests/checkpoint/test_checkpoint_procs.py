"""monarch.checkpoint on real worker processes (a 2x2 mesh): the workers write and read the files.

A compiled training loop saved in the middle resumes with the uninterrupted losses on dp=4 and one
process (views of the same workers); a failing write (a file size limit in the workers, a real
EFBIG from the kernel) surfaces on the async_save future and leaves the earlier checkpoint whole;
the workers' torch generators resume; checkpoints move to and from torchrun + DTensor jobs.
"""
from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import monarch.checkpoint as mcp
from monarch import CheckpointError
from monarch.actor import Actor, ProcMesh, endpoint
from tests.checkpoint.ckpt_runs import T, batches, build, losses, plain_values, resume, stepper

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Worker(Actor):
    """What a test does inside the worker processes: limit file sizes, draw from torch's generator."""

    @endpoint
    def limit_file_size(self, nbytes: int) -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    @endpoint
    def draw(self) -> list[float]:
        return torch.rand(3).tolist()


def test_compiled_resume_on_dp4_and_one_process(procs: ProcMesh, tmp_path: Path) -> None:
    """(tp=4 and the others are resumed on in-process meshes in test_checkpoint.py.)"""
    resume(procs, [procs.flatten("dp"), procs.slice(dp=0, tp=0)], tmp_path / "c", compiled=True)


def test_eager_round_trip(procs: ProcMesh, tmp_path: Path) -> None:
    resume(procs, [procs], tmp_path / "c", compiled=False)


def test_a_failed_async_write_raises_on_the_future_and_keeps_the_earlier_checkpoint(procs: ProcMesh,
                                                                                    tmp_path: Path) -> None:
    model, opt = build(procs)
    step = stepper(model, opt, False)
    losses(step, batches(1))
    mcp.save(mcp.get_state_dict(model, opt), checkpoint_id=tmp_path / "c", timeout=T)
    kept = plain_values(model)
    losses(step, batches(1, seed=2))
    workers = procs.spawn("ckpt_workers", Worker)
    workers.limit_file_size.call(4096).get(timeout=T)
    try:
        fut = mcp.async_save(mcp.get_state_dict(model, opt), checkpoint_id=tmp_path / "c")
        losses(step, batches(1, seed=3))  # training goes on while the workers write (and fail)
        with pytest.raises(CheckpointError, match="File too large") as failed:
            fut.get(T)
    finally:
        workers.limit_file_size.call(resource.RLIM_INFINITY).get(timeout=T)
    assert "unchanged" in str(failed.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"], "the temporary directory was removed"
    fresh, fresh_opt = build(procs, seed=8)
    sd = mcp.get_state_dict(fresh, fresh_opt)
    mcp.load(sd, checkpoint_id=tmp_path / "c", timeout=T)
    mcp.set_state_dict(fresh, fresh_opt, sd)
    for name, value in plain_values(fresh).items():
        assert torch.equal(value, kept[name]), name


def test_the_workers_generators_resume(procs: ProcMesh, tmp_path: Path) -> None:
    workers = procs.spawn("ckpt_draws", Worker)
    mcp.save({"rng": mcp.RNGState(procs)}, checkpoint_id=tmp_path / "c", timeout=T)
    want = workers.draw.call().get(timeout=T)
    workers.draw.call().get(timeout=T)
    mcp.load({"rng": mcp.RNGState(procs)}, checkpoint_id=tmp_path / "c", timeout=T)
    got = workers.draw.call().get(timeout=T)
    assert list(got.values()) == list(want.values())
    assert len({tuple(v) for v in want.values()}) == 4, "each worker has a generator of its own"


def wait_for(path: Path, job: subprocess.Popen, timeout: float = 100.0) -> None:
    deadline = time.monotonic() + timeout
    while not (path / ".metadata").exists():
        if job.poll() is not None:
            raise AssertionError(f"the torchrun job exited with {job.returncode}: {job.communicate()[1][-3000:]}")
        assert time.monotonic() < deadline, f"no checkpoint at {path} after {timeout} s"
        time.sleep(0.1)


def test_a_torchrun_dtensor_checkpoint_loads_here_and_the_other_way(procs: ProcMesh, tmp_path: Path) -> None:
    """A torchrun + DTensor job (tests/checkpoint/dtensor_job.py: parameters sharded over 2 ranks, AdamW
    after one step) saves with DCP; the 2x2 mesh loads it resharded and equals a plain replay of the
    same step. The job then reads back the checkpoint monarch writes (it prints the full parameters' sum)."""
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node=2",
           str(ROOT / "tests" / "checkpoint" / "dtensor_job.py"), str(tmp_path / "torchrun"), str(tmp_path / "monarch")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT) as job:
        try:
            wait_for(tmp_path / "torchrun", job)
            model, opt = build(procs, seed=2)
            sd = mcp.get_state_dict(model, opt) | {"step": 0}
            mcp.load(sd, checkpoint_id=tmp_path / "torchrun", timeout=T)
            mcp.set_state_dict(model, opt, sd)
            assert sd["step"] == 1
            plain, plain_opt = build(None, seed=11)
            plain.eval()
            losses(stepper(plain, plain_opt, False), batches(1, seed=11))
            for name, value in plain.state_dict().items():
                torch.testing.assert_close(plain_values(model)[name], value, rtol=1e-6, atol=1e-7)
            mcp.save(mcp.get_state_dict(model, opt) | {"step": 5}, checkpoint_id=tmp_path / "monarch", timeout=T)
            total = sum(v.double().sum().item() for v in plain_values(model).values())
            out, err = job.communicate(timeout=100)
        finally:
            if job.poll() is None:  # torchrun stops its ranks on SIGTERM
                job.terminate()
                job.wait(30)
    assert job.returncode == 0, err[-3000:]
    assert out.strip().splitlines()[-1] == f"step 5 checksum {total:.6e}"
