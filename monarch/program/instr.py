"""The instruction set of per-rank programs: local kernels, collectives and frees over buffer ids.

Shared by the compiler (which emits them) and the workers (which run them), so it imports torch only.
Kernels are named by qualified name (`aten::mm`, or `monarch::<kernel>` for the few local helpers the
workers provide); collectives name a dim of the mesh view the program runs on, never processes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import torch


@dataclass(frozen=True, slots=True)
class Buf:
    """A tensor argument: the local buffer with this id."""
    id: int

    def __reduce__(self) -> tuple:
        return (Buf, (self.id,))

    def __repr__(self) -> str:
        return f"%{self.id}" if self.id >= 0 else f"%t{-self.id}"


@dataclass(frozen=True, slots=True)
class Local:
    """Run kernel `op` on local buffers; its tensor results are stored under `outs`, in order."""
    op: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outs: tuple[int, ...]

    def __reduce__(self) -> tuple:
        return (Local, (self.op, self.args, self.kwargs, self.outs))

    def __repr__(self) -> str:
        args = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        outs = ", ".join(repr(Buf(o)) for o in self.outs)
        return f"{outs} = {self.op.removeprefix('aten::')}({', '.join(args)})"


@dataclass(frozen=True, slots=True)
class Comm:
    """A collective over mesh dim `mdim`: every member of this rank's group along that dim takes part.

    kinds: all_gather (concatenate along `dim`), all_reduce (`op`), reduce_scatter (`op`, scatter
    along `dim`), all_to_all (split along `dim`, concatenate along `cat_dim`). `shapes` holds the local
    input shape of each group member in group order, so uneven pieces need no handshake.
    """
    kind: str
    src: int
    out: int
    mdim: int
    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype
    dim: int = 0
    cat_dim: int = 0
    op: str = "sum"

    def __repr__(self) -> str:
        extra = {"all_gather": f"dim={self.dim}", "all_reduce": self.op,
                 "reduce_scatter": f"{self.op}, dim={self.dim}",
                 "all_to_all": f"split={self.dim}, cat={self.cat_dim}"}[self.kind]
        return f"{Buf(self.out)!r} = {self.kind}({Buf(self.src)!r}, {extra}, mdim={self.mdim})"


@dataclass(frozen=True, slots=True)
class Free:
    """Drop these buffers (their last use has run)."""
    ids: tuple[int, ...]

    def __reduce__(self) -> tuple:
        return (Free, (self.ids,))

    def __repr__(self) -> str:
        return "free " + ", ".join(repr(Buf(i)) for i in self.ids)


@dataclass(frozen=True, slots=True)
class Start:
    """Begin one collective over mesh dim `mdim` of the buffers `srcs` (a bucket: packed into one flat buffer)
    without waiting; the matching Wait stores the results under `outs`. `shapes` are this rank's local input
    shapes. Kinds: all_reduce (`op`); reduce_scatter (`op`) and all_gather, where src k is split or gathered
    along `dims[k]` and `groups[k]` holds the shape of each member's piece of it, in group order: the slice
    it receives (reduce_scatter) or the input it gives (all_gather)."""
    srcs: tuple[int, ...]
    outs: tuple[int, ...]
    mdim: int
    op: str
    dtype: torch.dtype
    shapes: tuple[tuple[int, ...], ...]
    kind: str = "all_reduce"
    dims: tuple[int, ...] = ()
    groups: tuple[tuple[tuple[int, ...], ...], ...] = ()

    def __reduce__(self) -> tuple:
        return (Start, (self.srcs, self.outs, self.mdim, self.op, self.dtype, self.shapes, self.kind, self.dims,
                        self.groups))

    def __repr__(self) -> str:
        outs = ", ".join(repr(Buf(o)) for o in self.outs)
        srcs = ", ".join(repr(Buf(s)) for s in self.srcs)
        extra = self.op if self.kind == "all_reduce" else f"{self.op}, dims={self.dims}" \
            if self.kind == "reduce_scatter" else f"dims={self.dims}"
        return f"start {outs} = {self.kind}({srcs}, {extra}, mdim={self.mdim})"


@dataclass(frozen=True, slots=True)
class Wait:
    """Finish the Start whose outputs are `outs`."""
    outs: tuple[int, ...]

    def __reduce__(self) -> tuple:
        return (Wait, (self.outs,))

    def __repr__(self) -> str:
        return "wait " + ", ".join(repr(Buf(o)) for o in self.outs)


Instr = Union[Local, Comm, Free, Start, Wait]
