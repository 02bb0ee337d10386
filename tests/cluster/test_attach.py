"""Attach mode on this host: agents (`python -m monarch worker`) on the loopback addresses 127.0.0.1, .2 and .3.

A controller attaches to two of them, spawns a mesh across both twice (actors, a sharded op equal to torch,
rank i under agent i, no secret or token left anywhere); the handshake turns away a wrong secret, garbage,
a silent peer and an impostor agent, and a second controller while one is attached; a controller that
vanishes (kill -9 included) leaves nothing behind and the agents serve the next one. Connections held open
or a flood of bad peers keep no controller out and the agent's log short; a controller whose agent closes
the connection before the handshake, or is not listening yet, tries again.
"""
from __future__ import annotations

import os
import re
import secrets
import select
import selectors
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import monarch
from monarch import Shard, SpawnError
from monarch.actor import Actor, ProcMesh, current_rank, endpoint
from monarch.cluster import wire
from monarch.cluster.agent import descendants
from monarch.cluster.attach import AgentLink, attach_to_workers, detach
from monarch.runtime.control import codec
from monarch.runtime.control.launch import REMOTE_TOKEN_ROOT

T = 30.0  # bound of every wait
SECRET = secrets.token_hex(16)
ANSWER = len(wire.MAGIC) + wire.NONCE_BYTES + wire.MAC_BYTES  # a controller's answer to an agent's greeting


@dataclass
class Agent:
    proc: subprocess.Popen[str]
    address: str
    log: Path

    def children(self) -> set[int]:
        return descendants({self.proc.pid})

    def logged(self, text: str) -> bool:
        return text in self.log.read_text()


def owned(controller: int) -> list[int]:
    """Live processes started for controller `controller` (their command line says `--owner PID`)."""
    mark = f"--owner\0{controller}\0".encode()
    return [pid for pid in descendants({1}) if mark in _read(f"/proc/{pid}/cmdline")]


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError:
        return b""


def until(check: Callable[[], object], what: str, timeout: float = T) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.05)


def start_agent(ip: str, log: Path, port: int = 0) -> Agent:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MONARCH_ATTACH_SECRET")}
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "monarch", "worker", "--listen", f"tcp://{ip}:{port}"],
                                stdout=subprocess.PIPE, stderr=err, text=True,
                                env=env | {"MONARCH_ATTACH_SECRET": SECRET})
    assert select.select([proc.stdout], [], [], T)[0], f"the agent on {ip} printed nothing: {log.read_text()}"
    line = proc.stdout.readline().strip()  # type: ignore[union-attr]
    assert line.startswith(f"monarch worker listening on tcp://{ip}:"), (line, log.read_text())
    return Agent(proc, line.rsplit(" ", 1)[1], log)


def stop_agent(agent: Agent) -> None:
    until(lambda: not agent.children(), f"the agent at {agent.address} killed what it started")
    agent.proc.terminate()
    try:
        agent.proc.wait(timeout=T)
    finally:
        agent.proc.kill()
        agent.proc.wait(timeout=T)


@pytest.fixture(scope="module")
def agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Agent]]:
    """Two agents, on 127.0.0.1 and 127.0.0.2 (Hydra names hosts by address, so one agent per address)."""
    started = []
    try:
        for ip in ("127.0.0.1", "127.0.0.2"):
            started.append(start_agent(ip, tmp_path_factory.mktemp("agent") / "log"))
        yield started
    finally:
        detach()
        for agent in started:
            stop_agent(agent)


@pytest.fixture(scope="module")
def lone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    """An agent of its own (127.0.0.3) for the handshake and lifecycle tests."""
    agent = start_agent("127.0.0.3", tmp_path_factory.mktemp("lone") / "log")
    try:
        yield agent
    finally:
        detach([agent.address])
        stop_agent(agent)


class Where(Actor):
    @endpoint
    def where(self) -> tuple[int, int]:
        return current_rank().rank, os.getpid()


