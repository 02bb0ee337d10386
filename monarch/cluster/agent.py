"""Attach mode, the worker host's side: an agent waits for a controller and starts MPI proxies for it.

`run_worker_loop_forever` (`python -m monarch worker`) listens on tcp://HOST:PORT and authenticates each
peer (runtime/debug/gate.py, wire.py). One controller at a time: the next is refused with a reason. What the
agent started for a controller is killed on `Kill` or when its connection closes, and the agent waits for the next one.
"""
from __future__ import annotations

import ctypes
import logging
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import threading
import time
from contextlib import suppress
from pathlib import Path
from typing import Any, Callable, NoReturn

from monarch import config
from monarch.cluster.k8s import DEFAULT_PORT
from monarch.cluster.wire import (MAX_FRAME, Attached, Challenge, Exited, Failed, Kill, Launch, Launched, Refused,
                                  WriteToken, Written, parse_address, resolve_secret)
from monarch.errors import SpawnError
from monarch.runtime.control import codec
from monarch.runtime.control.bootstrap import token_file
from monarch.runtime.control.launch import REMOTE_TOKEN_ROOT
from monarch.runtime.debug.gate import Caps, Gate, address_of

log = logging.getLogger("monarch.agent")

SWEEP_S = 1.0  # how often an attached agent reaps the orphans of what it started
END_WAIT_S = 10.0  # how long a new controller waits for the cleanup after the previous one left
_TOKEN_DIR = re.compile(r"monarch-token-[0-9a-f]+\Z")


# -- the agent --------------------------------------------------------------------------------------
def run_worker_loop_forever(address: str = f"tcp://0.0.0.0:{DEFAULT_PORT}",
                            secret: str | bytes | None = None) -> None:
    """Wait for controllers on `address` (tcp://HOST:PORT; port 0 picks a free one), forever; prints
    `monarch worker listening on tcp://HOST:PORT` once listening. The secret: `secret`, else
    MONARCH_ATTACH_SECRET, else the file MONARCH_ATTACH_SECRET_FILE. SIGTERM ends it, after it killed
    what it started."""
    agent = Agent(address, resolve_secret(secret))
    print(f"monarch worker listening on {agent.address}", flush=True)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit)
    try:
        agent.serve_forever()
    finally:
        agent.close()


def _exit(signum: int, frame: Any) -> NoReturn:
    raise SystemExit(128 + signum)


class Agent:
    """Listens for controllers and serves one at a time (a Session); others are refused meanwhile."""

    def __init__(self, address: str, secret: bytes) -> None:
        host, port = parse_address(address)
        try:
            self.listener = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else
                                                 socket.AF_INET)
        except OSError as e:
            raise SpawnError(f"the agent cannot listen on {address}: {e}") from None
        self.address = f"tcp://{f'[{host}]' if ':' in host else host}:{self.listener.getsockname()[1]}"
        self.secret = secret
        self.session: Session | None = None
        self._lock = threading.Lock()
        with suppress(OSError, AttributeError):  # not Linux: orphans of what we start are not ours to kill
            ctypes.CDLL(None, use_errno=True).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER

    def serve_forever(self) -> None:
        Gate(self.listener, Challenge(self.secret), self._admit, Caps(per_peer=64, total=512), log, address_of).run()

    def _admit(self, sock: socket.socket, peer: str) -> None:
        """An authenticated controller's connection: served (or refused) on a thread of its own."""
        threading.Thread(target=self._connection, args=(sock, peer), name="monarch-agent", daemon=True).start()

    def close(self) -> None:
        self.listener.close()
        with self._lock:
            session = self.session
        if session is not None:
            session.end()

    def _connection(self, sock: socket.socket, peer: str) -> None:
        with sock:
            session = self._claim(sock, peer)
            if session is not None:
                self._serve(session)

    def _claim(self, sock: socket.socket, peer: str) -> Session | None:
        """The new controller's session, or None once it is refused: another one is attached. One whose
        connection has closed and is being cleaned up is waited for (up to END_WAIT_S), not counted."""
        with self._lock:
            current = self.session
            if current is None:
                self.session = Session(sock, peer)
                return self.session
        if current.ending.is_set() and current.ended.wait(END_WAIT_S):
            return self._claim(sock, peer)
        log.info("refused controller %s: attached to %s", peer, current.peer)
        with suppress(OSError):
            sock.sendall(codec.encode_frame([Refused(
                f"attached to the controller at {current.peer} since {current.since}; an agent serves one "
                "controller at a time, so that one must stop (close its connection) first")]))
        return None

    def _serve(self, session: Session) -> None:
        log.info("controller %s attached", session.peer)
        try:
            session.serve()
        finally:
            session.ending.set()
            session.end()
            with self._lock:
                self.session = None
            session.ended.set()
            log.info("controller %s detached; what it started is gone, waiting for the next one", session.peer)


