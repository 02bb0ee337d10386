"""One-sided transfers over RDMA verbs through pyverbs (rdma-core's binding) on InfiniBand or RoCE: regions
registered in place, one reliable-connected queue pair per owner process (connected through its TCP door),
RDMA READ / WRITE completed here; `Device.open()` finds the device or says why not (`why_not`). Local memory
bounces through the queue pair's staging buffer up to STAGE_BYTES, above that it is registered for the one
transfer (no cache keyed by address: it would keep pages pinned that the caller may free and reuse)."""
from __future__ import annotations

import ctypes
import hashlib
import os
import resource
import secrets
import socket
import struct
import threading
import time
from functools import cache
from typing import TYPE_CHECKING, NamedTuple

from monarch import config
from monarch.errors import TransportError
from monarch.runtime.engine.transport import tcp
from monarch.runtime.engine.transport.handle import Handle, Owner, start_time, this_node

if TYPE_CHECKING:
    from pyverbs.cq import CQ
    from pyverbs.device import Context
    from pyverbs.mr import MR
    from pyverbs.qp import QP

ADDRESS = struct.Struct("<32sBHB16sBB")  # device name, port, LID, GID index, GID, link layer, active MTU
PEER = struct.Struct("<16sIIH16sB")  # process id, QP number, first packet number, LID, GID, active MTU
STAGE_BYTES = 1 << 20  # transfers up to this size bounce through the queue pair's staging buffer
CHUNK = 1 << 30  # the most bytes one work request moves
DEPTH = 16  # work requests a queue pair and its completion queue hold
ETHERNET = 2  # IBV_LINK_LAYER_ETHERNET: RoCE, addressed by GID
_why_not: list[str] = []


class Port(NamedTuple):
    """The port this process's queue pairs use, as `Owner.verbs` carries it."""
    name: str
    port: int
    lid: int
    gid_index: int
    gid: bytes
    link_layer: int
    mtu: int

    def pack(self) -> bytes:
        return ADDRESS.pack(self.name.encode()[:32], self.port, self.lid, self.gid_index, self.gid, self.link_layer,
                            self.mtu)

    def __str__(self) -> str:
        return f"{self.name} port {self.port}"


class Peer(NamedTuple):
    """One end of a queue-pair connection, as the handshake through the owner's door carries it."""
    process: bytes
    qpn: int
    psn: int
    lid: int
    gid: bytes
    mtu: int


