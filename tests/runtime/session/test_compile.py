"""monarch.compile: compiled training steps equal plain torch and eager MeshTensors, retrace on new
signatures, replay with one frame per worker, refuse sync points, and keep worker memory flat."""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import monarch
from monarch import Shard
from monarch.runtime.control.controller import controller
from monarch.runtime.session.local import LocalMesh

MESHES = [{"dp": 2}, {"tp": 2}, {"dp": 2, "tp": 2}]
OPTIMIZERS = [(torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}), (torch.optim.AdamW, {"lr": 0.01}),
              (torch.optim.AdamW, {"lr": 0.01, "foreach": True})]


def data(seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(8, 16, generator=g), torch.randn(16, 4, generator=g),
            torch.randn(10, 8, generator=g), torch.randn(10, 4, generator=g))


def mlp_loss(x: torch.Tensor, y: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return ((torch.relu(x @ w1) @ w2 - y) ** 2).mean()


def train_step(w1: torch.Tensor, w2: torch.Tensor, opt: torch.optim.Optimizer) -> Callable[..., torch.Tensor]:
    """One training step of the MLP (forward, backward, optimizer), to run eager or compiled."""
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = mlp_loss(x, y, w1, w2)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return step


def plain_run(opt_cls: type, kw: dict, steps: int) -> tuple[list[float], torch.Tensor]:
    w1, w2, x, y = data()
    w1.requires_grad_(True)
    w2.requires_grad_(True)
    opt = opt_cls([w1, w2], **kw)
    losses = []
    for _ in range(steps):
        loss = mlp_loss(x, y, w1, w2)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, w1.detach()


def sharded(mesh: object, dims: dict) -> tuple[torch.Tensor, ...]:
    """The MLP column- then row-parallel over tp (if any), the batch over dp (if any)."""
    w1, w2, x, y = data()
    tp = {"tp": Shard(1)} if "tp" in dims else {}
    tp2 = {"tp": Shard(0)} if "tp" in dims else {}
    batch = {"dp": Shard(0)} if "dp" in dims else {}
    return (torch.nn.Parameter(monarch.distribute_tensor(w1, mesh, tp)),
            torch.nn.Parameter(monarch.distribute_tensor(w2, mesh, tp2)),
            monarch.distribute_tensor(x, mesh, batch), monarch.distribute_tensor(y, mesh, batch))


@pytest.mark.parametrize("dims", MESHES, ids=str)
@pytest.mark.parametrize("opt_cls, kw", OPTIMIZERS, ids=["sgd", "adamw", "adamw-foreach"])
def test_compiled_steps_match_plain_and_eager(dims: dict, opt_cls: type, kw: dict) -> None:
    want, want_w1 = plain_run(opt_cls, kw, 5)
    for compiled in (True, False):
        mesh = LocalMesh(dims)
        w1, w2, x, y = sharded(mesh, dims)
        opt = opt_cls([w1, w2], **kw)

        step = train_step(w1, w2, opt)
        run = monarch.compile(step) if compiled else step
        losses = [run(x, y) for _ in range(5)]
        torch.testing.assert_close([t.item() for t in losses], want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(w1.full_tensor(), want_w1, rtol=1e-4, atol=1e-5)
        if compiled:
            assert run.traces == 2, "one trace with empty optimizer state, one in steady state"


def test_new_shapes_and_scalars_retrace() -> None:
    mesh = LocalMesh({"dp": 2})
    w = monarch.distribute_tensor(torch.ones(4, 3), mesh)

    @monarch.compile
    def f(x: torch.Tensor, scale: float) -> torch.Tensor:
        return (x @ w) * scale

    x8 = monarch.distribute_tensor(torch.ones(8, 4), mesh, [Shard(0)])
    assert f(x8, 2.0).full_tensor().sum().item() == 8 * 3 * 4 * 2
    f(x8, 2.0)
    assert f.traces == 1
    x6 = monarch.distribute_tensor(torch.ones(6, 4), mesh, [Shard(0)])
    assert f(x6, 2.0).full_tensor().shape == (6, 3)
    assert f.traces == 2
    assert f(x6, 3.0).full_tensor().sum().item() == 6 * 3 * 4 * 3
    assert f.traces == 3
    f(x8, 2.0)
    assert f.traces == 3, "the first signature is still cached"


def test_plain_tensor_arguments_are_fed_each_call() -> None:
    mesh = LocalMesh({"dp": 2})
    w = monarch.distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh)

    @monarch.compile
    def f(batch: torch.Tensor) -> torch.Tensor:
        x = monarch.distribute_tensor(batch, mesh, {"dp": Shard(0)})
        return (x @ w).sum(0)

    for seed in range(4):
        b = torch.randn(6, 4, generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(f(b).full_tensor(), (b @ torch.arange(12.0).reshape(4, 3)).sum(0))
    assert f.traces == 1


def test_sync_points_inside_a_step_raise() -> None:
    mesh = LocalMesh({"dp": 2})
    x = monarch.distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])

    @monarch.compile
    def reads(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        print(y.sum().item())
        return y

    @monarch.compile
    def branches(x: torch.Tensor) -> torch.Tensor:
        return x if (x > 0).all() else -x

    for f in (reads, branches):
        with pytest.raises(monarch.TraceError, match="monarch.synchronize"):
            f(x)
    assert torch.equal(x.full_tensor(), torch.ones(4, 4)), "the mesh still works after a failed trace"


def test_python_errors_point_at_the_users_line() -> None:
    mesh = LocalMesh({"dp": 2})
    x = monarch.distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])

    @monarch.compile
    def bad(x: torch.Tensor) -> torch.Tensor:
        return x @ torch.ones(5, 5)  # wrong shape

    with pytest.raises(monarch.ShapeError) as info:
        bad(x)
    assert any(entry.name == "bad" for entry in info.traceback)


