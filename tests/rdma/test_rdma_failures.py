"""RDMABuffer when things go wrong, between real meshes: dropped buffers (by the owner, a reader, the
controller), an owner killed with SIGKILL, an owner's door that never answers, forged handles, and the TCP
fallback's warning (once) or error.
"""
from __future__ import annotations

import os
import pickle
import signal
import socket
import time
from dataclasses import replace

import pytest
import torch
from rdma_actors import T, Owner, Reader, backend

from monarch.actor import ActorMesh, this_host
from monarch.errors import TransportError
from monarch.rdma import RDMABuffer, get_rdma_backend, is_rdma_available
from monarch.runtime.engine.transport.handle import Handle, start_time
from monarch.runtime.engine.transport.handle import Owner as Process

pytestmark = pytest.mark.slow
GONE = "it was dropped, or the handle is not one"


def share(owner: ActorMesh[Owner], name: str, n: int = 4096) -> RDMABuffer:
    return owner.share.call_one(name, torch.arange(n, dtype=torch.int32)).get(timeout=T)


def forged(buf: RDMABuffer, **owner_fields: object) -> RDMABuffer:
    handle = buf._handle
    return RDMABuffer._of(replace(handle, owner=replace(handle.owner, **owner_fields)))


@pytest.mark.parametrize("dropper", ["owner", "reader", "controller"])
def test_a_dropped_buffer_is_refused(owners: ActorMesh[Owner], readers: ActorMesh[Reader], via: str,
                                     dropper: str) -> None:
    owner = owners.slice(gpus=0)
    buf = share(owner, f"drop-{dropper}-{via}")
    assert readers.slice(gpus=0).try_read.call_one(buf, via).get(timeout=T)[0] == ""
    if dropper == "owner":
        owner.drop.call_one(buf).get(timeout=T)
    elif dropper == "reader":
        readers.slice(gpus=1).drop.call_one(buf).get(timeout=T)
    else:
        buf.drop().get(timeout=T)
    error, _ = readers.slice(gpus=0).try_read.call_one(buf, via).get(timeout=T)
    assert error.startswith("TransportError") and GONE in error and buf.owner in error, error
    with backend(via), pytest.raises(TransportError, match=GONE):
        buf.write_from(torch.zeros(4, dtype=torch.uint8)).get(timeout=T)
    with pytest.raises(TransportError, match=GONE):
        buf.drop().get(timeout=T)
    fresh = share(owner, f"after-{dropper}-{via}")  # the slot is reused under a new generation
    assert readers.slice(gpus=0).try_read.call_one(fresh, via).get(timeout=T)[0] == ""
    assert readers.slice(gpus=0).try_read.call_one(buf, via).get(timeout=T)[0].startswith("TransportError")


def _wait_gone(pid: int, started: int) -> None:
    deadline = time.monotonic() + T
    while start_time(pid) == started and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_read_from_a_killed_owner_fails_quickly(readers: ActorMesh[Reader], faults: list) -> None:
    procs = this_host().spawn_procs(per_host={"gpus": 1}, name="rdma_victim")
    try:
        victim = procs.spawn("victim", Owner)
        buf = share(victim, "doomed", 1 << 18)
        reader = readers.slice(gpus=2)
        for via in ("shm", "tcp"):  # the reader holds the owner's slot table and a connection to its door
            assert reader.try_read.call_one(buf, via).get(timeout=T)[0] == ""
        pid = victim.pid.call_one().get(timeout=T)
        started = start_time(pid)
        os.kill(pid, signal.SIGKILL)
        _wait_gone(pid, started)
        for via in ("shm", "tcp"):
            error, took = reader.try_read.call_one(buf, via).get(timeout=T)
            assert error.startswith("TransportError") and buf.owner in error, error
            assert "has exited" in error if via == "shm" else "closed the connection" in error, error
            assert took < 0.5, (via, took)
        t0 = time.monotonic()  # the controller never attached to it: the first look finds it gone
        with backend("shm"), pytest.raises(TransportError, match="has exited"):
            buf.read_into(torch.empty(buf.size(), dtype=torch.uint8)).get(timeout=T)
        assert time.monotonic() - t0 < 0.5
    finally:
        procs.stop()


