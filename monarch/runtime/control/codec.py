"""Bytes on the control plane: the authentication handshake, length-prefixed frames and payload pickling.

A connection opens with a fixed-size raw header (magic, mesh id, role, rank, token) that is checked
before anything is decoded; then frames of `!I` length + a pickled list of messages follow, at most
MONARCH_MAX_FRAME bytes (a receiver drops a connection that sends more, so senders refuse). User payloads
use plain pickle when they are plain data and cloudpickle otherwise (classes defined in `__main__`); code
pickled by value keeps its file name and brings that file's lines, for tracebacks and pdb on the workers.
"""
from __future__ import annotations

import hmac
import io
import linecache
import pickle
import socket
import struct
import time
import types
from collections import ChainMap
from dataclasses import dataclass
from typing import Any, Callable

import cloudpickle

from monarch.errors import RemoteError, TransportError

MAGIC = b"MNR1"
TOKEN_BYTES = 32
_HEADER = struct.Struct(f"!4sIBI{TOKEN_BYTES}s")
HEADER_SIZE = _HEADER.size
_LEN = struct.Struct("!I")
ROLE_WORKER, ROLE_MONITOR = 0, 1
RECV_BYTES = 65536  # per recv call; larger buffers cost an mmap per call
_PLAIN = (int, float, str, bytes, bool, type(None))
SOURCE_LIMIT = 1 << 20  # bytes: a larger source file does not travel with its code


@dataclass(frozen=True)
class Header:
    """The handshake a peer opens its connection with."""
    mesh_id: int
    role: int
    rank: int
    token: bytes

    def encode(self) -> bytes:
        return _HEADER.pack(MAGIC, self.mesh_id, self.role, self.rank, self.token)

    @staticmethod
    def decode(raw: bytes) -> Header | None:
        """The header, or None when `raw` is not a well-formed monarch header."""
        if len(raw) != HEADER_SIZE:
            return None
        magic, mesh_id, role, rank, token = _HEADER.unpack(raw)
        if magic != MAGIC or role not in (ROLE_WORKER, ROLE_MONITOR):
            return None
        return Header(mesh_id, role, rank, token)

    def authentic(self, token: bytes) -> bool:
        return hmac.compare_digest(self.token, token)


def encode_frame(messages: list[Any]) -> bytes:
    """One frame carrying many messages."""
    body = pickle.dumps(messages, protocol=5)
    return _LEN.pack(len(body)) + body


def fits(frame: bytes, limit: int) -> bool:
    """Whether a receiver whose MONARCH_MAX_FRAME is `limit` accepts this encoded frame."""
    return len(frame) - _LEN.size <= limit


def too_large(what: str, frame: bytes, limit: int) -> TransportError:
    """The error of a frame the sender refuses (the receiver would drop the connection)."""
    return TransportError(
        f"{what} is {len(frame) - _LEN.size} bytes, over the control-plane frame limit of {limit} bytes "
        "(MONARCH_MAX_FRAME), so it was not sent; the mesh keeps working. Keep large data out of pickled "
        "arguments and return values: hold tensors on the mesh as MeshTensors (monarch.distribute_tensor, "
        "the monarch factories) and fetch only what you need (monarch.fetch, .full_tensor() of a slice), or "
        "raise MONARCH_MAX_FRAME for the controller and its workers alike")


def encode_frames(messages: list[Any], limit: int, refuse: Callable[[Any, bytes], Any]) -> bytes:
    """`messages` as frames a receiver with `limit` accepts: one frame when they fit together, else one
    frame per message, where a message too large alone is replaced by `refuse(message, its frame)` (or
    dropped when that gives None)."""
    frame = encode_frame(messages)
    if fits(frame, limit):
        return frame
    frames = []
    for msg in messages:
        one = encode_frame([msg])
        if not fits(one, limit):
            msg = refuse(msg, one)
            if msg is None:
                continue
            one = encode_frame([msg])
        frames.append(one)
    return b"".join(frames)


