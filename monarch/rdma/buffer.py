"""`RDMABuffer` and `RDMAAction`, Monarch's one-sided transfer API, over the engine's one-sided backends
(runtime/engine/transport/onesided.py: ibverbs, cross-memory attach on one host, TCP fallback).

An RDMABuffer registers a contiguous tensor or memoryview where it is made, without copying; the object
is a small handle that pickles, so an endpoint can return it and any actor of any mesh of the same
controller (or the controller) can read from it or write into it while the owner's code runs on. Each
transfer returns a Future; a failed transfer's Future raises TransportError (or ValueError for sizes).
"""
from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from monarch.runtime.control.client import client
from monarch.runtime.control.futures import CallState, Future, one_result
from monarch.runtime.engine.transport import onesided
from monarch.runtime.engine.transport.handle import Handle, region
from monarch.shape import Shape

LocalMemory = torch.Tensor | memoryview
_ONE = Shape.row_major((), ())


class RDMABuffer:
    """A registered region of the process that made it; `read_into`/`write_from` move bytes from anywhere."""

    def __init__(self, data: LocalMemory) -> None:
        self._handle = onesided.register(data)

    @classmethod
    def _of(cls, handle: Handle) -> RDMABuffer:
        if not isinstance(handle, Handle):
            raise TypeError(f"an RDMABuffer is rebuilt from a Handle, not {type(handle).__name__}")
        buf = cls.__new__(cls)
        buf._handle = handle
        return buf

    def __reduce__(self) -> tuple[Any, ...]:
        return (RDMABuffer._of, (self._handle,))

    def size(self) -> int:
        """The buffer's size in bytes."""
        return self._handle.size

    @property
    def owner(self) -> str:
        """The process holding the memory."""
        return str(self._handle.owner)

    @property
    def backend(self) -> str:
        """How a transfer from this process reaches the owner: local, ibverbs, shm or tcp."""
        return onesided.backend_for(self._handle)

    def read_into(self, dst: LocalMemory, *, offset: int = 0, timeout: float = 3) -> Future[None]:
        """Copy the buffer's bytes from `offset` to its end into the start of `dst` (a contiguous tensor or
        memoryview of at least that many bytes)."""
        addr, room = region(dst, "RDMABuffer.read_into")
        n = self.size() - offset
        if room < n or offset < 0:
            raise ValueError(f"RDMABuffer.read_into: the destination holds {room} bytes, but the buffer has "
                             f"{max(n, 0)} from offset {offset} (of {self.size()}); pass a larger destination, or "
                             "read the rest with a larger offset")
        return _run("read_into", lambda: onesided.read(self._handle, offset, addr, n, timeout), dst)

    def write_from(self, src: LocalMemory, *, offset: int = 0, timeout: float = 3) -> Future[None]:
        """Copy all of `src` into the buffer from `offset`."""
        addr, n = region(src, "RDMABuffer.write_from")
        if offset < 0 or offset + n > self.size():
            raise ValueError(f"RDMABuffer.write_from: {n} bytes at offset {offset} do not fit the buffer's "
                             f"{self.size()} bytes")
        return _run("write_from", lambda: onesided.write(self._handle, offset, addr, n, timeout), src)

    def drop(self) -> Future[None]:
        """Unregister the memory (after the transfers under way); later transfers raise TransportError."""
        return _run("drop", lambda: onesided.drop(self._handle, 3.0), None)

    def __repr__(self) -> str:
        return f"<RDMABuffer {self.size()} bytes of {self.owner}>"


class RDMAAction:
    """Several transfers submitted at once: those to one owner run in order, owners in parallel."""

    def __init__(self) -> None:
        self._ops: list[tuple[str, RDMABuffer, LocalMemory]] = []
        self._ranges: dict[tuple[int, int], str] = {}

    def read_into(self, src: RDMABuffer, dst: LocalMemory) -> RDMAAction:
        """Add a read of all of `src` into `dst`."""
        addr, n = region(dst, "RDMAAction.read_into")
        if n < src.size():
            raise ValueError(f"RDMAAction.read_into: dst holds {n} bytes, src has {src.size()}")
        self._claim(addr, n, "read_into")
        self._ops.append(("read_into", src, dst))
        return self

    def write_from(self, src: RDMABuffer, dst: LocalMemory) -> RDMAAction:
        """Add a write of all of local `dst` into the buffer `src` (Monarch's argument names)."""
        addr, n = region(dst, "RDMAAction.write_from")
        if n > src.size():
            raise ValueError(f"RDMAAction.write_from: local memory holds {n} bytes, the buffer only {src.size()}")
        self._claim(addr, n, "write_from")
        self._ops.append(("write_from", src, dst))
        return self

    def _claim(self, addr: int, n: int, op: str) -> None:
        """Local memory of one action may be shared by reads, never by a write and another transfer."""
        for (start, end), other in self._ranges.items():
            if addr < end and start < addr + n and "write_from" in (op, other):
                raise ValueError(f"RDMAAction.{op}: local bytes [{addr:#x}, {addr + n:#x}) overlap those of an "
                                 f"earlier {other} in this action; a write must not share local memory")
        self._ranges[(addr, addr + n)] = op

    def submit(self) -> Future[None]:
        """Run every transfer (again, when called again); the Future is done when all are."""
        by_owner: dict[str, list[tuple[str, RDMABuffer, LocalMemory]]] = defaultdict(list)
        for op in self._ops:
            by_owner[op[1].owner].append(op)
        errors: list[BaseException] = []

        def run(ops: list[tuple[str, RDMABuffer, LocalMemory]]) -> None:
            try:
                for name, buf, mem in ops:
                    (buf.read_into if name == "read_into" else buf.write_from)(mem).get()
            except BaseException as e:  # noqa: BLE001 - reported through the submit's Future
                errors.append(e)

        def all_of() -> None:
            groups = list(by_owner.values())
            threads = [threading.Thread(target=run, args=(ops,), daemon=True) for ops in groups[1:]]
            for t in threads:
                t.start()
            if groups:
                run(groups[0])
            for t in threads:
                t.join()
            if errors:
                raise errors[0]
        return _run("submit", all_of, self._ops)


def _run(what: str, transfer: Callable[[], None], keep: object) -> Future[None]:
    """Run `transfer` now, in this thread (`keep`, the local memory, stays referenced meanwhile); a Future
    holding its outcome."""
    state = CallState(_ONE, f"RDMABuffer.{what}")
    try:
        transfer()
    except Exception as e:  # noqa: BLE001 - raised by the Future's get()
        state.deliver(0, False, e)
    else:
        state.deliver(0, True, None)
    del keep
    return Future(state, client(), one_result)
