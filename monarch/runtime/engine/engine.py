"""The tensor engine of a worker: local shards by buffer id and the interpreter of rank programs.

Instructions dispatch through `HANDLERS`. A kernel that raises poisons its outputs with the error
(rank, op, traceback); later instructions that read a poisoned buffer pass the poison on without
running, collectives still take part (with zeros) so that no peer hangs, and the next sync reports it.
"""
from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from monarch import config
from monarch.errors import RemoteError
from monarch.program.instr import Buf, Comm, Free, Instr, Local, Start, Wait
from monarch.runtime.engine import buckets
from monarch.runtime.engine.kernels import KERNELS
from monarch.runtime.telemetry.events import RECORDER, now_us


class Transport(Protocol):
    """Runs this rank's part of a collective (blocking; `owned`: no one reads `x` afterwards, so it may
    be reduced in place and returned), or starts a bucketed all_reduce of `flat` (a fresh
    flat copy of the bucket's buffers, the transport's to reduce in place); `name` is what runs the
    collectives over mesh dim `mdim` (the `transport` column of the collectives table)."""

    def __call__(self, ins: Comm, x: torch.Tensor, owned: bool = False) -> torch.Tensor: ...

    def start(self, ins: Start, flat: torch.Tensor) -> Callable[[], torch.Tensor]: ...

    def name(self, mdim: int) -> str: ...


def _allocator(e: Exception) -> str:
    """For a CUDA out-of-memory error: the caching allocator's figures on this rank's GPU."""
    if not isinstance(e, torch.OutOfMemoryError) or not torch.cuda.is_initialized():
        return ""
    d = torch.cuda.current_device()
    gib = [torch.cuda.memory_allocated(d), torch.cuda.memory_reserved(d), torch.cuda.max_memory_allocated(d),
           torch.cuda.get_device_properties(d).total_memory]
    a, r, p, total = (f"{n / (1 << 30):.2f}" for n in gib)
    return (f" [cuda:{d}: {a} GiB allocated by tensors, {r} GiB reserved by the caching allocator, peak {p} GiB, "
            f"{total} GiB on the device; the failed op's outputs are poisoned, the mesh goes on]")


@dataclass(frozen=True)
class Poison:
    """Stored in place of a tensor whose computation failed."""
    error: RemoteError


