"""Rules for the batched linear-algebra ops (solve, inv, cholesky, lu, qr, svd, eigh, det, pinv, ...).

Each op is one row of `CORES`: how many trailing "core" (matrix or vector) dims every tensor argument and
every output has; the dims before them are batch dims, broadcast between the inputs as in torch. A batch
dim shards freely: every input that has it (not broadcast) shards it, the others stay replicated, and
every output that has it keeps the shard. Core dims are replicated (gathered when they come sharded).
The error check of linalg.inv, cholesky, solve (`_linalg_check_errors`) returns no tensor, so it runs on
the controller on the fetched `info` (a sync point): a failure in any rank's piece raises torch's own
error there. Output shapes come from meta tensors; the ops torch has no meta kernel for (geqrf,
linalg_lstsq, linalg_pinv with tolerances given as CPU scalars) get one here.
"""
from __future__ import annotations

import torch

from monarch.errors import UnsupportedOpError
from monarch.graph.rules.common import aten
from monarch.graph.rules.table import OpCall, OpOverload, Strategy, register_rule
from monarch.tensor.placement import Placement, R, Shard
from monarch.tensor.spec import Spec

RHS = -1  # a right-hand side: 1 core dim when it is a vector for A (torch's vector case), else 2

# op -> (core dims by tensor argument name, core dims of each output)
CORES: dict[OpOverload, tuple[dict[str, int], tuple[int, ...]]] = {
    aten._linalg_check_errors.default: ({"info": 0}, ()),
    aten._linalg_det.default: ({"A": 2}, (0, 2, 1)),
    aten._linalg_eigh.default: ({"A": 2}, (1, 2)),
    aten._linalg_slogdet.default: ({"A": 2}, (0, 0, 2, 1)),
    aten._linalg_solve_ex.default: ({"A": 2, "B": RHS}, (RHS, 2, 1, 0)),
    aten._linalg_svd.default: ({"A": 2}, (2, 1, 2)),
    aten.cholesky.default: ({"self": 2}, (2,)),
    aten.cholesky_inverse.default: ({"self": 2}, (2,)),
    aten.cholesky_solve.default: ({"self": 2, "input2": 2}, (2,)),
    aten.geqrf.default: ({"self": 2}, (2, 1)),
    aten.linalg_cholesky_ex.default: ({"self": 2}, (2, 0)),
    aten.linalg_householder_product.default: ({"input": 2, "tau": 1}, (2,)),
    aten.linalg_inv_ex.default: ({"A": 2}, (2, 0)),
    aten.linalg_ldl_factor_ex.default: ({"self": 2}, (2, 1, 0)),
    aten.linalg_ldl_solve.default: ({"LD": 2, "pivots": 1, "B": 2}, (2,)),
    aten.linalg_lstsq.default: ({"self": 2, "b": RHS}, (RHS, 1, 0, 1)),
    aten.linalg_lu.default: ({"A": 2}, (2, 2, 2)),
    aten.linalg_lu_factor_ex.default: ({"A": 2}, (2, 1, 0)),
    aten.linalg_lu_solve.default: ({"LU": 2, "pivots": 1, "B": 2}, (2,)),
    aten.linalg_matrix_exp.default: ({"self": 2}, (2,)),
    aten.linalg_pinv.atol_rtol_tensor: ({"self": 2, "atol": 0, "rtol": 0}, (2,)),
    aten.linalg_qr.default: ({"A": 2}, (2, 2)),
    aten.linalg_solve_triangular.default: ({"self": 2, "B": 2}, (2,)),
    aten.lu_unpack.default: ({"LU_data": 2, "LU_pivots": 1}, (2, 2, 2)),
    aten.ormqr.default: ({"self": 2, "input2": 1, "input3": 2}, (2,)),
    aten.triangular_solve.default: ({"self": 2, "A": 2}, (2, 2)),
}


def tensor_cores(call: OpCall) -> list[int]:
    """Core dims of each tensor input, in `call.ins` order (the op's tensor arguments that are given)."""
    table = CORES[call.op][0]
    cores = [table[a.name] for i, a in enumerate(call.op._schema.arguments)
             if isinstance(call.arg(i, a.name), Spec)]
    return [_rhs(call) if c == RHS else c for c in cores]


def _rhs(call: OpCall) -> int:
    """1 when the second operand is a vector right-hand side of the first (B.ndim == 1, or A's batch and
    rows without the last dim), else 2: torch's `linalg_solve_is_vector_rhs`."""
    a, b = call.ins[0], call.ins[1]
    return 1 if b.ndim == 1 or (b.ndim == a.ndim - 1 and b.shape == a.shape[:-1]) else 2


