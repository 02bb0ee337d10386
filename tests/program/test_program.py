"""`share` and `assemble` are inverses: every rank assembles exactly its own instructions back.

Programs are drawn directly from instructions: at each position all ranks hold one shared object, or
each rank its own (sometimes equal but another object, as per-rank emitters make them); only
positions where some rank holds another object are patched.
"""
from __future__ import annotations

import dataclasses

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from monarch.program.instr import Buf, Comm, Free, Instr, Local, Start, Wait
from monarch.program.program import RankProgram, assemble, share

ids = st.integers(-8, 32)
id_tuples = st.lists(ids, max_size=3).map(tuple)
shapes = st.lists(st.lists(st.integers(0, 5), max_size=3).map(tuple), min_size=1, max_size=4).map(tuple)
dtypes = st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool])
scalars = st.none() | st.booleans() | st.integers(-9, 9) | st.floats(allow_nan=False) | st.text(max_size=4)
args = st.lists(scalars | ids.map(Buf), max_size=4).map(tuple)

instrs: st.SearchStrategy[Instr] = st.one_of(
    st.builds(Local, st.sampled_from(["aten::mm", "aten::add.Tensor", "monarch::seed"]), args,
              st.dictionaries(st.sampled_from(["dim", "alpha", "out_dtype"]), scalars, max_size=2), id_tuples),
    st.builds(Comm, st.sampled_from(["all_gather", "all_reduce", "reduce_scatter", "all_to_all"]), ids, ids,
              st.integers(0, 2), shapes, dtypes, st.integers(0, 2), st.integers(0, 2),
              st.sampled_from(["sum", "max"])),
    st.builds(Free, id_tuples),
    st.builds(Start, id_tuples, id_tuples, st.integers(0, 2), st.sampled_from(["sum", "min"]), dtypes, shapes),
    st.builds(Wait, id_tuples),
)


@st.composite
def rank_programs(draw: st.DrawFn) -> tuple[RankProgram, ...]:
    n = draw(st.integers(1, 4))
    columns: list[list[Instr]] = []
    for _ in range(draw(st.integers(0, 8))):
        if draw(st.booleans()):
            columns.append([draw(instrs)] * n)  # one object all ranks share
        else:
            own = draw(instrs)
            columns.append([draw(instrs | st.just(own).map(dataclasses.replace)) for _ in range(n)])
    coords = [(r // 2, r % 2) for r in range(n)]
    return tuple(RankProgram(c, tuple(col[r] for col in columns)) for r, c in enumerate(coords))


@settings(max_examples=200, deadline=None)
@given(rank_programs())
def test_assemble_inverts_share_for_every_rank(programs: tuple[RankProgram, ...]) -> None:
    blob, patches = share(programs)
    assert len(patches) == len(programs)
    patched = {i for i, _ in patches[0]}
    for program, own in zip(programs, patches, strict=True):
        assert assemble(blob, own) == program.instrs
        assert {i for i, _ in own} == patched  # every rank patches the same positions
    first = programs[0].instrs
    assert patched == {i for i, ins in enumerate(first) if any(p.instrs[i] is not ins for p in programs)}
