"""How MeshTensors meet torch.compile (Dynamo): it runs monarch's recording eagerly, graph-breaking around
it, and `torch.compile(fullgraph=True)`, which allows no graph break, raises one TraceError pointing to
`@monarch.compile`. Built on Dynamo's internals (its frame strategies, `assume_constant_result`, the
tracer of the frame being compiled), kept here apart from MeshTensor itself.
"""
from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from monarch.errors import TraceError


class NotTraceable:
    """An attribute MeshTensor lacks (a class or an instance has no such attribute), except that asking a
    MeshTensor for it while Dynamo traces for `torch.compile(fullgraph=True)` raises the TraceError."""

    def __get__(self, obj: Any, cls: type | None = None) -> Any:
        if obj is not None and torch.compiler.is_compiling():
            refuse_one_graph()
        raise AttributeError("__tensor_flatten__")


class _OneGraphError(TraceError, torch._dynamo.exc.ShortenTraceback):
    """A TraceError that Dynamo hands to the caller of the compiled function as it is, its traceback cut
    at `frame` and its message without the frames Dynamo appends."""

    def __init__(self, message: str, frame: types.FrameType | None) -> None:
        super().__init__(message, first_useful_frame=frame)
        self.message = message

    def __str__(self) -> str:
        return self.message


@torch._dynamo.assume_constant_result
def refuse_one_graph() -> None:
    """Raises when Dynamo traces a MeshTensor op for `torch.compile(fullgraph=True)`: without fullgraph it
    graph-breaks there and runs the op eagerly. Dynamo runs this at trace time (a constant result)."""
    from torch._dynamo.symbolic_convert import InstructionTranslator
    try:
        tx = InstructionTranslator.current_tx()
    except AttributeError:  # not inside Dynamo's tracer (another tracer compiles)
        return
    if tx is not None and (tx.one_graph or tx.error_on_graph_break):
        raise _OneGraphError(
            "torch.compile(fullgraph=True) cannot capture MeshTensor ops: Dynamo cannot trace them into one "
            "graph (their data lives on the mesh's workers). Use @monarch.compile to record a step once and "
            "replay it, or torch.compile without fullgraph=True, which runs MeshTensor ops eagerly", sys._getframe())


def eager_under_torch_compile(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, a monarch entry point that records ops (distribute_tensor, the factories, local_map), as
    Dynamo must meet it: under `torch.compile(fullgraph=True)` the call raises the TraceError; otherwise
    Dynamo graph-breaks at the call and runs it eagerly, never tracing the recording machinery (a data
    parallel model's input hook calls distribute_tensor inside the compiled forward)."""
    eager = torch.compiler.disable(fn, recursive=True)

    @functools.wraps(fn)
    def entry(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            refuse_one_graph()
            return eager(*args, **kwargs)
        return fn(*args, **kwargs)
    return entry


def run_eagerly(*classes: type) -> None:
    """torch.compile (Dynamo) runs MeshTensor's methods as they are, and all they call: it graph-breaks
    at them instead of tracing the recording machinery (whose ops it cannot capture anyway)."""
    frames = getattr(torch._C, "_dynamo", None)
    if frames is None:
        return
    e = frames.eval_frame
    skip = e._FrameExecStrategy(e._FrameAction.SKIP, e._FrameAction.SKIP)
    for cls in classes:
        for f in vars(cls).values():
            f = getattr(f, "__func__", getattr(f, "fget", f))
            if isinstance(f, types.FunctionType):
                e.set_code_exec_strategy(f.__code__, skip)
