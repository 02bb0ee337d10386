"""What one-sided transfers name: the `Owner` of registered memory (its process, host and doors) and the
`Handle` of one registered region, small frozen values that pickle as plain fields and are checked when
they are rebuilt, so a malformed handle fails where it arrives; the region of a tensor or memoryview.

A handle is a capability: its 128-bit random key is what an owner checks (in constant time) before it
touches memory, so a handle forged from guessed fields is refused.
"""
from __future__ import annotations

import ctypes
import os
import re
import socket
from dataclasses import dataclass
from functools import cache

import torch

from monarch.errors import TransportError

KEY_BYTES = 16
_LABEL = re.compile(r"[\w .,:'()=\-/<>#\[\]]{0,200}")


@dataclass(frozen=True)
class Owner:
    """A process holding registered memory: its pid and start time (pid reuse cannot alias it), the node it
    runs on (boot id and pid namespace: where cross-memory attach reaches it), the TCP door its transfer
    server listens at, the descriptor of its slot table (readable as /proc/<pid>/fd/<fd> on its node), and
    what the verbs backend needs to reach it (empty without an RDMA device)."""
    pid: int
    started: int
    node: str
    host: str
    port: int
    table_fd: int
    verbs: bytes = b""
    label: str = ""

    def __post_init__(self) -> None:
        ints = (self.pid, self.started, self.port, self.table_fd)
        if not all(type(v) is int and v >= 0 for v in ints) or self.port > 65535:
            raise TransportError(f"malformed RDMA handle: owner fields {ints} are not valid numbers")
        if not (isinstance(self.node, str) and isinstance(self.host, str) and isinstance(self.verbs, bytes)
                and isinstance(self.label, str) and len(self.node) < 200 and len(self.verbs) < 4096
                and _LABEL.fullmatch(self.label)):
            raise TransportError("malformed RDMA handle: the owner's node, host, verbs or label field is invalid")
        try:
            socket.inet_pton(socket.AF_INET6 if ":" in self.host else socket.AF_INET, self.host)
        except (OSError, ValueError):
            raise TransportError(f"malformed RDMA handle: owner host {self.host!r} is not an IP address") from None

    def __str__(self) -> str:
        return self.label or f"pid {self.pid} at {self.host}:{self.port}"

    def __reduce__(self) -> tuple:  # rebuilt through __init__, so a received owner is checked
        return (Owner, (self.pid, self.started, self.node, self.host, self.port, self.table_fd, self.verbs, self.label))


@dataclass(frozen=True)
class Handle:
    """One registered region: its owner, its slot in the owner's table with that slot's generation (a
    dropped region's slot is reused under a new generation), the key, the region's address and size there,
    and the verbs memory key (0 without verbs)."""
    owner: Owner
    slot: int
    gen: int
    key: bytes
    addr: int
    size: int
    rkey: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.owner, Owner):
            raise TransportError("malformed RDMA handle: it names no owner")
        ints = (self.slot, self.gen, self.addr, self.size, self.rkey)
        if not all(type(v) is int and 0 <= v < 1 << 64 for v in ints) or self.slot >= 1 << 24:
            raise TransportError(f"malformed RDMA handle: fields {ints} are not valid numbers")
        if not isinstance(self.key, bytes) or len(self.key) != KEY_BYTES:
            raise TransportError("malformed RDMA handle: its key is not 16 bytes")

    def __reduce__(self) -> tuple:  # rebuilt through __init__, so a received handle is checked
        return (Handle, (self.owner, self.slot, self.gen, self.key, self.addr, self.size, self.rkey))

    def check(self, offset: int, nbytes: int, what: str) -> None:
        """Raise ValueError unless [offset, offset + nbytes) lies within the region."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(f"RDMABuffer.{what}: {nbytes} bytes at offset {offset} do not fit the buffer's "
                             f"{self.size} bytes")

    def __repr__(self) -> str:
        return f"<RDMA region of {self.size} bytes, slot {self.slot}.{self.gen} of {self.owner}>"


def region(data: torch.Tensor | memoryview, what: str) -> tuple[int, int]:
    """The address and size in bytes of a contiguous CPU tensor (a view or slice included) or a
    C-contiguous memoryview; ValueError otherwise."""
    if isinstance(data, torch.Tensor):
        if data.device.type != "cpu":
            raise ValueError(f"{what}: a {data.device.type} tensor; an RDMABuffer registers host memory here (no "
                             "GPUDirect): register a host copy, t.cpu() (read_into and write_from take GPU tensors "
                             "and stage them)")
        if not data.is_contiguous():
            raise ValueError(f"{what}: the tensor is not contiguous (shape {tuple(data.shape)}, stride "
                             f"{data.stride()}); pass t.contiguous() or a contiguous view")
        return data.data_ptr(), data.numel() * data.element_size()
    if isinstance(data, memoryview):
        if not data.c_contiguous:
            raise ValueError(f"{what}: the memoryview is not C-contiguous")
        if data.nbytes == 0:
            return 0, 0
        if data.readonly:
            return _readonly_address(data), data.nbytes
        return ctypes.addressof(ctypes.c_char.from_buffer(data)), data.nbytes
    raise ValueError(f"{what} takes a torch.Tensor or a memoryview, not {type(data).__name__}")


def _readonly_address(view: memoryview) -> int:
    """A read-only buffer's address (bytes objects, read-only mmaps): through numpy's array interface."""
    import numpy
    return int(numpy.frombuffer(view.cast("B"), dtype=numpy.uint8).__array_interface__["data"][0])


def memory(addr: int, size: int) -> memoryview:
    """A writable byte view of `size` bytes at `addr` of this process (a region kept alive by its owner)."""
    return memoryview((ctypes.c_char * size).from_address(addr)).cast("B") if size else memoryview(b"")


@cache
def this_node() -> str:
    """The boot id and pid namespace of this process: processes with the same value share a kernel and
    see each other's pids, so cross-memory attach can reach them."""
    try:
        boot = open("/proc/sys/kernel/random/boot_id").read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return f"{socket.gethostname()}:unknown"


def start_time(pid: int) -> int:
    """A process's start time in clock ticks since boot (field 22 of /proc/<pid>/stat); 0 when unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return 0
