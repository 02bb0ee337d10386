"""monarch.compile follows the Python state a step reads: an optimizer reached through a helper keeps up
with its LR scheduler, a compiled forward+backward leaves `.grad` set (fresh after zero_grad, accumulated
without) for an eager optimizer, module attributes and closure scalars retrace, and state a step changes
in Python while it is recorded (a scheduler stepped inside it) is refused. Values equal plain torch."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import monarch
import monarch.actor
from monarch.errors import TraceError
from monarch.runtime.actors.proc_mesh import ProcMesh
from monarch.runtime.session.local import LocalMesh

TIMEOUT = 60
F = nn.functional


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def on(mesh: ProcMesh | None, m: nn.Module) -> nn.Module:
    """`m` data-parallel over the mesh's "dp", or as it is for plain torch (mesh None)."""
    return m if mesh is None else monarch.data_parallel(m, mesh, dim="dp")


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(n)]


def value(t: torch.Tensor) -> torch.Tensor:
    return monarch.fetch(t).get(timeout=TIMEOUT) if isinstance(t, monarch.MeshTensor) else t.detach().clone()


def params(m: nn.Module) -> list[torch.Tensor]:
    return [value(p) for p in m.parameters()]


def grads(m: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else value(p.grad) for p in m.parameters()]


def close(got: Any, want: Any) -> None:
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def updater(opt: torch.optim.Optimizer) -> Callable[[], None]:
    """The optimizer step, defined away from the compiled step (which names only this helper)."""
    def update() -> None:
        opt.step()
        opt.zero_grad()
    return update


SGD = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
ADAMW = (torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1})
STEP_LR = (torch.optim.lr_scheduler.StepLR, {"step_size": 1, "gamma": 0.5})
ONE_CYCLE = (torch.optim.lr_scheduler.OneCycleLR, {"max_lr": 0.1, "total_steps": 6})


@pytest.mark.parametrize("opt_kind, sched_kind", [(SGD, STEP_LR), (SGD, ONE_CYCLE), (ADAMW, STEP_LR),
                                                  (ADAMW, ONE_CYCLE)],
                         ids=["sgd-steplr", "sgd-onecycle", "adamw-steplr", "adamw-onecycle"])
def test_a_scheduler_reaches_an_optimizer_stepped_by_a_helper(procs: ProcMesh, opt_kind: tuple,
                                                              sched_kind: tuple) -> None:
    runs = []
    for mesh in (None, procs):
        m = on(mesh, model())
        opt = opt_kind[0](m.parameters(), **opt_kind[1])
        sched = sched_kind[0](opt, **sched_kind[1])
        update = updater(opt)

        def step(x: torch.Tensor, y: torch.Tensor, m: nn.Module = m) -> torch.Tensor:
            loss = F.mse_loss(m(x), y)
            loss.backward()
            update()
            return loss
        run = monarch.compile(step) if mesh is not None else step
        losses = []
        for x, y in batches(5):
            losses.append(run(x, y))
            sched.step()
        runs.append(([value(t) for t in losses], params(m)))
    close(runs[1], runs[0])


@pytest.mark.parametrize("opt_kind", [SGD, ADAMW], ids=["sgd-momentum", "adamw"])
def test_a_compiled_forward_backward_feeds_an_eager_optimizer(procs: ProcMesh, opt_kind: tuple) -> None:
    runs = []
    for mesh in (None, procs):
        m = on(mesh, model())
        opt = opt_kind[0](m.parameters(), **opt_kind[1])

        def fwd_bwd(x: torch.Tensor, y: torch.Tensor, m: nn.Module = m) -> torch.Tensor:
            loss = F.mse_loss(m(x), y)
            loss.backward()
            return loss
        run = monarch.compile(fwd_bwd) if mesh is not None else fwd_bwd
        seen = []
        for x, y in batches(4):
            loss = run(x, y)
            seen.append((value(loss), grads(m)))
            opt.step()
            opt.zero_grad()
        runs.append((seen, params(m)))
    assert all(g is not None for _, gs in runs[1][0] for g in gs), "every call leaves .grad set"
    close(runs[1], runs[0])


def test_a_compiled_forward_backward_accumulates_gradients(procs: ProcMesh) -> None:
    """Two calls before each optimizer step: the second adds to the gradients the first left, as torch."""
    runs = []
    for mesh in (None, procs):
        m = on(mesh, model())
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

        def fwd_bwd(x: torch.Tensor, y: torch.Tensor, m: nn.Module = m) -> torch.Tensor:
            loss = F.mse_loss(m(x), y) / 2
            loss.backward()
            return loss
        run = monarch.compile(fwd_bwd) if mesh is not None else fwd_bwd
        seen = []
        for i, (x, y) in enumerate(batches(6)):
            seen.append((value(run(x, y)), grads(m)))
            if i % 2:
                opt.step()
                opt.zero_grad()
        runs.append((seen, params(m)))
    close(runs[1], runs[0])
    assert run.traces == 2, "one program makes fresh gradients, one accumulates"


