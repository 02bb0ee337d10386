"""monarch demo: one controller drives a 4-process mesh (dp=2 x tp=2) of actors and sharded tensors.

Run with `make demo`. Shows spawning, the call adverbs, slicing, an actor calling another mesh,
remote errors with tracebacks, a tensor-parallel MLP on MeshTensors, and clean shutdown.
"""
from __future__ import annotations

import asyncio
import time

import torch

import monarch
from monarch import Shard
from monarch.actor import Actor, ActorError, ActorMesh, ProcMesh, current_rank, endpoint, this_host
from monarch.runtime.session import session_of


class Counter(Actor):
    def __init__(self, start: int) -> None:
        self.n = start

    @endpoint
    def incr(self, by: int = 1) -> int:
        self.n += by
        return self.n

    @endpoint
    def value(self) -> int:
        return self.n

    @endpoint
    async def slow_double(self) -> int:
        await asyncio.sleep(0.01)
        return 2 * self.n

    @endpoint
    def fail(self) -> None:
        raise ValueError(f"counter at {dict(current_rank())} refuses")


class Reader(Actor):
    """Reads another actor mesh: actor meshes are values that can be passed around."""

    @endpoint
    def total(self, counters: ActorMesh) -> int:
        print(f"reader at {dict(current_rank())} sums the counters")
        return sum(counters.value.call().get(timeout=10).values())


def main() -> None:
    t0 = time.perf_counter()
    with this_host().spawn_procs(per_host={"dp": 2, "tp": 2}) as procs:
        counters = procs.spawn("counters", Counter, 0)
        print("spawn_procs + first answer:", counters.incr.call(2).get(timeout=30), f"{time.perf_counter() - t0:.2f} s")
        print("call_one on dp=0,tp=1 ->", counters.slice(dp=0, tp=1).incr.call_one().get(timeout=10))
        counters.slice(dp=1).incr.broadcast(5)
        for point, v in counters.value.call().get(timeout=10).items():
            print(f"  counter {dict(point)} = {v}")
        print("async endpoint, streamed:", sorted(f.get() for f in counters.slow_double.stream()))
        readers = procs.slice(dp=0, tp=0).spawn("readers", Reader)
        print("an actor calling the whole mesh ->", readers.total.call_one(counters).get(timeout=10))
        try:
            counters.slice(dp=1, tp=1).fail.call_one().get(timeout=10)
        except ActorError as e:
            print(f"remote error from rank {e.rank} ({e.coords}): {str(e).splitlines()[0]}")
        n = 2000
        one = counters.slice(dp=0, tp=0)
        t = time.perf_counter()
        for _ in range(n):
            one.value.call_one().get(timeout=10)
        print(f"call_one round trip: {(time.perf_counter() - t) / n * 1e6:.0f} us")
        sharded_mlp(procs)
    print("stopped cleanly")


def sharded_mlp(procs: ProcMesh) -> None:
    """A two-layer MLP, column- then row-parallel over tp and data-parallel over dp, against plain torch."""
    torch.manual_seed(0)
    x, w1, w2 = torch.randn(8, 16), torch.randn(16, 32), torch.randn(32, 4)
    t = time.perf_counter()
    xs = monarch.distribute_tensor(x, procs, {"dp": Shard(0)})
    w1s = monarch.distribute_tensor(w1, procs, {"tp": Shard(1)})   # column parallel
    w2s = monarch.distribute_tensor(w2, procs, {"tp": Shard(0)})   # row parallel
    h = torch.relu(xs @ w1s)
    y = h @ w2s
    print(f"MLP output placements {y.placements}: the tp reduction is deferred as Partial")
    got = y.full_tensor(timeout=60)
    print(f"sharded MLP equals plain torch: {torch.allclose(got, torch.relu(x @ w1) @ w2, atol=1e-5)}, "
          f"collectives {session_of(procs).collectives}, {time.perf_counter() - t:.2f} s (first use loads torch)")


if __name__ == "__main__":
    main()
