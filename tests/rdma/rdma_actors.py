"""The actors of the monarch.rdma tests: an `Owner` that registers memory and shows what it holds, and a
`Reader` that transfers with a backend it is told (MONARCH_RDMA_BACKEND is read per transfer in the process
that transfers), and backend switching on the controller side.
"""
from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import torch

from monarch.actor import Actor, endpoint
from monarch.errors import TransportError
from monarch.rdma import RDMAAction, RDMABuffer

T = 30.0  # seconds: generous bound for every wait


@contextmanager
def backend(name: str | None, allow_tcp: str | None = None) -> Iterator[None]:
    """MONARCH_RDMA_BACKEND (and MONARCH_RDMA_ALLOW_TCP_FALLBACK) in this process for the block (None: unset)."""
    with mock.patch.dict(os.environ):
        for k, v in (("MONARCH_RDMA_BACKEND", name), ("MONARCH_RDMA_ALLOW_TCP_FALLBACK", allow_tcp)):
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield


class Owner(Actor):
    """Holds tensors and bytearrays under names and registers them."""

    def __init__(self) -> None:
        self.kept: dict[str, torch.Tensor | bytearray] = {}

    @endpoint
    def share(self, name: str, data: torch.Tensor) -> RDMABuffer:
        self.kept[name] = data
        return RDMABuffer(data)

    @endpoint
    def share_bytes(self, name: str, raw: bytes) -> RDMABuffer:
        self.kept[name] = bytearray(raw)
        return RDMABuffer(memoryview(self.kept[name]))

    @endpoint
    def value(self, name: str) -> torch.Tensor | bytes:
        data = self.kept[name]
        return data.clone() if isinstance(data, torch.Tensor) else bytes(data)

    @endpoint
    def read_own(self, buf: RDMABuffer) -> tuple[torch.Tensor, str]:
        dst = torch.empty(buf.size(), dtype=torch.uint8)
        buf.read_into(dst).get(timeout=T)
        return dst, buf.backend

    @endpoint
    def drop(self, buf: RDMABuffer) -> None:
        buf.drop().get(timeout=T)

    @endpoint
    def pid(self) -> int:
        return os.getpid()


class Reader(Actor):
    """Transfers with the buffers it is given, through the backend each call names."""

    @endpoint
    def read(self, buf: RDMABuffer, via: str, offset: int = 0,
             like: torch.Tensor | None = None) -> tuple[torch.Tensor, str]:
        with backend(via):
            dst = torch.empty_like(like) if like is not None else torch.empty(buf.size() - offset, dtype=torch.uint8)
            buf.read_into(dst, offset=offset).get(timeout=T)
            return dst, buf.backend

    @endpoint
    def echo(self, buf: RDMABuffer) -> RDMABuffer:
        return buf

    @endpoint
    def read_view(self, buf: RDMABuffer, via: str) -> bytes:
        with backend(via):
            dst = bytearray(buf.size())
            buf.read_into(memoryview(dst)).get(timeout=T)
            return bytes(dst)

    @endpoint
    def write(self, buf: RDMABuffer, via: str, src: torch.Tensor, offset: int = 0) -> str:
        with backend(via):
            buf.write_from(src, offset=offset).get(timeout=T)
            return buf.backend

    @endpoint
    def write_view(self, buf: RDMABuffer, via: str, raw: bytes) -> None:
        with backend(via):
            buf.write_from(memoryview(raw)).get(timeout=T)

    @endpoint
    def read_repeatedly(self, buf: RDMABuffer, via: str, threads: int, times: int) -> list[int]:
        """`threads` threads each read the buffer `times` times; the checksum of every read."""
        sums: list[int] = []
        errors: list[BaseException] = []

        def run() -> None:
            try:
                for _ in range(times):
                    dst = torch.empty(buf.size(), dtype=torch.uint8)
                    buf.read_into(dst).get(timeout=T)
                    sums.append(int(dst.to(torch.int64).sum()))
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)
        with backend(via):
            workers = [threading.Thread(target=run) for _ in range(threads)]
            for w in workers:
                w.start()
            for w in workers:
                w.join(T)
        if errors:
            raise errors[0]
        return sums

    @endpoint
    def try_read(self, buf: RDMABuffer, via: str, timeout: float = 3) -> tuple[str, float]:
        """The error a read raises ('' when none) and how long it took."""
        with backend(via):
            t0 = time.monotonic()
            try:
                buf.read_into(torch.empty(buf.size(), dtype=torch.uint8), timeout=timeout).get(timeout=T)
                return "", time.monotonic() - t0
            except TransportError as e:
                return f"TransportError: {e}", time.monotonic() - t0

    @endpoint
    def drop(self, buf: RDMABuffer) -> None:
        buf.drop().get(timeout=T)

    @endpoint
    def act(self, reads: list[RDMABuffer], writes: list[tuple[RDMABuffer, torch.Tensor]],
            via: str) -> list[torch.Tensor]:
        """One RDMAAction reading each of `reads` and writing each tensor into its buffer."""
        dsts = [torch.empty(b.size(), dtype=torch.uint8) for b in reads]
        action = RDMAAction()
        for b, d in zip(reads, dsts):
            action.read_into(b, d)
        for b, src in writes:
            action.write_from(b, src)
        with backend(via):
            action.submit().get(timeout=T)
        return dsts

    @endpoint
    def warnings_seen(self, buf: RDMABuffer, via: str | None, allow_tcp: str | None) -> tuple[list[str], str]:
        """The warning categories two reads and a write raise, and the error of a read ('' if none)."""
        dst = torch.empty(buf.size(), dtype=torch.uint8)
        with backend(via, allow_tcp), warnings.catch_warnings(record=True) as seen:
            try:
                for _ in range(2):
                    buf.read_into(dst).get(timeout=T)
                buf.write_from(dst).get(timeout=T)
                error = ""
            except TransportError as e:
                error = str(e)
        return [type(w.message).__name__ for w in seen], error
