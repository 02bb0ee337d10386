"""`Endpoint[P, R]`: a type checker sees the arguments and results of the call adverbs (mypy, a test
dependency, checks typed_endpoints.py), and the generic aliases and type hints resolve at run time."""
from __future__ import annotations

import re
import typing
from collections.abc import Iterator
from pathlib import Path

from monarch.actor import Actor, Future, ValueMesh, endpoint
from monarch.runtime.actors.actor_mesh import EndpointRef
from monarch.runtime.actors.endpoint import Endpoint, MeshEndpoint

ROOT = Path(__file__).resolve().parents[3]
TYPED = Path(__file__).with_name("typed_endpoints.py")


class Counter(Actor):
    @endpoint
    def incr(self, by: int = 1) -> int:
        return by


def test_mypy_sees_each_adverbs_types() -> None:
    """The `assert_type`s of typed_endpoints.py hold; the calls marked `# E:` are the only errors."""
    from mypy import api  # a test dependency (setup.cfg)
    cache = ROOT / ".mypy_cache"  # ignored by git; the first run fills it (about 15 s), later ones take 2 s
    out, err, _ = api.run(["--config-file", str(ROOT / "setup.cfg"), "--follow-imports=silent",
                           "--cache-dir", str(cache), str(TYPED)])
    lines = TYPED.read_text().splitlines()
    want = {n for n, line in enumerate(lines, 1) if "# E:" in line}
    got = {int(m.group(1)) for m in re.finditer(rf"{re.escape(TYPED.name)}:(\d+): error", out)}
    assert got == want, out + err


def test_generic_aliases_subscript() -> None:
    assert typing.get_args(Endpoint[[int], int]) == ((int,), int)
    assert typing.get_args(EndpointRef[[int, str], bool]) == ((int, str), bool)
    assert typing.get_origin(MeshEndpoint[[int], int]) is MeshEndpoint
    assert typing.get_origin(EndpointRef[..., typing.Any]) is EndpointRef


def test_type_hints_of_endpoints_resolve() -> None:
    assert typing.get_type_hints(Counter.incr.fn) == {"by": int, "return": int}
    hints = typing.get_type_hints(EndpointRef.call)
    assert hints["return"] == Future[ValueMesh[EndpointRef.__parameters__[1]]]  # type: ignore[misc]
    assert typing.get_type_hints(EndpointRef.stream)["return"].__origin__ is Iterator
    for fn in (Endpoint.__init__, Endpoint.__get__, MeshEndpoint.call, MeshEndpoint.choose):
        assert typing.get_type_hints(fn)
