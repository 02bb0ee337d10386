"""The shared-memory transport equals the MPI one: random collectives on bare ranks (transport_check.py under
mpiexec, 2-4 ranks, every kind, dtype and op, uneven, strided and multi-megabyte pieces) by cross-memory attach,
and through the shared windows where a seccomp filter makes the kernel refuse process_vm_readv (said once on
stderr); random programs and redistributions on meshes run with MONARCH_TRANSPORT=auto (shm on this host) and
=mpi, a compiled step's bucketed all_reduce; the collectives table names the transport that ran. A rank killed
while its peer waits in a collective fails the mesh without a hang.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import Program, placement_tuples, programs, run_program, tensor_shapes

import monarch
from monarch import config
from monarch import Replicate, Shard
from monarch.actor import Actor, ProcMesh, endpoint, this_host
from monarch.errors import SupervisionError

T = 60.0
CHECK = Path(__file__).with_name("transport_check.py")
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.complex64]
pytestmark = pytest.mark.filterwarnings("ignore:monarch. .* has no sharding rule")


def check(ranks: int, *args: str, env: dict[str, str] | None = None, script: Path = CHECK) -> tuple[str, str]:
    """transport_check.py (or `script`) under mpiexec: its stdout and stderr, after asserting every rank printed
    "ok"."""
    mpiexec = Path(sys.executable).with_name("mpiexec")
    proc = subprocess.Popen([str(mpiexec), "-n", str(ranks), sys.executable, str(script), str(ranks), "150", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, **(env or {})})
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0 and out.count("ok 150") == ranks, out[-3000:] + err[-3000:]
    return out, err


REFUSED = "may not read each other's memory"


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_transports_agree_on_random_collectives(ranks: int) -> None:
    assert REFUSED not in check(ranks)[1]


def test_refused_cross_memory_reads_fall_back_to_shared_windows() -> None:
    """process_vm_readv fails with EPERM in every rank (MPICH's own cross-memory copies are turned off)."""
    _, err = check(2, "refused", env={"MPIR_CVAR_CH4_CMA_ENABLE": "0"})
    assert err.count(REFUSED) == 2, err[-3000:]


@pytest.fixture(scope="module", params=[{"dp": 2, "tp": 2}, {"x": 4}], ids=["dp2xtp2", "x4"])
def meshes(request: pytest.FixtureRequest) -> Iterator[tuple[ProcMesh, ProcMesh]]:
    """The same mesh twice: MONARCH_TRANSPORT unset (auto: shared memory on this host) and =mpi."""
    with this_host().spawn_procs(per_host=request.param) as auto:
        with this_host().spawn_procs(per_host=request.param, env={"MONARCH_TRANSPORT": "mpi"}) as mpi:
            yield auto, mpi


def transports(mesh: ProcMesh, since: int) -> set[str]:
    rows = mesh.sql(f"SELECT DISTINCT transport FROM collectives WHERE mesh = '{mesh.name}' AND start_us >= {since}")
    return {r[0] for r in rows}


def now_us() -> int:
    return time.time_ns() // 1000


def run(program: Program, mesh: ProcMesh) -> list[torch.Tensor]:
    values = run_program(program, lambda data, placements: monarch.distribute_tensor(data, mesh, placements),
                         lambda x, placements: x.redistribute(placements))
    return [values[i].full_tensor(timeout=T) for i in program.outputs()]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_programs_equal_on_both_transports(meshes: tuple[ProcMesh, ProcMesh], data: st.DataObject) -> None:
    auto, mpi = meshes
    program = data.draw(programs(len(auto.extent), max_ops=5), label="program")
    want = [v for i, v in enumerate(run_program(program, lambda d, p: d, lambda x, p: x)) if i in program.outputs()]
    got_shm, got_mpi = run(program, auto), run(program, mpi)
    for s, m, w in zip(got_shm, got_mpi, want, strict=True):
        torch.testing.assert_close(s, w, rtol=1e-4, atol=1e-4, equal_nan=True, msg=lambda e: f"{program}\n{e}")
        torch.testing.assert_close(s, m, rtol=1e-5, atol=1e-5, equal_nan=True, msg=lambda e: f"{program}\n{e}")


def integral(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Small integers (exact in every dtype, whatever order sums run in)."""
    x = torch.randint(-4, 5, shape, generator=torch.Generator().manual_seed(seed))
    return x.bool() if dtype == torch.bool else x.to(dtype)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_redistributions_of_every_dtype_are_exact(meshes: tuple[ProcMesh, ProcMesh], data: st.DataObject) -> None:
    """Shard/Replicate to Shard/Replicate (all_gather, all_to_all, local slices) and a sum over a sharded
    dim (a Partial) to Replicate or Shard (all_reduce, reduce_scatter), uneven pieces included."""
    auto, mpi = meshes
    shape = data.draw(tensor_shapes(min_dims=2, max_dims=3), label="shape")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    src = data.draw(placement_tuples(len(shape), len(auto.extent), partial=False), label="src")
    dst = data.draw(placement_tuples(len(shape) - 1, len(auto.extent), partial=False), label="dst")
    x = integral(shape, dtype, data.draw(st.integers(0, 2**16)))
    since = now_us()
    for mesh in (auto, mpi):
        t = monarch.distribute_tensor(x, mesh, src)
        assert torch.equal(t.redistribute(dst).full_tensor(timeout=T), x)
        if dtype != torch.bool:
            s = t.sum(0)
            assert torch.equal(s.redistribute(dst).full_tensor(timeout=T), x.sum(0))
    assert transports(auto, since) <= {"shm"} and transports(mpi, since) <= {"mpi"}


def test_a_first_collective_of_empty_pieces() -> None:
    """A group's first collective may move nothing (an empty tensor): its segment is still made, and every
    kind of redistribution of empty tensors keeps the (empty) value."""
    with this_host().spawn_procs(per_host={"dp": 2, "tp": 2}) as procs:
        for shape, placements in [((0, 3), {"tp": Shard(0)}), ((0, 3), {"dp": Shard(0), "tp": Shard(0)}),
                                  ((2, 0), {"tp": Shard(1)})]:
            x = torch.randn(shape)
            t = monarch.distribute_tensor(x, procs, placements)
            assert t.redistribute({}).full_tensor(timeout=T).shape == shape
            assert t.redistribute({"dp": Shard(1)}).full_tensor(timeout=T).shape == shape


def test_large_collectives_go_by_cross_memory_attach(meshes: tuple[ProcMesh, ProcMesh]) -> None:
    """Collectives of MONARCH_ATTACH_BYTES and more, uneven pieces: all_reduce, all_gather, reduce_scatter on the
    auto mesh."""
    auto = meshes[0]
    dim, k = next(iter(auto.extent.items()))
    n = config.attach_bytes() // 4 + 3
    x = integral((k, n), torch.float32, 0)
    since = now_us()
    part = monarch.distribute_tensor(x, auto, {dim: Shard(0)}).sum(0)  # Partial over `dim`
    assert torch.equal(part.redistribute({dim: Replicate()}).full_tensor(timeout=T), x.sum(0))
    sharded = part.redistribute({dim: Shard(0)})
    assert torch.equal(sharded.full_tensor(timeout=T), x.sum(0))
    assert torch.equal(sharded.redistribute({dim: Replicate()}).full_tensor(timeout=T), x.sum(0))
    rows = auto.sql(f"SELECT kind, transport, max(bytes) FROM collectives WHERE mesh = '{auto.name}' AND start_us >= "
                    f"{since} GROUP BY kind, transport ORDER BY kind")
    assert [r[:2] for r in rows] == [("all_gather", "shm"), ("all_reduce", "shm"), ("reduce_scatter", "shm")], rows


def test_compiled_step_buckets_on_shared_memory(meshes: tuple[ProcMesh, ProcMesh]) -> None:
    """Data parallel over the mesh's first dim: the gradients' all_reduces start in buckets."""
    auto, mpi = meshes
    dim = next(iter(auto.extent))
    g = torch.Generator().manual_seed(0)
    w0, x, y = torch.randn(16, 4, generator=g), torch.randn(12, 16, generator=g), torch.randn(12, 4, generator=g)

    def losses(mesh: ProcMesh | None) -> tuple[list[float], torch.Tensor]:
        w = torch.nn.Parameter(w0.clone() if mesh is None else monarch.distribute_tensor(w0, mesh))
        xs, ys = (x, y) if mesh is None else (monarch.distribute_tensor(v, mesh, {dim: Shard(0)}) for v in (x, y))
        opt = torch.optim.SGD([w], lr=0.1)

        def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            loss = ((a @ w - b) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        run_step = step if mesh is None else monarch.compile(step)
        out = [float(run_step(xs, ys).item()) for _ in range(3)]
        return out, (w.detach() if mesh is None else w.full_tensor(timeout=T))

    since = now_us()
    want, want_w = losses(None)
    for mesh, name in ((auto, "shm"), (mpi, "mpi")):
        got, got_w = losses(mesh)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)
        rows = mesh.sql(f"SELECT transport, count(*) FROM collectives WHERE mesh = '{mesh.name}' AND start_us >= "
                        f"{since} AND kind = 'all_reduce (bucket)' GROUP BY transport")
        assert [r[0] for r in rows] == [name] and rows[0][1] > 0, rows


class Sleeper(Actor):
    @endpoint
    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


@pytest.mark.parametrize("n", [1 << 16, config.attach_bytes() // 4], ids=["segment", "attach"])
def test_rank_killed_mid_collective_fails_the_mesh(n: int) -> None:
    """Rank 1 is held in an actor call while rank 0 enters an all_reduce of n floats and waits for it; rank 1
    is killed."""
    procs = this_host().spawn_procs(per_host={"x": 2}, name="shm_victim")
    try:
        sleepers = procs.spawn("sleepers", Sleeper)
        part = monarch.distribute_tensor(torch.ones(1 << 16), procs, {"x": Shard(0)}).sum()
        part.full_tensor(timeout=T)  # the group's transport is set up: the next collective runs on it
        busy = sleepers.slice(x=1).sleep.call(600)
        pending = monarch.distribute_tensor(torch.ones(2, n), procs, {"x": Shard(0)}).sum(0)
        time.sleep(0.5 + n / 2**23)  # rank 0 has its piece and waits in the all_reduce
        os.kill(procs.pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(SupervisionError):
            pending.full_tensor(timeout=T)
        assert time.monotonic() - t0 < 10
        with pytest.raises(SupervisionError):
            busy.get(timeout=T)
    finally:
        procs.stop().get(timeout=T)