class Device:
    """This process's RDMA device: its context, protection domain, registered regions and queue pairs."""

    @staticmethod
    def open() -> Device | None:
        """The first RDMA device with an active port (MONARCH_RDMA_DEVICE names one); None, with the reason in
        `why_not()`, otherwise."""
        wanted = config.rdma_device()
        try:
            from pyverbs.device import get_device_list  # optional: rdma-core's binding
        except ImportError as e:
            return _none(f"pyverbs (rdma-core's python3-pyverbs) cannot be imported ({e})")
        try:
            names = [d.name.decode() for d in get_device_list()]
        except Exception as e:  # noqa: BLE001 - pyverbs raises PyverbsRDMAError and others without a device
            driver = "" if os.path.isdir("/sys/class/infiniband") else "; no RDMA driver is loaded"
            return _none(f"pyverbs could not list devices ({type(e).__name__}: {e}{driver})")
        if not names:
            return _none("pyverbs found none")
        try:
            found = _active_port(names, *wanted)
            return Device(*found) if isinstance(found, tuple) else _none(found)
        except Exception as e:  # noqa: BLE001 - any pyverbs failure leaves the other backends
            return _none(f"pyverbs failed while opening one ({type(e).__name__}: {e})")

    def __init__(self, ctx: Context, port: Port) -> None:
        from pyverbs.cq import CQ
        from pyverbs.pd import PD
        self.ctx, self.port = ctx, port
        attr = ctx.query_device()
        self.rd_atomic = max(1, min(attr.max_qp_rd_atom, attr.max_qp_init_rd_atom, DEPTH))
        self.max_msg = min(ctx.query_port(port.port).max_msg_sz, CHUNK)
        self.pd = PD(ctx)
        self.cq = CQ(ctx, DEPTH)  # the accepted queue pairs' (they only answer: no completions)
        self.process = hashlib.blake2b(f"{os.getpid()}:{start_time(os.getpid())}:{this_node()}".encode(),
                                       digest_size=16).digest()
        self._lock = threading.Lock()
        self._mrs: dict[int, MR] = {}
        self._accepted: dict[bytes, QP] = {}  # by the peer process: its latest queue pair
        self._links: dict[tuple[int, int, str], Link] = {}  # by owner
        self.new_qp(self.cq).close()  # EFA and iWARP-only devices refuse what transfers need: fail here

    def address(self) -> bytes:
        """What a peer needs to reach this process's queue pairs (device, port, LID, GID), packed."""
        return self.port.pack()

    def reaches(self, verbs: bytes) -> bool:
        """Whether an owner's port (its `Owner.verbs`) is of this port's kind: both InfiniBand or both RoCE
        (a fabric of one kind cannot reach the other; such a pair goes over TCP)."""
        try:
            return bool(verbs) and ADDRESS.unpack(verbs)[5] == self.port.link_layer
        except struct.error:
            return False

    # -- the owner's side ------------------------------------------------------------------------
    def register(self, addr: int, size: int) -> int:
        """Register [addr, addr + size) for remote READ/WRITE (READ only for read-only memory); its rkey."""
        from pyverbs.enums import IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_READ, IBV_ACCESS_REMOTE_WRITE
        from pyverbs.mr import MR
        from pyverbs.pyverbs_error import PyverbsError
        try:
            mr = MR(self.pd, size, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE,
                    address=addr)
        except PyverbsError:
            try:
                mr = MR(self.pd, size, IBV_ACCESS_REMOTE_READ, address=addr)
            except PyverbsError as e:
                raise TransportError(f"RDMABuffer: {self.port} cannot register {size} bytes at {addr:#x} ({e}); "
                                     f"{_memlock_hint()}") from None
        with self._lock:
            self._mrs[mr.rkey] = mr
        return mr.rkey

    def deregister(self, rkey: int) -> None:
        with self._lock:
            mr = self._mrs.pop(rkey, None)
        if mr is not None:
            mr.close()

    def accept(self, sock: socket.socket, length: int) -> None:
        """The owner's side of a peer's connection request arriving at its door (tcp.VERBS): read the peer's
        queue pair, connect a new one to it, answer with that one."""
        from pyverbs.enums import IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_READ, IBV_ACCESS_REMOTE_WRITE
        from pyverbs.pyverbs_error import PyverbsError
        raw = tcp.recv_exactly(sock, length) if length == PEER.size else None
        if raw is None:
            raise TransportError(f"a verbs connection request of {length} bytes, not {PEER.size}")
        peer = Peer(*PEER.unpack(raw))
        try:
            qp = self.new_qp(self.cq)
            me = self.me(qp)
            self.connect(qp, me, peer, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE)
        except PyverbsError as e:
            raise TransportError(f"{self.port} could not connect a queue pair to the peer's ({e})") from None
        with self._lock:
            old, self._accepted[peer.process] = self._accepted.get(peer.process), qp
        if old is not None:  # the peer dropped that one (a failed transfer) and dialed again
            old.close()
        tcp.status(sock, "")
        sock.sendall(PEER.pack(*me))

    # -- queue pairs -----------------------------------------------------------------------------
    def new_qp(self, cq: CQ) -> QP:
        from pyverbs.enums import IBV_QPT_RC
        from pyverbs.qp import QP, QPCap, QPInitAttr
        cap = QPCap(max_send_wr=DEPTH, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        return QP(self.pd, QPInitAttr(qp_type=IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=1))

    def me(self, qp: QP) -> Peer:
        """This end of a connection of `qp`, with a random first packet number."""
        return Peer(self.process, qp.qp_num, secrets.randbits(24), self.port.lid, self.port.gid, self.port.mtu)

    def connect(self, qp: QP, me: Peer, peer: Peer, access: int) -> None:
        """Move `qp` through INIT and RTR to RTS, connected to `peer`'s queue pair (pyverbs' masks per step)."""
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr
        attr = QPAttr(port_num=self.port.port, path_mtu=min(self.port.mtu, peer.mtu))
        attr.qp_access_flags = access
        attr.dest_qp_num, attr.rq_psn, attr.sq_psn = peer.qpn, peer.psn, me.psn
        attr.max_dest_rd_atomic = attr.max_rd_atomic = self.rd_atomic
        attr.min_rnr_timer, attr.timeout, attr.retry_cnt, attr.rnr_retry = 12, 14, 7, 7
        routed = self.port.link_layer == ETHERNET or not peer.lid
        route = GlobalRoute(dgid=GID(_gid_text(peer.gid)), sgid_index=self.port.gid_index, hop_limit=64) \
            if routed else None
        attr.ah_attr = AHAttr(dlid=peer.lid, port_num=self.port.port, is_global=int(routed), gr=route)
        qp.to_rts(attr)

    # -- the reader's side -----------------------------------------------------------------------
    def read(self, handle: Handle, offset: int, dst: memoryview, addr: int, timeout: float) -> None:
        self._link(handle.owner).move(handle, offset, addr, len(dst), timeout, True)

    def write(self, handle: Handle, offset: int, src: memoryview, addr: int, timeout: float) -> None:
        self._link(handle.owner).move(handle, offset, addr, len(src), timeout, False)

    def _link(self, owner: Owner) -> Link:
        with self._lock:
            key = (owner.pid, owner.started, owner.node)
            link = self._links.get(key)
            if link is None:
                link = self._links[key] = Link(self, owner)
            return link


class Link:
    """This process's queue pair to one owner process (made on first use, remade after a failure), with its
    completion queue and staging buffer; one transfer at a time."""

    def __init__(self, device: Device, owner: Owner) -> None:
        self.device, self.owner = device, owner
        self.lock = threading.Lock()
        self.qp: QP | None = None
        self.cq: CQ | None = None
        self.stage: MR | None = None

    def move(self, handle: Handle, offset: int, addr: int, n: int, timeout: float, reading: bool) -> None:
        from pyverbs.pyverbs_error import PyverbsError
        deadline = time.monotonic() + timeout
        with self.lock:
            if self.qp is None:
                self._dial(handle, timeout)
            try:
                if n <= STAGE_BYTES:
                    self._bounce(handle, offset, addr, n, deadline, reading)
                else:
                    self._direct(handle, offset, addr, n, deadline, reading)
            except PyverbsError as e:
                raise self._failed(n, reading, f"pyverbs raised {type(e).__name__}: {e}") from None

    def _bounce(self, handle: Handle, offset: int, addr: int, n: int, deadline: float, reading: bool) -> None:
        from pyverbs.enums import IBV_ACCESS_LOCAL_WRITE
        from pyverbs.mr import MR
        if self.stage is None:
            self.stage = MR(self.device.pd, STAGE_BYTES, IBV_ACCESS_LOCAL_WRITE)
        if not reading:
            ctypes.memmove(self.stage.buf, addr, n)
        self._post(self.stage.buf, n, self.stage.lkey, handle, offset, deadline, reading)
        if reading:
            ctypes.memmove(addr, self.stage.buf, n)

    def _direct(self, handle: Handle, offset: int, addr: int, n: int, deadline: float, reading: bool) -> None:
        from pyverbs.enums import IBV_ACCESS_LOCAL_WRITE
        from pyverbs.mr import MR
        from pyverbs.pyverbs_error import PyverbsError
        try:
            mr = MR(self.device.pd, n, IBV_ACCESS_LOCAL_WRITE if reading else 0, address=addr)
        except PyverbsError as e:
            raise self._failed(n, reading, f"could not register the {n} local bytes at {addr:#x} ({e}); "
                               f"{_memlock_hint()}") from None
        try:
            step = self.device.max_msg
            for start in range(0, n, step):
                self._post(addr + start, min(step, n - start), mr.lkey, handle, offset + start, deadline, reading)
        finally:
            mr.close()  # after the queue pair is gone when a post failed: no DMA into memory let go of

    def _post(self, local: int, n: int, lkey: int, handle: Handle, offset: int, deadline: float,
              reading: bool) -> None:
        from pyverbs.cq import cqe_status_to_str
        from pyverbs.enums import IBV_SEND_SIGNALED, IBV_WC_SUCCESS, IBV_WR_RDMA_READ, IBV_WR_RDMA_WRITE
        from pyverbs.wr import SGE, SendWR
        assert self.qp is not None and self.cq is not None, "a link posts only while connected"
        wr = SendWR(opcode=IBV_WR_RDMA_READ if reading else IBV_WR_RDMA_WRITE, num_sge=1, sg=[SGE(local, n, lkey)],
                    send_flags=IBV_SEND_SIGNALED)
        wr.set_wr_rdma(handle.rkey, handle.addr + offset)
        self.qp.post_send(wr)
        spins = 0
        while True:
            polled, completions = self.cq.poll()
            if polled:
                wc = completions[0]
                if wc.status != IBV_WC_SUCCESS:
                    raise self._failed(n, reading, f"completed with status {cqe_status_to_str(wc.status)} (vendor "
                                       f"error {wc.vendor_err:#x}); the buffer was dropped or its owner died")
                return
            if time.monotonic() > deadline:
                raise self._failed(n, reading, "did not complete in time (the owner's host or the fabric is "
                                   "unreachable); pass a larger timeout")
            spins += 1
            time.sleep(0 if spins < 1000 else 50e-6)

    def _dial(self, handle: Handle, timeout: float) -> None:
        """Connect a new queue pair to the owner's, trading their ends through the owner's door."""
        from pyverbs.cq import CQ
        from pyverbs.pyverbs_error import PyverbsError
        device = self.device
        try:
            self.cq = CQ(device.ctx, DEPTH)
            self.qp = device.new_qp(self.cq)
            me = device.me(self.qp)
            body = PEER.pack(*me)
            with tcp.request(handle, tcp.VERBS, len(body), timeout) as sock:
                sock.sendall(body)
                tcp.answer(sock, handle)
                raw = tcp.recv_exactly(sock, PEER.size)
            if raw is None:
                raise self._failed(0, True, "closed its door before answering the connection request")
            device.connect(self.qp, me, Peer(*PEER.unpack(raw)), 0)
        except (PyverbsError, OSError) as e:
            raise self._failed(0, True, f"could not connect a queue pair ({type(e).__name__}: {e})") from None
        except TransportError:
            self._reset()
            raise

    def _failed(self, n: int, reading: bool, what: str) -> TransportError:
        """Drop the queue pair (destroying it stops every access it had under way) and say what failed."""
        self._reset()
        there = _describe(self.owner.verbs)
        op = f"RDMA {'read' if reading else 'write'} of {n} bytes" if n else "RDMA connection"
        return TransportError(f"{op} between {socket.gethostname()} (pid {os.getpid()}, {self.device.port}) and "
                              f"{self.owner} ({there}) failed: {what}")

    def _reset(self) -> None:
        for part in (self.qp, self.cq, self.stage):
            if part is not None:
                part.close()
        self.qp = self.cq = self.stage = None


def _active_port(names: list[str], wanted: str, wanted_port: int) -> tuple[Context, Port] | str:
    """The context and port of the first active port (of device `wanted`, port `wanted_port` when given), or
    why there is none."""
    from pyverbs.device import Context
    from pyverbs.enums import IBV_PORT_ACTIVE
    if wanted and wanted not in names:
        return f"MONARCH_RDMA_DEVICE={wanted} names none of this host's devices ({', '.join(names)})"
    inactive: list[str] = []
    for name in [wanted] if wanted else names:
        ctx = Context(name=name)
        for port in range(1, ctx.query_device().phys_port_cnt + 1):
            if wanted_port and port != wanted_port:
                continue
            attr = ctx.query_port(port)
            gid_index = _gid_index(ctx, port, attr.link_layer, attr.gid_tbl_len) if attr.state == IBV_PORT_ACTIVE \
                else None
            if gid_index is None:
                inactive.append(f"{name} port {port}")
                continue
            gid = bytes.fromhex(ctx.query_gid(port, gid_index).gid.replace(":", ""))
            return ctx, Port(name, port, attr.lid, gid_index, gid, attr.link_layer, attr.active_mtu)
        ctx.close()
    return f"no port is active with an address ({', '.join(inactive) or 'no ports'})"


def _gid_index(ctx: Context, port: int, link_layer: int, entries: int) -> int | None:
    """The GID a port's queue pairs send from: index 0 on InfiniBand; on RoCE, the first RoCE v2 GID mapping
    an IPv4 address, else the first v2 one, else the first that is set (None without one)."""
    if link_layer != ETHERNET:
        return 0
    from pyverbs.enums import IBV_GID_TYPE_SYSFS_ROCE_V2
    from pyverbs.pyverbs_error import PyverbsError
    ranked: list[tuple[int, int]] = []
    for index in range(min(entries, 64)):
        try:
            gid = bytes.fromhex(ctx.query_gid(port, index).gid.replace(":", ""))
            v2 = ctx.query_gid_type(port, index) == IBV_GID_TYPE_SYSFS_ROCE_V2
        except PyverbsError:
            continue
        if any(gid):
            ranked.append((-2 * v2 - (gid[:12] == bytes(10) + b"\xff\xff"), index))
    return min(ranked)[1] if ranked else None


def _gid_text(gid: bytes) -> str:
    """A GID in pyverbs' 8-group form, xxxx:xxxx:...:xxxx."""
    return ":".join(gid.hex()[i:i + 4] for i in range(0, 32, 4))


def _describe(verbs: bytes) -> str:
    """How errors name a peer's port from its `Owner.verbs`."""
    try:
        name, port = ADDRESS.unpack(verbs)[:2]
    except struct.error:
        return "no RDMA port known"
    return f"{name.rstrip(bytes(1)).decode(errors='replace')} port {port}"


def _memlock_hint() -> str:
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
    return f"registered memory stays locked: raise the locked-memory limit (ulimit -l, now {limit})"


def _none(reason: str) -> Device | None:
    """No device, for `reason` (what `why_not` says from now on)."""
    _why_not[:] = [f"no RDMA device: {reason}"]
    return None


@cache
def device() -> Device | None:
    """This process's device (opened once), or None."""
    return Device.open()


def why_not() -> str:
    """Why `Device.open()` found no device (empty before it ran, or when it found one)."""
    return _why_not[0] if _why_not else ""
