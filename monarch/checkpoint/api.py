"""save, async_save and load of state dicts holding MeshTensors, as DCP checkpoints written by the workers.

The controller plans and writes nothing itself: each rank writes the pieces it was given into a
temporary directory beside `checkpoint_id`, the mesh's first rank writes DCP's `.metadata` there and
renames the directory into place. A state dict with no MeshTensor is saved and loaded by plain
`torch.distributed.checkpoint` in this process. `Stateful` values (with state_dict/load_state_dict)
are handled as DCP handles them. Loading unpickles nothing a checkpoint could turn into code unless
asked to (`trusted=True`): `.metadata` with DCP's types only, object entries with
`torch.load(weights_only=True)`.
"""
from __future__ import annotations

import atexit
import io
import os
import pickle
import secrets
import shutil
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.stateful import Stateful

from monarch.checkpoint.plan import check_load, flatten, plan_load, plan_save, session_of_values
from monarch.errors import CheckpointError, RemoteError
from monarch.runtime.engine.checkpoint import FinishJob, SafeReader, check_target, replace, sweep
from monarch.tensor.meshtensor import MeshTensor

_pending: list[SaveFuture] = []


def save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike, timeout: float | None = None) -> Metadata:
    """Write `state_dict` as a DCP checkpoint at directory `checkpoint_id` (a path on the workers' file
    system, shared by them when they span hosts): every rank writes its own pieces, one writer per
    replicated piece. Returns the checkpoint's metadata."""
    return _start(state_dict, checkpoint_id, stage=False).get(timeout)


def async_save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike) -> SaveFuture:
    """Start a save and return at once: each rank copies its pieces (in the order of its other work, so
    later training steps do not change what is saved) and writes them in a thread. `get()` waits and
    finishes the checkpoint; a later save or load waits for this one first."""
    return _start(state_dict, checkpoint_id, stage=True)


def load(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike, timeout: float | None = None,
         trusted: bool = False) -> None:
    """Load the checkpoint at `checkpoint_id` into `state_dict` in place: each MeshTensor gets the saved
    values of its global shape in its own placements (any mesh shape), plain tensors are copied into,
    other values are replaced, Stateful values get load_state_dict. Every key and shape is checked
    before anything is read, and nothing changes unless every read succeeded. Object entries load with
    `torch.load(weights_only=True)` and `.metadata` with DCP's types only; `trusted=True` unpickles
    anything (which runs whatever code the files name: only for checkpoints from a source you trust)."""
    wait_pending(timeout)
    path = _path(checkpoint_id)
    states, templates = _resolve_stateful(state_dict)
    flat, mappings = flatten(templates)
    session = session_of_values(flat)
    if session is None:
        _load_here(templates, path, trusted)
    else:
        _load_on_mesh(session, flat, mappings, templates, path, timeout, trusted)
    for key, value in templates.items():
        if key in states:
            states[key].load_state_dict(value)
        else:
            state_dict[key] = value


def _load_here(templates: dict[str, Any], path: str, trusted: bool) -> None:
    """Plain DCP in this process (no MeshTensor in the state dict), unpickling as `trusted` allows."""
    sweep(path)
    _check_is_checkpoint(path)
    reader = SafeReader(path, trusted)
    try:
        reader.read_metadata()
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"cannot load checkpoint {path!r}: {e}; load(..., trusted=True) unpickles anything, "
                              "for a checkpoint from a source you trust") from None
    try:
        dcp.load(templates, storage_reader=reader, planner=_Objects(path, trusted), no_dist=True)
    except CheckpointException as e:  # DCP wraps what its steps raise, ours too
        mine = [f[0] for f in e.failures.values() if isinstance(f[0], CheckpointError)]
        if mine:
            raise mine[0] from None
        raise


class _Objects(DefaultLoadPlanner):
    """DCP's planner, loading object entries as `_object` does."""

    def __init__(self, path: str, trusted: bool) -> None:
        super().__init__()
        self.path, self.trusted = path, trusted

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        set_element(self.original_state_dict, self.mappings[fqn], _object(value.getvalue(), self.trusted,
                                                                          fqn, self.path))


