"""What the rule-family tests share: a drawn example on the in-process mesh (`Case`: a mesh, tensors put
with drawn placements, an op checked against plain torch with the collectives it shipped), a runner that
counts an op's collectives, and the hypothesis decorator they use."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import monarch
from tests.strategies import placement_tuples, reference_mesh, tensor_meshes

MESHES = ({"x": 1}, {"x": 2}, {"x": 4}, {"dp": 2, "tp": 2})


class Case:
    """One drawn example: a mesh, and plain tensors distributed with drawn placements."""

    def __init__(self, data: st.DataObject, meshes: tuple[dict[str, int], ...] = MESHES) -> None:
        self.draw = data.draw
        self.dims = self.draw(tensor_meshes(meshes))
        self.mesh = reference_mesh(self.dims)
        self.gen = torch.Generator().manual_seed(self.draw(st.integers(0, 2**16)))
        self.placed: list[tuple] = []

    def put(self, t: torch.Tensor | None, partial: bool | None = None) -> Any:
        """`t` distributed with drawn placements (Partial only for floating tensors)."""
        if t is None:
            return None
        partial = t.dtype.is_floating_point if partial is None else partial
        placements = self.draw(placement_tuples(t.ndim, len(self.dims), partial=partial))
        self.placed.append(placements)
        return monarch.distribute_tensor(t, self.mesh, placements)

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen)

    def run(self, fn: Callable[..., Any], *plain: Any) -> tuple[list[torch.Tensor | None], list[str]]:
        """fn on the distributed `plain` tensors and on the plain ones; the outputs must match."""
        want = fn(*plain)
        before = len(self.mesh.session.collectives)
        out = fn(*(self.put(t) if isinstance(t, torch.Tensor) else t for t in plain))
        got = [o.full_tensor(timeout=30) if o is not None else None for o in flat(out)]
        for g, w in zip(got, flat(want), strict=True):
            if w is None:
                assert g is None
            else:
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, equal_nan=True)
        return got, self.mesh.session.collectives[before:]

    def plain_placements(self) -> bool:
        """No input was Partial."""
        return not any(p.is_partial() for ps in self.placed for p in ps)


def flat(out: Any) -> list[Any]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def examples(n: int = 25) -> Callable:
    return lambda f: settings(deadline=None, max_examples=n)(given(data=st.data())(f))


def run(mesh: Any, fn: Callable[[Any], Any], x: Any) -> tuple[list[torch.Tensor], list[str]]:
    """fn(x)'s outputs fetched, and the collectives that fn's ops and the fetches shipped (work recorded
    earlier ships first, so that it is not counted)."""
    mesh.session.flush()
    before = len(mesh.session.collectives)
    out = fn(x)
    got = [t.full_tensor(timeout=30) for t in (out if isinstance(out, tuple) else (out,))]
    return got, mesh.session.collectives[before:]


def check(got: list[torch.Tensor], want: Any, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    want = list(want) if isinstance(want, tuple) else [want]
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol, equal_nan=True)