class Session:
    """One attached controller: its connection and what the agent started for it."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock, self.peer = sock, peer
        self.since = time.strftime("%Y-%m-%d %H:%M:%S")
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.token_dirs: set[str] = set()
        self._send_lock = threading.Lock()
        self.ending = threading.Event()  # the connection closed: what it started is being killed
        self.ended = threading.Event()  # ... and the agent is free

    def send(self, msg: Any) -> None:
        with self._send_lock, suppress(OSError):  # the controller is gone: serve() sees it too
            self.sock.sendall(codec.encode_frame([msg]))

    def serve(self) -> None:
        """Answer commands until the controller's connection closes (or sends what cannot be decoded)."""
        self.send(Attached(socket.gethostname()))
        reader = codec.FrameReader(MAX_FRAME)
        self.sock.settimeout(SWEEP_S)
        while True:
            try:
                data = self.sock.recv(codec.RECV_BYTES)
            except TimeoutError:
                reap_orphans(set(self.procs))
                continue
            except OSError:
                return
            if not data:
                return
            try:
                msgs = [m for body in reader.feed(data) for m in codec.decode_frame(body)]
            except Exception as e:  # noqa: BLE001 - a bad frame (unpickling raises many kinds) ends the session
                log.warning("dropped controller %s: it sent an undecodable frame: %r", self.peer, e)
                return
            for msg in msgs:
                handler = HANDLERS.get(type(msg))
                if handler is None:
                    log.warning("ignored a %s from controller %s", type(msg).__name__, self.peer)
                else:
                    handler(self, msg)

    def watch(self, proc: subprocess.Popen[bytes]) -> None:
        self.send(Exited(proc.pid, proc.wait()))

    def end(self) -> None:
        """Kill everything started for this controller (orphans included) and remove its token files."""
        kill_descendants(set(self.procs))
        for proc in self.procs.values():
            with suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        reap_orphans(set())
        for d in self.token_dirs:
            shutil.rmtree(d, ignore_errors=True)


def _launch(session: Session, msg: Launch) -> None:
    env = dict(os.environ)
    env.pop(config.ATTACH_SECRET, None)  # what the agent starts runs the controller's code, not ours
    try:
        proc = subprocess.Popen(list(msg.argv), env=env, stdin=subprocess.DEVNULL, stdout=2, start_new_session=True)
    except (OSError, ValueError, IndexError) as e:
        session.send(Failed(msg.id, f"cannot start {msg.argv[:1]}: {e}"))
        return
    session.procs[proc.pid] = proc
    session.send(Launched(msg.id, proc.pid))
    threading.Thread(target=session.watch, args=(proc,), name="monarch-agent-watch", daemon=True).start()


def _write_token(session: Session, msg: WriteToken) -> None:
    try:
        write_token_files(msg.directory, msg.ranks, msg.token)
    except (OSError, ValueError) as e:
        session.send(Failed(msg.id, f"cannot write the mesh token into {msg.directory}: {e}"))
        return
    session.token_dirs.add(msg.directory)
    session.send(Written(msg.id))


def _kill(session: Session, msg: Kill) -> None:
    roots = [pid for pid in msg.pids or session.procs if pid in session.procs]
    found = descendants(set(roots))
    for pid in roots:
        session.procs[pid].kill()  # a Popen kills its own child only while it is not reaped
    _signal(found)


HANDLERS: dict[type, Callable[[Session, Any], None]] = {Launch: _launch, WriteToken: _write_token, Kill: _kill}


def write_token_files(directory: str, ranks: tuple[int, ...], token: str) -> None:
    """One 0600 file per rank (bootstrap.token_file) in `directory`, a 0700 directory of ours that
    launch.TokenHandover named under REMOTE_TOKEN_ROOT; agents on one machine may share it."""
    path = Path(directory)
    if path.parent != Path(REMOTE_TOKEN_ROOT) or not _TOKEN_DIR.match(path.name):
        raise ValueError(f"it is not a token directory monarch-token-<hex> under {REMOTE_TOKEN_ROOT}")
    bytes.fromhex(token)
    with suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise ValueError("it exists and is not a directory of ours")
    os.chmod(path, 0o700)
    for rank in ranks:
        fd = os.open(token_file(directory, rank), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token)


# -- processes --------------------------------------------------------------------------------------
def _table() -> dict[int, tuple[str, int]]:
    """pid -> (state, parent pid) of every process, from /proc."""
    out = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with suppress(OSError, IndexError, ValueError):
                fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
                out[int(entry.name)] = (fields[0], int(fields[1]))
    return out


def descendants(roots: set[int]) -> set[int]:
    """The live (not zombie) descendants of `roots`."""
    children: dict[int, list[int]] = {}
    for pid, (state, ppid) in _table().items():
        if state != "Z":
            children.setdefault(ppid, []).append(pid)
    found: set[int] = set()
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _signal(pids: set[int]) -> None:
    for pid in pids:
        with suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def kill_descendants(tracked: set[int], timeout: float = 5.0) -> None:
    """SIGKILL every descendant of this process until none is left; zombies not in `tracked` (the
    Popens, reaped by their watchers) are reaped here: as a subreaper the agent inherits the orphans."""
    deadline = time.monotonic() + timeout
    while (left := descendants({os.getpid()})) and time.monotonic() < deadline:
        _signal(left)
        time.sleep(0.02)
        reap_orphans(tracked)


def reap_orphans(tracked: set[int]) -> None:
    """Reap the zombie children of this process that no Popen of ours waits for."""
    me = os.getpid()
    for pid, (state, ppid) in _table().items():
        if ppid == me and state == "Z" and pid not in tracked:
            with suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
