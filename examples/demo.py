"""monarch demo: one controller drives a 4-process mesh (dp=2 x tp=2) of actors.

Run with `make demo`. Shows spawning, the call adverbs, slicing, an actor calling another mesh,
remote errors with tracebacks, and clean shutdown.
"""
from __future__ import annotations

import asyncio
import time

from monarch.actor import Actor, ActorError, ActorMesh, current_rank, endpoint, this_host


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
    print("stopped cleanly")


if __name__ == "__main__":
    main()
