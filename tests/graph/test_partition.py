"""Partitioning's frees: each dead buffer is freed after its last reader, or, with a byte budget (an eager
flush), small dead buffers are freed together while large ones still go at once; the values stay those of
plain torch either way.
"""
from __future__ import annotations

import torch

import monarch
from monarch import LocalMesh, Shard
from monarch.graph.partition import FREE_BATCH, partition
from monarch.program.instr import Free, Local
from monarch.runtime.session.session import session_of


def _chain(x: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        x = torch.relu(x * 0.5)
    return x


def _frees(budget: int, rows: int, n: int = 10) -> tuple[list[tuple[int, ...]], int]:
    """The frees of one rank for a chain of n ops on a rows x 64 float tensor, and its op count."""
    mesh = LocalMesh({"x": 2})
    x = monarch.distribute_tensor(torch.randn(rows, 64), mesh, {"x": Shard(0)})
    session = session_of(mesh)
    session.flush()
    y = _chain(x, n)
    traced = session.tracer.take()
    programs = partition(traced, budget)
    session.ship(traced, programs)
    torch.testing.assert_close(y.full_tensor(), _chain(x.full_tensor(), n))
    instrs = programs[0].instrs
    return [i.ids for i in instrs if isinstance(i, Free)], sum(isinstance(i, Local) for i in instrs)


def test_without_a_budget_each_dead_buffer_goes_after_its_last_reader() -> None:
    frees, ops = _frees(0, 8)
    assert ops == 20 and len(frees) == 19  # every intermediate but the result, one Free each
    assert all(len(ids) == 1 for ids in frees)


def test_small_dead_buffers_are_freed_together() -> None:
    frees, ops = _frees(FREE_BATCH, 8)
    assert ops == 20 and len(frees) == 1 and len(frees[0]) == 19  # 19 x 2 KiB: one Free at the end


def test_large_dead_buffers_are_freed_at_once() -> None:
    rows = FREE_BATCH // (64 * 4)  # each intermediate is FREE_BATCH bytes
    frees, _ = _frees(FREE_BATCH, rows, n=3)
    assert [len(ids) for ids in frees] == [1] * 5
