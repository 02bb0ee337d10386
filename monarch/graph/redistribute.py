"""Redistribution planned as data: the steps that turn one placement tuple into another, and their cost.

Per mesh dim: S->R all_gather, P->R all_reduce, P->S reduce_scatter, S(i)->S(j) all_to_all, R->S a
local chunk, R->P a local "keep on the first rank, the reduction's identity elsewhere"; a Partial(avg)
is first divided by the dim's size where it stands (a local "unaverage" to Partial(sum)). Shards nest in
mesh-dim order, so un-sharding runs from the last mesh dim to the first and sharding from the first to
the last; a mesh dim whose shard sits inside one being undone is undone and redone too. On a mesh dim
of size 1 every step is a local copy: no collective runs over a single rank.
"""
from __future__ import annotations

from dataclasses import dataclass

from monarch.program.instr import Buf, Comm, Local
from monarch.shape import group_coords
from monarch.tensor.placement import P, Partial, Placement, Placements, R, Shard
from monarch.tensor.spec import Spec

COMM_KINDS = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")
COST_FACTOR = {"all_gather": 1.0, "all_reduce": 2.0, "reduce_scatter": 1.0, "all_to_all": 0.5,
               "chunk": 0.0, "partialize": 0.0, "unaverage": 0.0}
AVG = Partial("avg")


def cost(kind: str, spec: Spec, mdim: int) -> float:
    """THE cost model: the bytes a rank sends, roughly, to run step `kind` on mesh dim `mdim` of `spec`:
    its piece (the tensor over the shards of the other mesh dims) times the collective's factor."""
    n = spec.mesh.sizes[mdim]
    if n == 1:
        return 0.0
    piece = float(spec.nbytes)
    for d, p in enumerate(spec.placements):
        if d != mdim and isinstance(p, Shard):
            piece /= spec.mesh.sizes[d]
    return COST_FACTOR[kind] * piece * (n - 1) / n


def direct_kind(have: Placement, want: Placement) -> str:
    """The step that moves one mesh dim from `have` to `want` in one go (`plan` may take two when
    another mesh dim shards the same tensor dim); leaving R is always local."""
    if isinstance(have, Partial):
        return "reduce_scatter" if isinstance(want, Shard) else "all_reduce"
    if isinstance(have, Shard):
        return "all_to_all" if isinstance(want, Shard) else "all_gather"
    return "chunk" if isinstance(want, Shard) else "partialize"


@dataclass(frozen=True)
class Step:
    """One transition on mesh dim `mdim`; `before` is the spec it starts from."""
    kind: str
    mdim: int
    before: Spec
    after: Spec

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS and self.before.mesh.sizes[self.mdim] > 1

    def cost(self) -> float:
        return cost(self.kind, self.before, self.mdim)

    def __repr__(self) -> str:
        name = self.before.mesh.labels[self.mdim]
        return f"{self.kind}[{name}]({self.before.placements[self.mdim]}->{self.after.placements[self.mdim]})"


@dataclass(frozen=True)
class Plan:
    src: Spec
    dst: Spec
    steps: tuple[Step, ...]

    def cost(self) -> float:
        return sum(s.cost() for s in self.steps)

    def comms(self) -> list[str]:
        return [s.kind for s in self.steps if s.is_comm]

    def __repr__(self) -> str:
        return " ; ".join(map(repr, self.steps)) or "(no-op)"


def plan(src: Spec, dst: Placements) -> Plan:
    cur = list(src.placements)
    undo = _dims_to_undo(cur, list(dst))
    steps: list[Step] = []
    spec = src
    for d in sorted(undo, reverse=True):
        if cur[d] == AVG:  # an average is a sum of pieces divided by their count
            cur[d] = P
            after = spec.with_placements(tuple(cur))
            steps.append(Step("unaverage", d, spec, after))
            spec = after
            if cur[d] == dst[d]:
                continue
        kind, new = _undo_step(cur, list(dst), d)
        cur[d] = new
        after = spec.with_placements(tuple(cur))
        steps.append(Step(kind, d, spec, after))
        spec = after
    for d, want in enumerate(dst):
        if cur[d] != want:
            assert cur[d] == R, f"plan {src.placements}->{dst}: mesh dim {d} is {cur[d]} after undoing"
            cur[d] = want
            after = spec.with_placements(tuple(cur))
            steps.append(Step("chunk" if isinstance(want, Shard) else "partialize", d, spec, after))
            spec = after
    return Plan(src, spec, tuple(steps))


