"""Attach mode, the controller's side: `attach_to_workers` returns a HostMesh over waiting agents.

Each agent (agent.py) is authenticated both ways and keeps its connection while this process lives (or
until `detach`); when it closes, the agent kills what it started for us. A mesh is one MPI job: mpiexec
with Hydra's manual launcher prints one proxy command line per host and each goes to its host's agent.
The mesh token goes to the agents over their connections, never over MPI's.
"""
from __future__ import annotations

import itertools
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

from monarch import config
from monarch.cluster import wire
from monarch.cluster.hosts import HostMesh
from monarch.cluster.ssh import hydra_iface
from monarch.errors import SpawnError
from monarch.runtime.control import codec, launch
from monarch.shape import Shape

log = logging.getLogger("monarch.attach")

LAUNCH, LAUNCH_END = b"HYDRA_LAUNCH: ", b"HYDRA_LAUNCH_END\n"  # what mpiexec -launcher manual prints
RETRY_S, RETRY_MAX_S = 0.05, 1.0  # the first pause between tries to attach to an agent, doubled up to the most
_links: dict[tuple[str, bytes], AgentLink] = {}  # (address, secret) -> this process's connection to it
_links_lock = threading.Lock()


def attach_to_workers(workers: list[str], secret: str | bytes | None = None, timeout: float = 30.0) -> HostMesh:
    """A HostMesh over the hosts of the agents at `workers` (`tcp://HOST:PORT`, one agent per host, in
    rank order), each started with `python -m monarch worker` or `run_worker_loop_forever`.

    The secret: `secret`, else MONARCH_ATTACH_SECRET, else the file MONARCH_ATTACH_SECRET_FILE. Agents
    that do not listen yet, or close the connection before the handshake completed, are tried again
    (pausing longer each time, up to 1 s) for up to `timeout` s in all. An agent serves one controller at a
    time; this process keeps its agents until it exits or calls `detach`, and attaching again reuses them.
    """
    if not workers:
        raise SpawnError("attach_to_workers needs at least one worker address (tcp://HOST:PORT)")
    key = wire.resolve_secret(secret)
    hosts = [wire.parse_address(w)[0] for w in workers]
    shared = sorted({h for h in hosts if hosts.count(h) > 1})
    if shared:
        raise SpawnError(f"several agents on one host ({', '.join(shared)}) in {workers}: MPI names ranks' hosts "
                         "by these names, so attach to one agent per host and start several ranks on it with "
                         "spawn_procs(per_host=...); agents on one machine may listen on distinct loopback "
                         "addresses (127.0.0.1, 127.0.0.2, ...)")
    deadline = time.monotonic() + timeout
    made: list[AgentLink] = []
    try:
        links = [_link(w, key, deadline, made) for w in workers]
    except SpawnError:
        for link in made:
            _forget(link)
        raise
    return HostMesh(hosts, AttachLauncher(links))


def detach(workers: list[str] | None = None) -> None:
    """Close this process's connections to the agents at `workers` (default: all of them). Returns once
    each has killed what it started for us (stop the meshes on them first) and waits for the next controller."""
    with _links_lock:
        links = [link for (address, _), link in _links.items() if workers is None or address in workers]
    for link in links:
        _forget(link)


def _link(address: str, secret: bytes, deadline: float, made: list[AgentLink]) -> AgentLink:
    with _links_lock:
        link = _links.get((address, secret))
        if link is None or link.lost:
            link = _links[(address, secret)] = AgentLink.connect(address, secret, deadline)
            made.append(link)
        return link


def _forget(link: AgentLink) -> None:
    with _links_lock:
        for key in [k for k, v in _links.items() if v is link]:
            del _links[key]
    link.close()


@dataclass
class _Pending:
    """A request's reply, once the reader thread has it (None: the connection ended first)."""
    done: threading.Event = field(default_factory=threading.Event)
    reply: Any = None