def check_placement(procs: ProcMesh, agents: list[Agent], per_host: int) -> None:
    """Rank r runs under agent r // per_host, and its environment holds neither the secret nor the token."""
    got = procs.spawn("where", Where).where.call().get(timeout=T)
    assert sorted(rank for rank, _ in got.values()) == list(range(2 * per_host))
    for rank, pid in got.values():
        assert pid in agents[rank // per_host].children(), f"rank {rank} (pid {pid}) is not under its agent"
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        assert SECRET.encode() not in environ and procs._mesh.token.hex().encode() not in environ  # type: ignore
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        token_dir = Path(argv[argv.index(b"--token-dir") + 1].decode())
        assert token_dir.parent == Path(REMOTE_TOKEN_ROOT) and not token_dir.exists(), f"{token_dir} was left"


def test_a_mesh_across_two_agents_twice(agents: list[Agent], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MONARCH_ATTACH_SECRET", SECRET)  # the controller's secret from its environment
    hosts = attach_to_workers([a.address for a in agents], timeout=T)
    assert hosts.hostnames == ["127.0.0.1", "127.0.0.2"]
    with hosts.spawn_procs(per_host={"gpus": 1}) as procs:
        assert procs.extent == {"hosts": 2, "gpus": 1}
        check_placement(procs, agents, 1)
        x = torch.randn(64, 16)
        m = monarch.distribute_tensor(x, procs, {"hosts": Shard(0)})
        torch.testing.assert_close(((m * 2).relu().sum(0)).full_tensor(timeout=T), (x * 2).relu().sum(0),
                                   rtol=1e-4, atol=1e-4)
    for agent in agents:
        until(lambda a=agent: not a.children(), f"the proxies under {agent.address} ended with the mesh")
    again = attach_to_workers([a.address for a in agents], timeout=T)  # the same connections, reused
    with again.spawn_procs(per_host={"gpus": 2}) as procs:
        check_placement(procs, agents, 2)


def test_a_wrong_secret_is_refused_and_the_agent_serves_on(lone: Agent) -> None:
    with pytest.raises(SpawnError, match=f"agent at {re.escape(lone.address)}.*secret is another than ours"):
        attach_to_workers([lone.address], secret="not the secret", timeout=T)
    until(lambda: lone.logged("does not know the secret"), "the agent logged the drop")
    attach_to_workers([lone.address], secret=SECRET, timeout=T)
    detach([lone.address])


def test_garbage_and_silent_peers_are_dropped_within_the_deadline(lone: Agent) -> None:
    host, port = wire.parse_address(lone.address)
    for send in (os.urandom(ANSWER), b"", b"MNA1"):  # a wrong answer, nothing, a partial answer
        with socket.create_connection((host, port), timeout=T) as s:
            start = time.monotonic()
            s.sendall(send)
            received = b""
            while chunk := s.recv(65536):
                received += chunk
            took = time.monotonic() - start
        denied = wire.DENIED if len(send) == ANSWER else b""  # a wrong proof is told so, the rest is not
        assert len(received) == wire.HELLO_BYTES + len(denied) and received[wire.HELLO_BYTES:] == denied, \
            f"the agent sent {received!r} to {send[:8]!r}"
        limit = 0.5 if len(send) == ANSWER else wire.AUTH_DEADLINE_S + 1.0
        assert took < limit, f"a peer that sent {len(send)} bytes was dropped after {took:.2f} s"
    until(lambda: lone.logged("before it authenticated"), "the agent logged the silent peers")
    attach_to_workers([lone.address], secret=SECRET, timeout=T)  # it serves on
    detach([lone.address])


def test_an_impostor_agent_gets_no_command() -> None:
    received: list[bytes] = []

    def impostor(listener: socket.socket) -> None:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(T)
            nonce = os.urandom(wire.NONCE_BYTES)
            conn.sendall(wire.MAGIC + nonce)
            answer = codec.recv_exact(conn, ANSWER, time.monotonic() + T)
            conn.sendall(wire._mac(b"another secret", b"agent", answer[4:4 + wire.NONCE_BYTES], nonce))
            while chunk := conn.recv(65536):
                received.append(chunk)

    with socket.create_server(("127.0.0.1", 0)) as listener:
        thread = threading.Thread(target=impostor, args=(listener,), daemon=True)
        thread.start()
        address = "tcp://127.0.0.1:%d" % listener.getsockname()[1]
        with pytest.raises(SpawnError, match=f"agent at {re.escape(address)}.*does not know the secret"):
            attach_to_workers([address], secret=SECRET, timeout=T)
        thread.join(T)
    assert not thread.is_alive() and received == [], f"the impostor received {received!r}"


def test_one_controller_at_a_time(lone: Agent) -> None:
    attach_to_workers([lone.address], secret=SECRET, timeout=T)
    with pytest.raises(SpawnError, match="refused: attached to the controller at 127.0.0.1:"):
        AgentLink.connect(lone.address, wire.resolve_secret(SECRET), time.monotonic() + T)  # a second connection
    detach([lone.address])
    AgentLink.connect(lone.address, wire.resolve_secret(SECRET), time.monotonic() + T).close()  # free again


def test_what_a_controller_started_dies_with_its_connection(lone: Agent) -> None:
    link = AgentLink.connect(lone.address, wire.resolve_secret(SECRET), time.monotonic() + T)
    try:
        _start_kill_and_write_tokens(lone, link)
    finally:
        link.close()  # also when an assertion failed: the next test finds the agent free


def _start_kill_and_write_tokens(lone: Agent, link: AgentLink) -> None:
    deadline = time.monotonic() + T
    pids = [link.answer(link.ask(wire.Launch, argv=argv), deadline).pid
            for argv in [("sh", "-c", "sleep 60 & exec sleep 60"), ("sh", "-c", "(sleep 61 &); exec sleep 62")]]

    def orphans() -> set[int]:  # the sleep 61 whose subshell exited (a loaded machine takes a while to get there)
        return lone.children() - set(pids) - descendants({pids[0]})

    until(lambda: len(lone.children()) == 4 and len(orphans()) == 1, "two trees of two sleeps run")
    (orphan,) = orphans()
    assert Path(f"/proc/{orphan}/stat").read_text().rsplit(")", 1)[1].split()[1] == str(lone.proc.pid), \
        "the agent (a subreaper) inherits the orphan"
    link.send(wire.Kill((pids[0],)))
    until(lambda: lone.children() == {pids[1], orphan}, "Kill ended the first tree only")
    directory = f"{REMOTE_TOKEN_ROOT}/monarch-token-{secrets.token_hex(8)}"
    link.answer(link.ask(wire.WriteToken, directory=directory, ranks=(0, 1), token="ab" * 32), deadline)
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in Path(directory).iterdir()} == {
        "rank-0": "0o600", "rank-1": "0o600"} and Path(directory).stat().st_mode & 0o777 == 0o700
    with pytest.raises(SpawnError, match="not a token directory"):
        link.answer(link.ask(wire.WriteToken, directory="/tmp/elsewhere", ranks=(0,), token="ab"), deadline)
    link.close()
    until(lambda: not lone.children(), "the agent killed the rest, orphans included")
    until(lambda: not Path(directory).exists(), "the agent removed the token files nobody took")


KILLED_CONTROLLER = """
    import os, sys, time
    from monarch.cluster.attach import attach_to_workers
    procs = attach_to_workers(sys.argv[1:], timeout=30).spawn_procs(per_host={"gpus": 1})
    print("ready", *procs.pids, flush=True)
    time.sleep(600)
"""


def test_a_controller_killed_with_9_leaves_nothing(agents: list[Agent], monkeypatch: pytest.MonkeyPatch) -> None:
    detach()  # the agents are free for another controller
    for agent in agents:
        until(lambda a=agent: not a.children(), "the agents are idle")
    monkeypatch.setenv("MONARCH_ATTACH_SECRET", SECRET)
    script = KILLED_CONTROLLER.replace("sys.argv[1:]", repr([a.address for a in agents]))
    controller = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert select.select([controller.stdout], [], [], 2 * T)[0], "the controller did not spawn in time"
        words = controller.stdout.readline().split()  # type: ignore[union-attr]
        assert words[:1] == ["ready"], words
        workers = [int(w) for w in words[1:]]
        assert all(pid in agents[r].children() for r, pid in enumerate(workers))
    finally:
        os.kill(controller.pid, signal.SIGKILL)
        controller.wait(timeout=T)
    for agent in agents:
        until(lambda a=agent: not a.children(), f"the agent at {agent.address} killed the dead controller's ranks")
    until(lambda: not owned(controller.pid), "nothing of the dead controller's mesh is left")
    with attach_to_workers([a.address for a in agents], timeout=T).spawn_procs(per_host={"gpus": 1}) as procs:
        assert procs.spawn("where", Where).where.call().get(timeout=T).values()


def test_the_cli_needs_a_secret_and_reads_the_file_a_pod_mounts(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MONARCH_ATTACH_SECRET")}
    cmd = [sys.executable, "-m", "monarch", "worker", "--listen", "tcp://127.0.0.4:0"]
    for args, why in [([], "needs a shared secret"), (["--secret-file", "/nonexistent"], "cannot read")]:
        done = subprocess.run(cmd + args, env=env, capture_output=True, text=True, timeout=T)
        assert done.returncode == 2 and why in done.stderr, done
    (tmp_path / "secret").write_text(SECRET + "\n")  # as a Kubernetes pod has it, mounted from a Secret
    with open(tmp_path / "log", "w") as err:
        proc = subprocess.Popen(cmd, env=env | {"MONARCH_ATTACH_SECRET_FILE": str(tmp_path / "secret")},
                                stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        assert select.select([proc.stdout], [], [], T)[0], (tmp_path / "log").read_text()
        address = proc.stdout.readline().split()[-1]  # type: ignore[union-attr]
        attach_to_workers([address], secret=SECRET, timeout=T)
        detach([address])
    finally:
        proc.terminate()
        proc.wait(timeout=T)


class Holder:
    """Keeps `n` silent connections from `source` open to the agent at `address`; each one the agent
    closes is opened again at once."""

    def __init__(self, address: str, n: int, source: str = "127.0.0.1") -> None:
        self.target, self.n, self.source = wire.parse_address(address), n, source
        self.opened = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._hold, daemon=True)

    def __enter__(self) -> Holder:
        self._thread.start()
        until(lambda: self.opened >= self.n, f"{self.n} connections are open")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(T)
        assert not self._thread.is_alive()

    def _hold(self) -> None:
        with selectors.DefaultSelector() as held:
            try:
                while not self._stop.is_set():
                    while len(held.get_map()) < self.n:
                        held.register(socket.create_connection(self.target, T, (self.source, 0)), selectors.EVENT_READ)
                        self.opened += 1
                    for key, _ in held.select(0.05):
                        self._read(held, key.fileobj)  # type: ignore[arg-type]
                    time.sleep(0.01)  # the controller under test shares this process's interpreter
            finally:
                for key in list(held.get_map().values()):
                    key.fileobj.close()  # type: ignore[union-attr]

    @staticmethod
    def _read(held: selectors.BaseSelector, sock: socket.socket) -> None:
        try:
            data = sock.recv(65536)  # the agent's greeting, never answered
        except OSError:
            data = b""
        if not data:
            held.unregister(sock)
            sock.close()


def test_held_connections_keep_no_controller_out(lone: Agent) -> None:
    """40 silent connections from the controller's own address and 80 from another (over its cap of
    waiting connections, so the agent closes the oldest), all opened again as the agent closes them."""
    start = time.monotonic()
    try:
        with Holder(lone.address, 40), Holder(lone.address, 80, source="127.0.0.6") as other:
            hosts = attach_to_workers([lone.address], secret=SECRET, timeout=T)
            with hosts.spawn_procs(per_host={"gpus": 1}) as procs:
                assert procs.spawn("where", Where).where.call().get(timeout=T).values()
            assert other.opened > 80
    finally:
        detach([lone.address])
    assert time.monotonic() - start < 3 * T
    assert lone.logged("to make room: 64 of its connections wait")


def test_a_flood_of_bad_peers_logs_a_few_lines_a_second(lone: Agent) -> None:
    """Wrong proofs, empty connections and silent ones for 4 s: at most one line per kind of drop (wrong
    secret, silent, making room, ...; four at most here) a second, each saying how many it stands for."""
    target, lines = wire.parse_address(lone.address), len(lone.log.read_text().splitlines())
    start, sent = time.monotonic(), 0
    with Holder(lone.address, 20):  # silent peers, dropped at the deadline
        while time.monotonic() < start + 4.0:
            with socket.create_connection(target, timeout=T) as s:
                s.sendall(os.urandom(ANSWER) if sent % 2 else b"")  # a wrong proof, or nothing
            sent += 1
    time.sleep(0.5)
    added, took = lone.log.read_text().splitlines()[lines:], time.monotonic() - start
    assert sent > 100 and len(added) <= 4 * (took + 1), f"{len(added)} lines for {sent} peers: {added[:5]}"
    assert any("more like it in the last" in line for line in added), added
    attach_to_workers([lone.address], secret=SECRET, timeout=T)  # it serves on
    detach([lone.address])


def test_a_controller_tries_again_until_the_agent_completes_a_handshake(tmp_path: Path) -> None:
    """The first try is closed at once, the second after the greeting; then none listens until the agent
    starts on that port: the controller attaches within its timeout."""
    result: list[object] = []
    with socket.create_server(("127.0.0.5", 0)) as fake:
        address = "tcp://127.0.0.5:%d" % fake.getsockname()[1]
        thread = threading.Thread(target=lambda: result.append(_attach(address)), daemon=True)
        thread.start()
        _next_try(fake, thread, result).close()
        with _next_try(fake, thread, result) as conn:
            conn.sendall(wire.MAGIC + os.urandom(wire.NONCE_BYTES))
            codec.recv_exact(conn, ANSWER, time.monotonic() + T)
    agent = start_agent("127.0.0.5", tmp_path / "log", port=int(address.rsplit(":", 1)[1]))
    try:
        thread.join(T)
        assert not thread.is_alive() and len(result) == 1 and not isinstance(result[0], Exception), result
    finally:
        detach([address])
        stop_agent(agent)


def _next_try(fake: socket.socket, controller: threading.Thread, result: list[object]) -> socket.socket:
    """The controller's next connection to `fake`; fails at once when the controller has given up."""
    until(lambda: select.select([fake], [], [], 0.05)[0] or not controller.is_alive(), "the controller tried again")
    assert controller.is_alive(), f"the controller gave up: {result}"
    conn = fake.accept()[0]
    conn.settimeout(T)
    return conn


def _attach(address: str) -> object:
    try:
        return attach_to_workers([address], secret=SECRET, timeout=T)
    except Exception as e:  # noqa: BLE001 - the test's thread reports it
        return e
