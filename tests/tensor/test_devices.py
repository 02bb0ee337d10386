"""Devices of proc meshes and MeshTensors on real meshes: the cpu default, the device rule the controller and
the workers share, factories' `device=`, moves (`to`, `cpu`, `cuda`) with autograd, and the errors raised on
the controller before anything is shipped. A CUDA mesh is made here by CUDA_VISIBLE_DEVICES naming GPUs the
workers report (this machine has none): what the controller records for it is checked without running it, and
running it fails on the workers with the fix named.
"""
from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

import monarch
from monarch import DeviceError, Replicate, Shard, SpawnError
from monarch.actor import Actor, ActorError, ProcMesh, current_rank, endpoint, this_host
from monarch.runtime.control.bootstrap import mesh_device, visible_gpus

T = 120.0


@pytest.fixture(scope="module")
def procs() -> Iterator[ProcMesh]:
    mesh = this_host().spawn_procs(per_host={"gpus": 2})
    yield mesh
    mesh.stop().get(T)


@pytest.fixture
def gpu_procs(monkeypatch: pytest.MonkeyPatch) -> Iterator[ProcMesh]:
    """A mesh whose workers each see two GPUs by CUDA_VISIBLE_DEVICES (none exist here): a CUDA mesh."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    mesh = this_host().spawn_procs(per_host={"gpus": 2})
    yield mesh
    mesh.stop().get(T)


def test_the_device_rule() -> None:
    assert mesh_device("auto", 8, 8) == "cuda"
    assert mesh_device("auto", 1, 2) == "cpu"  # two ranks would share one GPU: not without asking
    assert mesh_device("auto", 0, 1) == "cpu"
    assert mesh_device("cpu", 8, 1) == "cpu"
    assert mesh_device("cuda", 1, 4) == "cuda"


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, n in (("0,1,3", 3), ("", 0), ("-1", 0), ("GPU-5c1e", 1)):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
        assert visible_gpus() == n


def test_a_mesh_without_gpus_is_a_cpu_mesh(procs: ProcMesh) -> None:
    assert procs.device == "cpu"
    x = monarch.randn(4, 6, mesh=procs, placements={"gpus": Shard(0)})
    assert x.device == torch.device("cpu") and x.is_cpu and not x.is_cuda
    assert x.cpu() is x and x.to("cpu") is x  # as plain torch: already there
    y = monarch.zeros(3, mesh=procs, device="cpu") + monarch.arange(3, mesh=procs, device=torch.device("cpu"))
    assert y.full_tensor().tolist() == [0.0, 1.0, 2.0]
    assert x.to(torch.float64).full_tensor().equal(x.full_tensor().double())


def test_gpu_requests_on_a_cpu_mesh_fail_on_the_controller(procs: ProcMesh) -> None:
    x = monarch.ones(2, 3, mesh=procs)
    for ask in (lambda: monarch.zeros(3, mesh=procs, device="cuda"), lambda: x.to("cuda"), lambda: x.cuda(),
                lambda: x.to(torch.device("cuda", 1)), lambda: torch.zeros_like(x, device="cuda")):
        with pytest.raises(DeviceError, match="no GPU of their own.*device='cuda'"):
            ask()
    with pytest.raises(DeviceError, match="'cpu' or 'cuda'"):
        monarch.zeros(3, mesh=procs, device="meta")
    assert x.sum().item() == 6.0  # the mesh goes on


def test_spawn_checks_the_device_before_starting_workers() -> None:
    with pytest.raises(SpawnError, match="device='cuda'.*no GPU"):
        this_host().spawn_procs(per_host={"gpus": 1}, device="cuda")
    with pytest.raises(SpawnError, match="'cpu' or 'cuda'"):
        this_host().spawn_procs(per_host={"gpus": 1}, device="tpu")
    mesh = this_host().spawn_procs(per_host={"gpus": 1}, device="cpu")
    try:
        assert mesh.device == "cpu"
    finally:
        mesh.stop().get(T)


def test_more_processes_than_gpus_need_consent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(SpawnError, match="2 processes on host .* 1 GPU.*MONARCH_SHARE_GPUS=1"):
        this_host().spawn_procs(per_host={"gpus": 2}, device="cuda")
    auto = this_host().spawn_procs(per_host={"gpus": 2})  # auto: they would share one GPU, so the CPU
    try:
        assert auto.device == "cpu"
    finally:
        auto.stop().get(T)


def test_a_cuda_mesh_traces_devices_on_the_controller(gpu_procs: ProcMesh) -> None:
    assert gpu_procs.device == "cuda"
    w = monarch.randn(4, 3, mesh=gpu_procs, placements={"gpus": Shard(0)}).requires_grad_()
    assert w.device == torch.device("cuda") and w.is_cuda
    host = monarch.zeros(4, 3, mesh=gpu_procs, device="cpu")
    assert host.device.type == "cpu" and (w * 2).device.type == "cuda"
    with pytest.raises(DeviceError, match="aten::add.*different devices.*cuda.*\\.cpu\\(\\)"):
        w + host
    with pytest.raises(DeviceError, match="different devices"):
        w + torch.ones(4, 3)  # a plain CPU tensor, as torch refuses it beside a GPU tensor
    assert (w * torch.tensor(2.0)).device.type == "cuda"  # a 0-dim CPU tensor goes with any device
    moved = w.cpu()
    assert moved.device.type == "cpu" and moved.placements == (Shard(0),)
    moved.sum().backward()  # the gradient goes back to the GPU
    assert w.grad is not None and w.grad.device.type == "cuda"
    with gpu_procs.activate():
        assert torch.randn(2, 2).device.type == "cuda"
        assert torch.zeros(2, device="cuda").device.type == "cuda"  # the mesh's GPUs, asked for by name
        assert type(torch.zeros(2, device="cpu")) is torch.Tensor  # a plain host tensor, as before
    assert monarch.distribute_tensor(torch.ones(4), gpu_procs, [Replicate()]).device.type == "cuda"


def test_running_a_cuda_mesh_without_a_cuda_torch_names_the_fix(gpu_procs: ProcMesh) -> None:
    x = monarch.ones(2, mesh=gpu_procs)
    with pytest.raises(monarch.MonarchError, match="cannot use a GPU.*device='cpu'"):
        x.sum().item()


def _one_gpu_each() -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = str(current_rank()["gpus"])


def _refuse() -> None:
    raise ValueError("no GPU for this rank")


class Env(Actor):
    @endpoint
    def get(self, key: str) -> str | None:
        return os.environ.get(key)


def test_bootstrap_runs_in_each_process_before_it_returns() -> None:
    """Monarch's spawn_procs(per_host, bootstrap): per-process environment, set before any actor or tensor."""
    mesh = this_host().spawn_procs({"gpus": 2}, bootstrap=_one_gpu_each)
    try:
        seen = mesh.spawn("env", Env).get.call("CUDA_VISIBLE_DEVICES").get(T)
        assert list(seen.values()) == ["0", "1"]
    finally:
        mesh.stop().get(T)
    with pytest.raises(ActorError, match="no GPU for this rank"):
        this_host().spawn_procs({"gpus": 1}, bootstrap=_refuse)


def test_a_copy_crosses_devices_as_in_torch(gpu_procs: ProcMesh) -> None:
    gpu = monarch.zeros(4, mesh=gpu_procs)
    host = monarch.ones(4, mesh=gpu_procs, device="cpu")
    assert gpu.copy_(host).device.type == "cuda" and host.copy_(gpu).device.type == "cpu"


def test_a_model_moves_to_the_gpus_with_to(gpu_procs: ProcMesh) -> None:
    """`model.to("cuda")` of a model whose parameters are MeshTensors moves them (and their gradients) in place."""
    model = torch.nn.Linear(4, 2)
    monarch.data_parallel(model, gpu_procs, dim="gpus")
    assert {p.device.type for p in model.parameters()} == {"cuda"}  # distributed onto the mesh's device
    weight = model.weight
    model.to("cpu")
    assert model.weight is weight and {p.device.type for p in model.parameters()} == {"cpu"}
    model.cuda()
    assert {p.device.type for p in model.parameters()} == {"cuda"} and model.weight.placements == (Replicate(),)
