"""One-sided transfers over MPI RMA windows between two worker processes (MPI processes of any meshes, one
MPI job or two): pairs joined on demand through the owner's door, one dynamic window per pair, passive target.

Joining (op MPI_JOIN, once the door checked the handle's key): the owner opens an MPI port and sends its name,
both ends run Accept / Connect on COMM_SELF and Merge (owner rank 0), and create the pair's dynamic window; the
owner attaches every live region to it (registry.py), so a handle's address is its displacement there. The
join's TCP connection stays as the pair's line: before each transfer the reader sends the request's header
there, the owner checks it, holds the region (a drop waits) and drives MPI's progress until the reader says it
is done (MPICH over UCX does not complete passive-target operations while the target calls no MPI, and its
async progress thread would spin a core for good). The reader holds a lock-all epoch for the pair's life and
polls its Rget/Rput requests until the transfer's deadline; the join and a write's flush, which cannot be
polled, run in a thread of their own. A pair whose peer stops answering is abandoned, never used again.
"""
from __future__ import annotations

import ctypes
import glob
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING, Protocol, TypeVar

from monarch import config
from monarch.errors import TransportError
from monarch.runtime.control.client import client
from monarch.runtime.engine.transport import tcp
from monarch.runtime.engine.transport.handle import Handle

if TYPE_CHECKING:
    from mpi4py.MPI import Intracomm, Win

LENGTH = struct.Struct("<I")
DONE = b"\x01"
CHUNK = 1 << 30  # the most bytes one Rget or Rput moves
POLLS_PER_CHECK = 256  # request tests between looks at the clock
OWNER_RANK = 0  # the owner's rank in a pair's merged communicator
RDMA_TLS = ("rc", "dc", "ud", "ib")  # UCX transport names (and prefixes: rc_mlx5, dc_x, ...) that are RDMA
NOT_MPI = "is not an MPI process"
T = TypeVar("T")


class NotMPI(TransportError):
    """One end of a transfer is not an MPI process (the controller): the pair cannot be joined."""


class Windows(Protocol):
    """What the owner side needs of the registry: attaching its regions to a pair's window, and the
    check-and-hold of a region that the door's transfers use."""

    def add_window(self, window: Attached) -> None: ...

    def remove_window(self, window: Attached) -> None: ...

    def using(self, slot: int, gen: int, key: bytes, offset: int, nbytes: int) -> AbstractContextManager[memoryview]:
        ...


@dataclass
class Attached:
    """The owner's side of one pair's window and what is attached to it: registrations by (address, size)
    (a region registered twice is attached once)."""
    win: Win
    regions: dict[tuple[int, int], int] = field(default_factory=dict)

    def attach(self, addr: int, size: int) -> None:
        n = self.regions.get((addr, size), 0)
        if not n:
            self.win.Attach(_mpi().buffer.fromaddress(addr, size))
        self.regions[(addr, size)] = n + 1

    def detach(self, addr: int, size: int) -> None:
        n = self.regions.pop((addr, size))
        if n > 1:
            self.regions[(addr, size)] = n - 1
        else:
            self.win.Detach(_mpi().buffer.fromaddress(addr, size))

    def detach_all(self) -> None:
        for addr, size in self.regions:
            self.win.Detach(_mpi().buffer.fromaddress(addr, size))
        self.regions.clear()


# -- the owner's side (the door's thread for the join's connection) -----------------------------------
def serve(sock: socket.socket, regions: Windows) -> None:
    """Join the pair the reader at the other end of `sock` asked for, then serve its transfers until the
    reader closes the line."""
    if why_not_mpi():
        raise TransportError(f"this process {NOT_MPI} ({why_not_mpi()})")
    MPI = _mpi()
    try:
        port = MPI.Open_port()
        tcp.status(sock, "")
        sock.sendall(LENGTH.pack(len(port)) + port.encode())
        inter = MPI.COMM_SELF.Accept(port)  # the reader connects right after it read the port's name
        MPI.Close_port(port)
        comm = inter.Merge(False)
        window = Attached(MPI.Win.Create_dynamic(comm=comm))
        window.win.Set_errhandler(MPI.ERRORS_RETURN)
        regions.add_window(window)
    except MPI.Exception as e:
        raise TransportError(f"joining an MPI pair failed: {e.Get_error_string()}") from None
    try:
        tcp.status(sock, "")
        serving = True
        while serving:
            serving = _serve_one(sock, regions, comm)
    finally:
        regions.remove_window(window)  # the window itself is the pair's: freeing it would need the reader
        sock.shutdown(socket.SHUT_RDWR)  # the door reads no further request on a pair's line


def _serve_one(sock: socket.socket, regions: Windows, comm: Intracomm) -> bool:
    """One transfer of the pair: check and hold the region, drive progress until the reader is done."""
    raw = tcp.recv_exactly(sock, tcp.HEADER.size)
    if raw is None:
        return False
    _, _, slot, gen, key, offset, length = tcp.HEADER.unpack(raw)
    try:
        with regions.using(slot, gen, key, offset, length):
            tcp.status(sock, "")
            return _progress(sock, comm)
    except (TransportError, ValueError) as e:
        tcp.status(sock, str(e))
        return True