def test_worker_memory_stays_flat_over_many_steps() -> None:
    mesh = LocalMesh({"dp": 2, "tp": 2})
    w1, w2, x, y = sharded(mesh, {"dp": 2, "tp": 2})
    opt = torch.optim.AdamW([w1, w2], lr=0.01)

    step = monarch.compile(train_step(w1, w2, opt))

    sizes = []
    for i in range(300):
        step(x, y)
        if i in (20, 299):
            monarch.synchronize(mesh)
            sizes.append([len(e.store) for e in mesh.session.runner.engines])
    assert sizes[0] == sizes[1], f"buffers per rank grew from {sizes[0]} to {sizes[1]}"


def test_a_replayed_step_sends_one_frame_per_worker(procs) -> None:
    w1, w2, x, y = sharded(procs, {"dp": 2, "tp": 2})
    opt = torch.optim.AdamW([w1, w2], lr=0.01)

    step = monarch.compile(train_step(w1, w2, opt))

    losses = [step(x, y) for _ in range(3)]
    monarch.synchronize(procs, timeout=60)
    mesh = controller().mesh(procs._mesh.id)
    before = mesh.frames
    losses += [step(x, y) for _ in range(5)]
    assert mesh.frames - before == 5 * len(procs)
    want, _ = plain_run(torch.optim.AdamW, {"lr": 0.01}, 8)
    torch.testing.assert_close([monarch.fetch(t).get(timeout=60).item() for t in losses], want,
                               rtol=1e-4, atol=1e-5)


def test_worker_buffers_stay_flat_over_1000_steps_on_procs(procs) -> None:
    from tests.tensor.test_meshtensor import BufferCount
    counter = procs.spawn("compiled_buffer_count", BufferCount)
    w1, w2, x, y = sharded(procs, {"dp": 2, "tp": 2})
    opt = torch.optim.AdamW([w1, w2], lr=1e-3)

    step = monarch.compile(train_step(w1, w2, opt))

    counts = []
    for i in range(1000):
        loss = step(x, y)
        if i in (50, 999):
            monarch.synchronize(procs, timeout=60)
            counts.append(counter.live.call().get(timeout=60).values())
    assert counts[0] == counts[1], f"live buffers per worker went from {counts[0]} to {counts[1]}"
    assert loss.item() < 10.0