def test_a_door_that_never_answers_times_out_naming_both_ends(owners: ActorMesh[Owner],
                                                              readers: ActorMesh[Reader]) -> None:
    buf = share(owners.slice(gpus=0), "silent")
    host = buf._handle.owner.host
    with socket.create_server((host, 0)) as mute:  # accepts connections (the backlog), never answers
        port = mute.getsockname()[1]
        silent = forged(buf, port=port)
        t0 = time.monotonic()
        with backend("tcp"), pytest.raises(TransportError) as e:
            silent.read_into(torch.empty(buf.size(), dtype=torch.uint8), timeout=0.5).get(timeout=T)
        took = time.monotonic() - t0
        assert 0.45 < took < 2.0, took
        text = str(e.value)
        assert f"{socket.gethostname()} (pid {os.getpid()})" in text and f"{host}:{port}" in text, text
        assert "did not answer within 0.5 s" in text and buf.owner in text, text
        error, took = readers.slice(gpus=0).try_read.call_one(silent, "tcp", 0.5).get(timeout=T)
        assert f"{host}:{port}" in error and "did not answer within 0.5 s" in error and took < 2.0, (error, took)


def test_a_key_that_does_not_match_its_slot_is_refused(owners: ActorMesh[Owner], readers: ActorMesh[Reader],
                                                       via: str) -> None:
    owner = owners.slice(gpus=1)
    buf = share(owner, f"keyed-{via}")
    wrong = RDMABuffer._of(replace(buf._handle, key=bytes(16)))
    error, _ = readers.slice(gpus=1).try_read.call_one(wrong, via).get(timeout=T)
    assert error.startswith("TransportError") and GONE in error, error
    with backend(via), pytest.raises(TransportError, match=GONE):
        wrong.write_from(torch.zeros(16, dtype=torch.uint8)).get(timeout=T)
    with pytest.raises(TransportError, match=GONE):
        wrong.drop().get(timeout=T)
    assert torch.equal(owner.value.call_one(f"keyed-{via}").get(timeout=T), torch.arange(4096, dtype=torch.int32))


class _Forged:
    """Pickles as `cls(*args)`: what a peer could send instead of a real handle."""

    def __init__(self, cls: type, *args: object) -> None:
        self.cls, self.args = cls, args

    def __reduce__(self) -> tuple:
        return (self.cls, self.args)


def test_malformed_pickled_handles_are_refused_where_they_arrive(owners: ActorMesh[Owner]) -> None:
    h = share(owners.slice(gpus=0), "pickled")._handle
    o = h.owner
    fields = (h.owner, h.slot, h.gen, h.key, h.addr, h.size)
    owner_fields = (o.pid, o.started, o.node, o.host, o.port, o.table_fd, o.verbs, o.label)
    assert pickle.loads(pickle.dumps(_Forged(Handle, *fields))) == h
    assert pickle.loads(pickle.dumps(_Forged(Process, *owner_fields))) == o
    for args in [(o, 1 << 24, *fields[2:]), (o, h.slot, -1, *fields[3:]), (*fields[:3], b"short", *fields[4:]),
                 (*fields[:5], 1 << 64), (*fields[:5], "4096"), ("an owner", *fields[1:])]:
        with pytest.raises(TransportError, match="malformed RDMA handle"):
            pickle.loads(pickle.dumps(_Forged(Handle, *args)))
    for args in [(-1, *owner_fields[1:]), (*owner_fields[:4], 70000, *owner_fields[5:]),
                 (*owner_fields[:3], "not-an-ip", *owner_fields[4:]), (*owner_fields[:7], "a label\n"),
                 (*owner_fields[:2], 7, *owner_fields[3:]), (*owner_fields[:6], "verbs", o.label)]:
        with pytest.raises(TransportError, match="malformed RDMA handle"):
            pickle.loads(pickle.dumps(_Forged(Process, *args)))
    with pytest.raises(TypeError, match="rebuilt from a Handle"):
        RDMABuffer._of(("not", "a", "handle"))  # type: ignore[arg-type]