class Scaled(nn.Module):
    """A linear layer whose output is scaled by a plain attribute its forward reads."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 1)
        self.scale = 1.0


def scaled_forward(self: Scaled, x: torch.Tensor) -> torch.Tensor:
    return self.lin(x) * self.scale


Scaled.forward = scaled_forward  # type: ignore[method-assign]


def test_module_attributes_and_closure_scalars_retrace(procs: ProcMesh) -> None:
    runs = []
    for mesh in (None, procs):
        m = on(mesh, Scaled())
        offset = 0.0

        def forward(x: torch.Tensor, m: Scaled = m) -> torch.Tensor:
            return (m(x) + offset).sum()
        run = monarch.compile(forward) if mesh is not None else forward
        got = []
        for i, (x, _) in enumerate(batches(4)):
            m.scale = 1.0 + i
            offset = 10.0 * i
            got.append(value(run(x)))
        runs.append(got)
    close(runs[1], runs[0])


def test_an_adamw_that_stepped_eagerly_before_compiling(procs: ProcMesh) -> None:
    """Its step counts were plain tensors when the compiled step first met it through a helper."""
    runs = []
    for mesh in (None, procs):
        m = on(mesh, model())
        update = updater(torch.optim.AdamW(m.parameters(), lr=0.05))

        def step(x: torch.Tensor, y: torch.Tensor, m: nn.Module = m) -> torch.Tensor:
            loss = F.mse_loss(m(x), y)
            loss.backward()
            update()
            return loss
        run = monarch.compile(step) if mesh is not None else step
        data = batches(5)
        losses = [step(*data[0])] + [run(x, y) for x, y in data[1:]]
        runs.append(([value(t) for t in losses], params(m)))
    close(runs[1], runs[0])


class Counting(nn.Linear):
    """A layer that counts its forward calls in a plain attribute."""

    def __init__(self) -> None:
        super().__init__(4, 1)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(x)


def stepper(m: nn.Module, opt: torch.optim.Optimizer, then: Callable[[], Any] = lambda: None) -> Callable[..., Any]:
    """A training step of `m` with `opt` (mean squared error), then `then()` inside the step."""
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(m(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        then()
        return loss
    return step


def scheduled_inside(mesh: LocalMesh) -> Callable[..., Any]:
    m = monarch.data_parallel(model(), mesh, dim="dp")
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return stepper(m, opt, sched.step)


def nadam(mesh: LocalMesh) -> Callable[..., Any]:
    m = monarch.data_parallel(model(), mesh, dim="dp")
    return stepper(m, torch.optim.NAdam(m.parameters(), lr=0.1))


def counting(mesh: LocalMesh) -> Callable[..., Any]:
    torch.manual_seed(0)
    m = monarch.data_parallel(Counting(), mesh, dim="dp")
    return lambda x, y: F.mse_loss(m(x), y)


@pytest.mark.parametrize("make, message", [
    (scheduled_inside, r"changed SGD.param_groups\[0\]\['lr'\] from 0.1 to 0.05 .*step LR schedulers and set "
                       r"hyperparameters outside the compiled step, between calls"),
    (nadam, r"NAdam keeps per-parameter state on the controller .*step this one eagerly, outside the compiled step"),
    (counting, r"changed Counting.calls from 0 to 1 .*set module attributes and modes \(train/eval\) outside the "
               r"compiled step")], ids=["scheduler-inside", "nadam", "module-attribute"])
def test_state_a_step_changes_while_recorded_is_refused(make: Callable[[LocalMesh], Callable[..., Any]],
                                                        message: str) -> None:
    step = monarch.compile(make(LocalMesh({"dp": 2})))
    x, y = batches(1)[0]
    with pytest.raises(TraceError, match=message):
        for _ in range(2):  # NAdam's state exists from the second call on
            step(x, y)


class Installed(monarch.actor.Actor):
    """How many compiled programs this worker's tensor engine holds."""

    @monarch.actor.endpoint
    def count(self) -> int:
        import gc
        services = [o for o in gc.get_objects() if type(o).__name__ == "TensorService"]
        return sum(len(s.installed) for s in services)


def test_programs_a_changing_hyperparameter_retires_are_uninstalled(procs: ProcMesh) -> None:
    """An lr that changes every call retraces every call; the workers keep no more programs than the
    controller's cache of the step (the ones it drops are uninstalled with the next call)."""
    from monarch.runtime.session.compile import _KEEP
    m, ref = model(), model()
    monarch.data_parallel(m, procs, dim="dp")
    opt, ropt = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    sch = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    rsch = torch.optim.lr_scheduler.StepLR(ropt, step_size=1, gamma=0.9)
    counter = procs.spawn("installed", Installed)
    before = max(counter.count.call().get(timeout=TIMEOUT).values())

    step = monarch.compile(stepper(m, opt))
    for x, y in batches(3 * _KEEP):
        got = value(step(x, y))
        want = F.mse_loss(ref(x), y)
        want.backward()
        ropt.step()
        ropt.zero_grad()
        sch.step()
        rsch.step()
        close(got, want.detach())
    assert step.traces == 3 * _KEEP
    assert max(counter.count.call().get(timeout=TIMEOUT).values()) - before <= _KEEP + 1  # one leaves next call


def test_an_lr_schedule_of_adamw_records_the_step_once(procs: ProcMesh) -> None:
    """A capturable AdamW reads its learning rate as an input each call brings: a scheduler that moves the
    lr every call (OneCycleLR without momentum cycling) needs no new recording, and values equal torch."""
    runs, traces = [], 0
    for mesh in (None, procs):
        m = on(mesh, model())
        opt = torch.optim.AdamW(m.parameters(), lr=0.05, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=8, cycle_momentum=False)
        step = monarch.compile(stepper(m, opt)) if mesh is not None else stepper(m, opt)
        losses = []
        for x, y in batches(6):
            losses.append(value(step(x, y)))
            sched.step()
        runs.append((losses, params(m)))
        traces = getattr(step, "traces", traces)
    close(runs[1], runs[0])
    assert traces == 2, "the first call (empty optimizer state) and the steady state, whatever the lr"