class Engine:
    """One rank's buffers; `transport` runs a collective for this rank's piece and returns its result."""

    def __init__(self, rank: int, transport: Transport | None = None) -> None:
        self.rank = rank
        self.coords: tuple[int, ...] = ()
        self.label = ""
        self.transport = transport
        self.store: dict[int, Any] = {}
        self.errors: list[RemoteError] = []
        self.pending: dict[tuple[int, ...], tuple[Start, Callable[[], torch.Tensor]]] = {}
        self.profile = config.profile()
        self.instrs: tuple[Instr, ...] = ()  # the program running, and the position of its current instruction
        self.at = 0

    def run(self, instrs: tuple[Instr, ...], coords: tuple[int, ...], label: str) -> None:
        """Run one rank program; `coords` is this rank's point in the mesh view the program is for."""
        self.coords, self.label, self.instrs = coords, label, instrs
        if not self.profile:
            for self.at, ins in enumerate(instrs):
                HANDLERS[type(ins)](self, ins)
            return
        for self.at, ins in enumerate(instrs):  # MONARCH_PROFILE=1: one ops row per instruction
            start = now_us()
            HANDLERS[type(ins)](self, ins)
            RECORDER.add("ops", (self.rank, -1, getattr(ins, "op", type(ins).__name__), 1, start, now_us()))

    def bind(self, inputs: tuple[tuple[int, int], ...], feeds: tuple[tuple[int, Any], ...]) -> dict[int, Any]:
        """Before an installed program runs: it gets a store of its own, holding this call's buffers
        under its input ids (`inputs`: (program id, buffer id) pairs) and this rank's pieces of the
        call's plain arguments under its feed ids. Returns the store to restore afterwards."""
        outer = self.store
        self.store = {p: outer[a] for p, a in inputs}
        self.store.update((i, v if isinstance(v, torch.Tensor) else torch.from_numpy(v)) for i, v in feeds)
        return outer

    def unbind(self, outputs: tuple[tuple[int, int], ...], outer: dict[int, Any]) -> None:
        """After it ran: its results land in the outer store under this call's buffer ids."""
        inner, self.store = self.store, outer
        for p, a in outputs:
            outer[a] = inner[p]

    # -- locals ----------------------------------------------------------------------------------
    def local(self, ins: Local) -> None:
        poison: list[Poison] = []
        args = self._resolve(ins.args, poison)
        kwargs = self._resolve(ins.kwargs, poison) if ins.kwargs else {}
        if poison:
            self._poison(ins.outs, poison[0])
            return
        try:
            result = kernel(ins.op)(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - the error travels to the controller
            self._fail(ins.outs, ins.op, e)
            return
        if len(ins.outs) == 1 and isinstance(result, torch.Tensor):
            self.store[ins.outs[0]] = result
        else:
            for i, r in zip(ins.outs, [r for r in result if r is not None], strict=True):  # None: undefined grad
                self.store[i] = r

    def _resolve(self, obj: Any, poison: list[Poison]) -> Any:
        t = type(obj)
        if t is Buf:
            v = self.store[obj.id]
            if type(v) is Poison:
                poison.append(v)
            return v
        if t is tuple or t is list:
            return t(self._resolve(o, poison) for o in obj)
        if t is dict:
            return {k: self._resolve(v, poison) for k, v in obj.items()}
        return obj

    def _fail(self, outs: tuple[int, ...], what: str, e: Exception) -> None:
        err = RemoteError(f"rank {self.rank} ({self.label}): {what} failed: {type(e).__name__}: {e}{_allocator(e)} "
                          "(monarch.debug() lists what this rank did before)",
                          rank=self.rank, coords=self.label, what=what, remote_traceback=traceback.format_exc(),
                          exc_type=type(e).__name__)
        self.errors.append(err)
        self._poison(outs, Poison(err))

    def _poison(self, outs: tuple[int, ...], p: Poison) -> None:
        for i in outs:
            self.store[i] = p

    # -- collectives and frees -------------------------------------------------------------------
    def comm_input(self, ins: Comm) -> torch.Tensor:
        """This rank's piece for a collective (zeros of the planned shape when the input is poisoned)."""
        x = self.store[ins.src]
        shape = ins.shapes[self.coords[ins.mdim]]
        if type(x) is Poison:
            return torch.zeros(shape, dtype=ins.dtype)
        assert tuple(x.shape) == shape, f"{ins!r}: local shape {tuple(x.shape)}, planned {shape}"
        return x

    def comm_output(self, ins: Comm, out: torch.Tensor) -> None:
        x = self.store[ins.src]
        self.store[ins.out] = x if type(x) is Poison else out

    def consumed(self, ins: Comm) -> bool:
        """Whether the all_reduce `ins` may reduce its input in place: the next instruction frees it and
        its store entry holds the only reference to the tensor, and the tensor the only one to its memory."""
        nxt = self.instrs[self.at + 1] if self.at + 1 < len(self.instrs) else None
        if ins.kind != "all_reduce" or type(nxt) is not Free or ins.src not in nxt.ids:
            return False
        x = self.store[ins.src]  # referenced here, by the store and by getrefcount's argument
        return (type(x) is torch.Tensor and sys.getrefcount(x) == 3 and _storage_users(x) == 1
                and not x.is_conj() and not x.is_neg())

    def comm(self, ins: Comm) -> None:
        assert self.transport is not None, "this engine has no transport"
        owned = self.consumed(ins)
        x = self.comm_input(ins)
        start = now_us()
        try:
            out = self.transport(ins, x, owned)
        except Exception as e:  # noqa: BLE001
            self._fail((ins.out,), f"{ins.kind} over mesh dim {ins.mdim}", e)
            return
        self.comm_output(ins, out)
        if RECORDER.on:
            RECORDER.add("collectives", (self.rank, ins.kind, ins.mdim, x.nbytes, start, now_us(),
                                         self.transport.name(ins.mdim)))

    def bucket_input(self, ins: Start) -> torch.Tensor:
        """The bucket's buffers packed into one flat buffer (zeros for poisoned ones)."""
        xs = [torch.zeros(shape, dtype=ins.dtype) if type(x) is Poison else x
              for x, shape in zip((self.store[s] for s in ins.srcs), ins.shapes, strict=True)]
        return buckets.pack(ins, xs)

    def bucket_output(self, ins: Start, flat: torch.Tensor) -> None:
        results = buckets.unpack(ins, flat, self.coords[ins.mdim])
        for s, o, out in zip(ins.srcs, ins.outs, results, strict=True):
            x = self.store.get(s)
            self.store[o] = x if type(x) is Poison else out

    def start(self, ins: Start) -> None:
        """An all_reduce bucket starts without waiting (the transport's); the other kinds run now, packed."""
        assert self.transport is not None, "this engine has no transport"
        flat = self.bucket_input(ins)
        if ins.kind == "all_reduce":
            finish = self.transport.start(ins, flat)
        else:
            out = self.transport(buckets.comm(ins), flat, True)
            finish = lambda: out  # noqa: E731
        self.pending[ins.outs] = (ins, finish)
        if RECORDER.on:
            RECORDER.add("collectives", (self.rank, f"{ins.kind} (bucket)", ins.mdim, flat.nbytes, now_us(), 0,
                                         self.transport.name(ins.mdim)))

    def wait(self, ins: Wait) -> None:
        entry = self.pending.pop(ins.outs, None)
        if entry is not None:  # (the reference mesh finishes a bucket at its Start)
            start, finish = entry
            self.bucket_output(start, finish())

    def free(self, ins: Free) -> None:
        for i in ins.ids:
            self.store.pop(i, None)

    # -- sync ------------------------------------------------------------------------------------
    def fetch(self, id: int) -> torch.Tensor | None:
        """The value of buffer `id` (None when 0); raises the first error since the last sync."""
        errors, self.errors = self.errors, []
        if errors:
            raise errors[0]
        if not id:
            return None
        v = self.store[id]
        if type(v) is Poison:
            raise v.error
        return v


def _storage_users(x: torch.Tensor) -> int:
    """How many tensors share `x`'s memory (x and its views; the storage object asked for is not counted)."""
    return torch._C._storage_Use_Count(x.untyped_storage()._cdata) - 1


_KERNEL_CACHE: dict[str, Callable[..., Any]] = {}


def kernel(name: str) -> Callable[..., Any]:
    """The callable behind `aten::add.Tensor` or `monarch::chunk`."""
    fn = _KERNEL_CACHE.get(name)
    if fn is None:
        if name in KERNELS:
            fn = KERNELS[name]
        else:
            ns, _, rest = name.partition("::")
            op, _, overload = rest.partition(".")
            fn = getattr(getattr(getattr(torch.ops, ns), op), overload or "default")
        _KERNEL_CACHE[name] = fn
    return fn


HANDLERS: dict[type, Callable[[Engine, Any], None]] = {
    Local: Engine.local, Comm: Engine.comm, Free: Engine.free, Start: Engine.start, Wait: Engine.wait}
