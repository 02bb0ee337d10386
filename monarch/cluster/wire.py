"""Attach mode's wire, both ends: the shared secret, agent addresses, the handshake and the commands.

A connection opens with a mutual handshake: each side proves it knows the shared secret with an
HMAC-SHA256 of the other's fresh nonce, compared in constant time before anything else is read. Then
codec frames (pickles, decoded only after the handshake) carry the frozen commands and replies below.
"""
from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from monarch import config
from monarch.cluster.k8s import DEFAULT_PORT
from monarch.errors import SpawnError
from monarch.runtime.control import codec

MAGIC = b"MNA1"
NONCE_BYTES = MAC_BYTES = 32
CONTEXT = b"monarch attach mode v1: "  # what each MAC is about, so that it proves nothing elsewhere
HELLO_BYTES = len(MAGIC) + NONCE_BYTES  # the agent's greeting
ANSWER_BYTES = HELLO_BYTES + MAC_BYTES  # the controller's answer: its nonce and its proof
DENIED = b"monarch attach: wrong secret".ljust(MAC_BYTES, b"\0")  # the agent's reply to a wrong proof
AUTH_DEADLINE_S = 1.0  # an unauthenticated peer has this long, in all, to prove it knows the secret
MAX_FRAME = 1 << 20  # commands are small
_ADDRESS = re.compile(r"tcp://(\[[0-9a-fA-F:.]+\]|[^:/\[\]\s]+)(?::(\d{1,5}))?/?\Z")
_LEN = struct.Struct("!I")  # a frame's length prefix (codec.encode_frame)


# -- commands: controller -> agent ------------------------------------------------------------------
@dataclass(frozen=True)
class Launch:
    """Start `argv` (a Hydra proxy's command line) in its own session; answered by Launched or Failed."""
    id: int
    argv: tuple[str, ...]


@dataclass(frozen=True)
class WriteToken:
    """Write the mesh token (hex) into one 0600 file per rank in `directory`; answered by Written or Failed."""
    id: int
    directory: str
    ranks: tuple[int, ...]
    token: str


@dataclass(frozen=True)
class Kill:
    """Kill the process trees of `pids`, or of everything started for this controller when empty."""
    pids: tuple[int, ...] = ()


# -- replies: agent -> controller -------------------------------------------------------------------
@dataclass(frozen=True)
class Attached:
    hostname: str


@dataclass(frozen=True)
class Refused:
    reason: str


@dataclass(frozen=True)
class Launched:
    id: int
    pid: int


@dataclass(frozen=True)
class Written:
    id: int


@dataclass(frozen=True)
class Failed:
    id: int
    reason: str


@dataclass(frozen=True)
class Exited:
    pid: int
    status: int


# -- the secret, addresses and the handshake (both sides) -------------------------------------------
def resolve_secret(secret: str | bytes | None = None) -> bytes:
    """`secret`, else MONARCH_ATTACH_SECRET, else the file named by MONARCH_ATTACH_SECRET_FILE."""
    if secret is None:
        secret = config.attach_secret() or read_secret_file(config.attach_secret_file())
    value = secret.encode() if isinstance(secret, str) else secret
    if not value:
        raise SpawnError("attach mode needs a shared secret and none was given: pass secret=..., or set "
                         "MONARCH_ATTACH_SECRET, or MONARCH_ATTACH_SECRET_FILE to a file holding it (the same "
                         "secret on the controller and on every agent)")
    return value


def read_secret_file(path: str) -> str:
    """The secret in file `path` without surrounding whitespace; "" when no file is named."""
    if not path:
        return ""
    try:
        return Path(path).read_text().strip()
    except OSError as e:
        raise SpawnError(f"cannot read the attach-mode secret from {path}: {e}") from None


def parse_address(address: str) -> tuple[str, int]:
    """(host, port) of `tcp://HOST:PORT` (PORT defaults to the agent's port, HOST may be [IPv6])."""
    m = _ADDRESS.match(address)
    if not m:
        raise SpawnError(f"{address!r} is not an attach-mode address; write tcp://HOST:PORT, e.g. "
                         f"tcp://node1:{DEFAULT_PORT}")
    return m[1].strip("[]"), int(m[2]) if m[2] else DEFAULT_PORT


def _mac(secret: bytes, side: bytes, theirs: bytes, mine: bytes) -> bytes:
    return hmac.new(secret, CONTEXT + side + theirs + mine, hashlib.sha256).digest()


@dataclass(frozen=True)
class Challenge:
    """The agent's half of the handshake, as its gate runs it (runtime/debug/gate.py): a greeting with a
    fresh nonce first; then the controller's answer (ANSWER_BYTES) to that nonce is checked, and our proof
    for its nonce is the reply; a peer that does not know the secret is answered DENIED and closed."""
    secret: bytes
    deadline_s: float = AUTH_DEADLINE_S
    answer_bytes: int = ANSWER_BYTES
    refusal: bytes = DENIED

    def greet(self) -> tuple[bytes, bytes]:
        nonce = secrets.token_bytes(NONCE_BYTES)
        return MAGIC + nonce, nonce

    def check(self, nonce: bytes, answer: bytes) -> bytes | None:
        theirs, mac = answer[len(MAGIC):-MAC_BYTES], answer[-MAC_BYTES:]
        expected = _mac(self.secret, b"controller", nonce, theirs)
        if answer[:len(MAGIC)] != MAGIC or not hmac.compare_digest(mac, expected):
            return None
        return _mac(self.secret, b"agent", theirs, nonce)


def prove_to_agent(sock: socket.socket, secret: bytes, deadline: float) -> None:
    """The controller's half: prove we know the secret, then check that the agent does too (before any
    command goes to it). SpawnError when it does not, or denies our proof; OSError for a slow peer, or one
    that closed the connection before the handshake completed (an agent that made room, a restarting one)."""
    hello = codec.recv_exact(sock, HELLO_BYTES, deadline)
    if hello[:len(MAGIC)] != MAGIC:
        raise SpawnError("it is not a monarch attach-mode agent (it did not greet as one)")
    mine = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(MAGIC + mine + _mac(secret, b"controller", hello[len(MAGIC):], mine))
    proof = codec.recv_exact(sock, MAC_BYTES, deadline)
    if proof == DENIED:
        raise SpawnError("it denied our proof: its secret is another than ours (check MONARCH_ATTACH_SECRET or "
                         "MONARCH_ATTACH_SECRET_FILE on both ends)")
    if not hmac.compare_digest(proof, _mac(secret, b"agent", mine, hello[len(MAGIC):])):
        raise SpawnError("it does not know the secret (an impostor, or an agent with another secret); nothing "
                         "was sent to it")


def read_message(sock: socket.socket, deadline: float) -> Any:
    """The first message of the next frame (after the handshake only: frames are pickles)."""
    (n,) = _LEN.unpack(codec.recv_exact(sock, _LEN.size, deadline))
    if n > MAX_FRAME:
        raise ConnectionError(f"a frame of {n} bytes is over the limit of {MAX_FRAME}")
    return codec.decode_frame(codec.recv_exact(sock, n, deadline))[0]
