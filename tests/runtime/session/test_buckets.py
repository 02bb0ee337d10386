"""Compiled training steps reduce gradients as DDP does: a few bucketed all_reduces per step (not one per
parameter), in the order the backward writes the gradients, each started while the backward still runs and
waited for where the optimizer reads it; losses and parameters equal plain torch's (MONARCH_BUCKET_MB)."""
from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import monarch
from monarch.actor import this_host
from monarch.program.instr import Buf, Comm, Instr, Local, Start, Wait
from monarch.program.program import RankProgram
from monarch.runtime.actors.proc_mesh import ProcMesh
from monarch.runtime.session.local import LocalMesh, LockstepRunner
from monarch.runtime.session.session import session_of
from monarch.runtime.telemetry.events import now_us

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
import gpt  # noqa: E402
import zoo  # noqa: E402

from tests.end_to_end import zoo_runs  # noqa: E402

CFG = gpt.GPTConfig(d_model=32, n_layer=2, n_head=4, context=16)  # 29 parameters, 140 kB of gradients
BATCH, STEPS, T = 4, 3, 120.0
WORDS = b"monarch mesh tensor shard replicate partial actor endpoint controller worker".split()
Optimizer = Callable[[nn.Module], torch.optim.Optimizer]
OPTIMIZERS: dict[str, Optimizer] = {
    "sgd-momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
    "adamw": lambda m: gpt.optimizer(m, 1e-2)}


@pytest.fixture(scope="module")
def procs() -> Iterator[ProcMesh]:
    with this_host().spawn_procs(per_host={"dp": 2}) as p:
        yield p


def text() -> torch.Tensor:
    picks = torch.randint(0, len(WORDS), (4000,), generator=torch.Generator().manual_seed(0))
    return torch.tensor(list(b" ".join(WORDS[i] for i in picks.tolist())), dtype=torch.int64)


def train(optimizer: Optimizer, mesh: ProcMesh | LocalMesh | None) -> tuple[list[float], nn.Module]:
    """STEPS steps from seed 0: plain torch, or data-parallel on `mesh` under monarch.compile."""
    model = gpt.build(CFG)
    if mesh is not None:
        monarch.data_parallel(model, mesh)
    step = gpt.train_step(model, optimizer(model))
    step = monarch.compile(step) if mesh is not None else step
    stream = gpt.batches(text(), BATCH, CFG.context, seed=0)
    losses = [monarch.fetch(loss).get(timeout=T).item() if mesh is not None else loss.item()
              for loss in (step(*next(stream)) for _ in range(STEPS))]
    return losses, model