def _progress(sock: socket.socket, comm: Intracomm) -> bool:
    """Drive MPI's progress engine until the reader's done byte arrives (True) or its line fails (False);
    at most MONARCH_RDMA_TIMEOUT seconds."""
    deadline = time.monotonic() + config.rdma_timeout()
    source, tag = _mpi().ANY_SOURCE, _mpi().ANY_TAG
    while not select.select([sock], [], [], 0)[0]:
        for _ in range(64):
            comm.Iprobe(source, tag)
        if time.monotonic() > deadline:
            return False
    try:
        return sock.recv(1) == DONE
    except OSError:
        return False


# -- the reader's side --------------------------------------------------------------------------------
@dataclass
class Pair:
    """This process's end of a joined pair: the line to the owner's door, the merged communicator, the
    window; `lock` keeps one transfer at a time on the line."""
    sock: socket.socket
    comm: Intracomm
    win: Win
    lock: threading.Lock = field(default_factory=threading.Lock)


_pairs: dict[tuple[str, int, int], Pair] = {}  # by owner door and pid
_pairs_lock = threading.Lock()
_joining: dict[tuple[str, int, int], threading.Lock] = {}


def read(handle: Handle, offset: int, dst: memoryview, addr: int, timeout: float) -> None:
    """Copy the owner's bytes [offset, offset + len(dst)) to this process's address `addr` (dst's)."""
    _transfer(handle, offset, addr, len(dst), timeout, True)


def write(handle: Handle, offset: int, src: memoryview, addr: int, timeout: float) -> None:
    """Copy len(src) bytes at this process's address `addr` (src's) to the owner's bytes at `offset`."""
    _transfer(handle, offset, addr, len(src), timeout, False)


def _transfer(handle: Handle, offset: int, addr: int, n: int, timeout: float, reading: bool) -> None:
    deadline = time.monotonic() + timeout
    pair = _pair(handle, timeout)
    with pair.lock:
        try:
            pair.sock.settimeout(max(deadline - time.monotonic(), 0.001))
            pair.sock.sendall(tcp.HEADER.pack(tcp.MAGIC, tcp.READ if reading else tcp.WRITE, handle.slot,
                                              handle.gen, handle.key, offset, n))
            tcp.answer(pair.sock, handle)
        except tcp.Refusal:
            raise  # the owner goes on serving the pair
        except (OSError, TransportError):
            raise _abandon(handle, pair, "did not answer on the pair's line (it died, or hung)") from None
        _rma(pair, handle, handle.addr + offset, addr, n, reading, deadline)
        try:
            pair.sock.sendall(DONE)
        except OSError:
            raise _abandon(handle, pair, "closed the pair's line") from None


def _rma(pair: Pair, handle: Handle, disp: int, addr: int, n: int, reading: bool, deadline: float) -> None:
    """The bytes in chunks, in the pair's lock-all epoch: a read is done once its requests completed (polled
    here until the deadline); a write's puts are then flushed, complete at the owner (in a thread of its own:
    MPI's flush has no timeout)."""
    MPI = _mpi()
    what = "Rget" if reading else "Rput"
    move = pair.win.Rget if reading else pair.win.Rput
    try:
        requests = [move([MPI.buffer.fromaddress(addr + done, min(CHUNK, n - done)), MPI.BYTE], OWNER_RANK,
                         (disp + done, min(CHUNK, n - done), MPI.BYTE)) for done in range(0, n, CHUNK)]
        polls = 0
        while not MPI.Request.Testall(requests):
            polls += 1
            if polls % POLLS_PER_CHECK == 0:
                if time.monotonic() > deadline:
                    raise _abandon(handle, pair, f"did not complete MPI {what} in time (the owner hung or died)")
                time.sleep(0)  # lets this process's other threads run
    except MPI.Exception as e:
        raise _abandon(handle, pair, f"failed MPI {what}: {e.Get_error_string()}") from None
    if not reading:
        _run(lambda: pair.win.Flush(OWNER_RANK), deadline, handle, pair, "Win_flush")


def _pair(handle: Handle, timeout: float) -> Pair:
    """The pair with the handle's owner, joined on first use."""
    owner = handle.owner
    door = (owner.host, owner.port, owner.pid)
    with _pairs_lock:
        pair = _pairs.get(door)
        joining = _joining.setdefault(door, threading.Lock())
    if pair is not None:
        return pair
    with joining:
        pair = _pairs.get(door) or _join(handle, timeout)
        with _pairs_lock:
            _pairs[door] = pair
    return pair


