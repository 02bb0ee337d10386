"""torchrun-style scripts on a real 2x2 mesh (monarch.spmd): torchrun's environment, gloo collectives and
DDP inside the script equal to plain torch, failures and exit statuses as ActorErrors, the process restored."""
from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from monarch.actor import Actor, ActorError, ProcMesh, endpoint
from monarch.spmd import SPMDActor, SPMDError, Topology, setup_torch_elastic_env, setup_torch_elastic_env_async

T = 120  # seconds: bound of every run (four workers load torch on two shared cores)
KEYS = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
        "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"]
STEPS, LR = 3, 0.1

TRAIN = f'''
import json, os, sys
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

def main():
    out, steps = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([rank + 1.0, 10.0 * rank])
    dist.all_reduce(total)
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr={LR})
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 3, generator=g), torch.randn(8, 2, generator=g)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        opt.step()
    os.chdir(out)  # the worker's cwd comes back afterwards
    os.environ["SCRIPT_LEFT_THIS"] = "1"
    print(f"spmd rank {{rank}} of {{world}} trained", flush=True)
    with open(f"rank{{rank}}.json", "w") as f:
        json.dump({{"name": __name__, "argv": sys.argv, "env": {{k: os.environ[k] for k in {KEYS!r}}},
                   "total": total.tolist(), "params": [p.tolist() for p in model.module.parameters()]}}, f)
    # no destroy_process_group(): run_spmd destroys what the script leaves

if __name__ == "__main__":
    main()
'''

FAIL = '''
import os, sys, time
rank, folder = os.environ["RANK"], os.path.dirname(os.path.abspath(__file__))
if rank == sys.argv[1]:
    raise ValueError("bad batch on this rank")
deadline = time.monotonic() + 60  # the others stay busy (as if blocked in a collective) until told to go
while not os.path.exists(os.path.join(folder, "go")) and time.monotonic() < deadline:
    time.sleep(0.02)
open(os.path.join(folder, "done" + rank), "w").close()
'''

EXIT = '''
import sys
sys.exit(int(sys.argv[1]))
'''


class Probe(Actor):
    """What a script may change in a worker process."""

    @endpoint
    def state(self) -> dict:
        dist = sys.modules.get("torch.distributed")
        return {"env": {k: os.environ.get(k) for k in [*KEYS, "SCRIPT_LEFT_THIS"]}, "argv": list(sys.argv),
                "cwd": os.getcwd(), "path": list(sys.path), "group": bool(dist is not None and dist.is_initialized())}


class Trainer(Actor):
    """Monarch's other way: the environment is set first, an actor joins the group in an endpoint."""

    @endpoint
    def all_reduce(self, value: float) -> float:
        import torch.distributed as dist
        dist.init_process_group("gloo")
        try:
            t = torch.tensor([value * (dist.get_rank() + 1)])
            dist.all_reduce(t)
            return t.item()
        finally:
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def probes(procs: ProcMesh):
    return procs.spawn("probes", Probe)


