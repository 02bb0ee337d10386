"""The controller's admin endpoint: other local processes (`monarch query`, `monarch top`) run SQL here.

The controller (control/controller.py) starts it when MONARCH_ADMIN is set: a thread listens on loopback
and announces its port and a random token in a file only this user can read (`monarch-<uid>/controller-
<pid>.json` in the user's runtime directory, else the temp dir; the directory must be this user's alone,
and the file is created anew, never through a link). A client sends the token first (compared in constant
time before anything else is read), then one JSON request `{"sql": ..., "timeout": s}`; the answer is JSON
`{"columns": [...], "rows": [...], "late": [...]}` (late: the ranks that did not send their events within
WAIT_S) or `{"error": ...}`. The query runs for at most `timeout` s (and never past MONARCH_QUERY_TIMEOUT),
and is cancelled when the client hangs up. A request `{"debug": true}` opens a `monarch_dbg>` console
instead (console.py): `{"line": ...}` requests, each answered `{"output", "prompt", "done"}`, until quit or
the client hangs up. Tokens are read by one event loop (gate.py: TOKEN_DEADLINE_S each, capped per
peer); only an authenticated connection gets a thread, at most MAX_CONNECTIONS at once (the next is answered
busy). Nothing a client sends is unpickled; the SQL is read-only (telemetry/store.py).
"""
from __future__ import annotations

import atexit
import json
import os
import secrets
import select
import socket
import stat
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

from monarch import config
from monarch.errors import MonarchError
from monarch.runtime.control import codec
from monarch.runtime.debug.gate import Gate, Token
from monarch.runtime.telemetry.store import Limits, Rows

_LEN = struct.Struct("!I")
MAX_REQUEST = 1 << 20
WAIT_S = 2.0  # how long a query waits for the workers' newest events; a rank busy in a long call is skipped
MAX_CONNECTIONS = 32     # authenticated connections served at once (queries, consoles); the next is told busy
TOKEN_BYTES = 32
TOKEN_DEADLINE_S = 1.0  # a new connection has this long, in all, to send its token
REQUEST_DEADLINE_S = 10.0  # an authenticated connection has this long to send its request
ANSWER_SLACK_S = 5.0     # what a client waits beyond the query's time limit and WAIT_S


RUNTIME_ROOT = "/run/user"  # where logind keeps each user's runtime directory


class UnsafeAnnounceDir(MonarchError, PermissionError):
    """The announce directory or file is not this user's alone: another user could read the token."""


def announce_dir() -> Path:
    """`monarch-<uid>` in this user's runtime directory (`$XDG_RUNTIME_DIR`, else `/run/user/<uid>`), else
    in the temp dir; made 0700 here, and refused when it is a link, another user's, or open to others."""
    uid = os.geteuid()
    runtime = Path(RUNTIME_ROOT) / str(uid)
    base = config.external("XDG_RUNTIME_DIR") or (str(runtime) if _private(runtime, uid) else tempfile.gettempdir())
    path = Path(base) / f"monarch-{uid}"
    with suppress(FileExistsError):
        os.mkdir(path, 0o700)
    if not _private(path, uid):
        st = os.lstat(path)
        raise UnsafeAnnounceDir(
            f"{path} holds the admin token of this user's controllers, but it is {_why(st, uid)}: another user "
            f"may have made it to read the token. Remove it (it is re-made 0700), or set XDG_RUNTIME_DIR to a "
            "directory only you can use, or MONARCH_ADMIN=0 to run without the admin endpoint")
    return path