class AgentLink:
    """One authenticated connection to an agent: requests (`ask`, then `answer`) and a thread reading replies."""

    def __init__(self, address: str, sock: socket.socket) -> None:
        self.address, self.sock = address, sock
        self.host = wire.parse_address(address)[0]
        self.lost = ""  # why the connection ended, once it did
        self._closing = False
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name=f"monarch-attach-{self.host}", daemon=True)
        self._reader.start()

    @classmethod
    def connect(cls, address: str, secret: bytes, deadline: float) -> AgentLink:
        """Attach to the agent at `address`, tried again (pausing RETRY_S, doubled up to RETRY_MAX_S) until
        `deadline` while it cannot be reached or closes the connection before the handshake completed (an
        agent still starting, a pod whose DNS name is not published yet, an agent that made room)."""
        pause = RETRY_S
        while True:
            try:
                return cls._try(address, secret, deadline)
            except OSError as e:
                if time.monotonic() + pause >= deadline:
                    raise SpawnError(f"cannot attach to the agent at {address}: {e or type(e).__name__}; is "
                                     "`python -m monarch worker --listen ...` running there, and its port open to "
                                     "this host?") from None
                log.debug("the agent at %s: %s; trying again in %.2f s", address, e, pause)
            time.sleep(pause)
            pause = min(2 * pause, RETRY_MAX_S)

    @classmethod
    def _try(cls, address: str, secret: bytes, deadline: float) -> AgentLink:
        """One attempt; OSError where another may succeed, SpawnError where none would."""
        host, port = wire.parse_address(address)
        sock = socket.create_connection((host, port), timeout=max(0.05, deadline - time.monotonic()))
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            wire.prove_to_agent(sock, secret, deadline)
            greeting = wire.read_message(sock, deadline)
            if isinstance(greeting, wire.Refused):
                raise SpawnError(f"it refused: {greeting.reason}")
            if not isinstance(greeting, wire.Attached):
                raise SpawnError(f"it greeted with a {type(greeting).__name__}, not Attached")
        except SpawnError as e:
            sock.close()
            raise SpawnError(f"attaching to the agent at {address} failed: {e}") from None
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)
        log.debug("attached to the agent at %s (host %s)", address, greeting.hostname)
        return cls(address, sock)

    def send(self, msg: Any) -> None:
        try:
            with self._send_lock:
                self.sock.sendall(codec.encode_frame([msg]))
        except OSError as e:
            raise SpawnError(f"lost the agent at {self.address}: {self.lost or e}") from None

    def ask(self, kind: type, **fields: Any) -> int:
        """Send request `kind(id, **fields)`; its id, for `answer`."""
        if self.lost:
            raise SpawnError(f"lost the agent at {self.address}: {self.lost}")
        request_id = next(self._ids)
        self._pending[request_id] = _Pending()
        self.send(kind(id=request_id, **fields))
        return request_id

    def answer(self, request_id: int, deadline: float) -> Any:
        """The agent's reply to request `request_id`; SpawnError for Failed, a lost agent or the deadline."""
        pending = self._pending[request_id]
        done = pending.done.wait(max(0.0, deadline - time.monotonic()))
        del self._pending[request_id]
        if not done:
            raise SpawnError(f"the agent at {self.address} did not answer within MONARCH_SPAWN_TIMEOUT")
        if pending.reply is None:
            raise SpawnError(f"lost the agent at {self.address}: {self.lost}")
        if isinstance(pending.reply, wire.Failed):
            raise SpawnError(f"the agent at {self.address}: {pending.reply.reason}")
        return pending.reply

    def close(self, timeout: float = 10.0) -> None:
        """End our side and wait (up to `timeout` s) for the agent to close its own: by then it has killed
        what it started for us and serves the next controller."""
        self._closing = True
        with suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)
        self._reader.join(timeout)
        self.sock.close()

    def _read(self) -> None:
        reader = codec.FrameReader(wire.MAX_FRAME)
        try:
            while data := self.sock.recv(codec.RECV_BYTES):
                for body in reader.feed(data):
                    for msg in codec.decode_frame(body):
                        self._on(msg)
            self.lost = "it closed the connection"
        except Exception as e:  # noqa: BLE001 - the connection is gone (OSError) or sent garbage: both end it
            self.lost = repr(e)
        for pending in list(self._pending.values()):
            pending.done.set()
        if not self._closing:
            log.warning("monarch: lost the attach-mode agent at %s: %s", self.address, self.lost)

    def _on(self, msg: Any) -> None:
        if isinstance(msg, wire.Exited):
            log.debug("agent %s: process %d exited with status %d", self.address, msg.pid, msg.status)
            return
        pending = self._pending.get(msg.id)
        if pending is not None:
            pending.reply = msg
            pending.done.set()