def _join(handle: Handle, timeout: float) -> Pair:
    """Ask the owner's door for a port, then connect, merge and create the pair's window (in a thread of
    their own: a peer that dies meanwhile cannot hold this thread past the timeout)."""
    if why_not_mpi():
        raise NotMPI(f"this process {NOT_MPI} ({why_not_mpi()})")
    MPI = _mpi()
    deadline = time.monotonic() + timeout
    sock = tcp.request(handle, tcp.MPI_JOIN, 0, timeout)
    try:
        _joined(sock, handle)
        size = tcp.recv_exactly(sock, LENGTH.size)
        port = tcp.recv_exactly(sock, LENGTH.unpack(size)[0]) if size else None
    except OSError:
        sock.close()
        raise tcp.gone(handle, f"did not answer a request to join an MPI pair within {timeout:g} s") from None
    if port is None:
        sock.close()
        raise tcp.gone(handle, "closed the connection while joining an MPI pair")

    def connect() -> tuple[Intracomm, Win]:
        info = MPI.Info.Create()
        info.Set("timeout", str(max(1, int(deadline - time.monotonic()))))
        inter = MPI.COMM_SELF.Connect(port.decode(), info)
        info.Free()
        comm = inter.Merge(True)
        win = MPI.Win.Create_dynamic(comm=comm)
        win.Set_errhandler(MPI.ERRORS_RETURN)
        win.Lock_all(MPI.MODE_NOCHECK)  # for the pair's life: the owner never locks its side
        return comm, win

    pair = Pair(sock, *_run(connect, deadline, handle, None, "Connect"))
    try:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        tcp.answer(sock, handle)  # the owner attached its regions
    except OSError:
        raise _abandon(handle, pair, "did not finish joining the MPI pair") from None
    return pair


def _joined(sock: socket.socket, handle: Handle) -> None:
    """The owner's answer to a join; NotMPI when it is no MPI process."""
    try:
        tcp.answer(sock, handle)
    except TransportError as e:
        sock.close()
        if NOT_MPI in str(e):
            raise NotMPI(f"the buffer's owner, {handle.owner}, {NOT_MPI}") from None
        raise


def _run(call: Callable[[], T], deadline: float, handle: Handle, pair: Pair | None, what: str) -> T:
    """`call()` in a daemon thread, waited for until `deadline`; a call still running then is abandoned
    with its pair (MPI calls cannot be cancelled)."""
    done = threading.Event()
    box: list[T] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            box.append(call())
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            failed.append(e)
        done.set()

    threading.Thread(target=run, name="monarch-mpi-rma", daemon=True).start()
    if not done.wait(max(deadline - time.monotonic(), 0.0)):
        raise _abandon(handle, pair, f"did not complete MPI {what} in time (the owner hung or died)")
    if failed:
        raise _abandon(handle, pair, f"failed MPI {what}: {failed[0]}") from failed[0]
    return box[0]


def _abandon(handle: Handle, pair: Pair | None, what: str) -> TransportError:
    """Forget the pair (its communicator and window are left as they are: freeing them needs the owner)."""
    if pair is not None:
        pair.sock.close()
        with _pairs_lock:
            door = (handle.owner.host, handle.owner.port, handle.owner.pid)
            if _pairs.get(door) is pair:
                del _pairs[door]
    return tcp.gone(handle, f"{what} (MPI RMA backend)")


# -- where this backend applies -------------------------------------------------------------------------
def why_not_mpi() -> str:
    """Why this process cannot take part in MPI RMA transfers ("" when it can)."""
    if client().is_controller:
        return "this process is the controller, which never joins MPI"
    return ""


def _mpi():  # noqa: ANN202 - mpi4py's module, imported only where why_not_mpi() is ""
    from mpi4py import MPI
    return MPI


@cache
def offers_rdma() -> bool:
    """Whether UCX would carry this worker's RMA over an RDMA transport: an InfiniBand or RoCE port is active,
    UCX's ib module loads (it needs rdma-core's libibverbs), and UCX_TLS / UCX_NET_DEVICES leave such a
    transport in (what `ucx_info -d` would list; the mpich wheel ships no ucx_info)."""
    if why_not_mpi():
        return False
    ports = [p.split("/")[4] + ":" + p.split("/")[6] for p in glob.glob("/sys/class/infiniband/*/ports/*/state")
             if "ACTIVE" in open(p).read()]
    nets = config.external("UCX_NET_DEVICES")
    if nets and nets != "all":
        ports = [p for p in ports if p in nets.split(",")]
    tls = config.external("UCX_TLS")
    named = [t.strip() for t in tls.lstrip("^").split(",") if t.strip()]
    rdma_named = any(t.startswith(RDMA_TLS) or t == "all" for t in named)
    if tls and (rdma_named == tls.startswith("^")):
        return False
    return bool(ports) and _loads_uct_ib()


def _loads_uct_ib() -> bool:
    with open("/proc/self/maps") as f:
        libs = {line.split()[-1] for line in f if "libucp.so" in line}
    for lib in libs:
        try:
            ctypes.CDLL(os.path.join(os.path.dirname(lib), "ucx", "libuct_ib.so.0"))
            return True
        except OSError:
            continue
    return False