def _load_on_mesh(session: Any, flat: dict[str, Any], mappings: dict[str, Any], templates: dict[str, Any],
                  path: str, timeout: float | None, trusted: bool) -> None:
    found = _on_first_rank(session, "monarch::dcp_metadata", (path, trusted), timeout)
    if isinstance(found, str):
        raise CheckpointError(f"cannot load checkpoint {path!r}: {found}")
    try:
        check_load(flat, found, f"checkpoint {path!r}")
        planned = plan_load(flat, found, session, path)
    except (KeyError, IndexError, TypeError, AttributeError, ValueError) as e:
        raise CheckpointError(f"cannot load checkpoint {path!r}: its .metadata is inconsistent ({type(e).__name__}: "
                              f"{e}); the file is damaged, nothing was loaded") from None
    specs = [spec for _, _, spec in planned.targets]
    handles = session.on_ranks("monarch::dcp_read", lambda r, _: (planned.jobs[r],), specs=(*specs, None))
    try:
        extras = session.values(handles[-1]).get(timeout)[0]
    except RemoteError as e:
        raise CheckpointError(f"reading checkpoint {path!r} failed on rank {e.rank}: {e}; nothing was loaded") from e
    with torch.no_grad():
        for (_, target, _), loaded in zip(planned.targets, handles[:-1], strict=True):
            if not session.adopt(target, loaded):  # a target a view shares, or of other placements: copied
                target.copy_(loaded)
        for fqn, value in extras.items():  # read by the first rank: plain tensors (copied into) and objects
            value = value if isinstance(value, torch.Tensor) else _object(value, trusted, fqn, path)
            if isinstance(flat[fqn], torch.Tensor):
                flat[fqn].copy_(value)
            else:
                set_element(templates, mappings[fqn], value)


def _object(blob: bytes, trusted: bool, fqn: str, path: str) -> Any:
    """An object entry as DCP's planner loads one, but with weights_only=True (tensors, containers and
    Python scalars; no code) unless `trusted`."""
    try:
        return torch.load(io.BytesIO(blob), weights_only=not trusted)
    except pickle.UnpicklingError as e:
        why = str(e).split("\n\n")[-1].splitlines()[0] if "\n\n" in str(e) else str(e).splitlines()[0]
        raise CheckpointError(f"cannot load checkpoint {path!r}: entry {fqn!r} is a pickled object that "
                              f"torch.load(weights_only=True) refuses ({why}); load(..., trusted=True) unpickles "
                              "anything, which runs what the file names: only for a checkpoint you trust; "
                              "nothing was loaded") from None


# -- saving ------------------------------------------------------------------------------------
def _start(state_dict: dict[str, Any], checkpoint_id: str | os.PathLike, stage: bool) -> SaveFuture:
    wait_pending()
    final = _path(checkpoint_id)
    path = f"{final}.tmp-{secrets.token_hex(4)}"
    _, templates = _resolve_stateful(state_dict)
    flat, mappings = flatten(templates)
    session = session_of_values(flat)
    if session is None:
        return SaveFuture.done(_save_here(templates, path, final))
    planned = plan_save(flat, mappings, len(session.view), path, final, stage)
    (handle,) = session.on_ranks("monarch::dcp_write", lambda r, _: (planned.jobs[r],), planned.pieces)
    future = SaveFuture(session, handle, planned.metadata, path, final, stage)
    if stage:
        session.flush()
        _pending.append(future)
    return future


def _save_here(templates: dict[str, Any], path: str, final: str) -> Metadata:
    """Plain DCP in this process (no MeshTensor in the state dict), written beside the id, then moved."""
    sweep(final, keep=path)
    check_target(final)
    try:
        dcp.save(templates, checkpoint_id=path, no_dist=True)
        replace(path, final)
    except Exception:
        shutil.rmtree(path, ignore_errors=True)
        raise
    return dcp.FileSystemReader(final).read_metadata()


