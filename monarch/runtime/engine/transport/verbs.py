"""One-sided transfers over RDMA verbs through pyverbs (rdma-core's Python binding), where this host has an
RDMA device (InfiniBand, RoCE, EFA): memory regions registered in place, one RC queue pair per peer process,
RDMA READ / WRITE posted and completed here, the owner's CPU idle.

`Device.open()` finds the device, or says why there is none (`why_not`): pyverbs missing, no device, or
pyverbs raising while it looks (Debian's python3-pyverbs on a host without a device can).
"""
from __future__ import annotations

import socket
from functools import cache

from monarch.runtime.engine.transport.handle import Handle

_why_not: list[str] = []


class Device:
    """This process's RDMA device context, protection domain and queue pairs."""

    @staticmethod
    def open() -> Device | None:
        """The first RDMA device with an active port; None, with the reason in `why_not()`, otherwise."""
        try:
            from pyverbs.device import get_device_list  # optional: rdma-core's binding
        except ImportError:
            _why_not[:] = ["no RDMA device: pyverbs (rdma-core's python3-pyverbs) is not installed"]
            return None
        try:
            devices = get_device_list()
        except Exception as e:  # noqa: BLE001 - pyverbs raises PyverbsRDMAError and others without a device
            _why_not[:] = [f"no RDMA device: pyverbs could not list devices ({type(e).__name__}: {e})"]
            return None
        if not devices:
            _why_not[:] = ["no RDMA device: pyverbs found none"]
            return None
        raise NotImplementedError("verbs transfers")

    def address(self) -> bytes:
        """What a peer needs to reach this process's queue pairs (device, port, LID, GID), packed."""
        raise NotImplementedError

    def register(self, addr: int, size: int) -> int:
        """Register [addr, addr + size) for remote READ/WRITE; its rkey."""
        raise NotImplementedError

    def deregister(self, rkey: int) -> None:
        raise NotImplementedError

    def accept(self, sock: socket.socket, length: int) -> None:
        """The owner's side of a peer's connection request arriving at its door (tcp.VERBS)."""
        raise NotImplementedError

    def read(self, handle: Handle, offset: int, dst: memoryview, addr: int, timeout: float) -> None:
        raise NotImplementedError

    def write(self, handle: Handle, offset: int, src: memoryview, addr: int, timeout: float) -> None:
        raise NotImplementedError


@cache
def device() -> Device | None:
    """This process's device (opened once), or None."""
    return Device.open()


def why_not() -> str:
    """Why `Device.open()` found no device (empty before it ran, or when it found one)."""
    return _why_not[0] if _why_not else ""