def _private(path: Path, uid: int, kind: int = stat.S_IFDIR) -> bool:
    """Whether `path` itself (no link) is a `kind` file of `uid` that no one else can read or write."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_IFMT(st.st_mode) == kind and st.st_uid == uid and not st.st_mode & 0o077


def _why(st: os.stat_result, uid: int) -> str:
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if st.st_uid != uid:
        return f"owned by uid {st.st_uid}"
    return f"open to others (mode {oct(stat.S_IMODE(st.st_mode))})" if stat.S_ISDIR(st.st_mode) else "not a directory"


def send_json(sock: socket.socket, obj: Any) -> None:
    data = json.dumps(obj, default=str).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_json(sock: socket.socket, limit: int = 1 << 30, deadline: float | None = None) -> Any:
    (n,) = _LEN.unpack(codec.recv_exact(sock, _LEN.size, deadline))
    if n > limit:
        raise ValueError(f"a message of {n} bytes is over the limit of {limit}")
    return json.loads(codec.recv_exact(sock, n, deadline))


class AdminServer:
    """Answers SQL from local clients that know the token, each authenticated connection on its own thread."""

    def __init__(self, answer: Callable[..., Rows]) -> None:
        self.answer = answer  # (sql, seconds to wait for the workers' events, limits=) -> rows: the controller's
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.path = announce_dir() / f"controller-{os.getpid()}.json"
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        with suppress(FileNotFoundError):  # a stale one of an earlier process with this pid (or a link)
            os.unlink(self.path)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"pid": os.getpid(), "port": self.port, "token": self.token.hex()}, f)
        atexit.register(self.close)
        self.gate = Gate(self.listener, Token(self.token, TOKEN_DEADLINE_S), self._admit)
        threading.Thread(target=self.gate.run, name="monarch-admin", daemon=True).start()

    def close(self) -> None:
        """Withdraw the announcement and stop accepting (the gate closes the listener and what waits)."""
        with suppress(OSError):
            self.path.unlink()
        with suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)

    def _admit(self, conn: socket.socket, address: str) -> None:
        """An authenticated connection: served on a thread of its own, or told that the slots are taken."""
        if self._slots.acquire(blocking=False):
            try:
                threading.Thread(target=self._session, args=(conn,), name="monarch-admin-conn", daemon=True).start()
            except RuntimeError:  # no thread to be had now: the client may try again
                self._slots.release()
                conn.close()
            return
        with conn, suppress(OSError):
            conn.settimeout(TOKEN_DEADLINE_S)
            send_json(conn, {"error": f"busy: the controller serves {MAX_CONNECTIONS} queries and consoles at "
                                      "once; try again"})

    def _session(self, conn: socket.socket) -> None:
        try:
            with conn, suppress(OSError, ValueError, ConnectionError):
                self._answer(conn)
        finally:
            self._slots.release()

    def _answer(self, conn: socket.socket) -> None:
        request = recv_json(conn, MAX_REQUEST, time.monotonic() + REQUEST_DEADLINE_S)
        if request.get("debug"):
            self._debug(conn)
            return
        try:
            limits = Limits(query_limit(request.get("timeout")), lambda: hung_up(conn))
            rows = self.answer(str(request["sql"]), WAIT_S, limits=limits)
            send_json(conn, {"columns": rows.columns, "rows": [list(r) for r in rows], "late": rows.late})
        except Exception as e:  # noqa: BLE001 - the client shows the error
            send_json(conn, {"error": f"{type(e).__name__}: {e}"})

    def _debug(self, conn: socket.socket) -> None:
        """A console over the ranks paused in pdb: lines until quit (no deadline: a person types them)."""
        from monarch.runtime.debug.console import BANNER, DebugConsole
        console = DebugConsole()
        conn.settimeout(None)
        send_json(conn, {"output": BANNER, "prompt": console.prompt, "done": False})
        while not console.done:
            line = str(recv_json(conn, MAX_REQUEST).get("line", ""))
            send_json(conn, {"output": console.handle(line), "prompt": console.prompt, "done": console.done})


def query_limit(asked: Any) -> float:
    """Seconds a client's query may run: what it asked for (a positive number), never past a nonzero
    MONARCH_QUERY_TIMEOUT (0: no limit)."""
    most = config.query_timeout()
    if not isinstance(asked, (int, float)) or asked <= 0:
        return most
    return min(float(asked), most) if most > 0 else float(asked)


def hung_up(conn: socket.socket) -> bool:
    """Whether the client closed its end (it sends nothing more while its query runs)."""
    poll = select.poll()
    poll.register(conn, select.POLLIN)
    if not poll.poll(0):
        return False
    try:
        return conn.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def controllers() -> list[dict[str, Any]]:
    """Announcements of the live controllers of this user, newest first."""
    found = []
    for path in announce_dir().glob("controller-*.json"):
        if not _private(path, os.geteuid(), stat.S_IFREG):
            continue  # not written by a controller of this user
        with suppress(OSError, ValueError):
            info = json.loads(path.read_text())
            os.kill(int(info["pid"]), 0)
            found.append((path.stat().st_mtime, info))
    return [info for _, info in sorted(found, key=lambda x: x[0], reverse=True)]


def _find(pid: int | None) -> dict[str, Any]:
    live = [c for c in controllers() if pid is None or c["pid"] == pid]
    if not live:
        raise ConnectionError("no running monarch controller found" + (f" with pid {pid}" if pid else ""))
    return live[0]


def open_console(pid: int | None = None, timeout: float = 30.0) -> tuple[socket.socket, dict[str, Any]]:
    """Open the `monarch_dbg>` console of a controller (the newest unless `pid` is given): the connection
    (send `{"line": ...}` with send_json, read the answers with recv_json) and the first answer (the banner)."""
    info = _find(pid)
    sock = socket.create_connection(("127.0.0.1", info["port"]), timeout=timeout)
    sock.settimeout(None)  # a pdb line may run for long
    sock.sendall(bytes.fromhex(info["token"]))
    send_json(sock, {"debug": True})
    answer = recv_json(sock)
    if "error" in answer:
        sock.close()
        raise ConnectionError(answer["error"])
    return sock, answer


def query(sql: str, pid: int | None = None, timeout: float = 30.0) -> dict[str, Any]:
    """Run `sql` on a controller (the newest one unless `pid` is given), for at most `timeout` s (the
    controller's MONARCH_QUERY_TIMEOUT caps it); leaving early (Ctrl+C) cancels it there."""
    info = _find(pid)
    with socket.create_connection(("127.0.0.1", info["port"]), timeout=timeout + WAIT_S + ANSWER_SLACK_S) as sock:
        try:
            sock.sendall(bytes.fromhex(info["token"]))
            send_json(sock, {"sql": sql, "timeout": timeout})
            return recv_json(sock)
        except ConnectionError:
            raise ConnectionError(f"controller {info['pid']} closed the connection unanswered (too many of "
                                  "this user's connections waiting to authenticate?); try again") from None