class FrameReader:
    """Incremental frame splitter: feed received bytes, get whole frame bodies back."""

    def __init__(self, max_frame: int) -> None:
        self._buf = bytearray()
        self.max_frame = max_frame  # the controller sets a mesh's own once its peer authenticated

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf
        buf += data
        out, pos = [], 0
        while len(buf) - pos >= 4:
            (n,) = _LEN.unpack_from(buf, pos)
            if n > self.max_frame:
                raise TransportError(f"frame of {n} bytes exceeds MONARCH_MAX_FRAME={self.max_frame}")
            if len(buf) - pos - 4 < n:
                break
            out.append(bytes(buf[pos + 4:pos + 4 + n]))
            pos += 4 + n
        del buf[:pos]
        return out


def decode_frame(body: bytes) -> list[Any]:
    msgs = pickle.loads(body)
    if not isinstance(msgs, list):
        raise TransportError(f"frame decoded to {type(msgs).__name__}, not a list of messages")
    return msgs


def _is_plain(obj: Any, depth: int = 0) -> bool:
    if isinstance(obj, _PLAIN):
        return True
    if depth > 3:
        return False
    if type(obj) in (tuple, list):
        return all(_is_plain(x, depth + 1) for x in obj)
    if type(obj) is dict:
        return all(type(k) is str and _is_plain(v, depth + 1) for k, v in obj.items())
    return False


def dumps(obj: Any) -> bytes:
    """Pickle a user payload: plain pickle for plain data, cloudpickle for code and `__main__` classes."""
    if _is_plain(obj):
        return pickle.dumps(obj, protocol=5)
    buf = io.BytesIO()
    _Pickler(buf, protocol=5).dump(obj)
    return buf.getvalue()


def _code_reduce(code: types.CodeType) -> tuple[Any, tuple[Any, ...]]:
    """cloudpickle's reduction of a code object (which names its file `<dynamic-code>`), with the real file
    name and that file's lines: one list per file, which the pickle memo sends once."""
    make, args = cloudpickle.Pickler.dispatch_table[types.CodeType](code)
    name = code.co_filename
    lines = linecache.getlines(name)
    entry = linecache.cache.get(name)
    if entry is None or len(entry) < 4 or entry[0] > SOURCE_LIMIT:
        lines = []
    return _code_with_source, (make, tuple(name if a == "<dynamic-code>" else a for a in args), name, lines)


def _code_with_source(make: Callable[..., types.CodeType], args: tuple[Any, ...], name: str,
                      lines: list[str]) -> types.CodeType:
    """Unpickle a code object; its file's lines go into linecache (never checked against a file: mtime
    None), so tracebacks and pdb here show the source of a `__main__` class or a notebook cell."""
    if lines:
        linecache.cache[name] = (sum(map(len, lines)), None, lines, name)
    return make(*args)


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, with code objects reduced by `_code_reduce`."""
    dispatch_table = ChainMap({types.CodeType: _code_reduce}, *cloudpickle.Pickler.dispatch_table.maps)


def dumps_data(obj: Any) -> bytes:
    """Pickle monarch's own data (instructions, tensors): no code, so plain pickle always suffices."""
    return pickle.dumps(obj, protocol=5)


def loads(data: bytes) -> Any:
    return pickle.loads(data)


def loads_error(data: bytes) -> BaseException:
    """A pickled remote error; one that does not unpickle here becomes a RemoteError that says why."""
    try:
        return loads(data)
    except Exception as x:  # noqa: BLE001 - an error that does not unpickle here is still a failure
        return RemoteError(f"(the error did not unpickle on the controller: {type(x).__name__}: {x})")


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """`n` bytes from a blocking `sock`; TimeoutError once `deadline` (time.monotonic) has passed, however
    the bytes trickle in (a handshake's deadline, which a slow peer cannot stretch)."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{len(buf)} of {n} bytes arrived before the deadline")
            sock.settimeout(left)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        buf += chunk
    return bytes(buf)