def script(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def reference_params() -> list[list]:
    """The same training in one process on the whole batch: DDP's averaged gradients equal its gradients."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 3, generator=g), torch.randn(8, 2, generator=g)
    for _ in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.tolist() for p in model.parameters()]


def test_ddp_script_runs_with_torchruns_environment(procs: ProcMesh, probes, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    before = probes.state.call().get(timeout=T).values()
    procs.run_spmd(script(tmp_path, "train.py", TRAIN), args=[str(tmp_path), str(STEPS)], timeout=T)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for r, res in enumerate(results):
        assert res["name"] == "__main__"
        assert res["argv"] == [str(tmp_path / "train.py"), str(tmp_path), str(STEPS)]
        assert res["total"] == [1.0 + 2 + 3 + 4, 10.0 * (0 + 1 + 2 + 3)]
        env = res["env"]
        assert {k: env[k] for k in KEYS[:9]} == {  # one host: local ranks are the ranks, as torchrun's
            "RANK": str(r), "WORLD_SIZE": "4", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0",
            "GROUP_WORLD_SIZE": "1", "ROLE_RANK": str(r), "ROLE_WORLD_SIZE": "4", "ROLE_NAME": "default"}
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert (env["MASTER_PORT"], env["TORCHELASTIC_RUN_ID"]) == (results[0]["env"]["MASTER_PORT"],
                                                                    results[0]["env"]["TORCHELASTIC_RUN_ID"])
    expected = reference_params()
    for res in results:
        for got, want in zip(res["params"], expected, strict=True):
            assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-6)
    after = probes.state.call().get(timeout=T).values()
    assert after == before  # environment, argv, sys.path and cwd restored; the script's process group destroyed
    assert not any(s["group"] for s in after) and all(s["env"]["RANK"] is None for s in after)
    assert "spmd rank 3 of 4 trained" in capsys.readouterr().out
    (tmp_path / "rank0.json").unlink()
    procs.run_spmd(str(tmp_path / "train.py"), args=[str(tmp_path), str(STEPS)], timeout=T)  # a new group, port
    again = json.loads((tmp_path / "rank0.json").read_text())
    assert again["params"] == results[0]["params"] and again["env"]["MASTER_PORT"] != env["MASTER_PORT"]


def test_exception_comes_back_as_actor_error_naming_the_rank(procs: ProcMesh, probes, tmp_path: Path) -> None:
    path = script(tmp_path, "fail.py", FAIL)
    with pytest.raises(ActorError, match="bad batch on this rank") as info:
        procs.run_spmd(path, args=["2"], timeout=T)
    assert not list(tmp_path.glob("done*"))  # raised while the other ranks still run, not when they end
    assert info.value.rank == 2 and info.value.exc_type == "ValueError"
    assert "rank 2" in str(info.value) and path in info.value.remote_traceback
    (tmp_path / "go").touch()
    probes.state.call().get(timeout=T)  # answered once each worker's script has ended
    assert sorted(p.name for p in tmp_path.glob("done*")) == ["done0", "done1", "done3"]


def test_exit_status_zero_succeeds_nonzero_fails(procs: ProcMesh, probes, tmp_path: Path) -> None:
    path = script(tmp_path, "exit.py", EXIT)
    procs.run_spmd(path, args=["0"], timeout=T)
    with pytest.raises(ActorError, match=r"exit.py 3 exited with status 3 on rank \d") as info:
        procs.run_spmd(path, args=["3"], timeout=T)
    assert info.value.exc_type == "SPMDError"
    state = probes.state.call().get(timeout=T).values()
    assert all(s["env"]["RANK"] is None and s["argv"] == state[0]["argv"] for s in state)


def test_sibling_modules_import_and_are_fresh_on_each_run(procs: ProcMesh, probes, tmp_path: Path) -> None:
    path = script(tmp_path, "uses_helper.py", "import sys\nfrom spmd_helper import VALUE\n"
                  "open(sys.argv[1] + '/' + __import__('os').environ['RANK'], 'w').write(str(VALUE))\n")
    (tmp_path / "spmd_helper.py").write_text("VALUE = 1\n")
    two = procs.slice(tp=1)  # a strided view: its ranks are workers 1 and 3
    two.run_spmd(path, args=[str(tmp_path)], timeout=T)
    (tmp_path / "spmd_helper.py").write_text("VALUE = 22\n")
    assert [(tmp_path / r).read_text() for r in "01"] == ["1", "1"]
    two.run_spmd(path, args=[str(tmp_path)], timeout=T)
    assert [(tmp_path / r).read_text() for r in "01"] == ["22", "22"]


def test_module_form_runs_like_python_dash_m(procs: ProcMesh, tmp_path: Path) -> None:
    src, dst = tmp_path / "in.json", tmp_path / "out.json"
    src.write_text('{"b": 1, "a": [2]}')
    procs.slice(dp=0).run_spmd("-m", args=["json.tool", "--sort-keys", str(src), str(dst)], timeout=T)
    assert json.loads(dst.read_text()) == {"a": [2], "b": 1} and dst.read_text().startswith('{\n    "a"')


def test_a_slow_script_times_out_naming_the_ranks(procs: ProcMesh, probes, tmp_path: Path) -> None:
    path = script(tmp_path, "slow.py", "import time\ntime.sleep(1.5)\n")
    with pytest.raises(TimeoutError, match=r"did not finish within 0.3 s on rank\(s\) \[0, 1, 2, 3\]"):
        procs.run_spmd(path, timeout=0.3)
    probes.state.call().get(timeout=T)  # the mesh serves again once the script ends


def test_missing_script_names_the_path(procs: ProcMesh, tmp_path: Path) -> None:
    with pytest.raises(ActorError, match="script .*nope.py' not found on host"):
        procs.run_spmd(str(tmp_path / "nope.py"), timeout=T)


def test_setup_torch_elastic_env_lets_actors_join_a_group(procs: ProcMesh, probes) -> None:
    setup_torch_elastic_env(procs)
    state = probes.state.call().get(timeout=T).values()
    assert [s["env"]["RANK"] for s in state] == ["0", "1", "2", "3"]
    assert {s["env"]["MASTER_ADDR"] for s in state} == {"127.0.0.1"}
    trainers = procs.spawn("trainers", Trainer)
    assert trainers.all_reduce.call(1.5).get(timeout=T).values() == [1.5 * (1 + 2 + 3 + 4)] * 4


def test_async_setup_with_a_given_master(procs: ProcMesh, probes) -> None:
    asyncio.run(setup_torch_elastic_env_async(procs, "10.1.2.3", 4321))
    state = probes.state.call().get(timeout=T).values()
    assert {(s["env"]["MASTER_ADDR"], s["env"]["MASTER_PORT"]) for s in state} == {("10.1.2.3", "4321")}


def test_run_command_runs_a_child_process_with_env(procs: ProcMesh) -> None:
    actors = procs.slice(tp=0).spawn("commands", SPMDActor)
    check = "import os, sys; sys.exit(0 if os.environ['SPMD_FLAG'] == 'on' else 5)"
    assert actors.run_command.call(sys.executable, ["-c", check], {"SPMD_FLAG": "on"}).get(timeout=T).values() == [
        True, True]
    with pytest.raises(ActorError, match="exited with status 5 on rank 0"):
        actors.run_command.call(sys.executable, ["-c", check], {"SPMD_FLAG": "off"}).get(timeout=T)


def test_topology_by_hosts_or_by_the_last_dim() -> None:
    hosts = ["a", "a", "b", "b"]
    by_host = [Topology.of(r, 4, hosts, {"hosts": 2, "gpus": 2}, "gpus") for r in range(4)]
    assert [(t.local_rank, t.local_world_size, t.group_rank, t.group_world_size) for t in by_host] == [
        (0, 2, 0, 2), (1, 2, 0, 2), (0, 2, 1, 2), (1, 2, 1, 2)]
    one_host = [Topology.of(r, 4, ["a"] * 4, {"dp": 2, "tp": 2}, "tp") for r in range(4)]
    assert [(t.local_rank, t.local_world_size, t.group_rank) for t in one_host] == [(r, 4, 0) for r in range(4)]
    monarch_rule = [Topology.of(r, 4, None, {"dp": 2, "tp": 2}, "tp") for r in range(4)]  # Monarch: last dim
    assert [(t.local_rank, t.group_rank, t.group_world_size) for t in monarch_rule] == [
        (0, 0, 2), (1, 0, 2), (0, 1, 2), (1, 1, 2)]
    env = by_host[3].env("h", 1234, "job")
    assert (env["RANK"], env["NODE_RANK"], env["MASTER_PORT"], env["TORCHELASTIC_USE_AGENT_STORE"]) == (
        "3", "1", "1234", "False")


def test_master_needs_both_address_and_port(procs: ProcMesh) -> None:
    with pytest.raises(SPMDError, match="give both, or neither"):
        setup_torch_elastic_env(procs, master_addr="127.0.0.1")
