"""`RDMABuffer` and `RDMAAction`, Monarch's one-sided transfer API, over the engine's one-sided backends
(runtime/engine/transport/onesided.py: ibverbs, cross-memory attach on one host, TCP fallback).

An RDMABuffer registers a contiguous tensor or memoryview where it is made, without copying; the object
is a small handle that pickles, so an endpoint can return it and any actor of any mesh of the same
controller (or the controller) can read from it or write into it while the owner's code runs on. Each
transfer returns a Future and runs when that Future is waited for (Monarch's order: awaiting a write before
a read issued earlier runs the write first); a failed transfer's Future raises TransportError. Sizes that do
not fit raise ValueError at once.
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

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
        memoryview of at least that many bytes; a GPU tensor through pinned host memory)."""
        if _on_gpu(dst, "RDMABuffer.read_into"):
            assert isinstance(dst, torch.Tensor)
            n = max(self.size() - offset, 0)
            host = torch.empty(max(dst.nbytes, n), dtype=torch.uint8, pin_memory=True)
            inner = self.read_into(host, offset=offset, timeout=timeout)

            def staged() -> None:
                inner.get()
                _flat(dst)[:n].copy_(host[:n])
            return _run("read_into", staged, dst)
        addr, room = region(dst, "RDMABuffer.read_into")
        n = self.size() - offset
        if room < n or offset < 0:
            raise ValueError(f"RDMABuffer.read_into: the destination holds {room} bytes, but the buffer has "
                             f"{max(n, 0)} from offset {offset} (of {self.size()}); pass a larger destination, or "
                             "read the rest with a larger offset")
        return _run("read_into", lambda: onesided.read(self._handle, offset, addr, n, timeout), dst)

    def write_from(self, src: LocalMemory, *, offset: int = 0, timeout: float = 3) -> Future[None]:
        """Copy all of `src` into the buffer from `offset` (a GPU tensor through host memory, copied when the
        transfer runs)."""
        if _on_gpu(src, "RDMABuffer.write_from"):
            assert isinstance(src, torch.Tensor)
            if offset < 0 or offset + src.nbytes > self.size():
                raise ValueError(f"RDMABuffer.write_from: {src.nbytes} bytes at offset {offset} do not fit the "
                                 f"buffer's {self.size()} bytes")
            return _run("write_from", lambda: self.write_from(src.cpu(), offset=offset, timeout=timeout).get(), src)
        addr, n = region(src, "RDMABuffer.write_from")
        if offset < 0 or offset + n > self.size():
            raise ValueError(f"RDMABuffer.write_from: {n} bytes at offset {offset} do not fit the buffer's "
                             f"{self.size()} bytes")
        return _run("write_from", lambda: onesided.write(self._handle, offset, addr, n, timeout), src)

    def drop(self) -> Future[None]:
        """Unregister the memory (after the transfers under way); later transfers raise TransportError."""
        return _run("drop", lambda: onesided.drop(self._handle, 3.0))

    def __repr__(self) -> str:
        return f"<RDMABuffer {self.size()} bytes of {self.owner}>"