def grad_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def assert_equal_to_torch(optimizer: Optimizer, got: list[float], model: nn.Module) -> None:
    """Losses, and with SGD the parameters: AdamW's normalised updates would turn the rounding noise of
    near-zero gradients (the key bias's, which softmax ignores) into differences of lr."""
    want, reference = train(optimizer, None)
    assert got == pytest.approx(want, rel=1e-4, abs=1e-5)
    if optimizer is not OPTIMIZERS["sgd-momentum"]:
        return
    params = monarch.full_state_dict(model, timeout=T)
    for name, p in reference.state_dict().items():
        torch.testing.assert_close(params[name], p, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def buckets(procs: ProcMesh, since: int) -> list[int]:
    """Rank 0's bucket all_reduces since `since` (µs), their sizes in bytes in the order they started."""
    rows = procs.sql("SELECT bytes FROM collectives WHERE rank = 0 AND kind = 'all_reduce (bucket)' AND "
                     f"start_us >= {since} ORDER BY start_us")
    return [r[0] for r in rows]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_compiled_gpt_step_is_one_bucket_all_reduce(procs: ProcMesh, name: str) -> None:
    """Under DDP's default bucket size the GPT's 29 gradients travel as one all_reduce per step, holding
    every gradient once; with SGD's momentum too (whose buffer would otherwise be reduced parameter by
    parameter, where the optimizer reads it)."""
    s = session_of(procs)
    s.synchronize(T)
    before, since = len(s.collectives), now_us()
    losses, model = train(OPTIMIZERS[name], procs)
    assert s.collectives[before:] == ["all_reduce[dp]"] * (2 * STEPS)  # a bucket, and the loss fetch()ed
    assert procs.sql("SELECT kind, count(*) FROM collectives WHERE rank = 0 AND "
                     f"start_us >= {since} GROUP BY kind ORDER BY kind") == [("all_reduce", STEPS),
                                                                             ("all_reduce (bucket)", STEPS)]
    assert buckets(procs, since) == [grad_bytes(model)] * STEPS
    assert_equal_to_torch(OPTIMIZERS[name], losses, model)


def test_buckets_follow_the_size_cap(procs: ProcMesh, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a 16 KiB cap: several buckets, each full (at least the cap) but the last, together holding every
    gradient once; losses and parameters still equal plain torch's."""
    monkeypatch.setenv("MONARCH_BUCKET_MB", str(1 / 64))
    s = session_of(procs)
    s.synchronize(T)
    since = now_us()
    losses, model = train(OPTIMIZERS["sgd-momentum"], procs)
    sizes = buckets(procs, since)
    per_step = len(sizes) // STEPS
    assert len(sizes) == per_step * STEPS and 3 <= per_step <= 8, sizes
    last = sizes[-per_step:]
    assert sum(last) == grad_bytes(model) and all(b >= 16 << 10 for b in last[:-1]), last
    assert s.collectives[-per_step:] == ["all_reduce[dp]"] * per_step
    assert_equal_to_torch(OPTIMIZERS["sgd-momentum"], losses, model)


def test_starts_overlap_the_backward_and_waits_sit_at_the_first_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """The installed program (reference mesh): no blocking all_reduce is left; the first bucket starts
    before the backward's last kernel (the token embedding's gradient); every Wait comes right before the
    first instruction that reads one of its results."""
    monkeypatch.setenv("MONARCH_BUCKET_MB", str(1 / 64))
    mesh = LocalMesh({"dp": 2})
    losses, model = train(OPTIMIZERS["adamw"], mesh)
    runner = session_of(mesh).runner
    assert isinstance(runner, LockstepRunner)
    program: RankProgram = list(runner._installed.values())[-1][0]
    instrs = program.instrs
    assert not any(isinstance(i, Comm) and i.kind == "all_reduce" for i in instrs)
    starts = [k for k, i in enumerate(instrs) if isinstance(i, Start)]
    last_backward = max(k for k, i in enumerate(instrs) if isinstance(i, Local) and "embedding_dense_backward" in i.op)
    assert len(starts) >= 3 and starts[0] < last_backward
    for k, i in enumerate(instrs):
        if isinstance(i, Wait):
            after = next(j for j in instrs[k + 1:] if not isinstance(j, Wait))
            assert reads(after) & set(i.outs), (i, after)
    assert_equal_to_torch(OPTIMIZERS["adamw"], losses, model)


@pytest.mark.parametrize("name", ["encoder", "gpt"])
def test_bucketed_programs_read_only_what_is_there(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """dp=2 x tp=2 (gradients reduced over tp, then over dp), a 4 KiB cap: in every installed rank program,
    nothing reads a buffer the program makes before it is made, nor a bucket's result before its Wait."""
    monkeypatch.setenv("MONARCH_BUCKET_MB", str(1 / 256))
    entry, size = zoo.ZOO[name], zoo.Size()
    torch.manual_seed(0)
    mesh = LocalMesh({"dp": 2, "tp": 2})
    model = zoo_runs.parallelize(entry.build(size), mesh, entry, size)
    zoo_runs.train(model, entry, entry.data(size, 2, 1), compiled=True)
    runner = session_of(mesh).runner
    assert isinstance(runner, LockstepRunner) and runner._installed
    for programs in runner._installed.values():
        assert any(isinstance(i, Start) and i.mdim == 1 for i in programs[0].instrs)  # over tp too
        for p in programs:
            assert_well_formed(p.instrs)


def assert_well_formed(instrs: tuple[Instr, ...]) -> None:
    made = {o for i in instrs for o in (i.outs if isinstance(i, (Local, Start)) else
                                        (i.out,) if isinstance(i, Comm) else ())}
    have: set[int] = set()
    for k, i in enumerate(instrs):
        missing = reads(i) & made - have
        assert not missing, f"instruction {k} ({i!r}) reads {missing} before they are made"
        have |= set(i.outs if isinstance(i, (Local, Wait)) else (i.out,) if isinstance(i, Comm) else ())


def reads(ins: object) -> set[int]:
    """The buffer ids an instruction reads (a Local's arguments, also nested; a collective's inputs)."""
    if isinstance(ins, Comm):
        return {ins.src}
    if isinstance(ins, Start):
        return set(ins.srcs)
    found: set[int] = set()

    def walk(o: object) -> None:
        if isinstance(o, Buf):
            found.add(o.id)
        elif isinstance(o, (tuple, list)):
            for x in o:
                walk(x)
    if isinstance(ins, Local):
        walk(ins.args)
        walk(tuple(ins.kwargs.values()))
    return found
