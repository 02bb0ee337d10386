"""Meshes across test hosts started by Hydra over a real sshd: placement of ranks, actors, sharded ops,
a compiled training step, bytes on the wire, addresses, and the failures of a worker, a host and a link."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from processes import owned_processes
from testbed import Testbed

import monarch
from monarch import Replicate, Shard
from monarch.actor import Actor, HostMesh, ProcMesh, endpoint
from monarch.errors import SpawnError, SupervisionError

T = 60  # seconds any single wait may take


class Where(Actor):
    @endpoint
    def where(self) -> tuple[str, int]:
        return socket.gethostname(), os.getpid()

    @endpoint
    def sleep(self, s: float) -> float:
        time.sleep(s)
        return s


@pytest.fixture(scope="module")
def procs(testbed: Testbed) -> ProcMesh:
    with HostMesh(["mh1", "mh2"]).spawn_procs(per_host={"gpus": 2}) as p:
        yield p
    assert not testbed.strays(), testbed.strays()


def test_ranks_run_on_their_hosts(procs: ProcMesh) -> None:
    assert procs.extent == {"hosts": 2, "gpus": 2}
    got = procs.spawn("where", Where).where.call().get(timeout=T)
    assert [h for _, (h, _) in got.items()] == ["mh1", "mh1", "mh2", "mh2"]
    assert procs.hostnames == ["mh1", "mh1", "mh2", "mh2"]


def test_the_token_reaches_other_hosts_in_files_that_are_gone(procs: ProcMesh) -> None:
    token = procs._mesh.token.hex().encode()  # type: ignore[attr-defined]
    for pid in procs.pids:  # the workers (and their monitors) on both hosts
        for p in (pid, int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])):
            assert token not in Path(f"/proc/{p}/environ").read_bytes() + Path(f"/proc/{p}/cmdline").read_bytes()
    assert not list(Path("/dev/shm").glob("monarch-token-*"))  # each host's last rank removed its directory


def test_sharded_ops_cross_the_wire(procs: ProcMesh, testbed: Testbed) -> None:
    x = torch.randn(512, 256)
    before = testbed.veth_bytes()
    m = monarch.distribute_tensor(x, procs, [Shard(0), Replicate()])
    total = (m * 2).sum(0)  # a partial sum over both hosts, all_reduced
    torch.testing.assert_close(total.full_tensor(), (x * 2).sum(0), rtol=1e-4, atol=1e-4)
    gathered = m.redistribute([Replicate(), Replicate()]).full_tensor()
    assert torch.equal(gathered, x)
    crossed = testbed.veth_bytes() - before
    assert crossed > x.numel() * 4 // 2, f"only {crossed} bytes crossed the veths for a {x.numel() * 4}-byte tensor"


def _loss(x: torch.Tensor, y: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return ((torch.relu(x @ w1) @ w2 - y) ** 2).mean()


def test_compiled_training_step_across_hosts_equals_torch(procs: ProcMesh) -> None:
    g = torch.Generator().manual_seed(0)
    w1, w2, x, y = (torch.randn(16, 32, generator=g), torch.randn(32, 4, generator=g),
                    torch.randn(12, 16, generator=g), torch.randn(12, 4, generator=g))
    ref = [w1.clone().requires_grad_(), w2.clone().requires_grad_()]
    ref_opt = torch.optim.AdamW(ref, lr=0.01)
    want = []
    for _ in range(4):
        loss = _loss(x, y, *ref)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        want.append(loss.item())
    params = [torch.nn.Parameter(monarch.distribute_tensor(w1, procs, {"gpus": Shard(1)})),
              torch.nn.Parameter(monarch.distribute_tensor(w2, procs, {"gpus": Shard(0)}))]
    opt = torch.optim.AdamW(params, lr=0.01)
    xs, ys = (monarch.distribute_tensor(t, procs, {"hosts": Shard(0)}) for t in (x, y))

    @monarch.compile
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = _loss(x, y, *params)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    got = [step(xs, ys).item() for _ in range(4)]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(params[0].full_tensor(), ref[0].detach(), rtol=1e-4, atol=1e-5)


def test_workers_that_cannot_connect_say_where_they_tried(testbed: Testbed, others: set[int],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MONARCH_ADVERTISE", "127.0.0.1")  # loopback: inside the hosts, nobody listens there
    with pytest.raises(SpawnError, match=r"rank 0 on host mh1: cannot connect to the controller at 127\.0\.0\.1:\d+.*"
                                         r"MONARCH_ADVERTISE"):
        HostMesh(["mh1", "mh2"]).spawn_procs(per_host={"gpus": 1}, name="unreachable")
    assert not testbed.strays(others), testbed.strays(others)


def _fresh_mesh_works() -> None:
    with HostMesh(["mh1", "mh2"]).spawn_procs(per_host={"gpus": 1}, name="after") as p:
        assert p.spawn("w", Where).where.call().get(timeout=T).item(hosts=1, gpus=0)[0] == "mh2"


def _failure_within(procs: ProcMesh, limit: float, act: object) -> tuple[SupervisionError, float]:
    slow = procs.spawn("slow", Where).sleep.call(30.0)
    start = time.monotonic()
    act()  # type: ignore[operator]
    with pytest.raises(SupervisionError) as err:
        slow.get(timeout=T)
    took = time.monotonic() - start
    assert took < limit, f"the failure took {took:.2f} s to surface (limit {limit} s)"
    return err.value, took


@pytest.fixture
def others(testbed: Testbed) -> set[int]:
    """Processes already in the hosts (the module's mesh): a test's leftovers are the ones it adds."""
    return testbed.all_pids()


def test_kill_9_of_a_worker_on_another_host(testbed: Testbed, others: set[int]) -> None:
    procs = HostMesh(["mh1", "mh2"]).spawn_procs(per_host={"gpus": 2}, name="victim")
    victim = procs.slice(hosts=1, gpus=1).pids[0]
    err, _ = _failure_within(procs, 1.0, lambda: os.kill(victim, signal.SIGKILL))
    assert "rank 3 (hosts=1,gpus=1) on host mh2" in str(err) and "SIGKILL" in str(err), err
    procs.stop()
    assert not testbed.strays(others), testbed.strays(others)
    _fresh_mesh_works()


def test_cutting_a_host_off_the_network(testbed: Testbed, others: set[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MONARCH_HEARTBEAT_TIMEOUT", "2")
    procs = HostMesh(["mh1", "mh2"]).spawn_procs(per_host={"gpus": 1}, name="partitioned")
    try:
        err, _ = _failure_within(procs, 2 + 2.5, lambda: testbed.link("mh2", up=False))
        assert "on host mh2" in str(err) and "no heartbeat" in str(err), err
        procs.stop()
    finally:
        testbed.link("mh2", up=True)
    assert not testbed.strays(others, timeout=20), testbed.strays(others)
    _fresh_mesh_works()


def test_killing_every_process_of_a_host(testbed: Testbed, others: set[int]) -> None:
    procs = HostMesh(["mh1", "mh2"]).spawn_procs(per_host={"gpus": 2}, name="host-down")
    try:
        err, _ = _failure_within(procs, 1.0, lambda: [os.kill(p, signal.SIGKILL) for p in testbed.pids("mh2")])
        assert "on host mh2" in str(err) or "launcher" in str(err), err
        procs.stop()
    finally:
        testbed.restart("mh2")
    assert not testbed.strays(others), testbed.strays(others)
    _fresh_mesh_works()


PACKAGE = '''from monarch.actor import Actor, endpoint
from {pkg}.util import answer


class Answer(Actor):
    @endpoint
    def answer(self) -> tuple[str, int, str]:
        import socket
        from {pkg} import util
        return socket.gethostname(), util.answer(), util.__file__
'''


def test_sync_workspace_ships_a_package_the_hosts_never_saw(tmp_path, testbed: Testbed,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = "clusterpkg_never_seen"
    src = tmp_path / "project"
    (src / pkg).mkdir(parents=True)
    (src / pkg / "__init__.py").write_text(PACKAGE.format(pkg=pkg))
    (src / pkg / "util.py").write_text("def answer() -> int:\n    return 1\n")
    env = {"MONARCH_WORKSPACE_DIR": str(tmp_path / "copies")}
    hosts = HostMesh(["mh1", "mh2"])
    procs = hosts.spawn_procs(per_host={"gpus": 1}, name="synced", env=env)
    try:
        monkeypatch.syspath_prepend(str(src))  # the controller imports it; the workers never had it on their path
        from clusterpkg_never_seen import Answer  # type: ignore[import-not-found]
        first = hosts.sync_workspace(src)[0]
        assert first.files_sent == 4 and first.hosts == ("mh1", "mh2"), first  # 2 files to each host
        got = procs.spawn("a", Answer).answer.call().get(timeout=T)
        assert [(h, n) for _, (h, n, _) in got.items()] == [("mh1", 1), ("mh2", 1)]
        for (_, (host, _, where)) in got.items():
            assert where.startswith(str(tmp_path / "copies" / host)), where  # each host's own copy
        (src / pkg / "util.py").write_text("def answer() -> int:\n    return 2\n")
        again = hosts.sync_workspace(src)[0]
        assert again.files_sent == 2 and f"{pkg}.util" in again.reloaded, again
        assert [n for _, (_, n, _) in procs.spawn("b", Answer).answer.call().get(timeout=T).items()] == [2, 2]
        assert hosts.sync_workspace(src)[0].files_sent == 0
        with hosts.spawn_procs(per_host={"gpus": 1}, name="later", env=env) as later:  # synced at spawn
            assert [n for _, (_, n, _) in later.spawn("c", Answer).answer.call().get(timeout=T).items()] == [2, 2]
    finally:
        procs.stop()
        sys.modules.pop(pkg, None)
        sys.modules.pop(f"{pkg}.util", None)


def test_a_controller_killed_by_sigkill_leaves_nothing_on_the_hosts(testbed: Testbed, others: set[int]) -> None:
    script = ("from monarch.actor import HostMesh\n"
              "p = HostMesh(['mh1', 'mh2']).spawn_procs(per_host={'gpus': 2})\n"
              "print('up', flush=True)\n"
              "import time; time.sleep(600)\n")
    ctl = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert ctl.stdout is not None and ctl.stdout.readline().strip() == "up"
        assert len(testbed.all_pids() - others) >= 4
        ctl.kill()
        ctl.wait(timeout=T)
        assert not testbed.strays(others, timeout=15), testbed.strays(others)
        deadline = time.monotonic() + 15  # nor here: mpiexec and its ssh clients
        while owned_processes(ctl.pid):
            assert time.monotonic() < deadline, owned_processes(ctl.pid)
            time.sleep(0.1)
    finally:
        ctl.kill()
        ctl.wait(timeout=T)