def _dims_to_undo(cur: list[Placement], dst: list[Placement]) -> set[int]:
    """Mesh dims whose current placement must be turned into R or redistributed directly."""
    undo = {d for d, p in enumerate(cur) if p != dst[d] and p != R}
    changed = True
    while changed:
        changed = False
        for d in range(len(cur)):
            touched = {p.dim for p in (cur[d] if d in undo else None, dst[d] if cur[d] != dst[d] else None)
                       if isinstance(p, Shard)}
            for later in range(d + 1, len(cur)):
                p = cur[later]
                if later not in undo and isinstance(p, Shard) and p.dim in touched:
                    undo.add(later)
                    changed = True
    return undo


def _undo_step(cur: list[Placement], dst: list[Placement], d: int) -> tuple[str, Placement]:
    src, want = cur[d], dst[d]
    alone = _alone(cur, dst, d)
    if isinstance(src, Partial):
        if isinstance(want, Shard) and alone(want.dim):
            return "reduce_scatter", want
        return "all_reduce", R
    assert isinstance(src, Shard), f"cannot undo {src}"
    if isinstance(want, Shard) and want.dim != src.dim and alone(want.dim) and alone(src.dim):
        return "all_to_all", want
    return "all_gather", R


def _alone(cur: list[Placement], dst: list[Placement], d: int):
    """Whether no other mesh dim shards tensor dim `t` now or after, so a direct collective is safe."""
    def check(t: int) -> bool:
        return not any(isinstance(p, Shard) and p.dim == t
                       for e in range(len(cur)) if e != d for p in (cur[e], dst[e]))
    return check


def emit_step(step: Step, coords: tuple[int, ...], src: int, out: int) -> Local | Comm:
    """The instruction that runs `step` at mesh point `coords`."""
    d = step.mdim
    if step.kind == "unaverage":
        n, floating = step.before.mesh.sizes[d], step.before.dtype.is_floating_point or step.before.dtype.is_complex
        return Local("aten::div.Scalar", (Buf(src), n), {}, (out,)) if floating else \
            Local("aten::div.Scalar_mode", (Buf(src), n), {"rounding_mode": "trunc"}, (out,))
    if step.before.mesh.sizes[d] == 1 and step.kind != "chunk":  # one rank: its piece is the whole, no collective
        return Local("aten::clone", (Buf(src),), {}, (out,))
    if step.kind == "chunk":
        p = step.after.placements[d]
        assert isinstance(p, Shard)
        start, n = step.after.bounds(coords)[p.dim]
        start0, _ = step.before.bounds(coords)[p.dim]
        return Local("monarch::chunk", (Buf(src), p.dim, start - start0, n), {}, (out,))
    if step.kind == "partialize":
        p = step.after.placements[d]
        assert isinstance(p, Partial)
        return Local("monarch::partialize", (Buf(src), coords[d] == 0, p.op), {}, (out,))
    shapes = tuple(map(step.before.local_shape, group_coords(coords, d, step.before.mesh.sizes)))
    before, after = step.before.placements[d], step.after.placements[d]
    dtype = step.before.dtype
    if step.kind == "all_gather":
        return Comm("all_gather", src, out, d, shapes, dtype, dim=_dim(before))
    if step.kind == "all_to_all":
        return Comm("all_to_all", src, out, d, shapes, dtype, dim=_dim(after), cat_dim=_dim(before))
    assert isinstance(before, Partial), step
    if step.kind == "reduce_scatter":
        return Comm("reduce_scatter", src, out, d, shapes, dtype, dim=_dim(after), op=before.op)
    return Comm("all_reduce", src, out, d, shapes, dtype, op=before.op)


def _dim(p: Placement) -> int:
    assert isinstance(p, Shard), p
    return p.dim