class AttachLauncher:
    """Ranks on the hosts of attached agents; host i (agent i) runs ranks i*k .. i*k+k-1."""
    local = False
    kill_signal = signal.SIGKILL  # the proxies end with mpiexec (their upstream closes), and end their ranks

    def __init__(self, links: list[AgentLink]) -> None:
        self.links = list(links)
        self.hosts = [link.host for link in self.links]

    def route(self) -> str:
        """The local address of our connection to the first agent: its host reaches it."""
        return self.links[0].sock.getsockname()[0]

    def command(self, shape: Shape, worker: list[str], advertise: str) -> list[str]:
        per_host = len(shape) // len(self.hosts)
        return [launch.find_mpiexec(), "-n", str(len(shape)), "-hosts", ",".join(self.hosts), "-ppn",
                str(per_host), "-launcher", "manual", *hydra_iface(advertise, self.route()), *worker]

    def hand_over(self, token: str, directory: str, per_host: int) -> None:
        """Each agent writes the token files of its host's ranks, at once."""
        deadline = time.monotonic() + config.spawn_timeout()
        asked = [(link, link.ask(wire.WriteToken, directory=directory, token=token,
                                 ranks=tuple(range(i * per_host, (i + 1) * per_host))))
                 for i, link in enumerate(self.links)]
        for link, request_id in asked:
            link.answer(request_id, deadline)

    def start(self, cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        """mpiexec, then each proxy it asks for on its agent's host; the Popen's pipes are left unread
        after the proxies' command lines."""
        env = {k: v for k, v in env.items() if k != config.ATTACH_SECRET}
        proc = launch.start(cmd, env)
        deadline = time.monotonic() + config.spawn_timeout()
        started: list[tuple[AgentLink, int]] = []
        try:
            proxies = _proxy_commands(proc, deadline, len(self.links))
            asked = [(link, link.ask(wire.Launch, argv=tuple(argv)))
                     for link, argv in zip(self.links, proxies, strict=True)]
            for link, request_id in asked:
                started.append((link, link.answer(request_id, deadline).pid))
        except SpawnError as e:
            for link, pid in started:
                with suppress(SpawnError):
                    link.send(wire.Kill((pid,)))
            launch.kill_group(proc)
            proc.wait()
            assert proc.stderr is not None
            err = proc.stderr.read().decode(errors="replace").strip() or "(nothing)"
            raise SpawnError(f"{e}\nmpiexec's stderr: {err}") from None
        return proc

    def subset(self, hosts: list[str]) -> AttachLauncher:
        by_host = {link.host: link for link in self.links}
        return AttachLauncher([by_host[h] for h in hosts])

    def release(self) -> None:
        """Let the agents go: each kills what it still runs for us and waits for the next controller."""
        for link in self.links:
            _forget(link)


def _proxy_commands(proc: subprocess.Popen[bytes], deadline: float, hosts: int) -> list[list[str]]:
    """The proxies' command lines that `mpiexec -launcher manual` prints, in proxy-id (= host) order. Read
    from the pipe's file descriptor, so that the Popen's buffered reader holds nothing of it."""
    assert proc.stdout is not None
    fd, out = proc.stdout.fileno(), b""
    while LAUNCH_END not in out:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise SpawnError(f"mpiexec printed no proxy command lines within {config.spawn_timeout()} s "
                             "(MONARCH_SPAWN_TIMEOUT)")
        data = os.read(fd, 65536)
        if not data:
            raise SpawnError("mpiexec exited before printing its proxies' command lines")
        out += data
    head, _, rest = out.partition(LAUNCH_END)
    if rest:  # nothing follows before the proxies run; were there, it is the job's output
        sys.stdout.write(rest.decode(errors="replace"))
    commands = [ln[len(LAUNCH):].decode().split() for ln in head.splitlines() if ln.startswith(LAUNCH)]
    try:
        commands.sort(key=lambda argv: int(argv[argv.index("--proxy-id") + 1]))
    except (ValueError, IndexError):
        raise SpawnError(f"mpiexec printed a proxy command line without --proxy-id: {commands}") from None
    if len(commands) != hosts:
        raise SpawnError(f"mpiexec printed {len(commands)} proxy command lines for {hosts} hosts")
    return commands