def batch_of(spec: Spec, core: int) -> tuple[int, ...]:
    return tuple(spec.shape[:max(spec.ndim - core, 0)])


def batch_placement(spec: Spec, core: int, batch: tuple[int, ...], j: int) -> Placement:
    """Shard on the tensor's dim for batch dim j of the broadcast `batch`, or R where the tensor lacks it
    or broadcasts along it (an output without it, e.g. the LU of an unbatched A, is the same on every rank)."""
    own = batch_of(spec, core)
    k = j - (len(batch) - len(own))
    return Shard(k) if k >= 0 and own[k] == batch[j] else R


@register_rule(*CORES)
def batched(call: OpCall, mdim: int) -> list[Strategy]:
    """One strategy per batch dim (of the inputs' broadcast batch) of size > 1."""
    ins_core = tensor_cores(call)
    outs_core = [_rhs(call) if c == RHS else c for c in CORES[call.op][1]]
    batch = tuple(torch.broadcast_shapes(*(batch_of(s, c) for s, c in zip(call.ins, ins_core, strict=True))))
    return [Strategy(tuple(batch_placement(s, c, batch, j) for s, c in zip(call.ins, ins_core, strict=True)),
                     tuple(batch_placement(s, c, batch, j) for s, c in zip(call.outs, outs_core, strict=True)))
            for j in range(len(batch)) if batch[j] > 1]


# -- meta kernels: output shapes for the ops torch computes only on data --------------------------------
_META = torch.library.Library("aten", "IMPL")


def _column_major(batch: tuple[int, ...], rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
    """An empty (*batch, rows, cols) meta tensor laid out as LAPACK writes it (each matrix column-major)."""
    stride, step = [1, rows], rows * cols
    for n in reversed(batch):
        stride.insert(0, step)
        step *= n
    return torch.empty_strided((*batch, rows, cols), stride, dtype=like.dtype, device=like.device)


def _geqrf_meta(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    *batch, m, n = a.shape
    return _column_major(tuple(batch), m, n, a), a.new_empty((*batch, min(m, n)))


def _lstsq_meta(a: torch.Tensor, b: torch.Tensor, rcond: float | None = None,
                driver: str | None = None) -> tuple[torch.Tensor, ...]:
    """torch.linalg.lstsq's shapes: the solution in a (max(m, n), k) LAPACK buffer narrowed to n rows;
    residuals for m > n and a driver other than gelsy; ranks but for gels; singular values for gelss and
    gelsd. For gelss and gelsd with m > n the residuals exist only when every matrix has full rank, which
    the shapes cannot tell."""
    driver = driver or "gelsy"
    vector = b.ndim == a.ndim - 1
    rhs = b.unsqueeze(-1) if vector else b
    (m, n), k = a.shape[-2:], rhs.shape[-1]
    batch = tuple(torch.broadcast_shapes(a.shape[:-2], rhs.shape[:-2]))
    if m > n and driver in ("gelss", "gelsd"):
        raise UnsupportedOpError(f"linalg.lstsq with driver={driver!r} and more rows than columns: whether it "
                                 "returns residuals depends on the ranks of the matrices; use driver='gels' or "
                                 "'gelsy' on a MeshTensor, or compute the residuals from the solution")
    solution = _column_major(batch, max(m, n), k, a).narrow(-2, 0, n)
    real = a.real.dtype if a.is_complex() else a.dtype
    residuals = a.new_empty((*batch, k) if m > n and driver != "gelsy" else (0,), dtype=real)
    rank = a.new_empty(batch if driver != "gels" else (0,), dtype=torch.int64)
    singular = a.new_empty((*batch, min(m, n)) if driver in ("gelss", "gelsd") else (0,), dtype=real)
    return solution.squeeze(-1) if vector else solution, residuals, rank, singular


def _pinv_meta(a: torch.Tensor, atol: torch.Tensor | None = None, rtol: torch.Tensor | None = None,
               hermitian: bool = False) -> torch.Tensor:
    """(*batch, n, m), the batch broadcast with the tolerances' shapes."""
    tols = [t.shape for t in (atol, rtol) if t is not None]
    batch = tuple(torch.broadcast_shapes(a.shape[:-2], *tols))
    return a.new_empty((*batch, a.shape[-1], a.shape[-2]))


_META.impl("geqrf", _geqrf_meta, "Meta")
_META.impl("linalg_lstsq", _lstsq_meta, "Meta")
_META.impl("linalg_pinv.atol_rtol_tensor", _pinv_meta, "Meta")