@dataclass(eq=False, repr=False)
class SaveFuture:
    """A save in progress (what async_save returns). `get()` waits for every rank's writes, writes the
    metadata and moves the checkpoint into place; a failed write raises CheckpointError here and leaves
    an earlier checkpoint at that id as it was."""
    session: Any
    handle: MeshTensor | None
    metadata: Metadata | None
    path: str
    final: str
    staged: bool
    error: CheckpointError | None = None

    @staticmethod
    def done(metadata: Metadata) -> SaveFuture:
        return SaveFuture(None, None, metadata, "", "", False)

    def get(self, timeout: float | None = None) -> Metadata:
        if self.handle is not None:
            handle, self.handle = self.handle, None
            if self in _pending:
                _pending.remove(self)
            try:
                self.metadata = self._finish(handle, timeout)
            except CheckpointError as e:
                self.error = e
        if self.error is not None:
            raise self.error
        assert self.metadata is not None
        return self.metadata

    result = get  # concurrent.futures' name, which DCP's async_save returns

    def __repr__(self) -> str:
        """Short: the checkpoint and its state (the metadata and the session stay out of it)."""
        state = "failed" if self.error is not None else "pending" if self.handle is not None else "done"
        return f"<SaveFuture {self.final or 'in this process'!r} {state}>"

    def _finish(self, handle: MeshTensor, timeout: float | None) -> Metadata:
        s = self.session
        if self.staged:
            (handle,) = s.on_ranks("monarch::dcp_wait", lambda r, _: (), [handle])
        try:
            results = s.values(handle).get(timeout)
            (done,) = s.on_ranks("monarch::dcp_finish", lambda r, _: (
                FinishJob(self.path, self.final, self.metadata, tuple(results)) if r == 0 else None,))
            s.values(done).get(timeout)
        except RemoteError as e:
            (gone,) = s.on_ranks("monarch::dcp_abort", lambda r, _: (self.path if r == 0 else None,))
            s.values(gone).get(timeout)
            raise CheckpointError(f"saving checkpoint {self.final!r} failed on rank {e.rank}: {e}; the checkpoint "
                                  "at that id (if any) is unchanged") from e
        return self.metadata


def wait_pending(timeout: float | None = None) -> None:
    """Finish every async_save in flight; a failure stays on its future and is also warned about here."""
    for future in list(_pending):
        try:
            future.get(timeout)
        except CheckpointError as e:
            warnings.warn(f"an earlier async_save failed: {e}", RuntimeWarning, stacklevel=3)


def _at_exit() -> None:
    if _pending:
        wait_pending(60.0)


atexit.register(_at_exit)


# -- helpers -----------------------------------------------------------------------------------
def _resolve_stateful(state_dict: dict[str, Any]) -> tuple[dict[str, Stateful], dict[str, Any]]:
    """The Stateful values by key, and the state dict with each replaced by its state_dict()."""
    states = {k: v for k, v in state_dict.items() if isinstance(v, Stateful) and not isinstance(v, torch.Tensor)}
    return states, {k: states[k].state_dict() if k in states else v for k, v in state_dict.items()}


def _path(checkpoint_id: str | os.PathLike) -> str:
    """The directory, as the workers see it (a relative one is relative to their working directory)."""
    return os.path.normpath(os.fspath(checkpoint_id))


def _on_first_rank(session: Any, op: str, args: tuple[Any, ...], timeout: float | None) -> Any:
    (handle,) = session.on_ranks(op, lambda r, _: args if r == 0 else (None,))
    return session.values(handle).get(timeout)[0]


def _check_is_checkpoint(path: str) -> None:
    if not os.path.exists(os.path.join(path, ".metadata")):
        raise CheckpointError(f"cannot load checkpoint {path!r}: it has no .metadata file (not a DCP checkpoint, "
                              "or a save that did not finish)")
