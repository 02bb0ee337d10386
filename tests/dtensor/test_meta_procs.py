"""Meta-device initialisation on real worker processes (a 2-rank tp mesh from init_device_mesh): a ~400 MB
model built under `torch.device("meta")` is materialised and initialised on the workers while the controller's
peak RSS grows by a small fraction of it; the values equal a LocalMesh run after the same monarch.manual_seed;
and the model trains (eager and under monarch.compile) as plain torch does from the same weights. On a CUDA
mesh, to_empty makes the pieces on the workers' GPUs without initialising CUDA on the controller.
"""
from __future__ import annotations

import gc
import math
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import monarch
from monarch import LocalMesh
from monarch.actor import ProcMesh, this_host
from monarch.dtensor import DeviceMesh, Shard, init_device_mesh
from monarch.dtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

T = 60.0  # seconds any single wait may take (the workers load torch on the first tensor op)


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    tp = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    yield tp
    tp.stop()


@pytest.fixture(scope="module")
def gpu_procs() -> Iterator[ProcMesh]:
    """A mesh whose workers each see a GPU by CUDA_VISIBLE_DEVICES (none exist here): a CUDA mesh whose
    tensors are traced on the controller, never run."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("CUDA_VISIBLE_DEVICES", "0,1")
        procs = this_host().spawn_procs(per_host={"tp": 2})
    yield procs
    procs.stop().get(T)


@pytest.mark.parametrize("device", [None, "cuda", torch.device("cuda", 1)])
def test_to_empty_on_a_cuda_mesh_makes_the_pieces_on_its_gpus(gpu_procs: ProcMesh, device: object) -> None:
    """No CUDA on the controller: this torch has none, and would raise if it initialised it."""
    assert gpu_procs.device == "cuda"
    model = parallelize_module(stack(2, 8), gpu_procs, plan(2)).to_empty(device=device)
    assert all(p.device == torch.device("cuda") and not p.is_meta for p in model.parameters())
    assert model[0].weight.placements == (Shard(0),) and model[1].weight.placements == (Shard(1),)


def stack(n: int, width: int) -> nn.Sequential:
    """`n` bias-free square linears under the meta device, column- then row-parallel in pairs."""
    with torch.device("meta"):
        return nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(n)))


def plan(n: int) -> dict[str, object]:
    return {str(i): ColwiseParallel() if i % 2 == 0 else RowwiseParallel() for i in range(n)}


def peak_rss() -> int:
    """This process's peak resident set since the last `reset_peak` (VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        line = next(ln for ln in f if ln.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def test_a_400mb_model_is_made_on_the_workers_not_on_the_controller(mesh: DeviceMesh) -> None:
    n, width = 6, 4096
    size = n * width * width * 4
    gc.collect()
    reset_peak()
    before = peak_rss()
    model = parallelize_module(stack(n, width), mesh, plan(n))
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device=None)
    monarch.manual_seed(0)
    for layer in model:
        layer.reset_parameters()
    bound = 1 / math.sqrt(width)
    stats = torch.stack([torch.stack([w.abs().amax(), w.std()]) for w in model.parameters()]).full_tensor(T).tolist()
    growth = peak_rss() - before
    for top, std in stats:  # kaiming_uniform_(a=sqrt(5)): U(-1/sqrt(fan_in), 1/sqrt(fan_in)) on the workers
        assert 0.99 * bound < top <= bound and std == pytest.approx(bound / math.sqrt(3), rel=0.01)
    assert all(w.placements == (Shard(0),) for w in model[::2].parameters())
    print(f"model {size / 2**20:.0f} MiB, controller peak RSS growth {growth / 2**20:.1f} MiB")
    assert growth < size / 8, f"the controller grew by {growth / 2**20:.0f} MiB for a {size / 2**20:.0f} MiB model"


class MLP(nn.Module):
    def __init__(self, d: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.norm(x))))


def materialised(mesh: object, seed: int) -> MLP:
    with torch.device("meta"):
        model = MLP()
    parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}).to_empty(device="cpu")
    monarch.manual_seed(seed)
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    return model


def test_values_equal_a_local_mesh_run_with_the_same_seed(mesh: DeviceMesh) -> None:
    got = monarch.full_state_dict(materialised(mesh, 3), timeout=T)
    want = monarch.full_state_dict(materialised(LocalMesh({"tp": 2}), 3))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    other = monarch.full_state_dict(materialised(mesh, 4), timeout=T)
    assert not torch.equal(other["fc1.weight"], got["fc1.weight"])


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 16, generator=g), torch.randn(6, 16, generator=g)) for _ in range(n)]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_meta_built_model_trains_as_plain_torch(mesh: DeviceMesh, compiled: bool) -> None:
    model = materialised(mesh, 7)
    ref = MLP()
    ref.load_state_dict(monarch.full_state_dict(model, timeout=T))
    runs = []
    for m in (model, ref):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)

        def step(x: torch.Tensor, y: torch.Tensor, m: nn.Module = m, opt: torch.optim.Optimizer = opt
                 ) -> torch.Tensor:
            loss = F.mse_loss(m(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        run = monarch.compile(step) if compiled and m is model else step
        runs.append([run(x, y) for x, y in batches(3)])
    got, want = ([float(v.item()) for v in losses] for losses in runs)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(timeout=T), q.detach(), atol=1e-5, rtol=1e-5, msg=name)