class RDMAAction:
    """Several transfers submitted at once: those to one owner run in order, owners in parallel. Transfers of
    one action may share local bytes only as Monarch allows: two `write_remote`s (both read them), or two
    `read_into`s (its earlier API, which merged such reads); any other overlap is a race and raises."""

    def __init__(self) -> None:
        self._ops: list[tuple[bool, RDMABuffer, LocalMemory]] = []  # (a read into local memory?, buffer, local)
        self._claims: list[tuple[int, int, str]] = []  # local [start, end), by what

    def read_remote(self, dst: LocalMemory, src: RDMABuffer) -> RDMAAction:
        """Add a read of all of buffer `src` into local `dst`."""
        return self._add(True, src, dst, "read_remote")

    def write_remote(self, dst: RDMABuffer, src: LocalMemory) -> RDMAAction:
        """Add a write of all of local `src` into buffer `dst`."""
        return self._add(False, dst, src, "write_remote")

    def read_into(self, src: RDMABuffer, dst: LocalMemory) -> RDMAAction:
        """Add a read of all of buffer `src` into local `dst` (the earlier spelling of read_remote)."""
        return self._add(True, src, dst, "read_into")

    def write_from(self, src: RDMABuffer, dst: LocalMemory) -> RDMAAction:
        """Add a write of all of local `dst` into buffer `src` (the earlier spelling of write_remote)."""
        return self._add(False, src, dst, "write_from")

    def _add(self, reading: bool, buf: RDMABuffer, local: LocalMemory, what: str) -> RDMAAction:
        addr, n = region(local, f"RDMAAction.{what}")
        if reading and n < buf.size():
            raise ValueError(f"RDMAAction.{what}: local memory holds {n} bytes, the buffer has {buf.size()}")
        if not reading and n > buf.size():
            raise ValueError(f"RDMAAction.{what}: local memory holds {n} bytes, the buffer only {buf.size()}")
        for start, end, other in self._claims:
            if addr < end and start < addr + n and not (what == other and what in _SHARING):
                raise ValueError(f"RDMAAction.{what}: local bytes [{addr:#x}, {addr + n:#x}) overlap those of an "
                                 f"earlier {other} in this action, and one of them writes there (a race)")
        self._claims.append((addr, addr + n, what))
        self._ops.append((reading, buf, local))
        return self

    def submit(self, timeout: float = 3) -> Future[None]:
        """Every transfer (again, when submitted again), run when the Future is waited for."""
        by_owner: dict[str, list[tuple[bool, RDMABuffer, LocalMemory]]] = defaultdict(list)
        for op in self._ops:
            by_owner[op[1].owner].append(op)
        errors: list[BaseException] = []

        def run(ops: list[tuple[bool, RDMABuffer, LocalMemory]]) -> None:
            try:
                for reading, buf, mem in ops:
                    (buf.read_into if reading else buf.write_from)(mem, timeout=timeout).get()
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
        return _run("submit", all_of)


def _on_gpu(data: LocalMemory, what: str) -> bool:
    """Whether `data` is a CUDA tensor, which a transfer stages through host memory (it must be contiguous)."""
    if not (isinstance(data, torch.Tensor) and data.is_cuda):
        return False
    if not data.is_contiguous():
        raise ValueError(f"{what}: the tensor is not contiguous (shape {tuple(data.shape)}, stride {data.stride()}); "
                         "pass t.contiguous() or a contiguous view")
    return True


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(torch.uint8)


_SHARING = ("write_remote", "read_into")  # transfers that may share local bytes with one of their kind


class _Deferred:
    """The waiter of a transfer's Future: the transfer runs, in the waiting thread, when the Future is first
    waited for (get() or await), as Monarch's transfers do; it keeps the local memory alive until then, so a
    temporary source is never read after it was freed."""
    threaded = False

    def __init__(self, transfer: Callable[[], None], keep: object) -> None:
        self._transfer: Callable[[], None] | None = transfer
        self._keep: object = keep
        self._lock = threading.Lock()

    def wait(self, state: CallState, deadline: float | None, arrived: int) -> None:
        with self._lock:
            transfer, keep, self._transfer, self._keep = self._transfer, self._keep, None, None
        if transfer is None:  # another thread runs it
            state.wait(arrived, None if deadline is None else deadline - time.monotonic())
            return
        try:
            transfer()
        except Exception as e:  # noqa: BLE001 - raised by the Future's get()
            state.deliver(0, False, e)
        else:
            state.deliver(0, True, None)
        del keep  # the local memory may go once the bytes moved


def _run(what: str, transfer: Callable[[], None], keep: object = None) -> Future[None]:
    """A Future of `transfer`, which runs when it is waited for; `keep` (its local memory) lives until then."""
    return Future(CallState(_ONE, f"RDMABuffer.{what}"), _Deferred(transfer, keep), one_result)