def test_a_table_fd_that_is_not_a_slot_table_is_refused(owners: ActorMesh[Owner],
                                                        readers: ActorMesh[Reader]) -> None:
    buf = share(owners.slice(gpus=1), "fd")
    assert readers.slice(gpus=1).try_read.call_one(buf, "shm").get(timeout=T)[0] == ""
    for fd in (0, 2, 1000):
        error, _ = readers.slice(gpus=1).try_read.call_one(forged(buf, table_fd=fd), "shm").get(timeout=T)
        assert f"fd {fd} of pid" in error and "is not a monarch slot table" in error, error
    assert readers.slice(gpus=1).try_read.call_one(buf, "shm").get(timeout=T)[0] == ""


def test_the_tcp_fallback_warns_once_or_fails_when_turned_off(owners: ActorMesh[Owner],
                                                              readers: ActorMesh[Reader]) -> None:
    far = forged(share(owners.slice(gpus=0), "far"), node="another-host:0")  # auto takes TCP to it
    reader = readers.slice(gpus=2)
    assert reader.warnings_seen.call_one(far, None, None).get(timeout=T) == (
        ["RDMAReadTransferWarning", "RDMAWriteTransferWarning"], "")
    assert reader.warnings_seen.call_one(far, None, None).get(timeout=T) == ([], "")
    assert readers.slice(gpus=1).warnings_seen.call_one(far, "tcp", None).get(timeout=T) == ([], "")
    seen, error = readers.slice(gpus=1).warnings_seen.call_one(far, None, "0").get(timeout=T)
    assert seen == [] and "MONARCH_RDMA_ALLOW_TCP_FALLBACK=0" in error and "RDMA path reaches" in error, error
    assert (get_rdma_backend(), is_rdma_available()) == ("tcp", True)
    with backend(None, "0"):
        assert (get_rdma_backend(), is_rdma_available()) == ("none", False)


def _closed(sock: socket.socket, within: float) -> bool:
    """Whether the peer closes `sock` within `within` seconds (it sent nothing)."""
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def test_the_door_closes_idle_and_surplus_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another local process can reach a door but not pile up on it: a connection that sends no request is closed
    after FIRST_REQUEST_S, one beyond MAX_CONNECTIONS at once; a transfer afterwards still works."""
    from monarch.runtime.engine.transport import tcp
    monkeypatch.setattr(tcp, "FIRST_REQUEST_S", 0.5)
    data = torch.arange(64, dtype=torch.uint8)
    buf = RDMABuffer(data)  # the controller's door
    door = (buf._handle.owner.host, buf._handle.owner.port)
    monkeypatch.setattr(tcp, "MAX_CONNECTIONS", 3 + len(tcp._idle.get(door, [])))  # room for three idlers
    idlers = [socket.create_connection(door, timeout=T) for _ in range(3)]
    time.sleep(0.1)
    extra = socket.create_connection(door, timeout=T)
    assert _closed(extra, 2.0), "a connection beyond MAX_CONNECTIONS was kept"
    start = time.monotonic()
    assert all(_closed(s, 5.0) for s in idlers) and time.monotonic() - start < 3.0
    with backend("tcp"):
        out = torch.empty(64, dtype=torch.uint8)
        forged(buf, pid=1).read_into(out).get(timeout=T)  # another pid: through the door, not in place
    assert torch.equal(out, data)
    for s in [*idlers, extra]:
        s.close()
    buf.drop().get(timeout=T)
