"""The worker's side of `to_mesh`: pieces read by the ranks of another mesh, one-sided.

Eagerly, a source rank registers its piece (`export`, unregistered when the store frees it) and each
destination rank reads the byte spans it needs (`pull`). A compiled step keeps one registered `Stage` per
source rank and crossing instead: every call the source copies its piece in and raises the stage's sequence
number (`stage_out`), once each reader has acknowledged the previous call; each reader waits for that number,
reads its spans and writes its acknowledgement into the stage (`stage_in`). The two meshes' programs run at
once, each waiting only where the data must arrive. Pieces on a GPU travel through host memory (registered
memory is host memory here): a source copies its piece to the host, a destination what it read to its GPU.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from math import prod

import torch

from monarch import config
from monarch.errors import TransportError
from monarch.runtime.engine.transport import onesided
from monarch.runtime.engine.transport.handle import Handle

HEADER = 64  # a stage's sequence number, then one acknowledgement per reader (8 bytes each), then the data
Read = tuple[Handle, int, int, tuple[int, ...], tuple[tuple[int, int], ...], tuple[int, ...]]


class Export:
    """A piece registered for other meshes' ranks to read; it answers the controller with its handle."""

    def __init__(self, x: torch.Tensor) -> None:
        self.piece = x.contiguous() if x.device.type == "cpu" else x.to("cpu")
        self.handle = onesided.register(_bytes(self.piece), "to_mesh")

    def __reduce__(self) -> tuple:
        return self.handle.__reduce__()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # the process may be shutting down
            onesided.drop(self.handle, config.rdma_timeout())


def export(x: torch.Tensor) -> tuple[Export]:
    return (Export(x),)


def pull(shape: tuple[int, ...], dtype: torch.dtype, reads: tuple[Read, ...], device: str = "cpu") -> torch.Tensor:
    """This rank's piece of a tensor from another mesh, on `device`."""
    out = torch.empty(shape, dtype=dtype)
    fill(out, reads, 0)
    return out.to(device)


def fill(out: torch.Tensor, reads: tuple[Read, ...], base: int) -> None:
    """Each read (handle, lo, hi, source piece shape, box in it, where the box lands in `out`) copies bytes
    [base + lo, base + hi) of the source one-sided, straight into `out` when both sides are contiguous runs,
    else through a buffer of the span."""
    size, timeout = out.dtype.itemsize, config.rdma_timeout()
    for handle, lo, hi, piece, box, at in reads:
        dst = out[tuple(slice(a, a + n) for a, (_, n) in zip(at, box, strict=True))]
        if hi - lo == dst.numel() * size and dst.is_contiguous():
            onesided.read(handle, base + lo, dst.data_ptr(), hi - lo, timeout)
            continue
        span = torch.empty(hi - lo, dtype=torch.uint8)
        onesided.read(handle, base + lo, span.data_ptr(), hi - lo, timeout)
        strides = [prod(piece[d + 1:]) for d in range(len(piece))]
        first = sum(s * st for (s, _), st in zip(box, strides, strict=True)) - lo // size
        dst.copy_(span.view(out.dtype).as_strided(tuple(n for _, n in box), strides, first))


class Stage:
    """A source rank's registered buffer for one crossing of a compiled step: header, then the piece."""

    def __init__(self, nbytes: int, readers: int) -> None:
        self.memory = torch.zeros(_header(readers) + nbytes, dtype=torch.uint8)
        self.readers, self.seq = readers, 0
        self.handle = onesided.register(self.memory, "a compiled step's to_mesh")

    def put(self, x: torch.Tensor) -> None:
        """This call's piece, once every reader has taken the previous one."""
        words = self.memory[:_header(self.readers)].view(torch.int64)
        acks = words[1:1 + self.readers]
        _until(lambda: all(int(a) >= self.seq for a in acks),
               f"the readers of {self.handle.owner}'s piece (call {self.seq}) to acknowledge it")
        data = self.memory[_header(self.readers):]
        if x.numel():
            data.copy_(_bytes(x.contiguous()))
        self.seq += 1
        words[0] = self.seq  # last: a reader that sees it finds the data in place


STAGES: dict[int, Stage] = {}  # by crossing site
_SEEN: dict[tuple[int, int], int] = {}  # (crossing site, source): the sequence number this rank read last


def stage_create(site: int, nbytes: int, readers: int) -> tuple[Handle]:
    """Register this rank's stage of crossing `site` (a compiled step's setup); its handle."""
    stage = STAGES[site] = Stage(nbytes, readers)
    return (stage.handle,)


def stage_drop(site: int) -> tuple[bool]:
    """Unregister the stage of crossing `site` (its compiled step will not run again); whether there was one."""
    stage = STAGES.pop(site, None)
    if stage is not None:
        onesided.drop(stage.handle, config.rdma_timeout())
    return (stage is not None,)


def stage_out(site: int, x: torch.Tensor) -> tuple[()]:
    STAGES[site].put(x)
    return ()


def stage_in(shape: tuple[int, ...], dtype: torch.dtype, site: int,
             sources: tuple[tuple[Handle, int, int, tuple[Read, ...]], ...], device: str = "cpu") -> torch.Tensor:
    """This rank's piece of crossing `site`: from each source stage (handle, its readers, this rank's
    acknowledgement slot, the reads), once it holds data newer than what this rank read last; then the
    acknowledgement. (A source whose program failed before its stage fails this call after the wait, and the
    next call finds the two in step again.)"""
    out = torch.empty(shape, dtype=dtype)
    word = torch.zeros(1, dtype=torch.int64)
    timeout = config.rdma_timeout()
    for i, (handle, readers, slot, reads) in enumerate(sources):
        last = _SEEN.get((site, i), 0)
        _until(lambda h=handle: _word(h, 0, word, timeout) > last, f"call {last + 1}'s piece from {handle.owner}")
        fill(out, reads, _header(readers))
        _SEEN[(site, i)] = int(word[0])
        onesided.write(handle, 8 * (1 + slot), word.data_ptr(), 8, timeout)
    return out.to(device)


def _word(handle: Handle, offset: int, into: torch.Tensor, timeout: float) -> int:
    onesided.read(handle, offset, into.data_ptr(), 8, timeout)
    return int(into[0])


def _until(ready: Callable[[], bool], what: str) -> None:
    """Poll `ready()` (spinning briefly, then sleeping up to 1 ms) until it holds or MONARCH_RDMA_TIMEOUT passes."""
    deadline = time.monotonic() + config.rdma_timeout()
    pause = 0.0
    while not ready():
        if time.monotonic() > deadline:
            raise TransportError(f"to_mesh in a compiled step waited {config.rdma_timeout():g} s for {what}; the "
                                 "other mesh's program did not get there (it failed, or it runs a different step)")
        time.sleep(pause)
        pause = min(0.001, pause + 0.00002)


def _header(readers: int) -> int:
    return HEADER if readers < HEADER // 8 else 8 * (1 + readers)


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, as a flat uint8 tensor (a zero byte for an empty one)."""
    return x.view(-1).view(torch.uint8) if x.numel() else torch.zeros(1, dtype=torch.uint8)
