"""The control plane: framing, the token handshake, and peers that send garbage or a wrong token."""
from __future__ import annotations

import logging
import socket
import time

import pytest

from monarch.actor import Actor, ProcMesh, endpoint
from monarch.errors import TransportError
from monarch.runtime.control import codec
from monarch.runtime.control.commands import Hello, Reply
from monarch.runtime.control.controller import controller

T = 30


class Echo(Actor):
    @endpoint
    def echo(self, x: object) -> object:
        return x


def test_frames_split_across_and_within_chunks() -> None:
    frames = codec.encode_frame([Hello(1, "a")]) + codec.encode_frame([Reply(i, 0, 0, True, b"x") for i in range(100)])
    reader = codec.FrameReader(1 << 20)
    bodies = [b for i in range(0, len(frames), 7) for b in reader.feed(frames[i:i + 7])]
    assert [len(codec.decode_frame(b)) for b in bodies] == [1, 100]


def test_oversize_frames_and_bad_headers_are_refused() -> None:
    with pytest.raises(TransportError, match="MONARCH_MAX_FRAME"):
        codec.FrameReader(10).feed(codec.encode_frame([b"y" * 100]))
    good = codec.Header(3, codec.ROLE_WORKER, 1, b"t" * codec.TOKEN_BYTES)
    assert codec.Header.decode(good.encode()) == good
    assert codec.Header.decode(b"GET / HTTP/1.1\r\n" + b"x" * 29) is None
    assert not good.authentic(b"u" * codec.TOKEN_BYTES)


def test_payloads_with_code_use_cloudpickle() -> None:
    assert codec.loads(codec.dumps(((1, "a", None), {"k": [1.5, b"x"]}))) == ((1, "a", None), {"k": [1.5, b"x"]})
    assert codec.loads(codec.dumps(lambda x: x + 1))(1) == 2


def _peer(payload: bytes) -> socket.socket:
    host, port = controller().address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    sock.sendall(payload)
    return sock


def _closed_by_controller(sock: socket.socket) -> bool:
    sock.settimeout(T)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.fixture(scope="module")
def echo(procs: ProcMesh):
    return procs.spawn("echo", Echo)


def test_controller_binds_to_loopback(procs: ProcMesh) -> None:
    assert controller().address.startswith("127.0.0.1:")


@pytest.mark.parametrize("payload", [
    b"\x00" * 3 + b"garbage that is not a monarch handshake at all......",
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"." * 40,
])
def test_garbage_peer_is_dropped_and_mesh_keeps_working(echo, payload: bytes, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="monarch.controller"), _peer(payload) as sock:
        assert _closed_by_controller(sock)
        assert echo.echo.call(7).get(timeout=T).values() == [7] * 4
    assert "bad handshake" in caplog.text


def test_wrong_token_is_rejected_before_decoding(echo, caplog: pytest.LogCaptureFixture) -> None:
    mesh_id = echo._mesh_id
    forged = codec.Header(mesh_id, codec.ROLE_WORKER, 0, b"\x00" * codec.TOKEN_BYTES).encode()
    evil = codec.encode_frame([Reply(1, 0, 0, True, b"\x80\x05I1\n.")])  # would be decoded if accepted
    with caplog.at_level(logging.WARNING, logger="monarch.controller"), _peer(forged + evil) as sock:
        assert _closed_by_controller(sock)
    assert "bad handshake" in caplog.text
    assert echo.echo.call("still fine").get(timeout=T).values() == ["still fine"] * 4


def test_silent_peer_is_dropped_after_the_handshake_timeout(echo, monkeypatch: pytest.MonkeyPatch) -> None:
    from monarch.runtime.control import door
    monkeypatch.setattr(door, "HANDSHAKE_TIMEOUT", 0.2)
    with _peer(b"MNR1") as sock:
        t0 = time.monotonic()
        assert _closed_by_controller(sock)
        assert time.monotonic() - t0 < 5
    assert echo.echo.call(1).get(timeout=T).values() == [1] * 4


def test_large_payload_round_trips(echo) -> None:
    blob = bytes(range(256)) * 40_000  # 10 MB: many recv chunks per frame
    assert echo.slice(dp=0, tp=0).echo.call_one(blob).get(timeout=T) == blob


def test_host_option_binds_another_address() -> None:
    from monarch.actor import this_host
    with this_host().spawn_procs(per_host={"gpus": 1}, host="127.0.0.2") as procs:
        assert procs.spawn("e", Echo).echo.call_one(5).get(timeout=T) == 5
        assert controller().door.listen("127.0.0.2").startswith("127.0.0.2:")


class Relay(Actor):
    @endpoint
    def relay(self, target, n: int, size: int) -> int:
        futures = [target.echo.call_one(bytes(size)) for _ in range(n)]  # queued, sent as one frame
        return sum(len(f.get(timeout=T)) for f in futures)


def test_large_relayed_traffic_in_both_directions_does_not_stall(procs: ProcMesh, echo) -> None:
    """Two workers relay batches to a third through the controller while it sends replies back:
    the controller must keep reading that worker while its own output to it is backed up."""
    relays = procs.slice(dp=0).spawn("relays", Relay)
    target = echo.slice(dp=1, tp=1)
    n, size = 4, 8 << 20
    assert relays.relay.call(target, n, size).get(timeout=T).values() == [n * size] * 2
