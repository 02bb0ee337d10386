"""The checkpoint kernels of a worker: it writes and reads its own pieces of a DCP checkpoint.

The controller plans (which rank writes which piece, which chunks each rank reads); the workers do all
file work with torch.distributed.checkpoint's FileSystemWriter and FileSystemReader, so the files and
the `.metadata` are DCP's own. A save writes into a temporary directory beside the checkpoint id; the
mesh's first rank writes the metadata there and then renames it into place, so an earlier checkpoint
at that id stays whole until the new one is complete; what a save killed midway left beside the id
is cleared by the next save or load of it. A `.metadata` is unpickled with DCP's own types only
(`MetadataUnpickler`): a crafted one cannot name code to run, unless the load was told `trusted=True`.
"""
from __future__ import annotations

import enum
import io
import os
import pickle
import re
import shutil
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, WriteItem, WriteItemType

METADATA = ".metadata"


_METADATA_TYPES = {
    *(("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    *(("pathlib", n) for n in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")),
}  # what DCP's FileSystemWriter pickles into a .metadata (and torch dtypes)


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata: its own types and torch dtypes, nothing else (a global naming a function
    or any other class is how a crafted pickle runs code)."""

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if dtype or (module, name) in _METADATA_TYPES:
            return super().find_class(module, name)
        if (module, name) in (("builtins", "getattr"), ("__builtin__", "getattr")):
            return _enum_member  # how Python 3.11.0-3.11.4 pickle an enum member: getattr(its class, its name)
        raise pickle.UnpicklingError(f"its .metadata names {module}.{name}, which is not a DCP metadata type")


def _enum_member(cls: Any, name: Any) -> enum.Enum:
    """`getattr` as a DCP metadata pickle may use it: a member, by name, of an enum the unpickler allowed."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    raise pickle.UnpicklingError(f"its .metadata asks for attribute {name!r} of {cls!r}, which is no enum member "
                                 "of a DCP metadata type")


class SafeReader(FileSystemReader):
    """DCP's FileSystemReader, reading `.metadata` with MetadataUnpickler unless `trusted`."""

    def __init__(self, path: str, trusted: bool = False) -> None:
        super().__init__(path)
        self.trusted = trusted

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.trusted:
            return super().read_metadata(*args, **kwargs)
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            found = MetadataUnpickler(f).load()
        if not isinstance(found, Metadata):
            raise pickle.UnpicklingError(f"its .metadata holds a {type(found).__name__}, not DCP Metadata")
        if getattr(found, "storage_meta", None) is None:
            found.storage_meta = StorageMeta()
        found.storage_meta.load_id = self.load_id
        return found


@dataclass(frozen=True)
class WriteJob:
    """One rank's part of a save: its items (with its file prefix) and the data behind them."""
    path: str                                   # the temporary directory every rank writes into
    final: str                                  # the checkpoint id, checked before writing (first rank; others "")
    plan: SavePlan
    fqns: tuple[str, ...]                       # the key of each piece argument, in order
    objects: tuple[tuple[str, bytes | torch.Tensor], ...] = ()  # data that is no piece (first rank)
    stage: bool = False                         # copy the pieces now, write them in a thread


@dataclass(frozen=True)
class FinishJob:
    """The first rank's last step of a save: the metadata, every rank's write results, the rename."""
    path: str
    final: str
    metadata: Metadata
    results: tuple[Any, ...]


Out = tuple[str, tuple[int, ...], torch.dtype]  # key, local shape, dtype


@dataclass(frozen=True)
class ReadJob:
    """One rank's reads: the items fill new tensors, `outs` (this rank's pieces, returned as its results)
    and `whole` (whole tensors, returned by key with the bytes of the byte items)."""
    path: str
    storage: dict[MetadataIndex, Any]
    items: tuple[ReadItem, ...]
    outs: tuple[Out, ...]
    whole: tuple[Out, ...] = ()


class Pending:
    """A save being written in a thread (async_save); `wait` gives its write results or raises its error."""

    def __init__(self, job: WriteJob, data: dict[str, Any]) -> None:
        self.results: list[Any] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(job, data), name="monarch-dcp-write", daemon=True)
        self.thread.start()

    def _run(self, job: WriteJob, data: dict[str, Any]) -> None:
        try:
            self.results = _write(job, data)
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            self.error = e

    def wait(self) -> list[Any]:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.results


class _Pieces(DefaultSavePlanner):
    """DCP's planner, resolving each item to this rank's data for its key (pieces are not DTensors)."""

    def __init__(self, data: dict[str, Any]) -> None:
        super().__init__()
        self.data = data

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        value = self.data[write_item.index.fqn]
        return io.BytesIO(value) if write_item.type == WriteItemType.BYTE_IO else value


class _Into(DefaultLoadPlanner):
    """DCP's planner, reading each item into its part of a fresh local tensor; bytes are kept as bytes."""

    def __init__(self, into: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.into = into
        self.blobs: dict[str, bytes] = {}

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        out = self.into[read_item.dest_index.fqn]
        for d, (start, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
            out = out.narrow(d, start, n)
        return out

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """Nothing to commit: resolve_tensor handed out a view of the output, which the reader filled."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.blobs[read_item.dest_index.fqn] = value.getvalue()


class _Writer(FileSystemWriter):
    """FileSystemWriter whose metadata names the checkpoint id, not the temporary directory."""

    def __init__(self, path: str, final: str) -> None:
        super().__init__(path)
        self.final = final

    def storage_meta(self) -> StorageMeta:
        return StorageMeta(checkpoint_id=self.final, save_id=self.save_id)


def write(job: WriteJob, *pieces: torch.Tensor) -> tuple[Any]:
    """Write this rank's items (or, with `job.stage`, copy them and start writing): its WriteResults, or
    the Pending write that `wait` finishes."""
    if job.final:
        sweep(job.final, keep=job.path)
        check_target(job.final)
    data: dict[str, Any] = dict(job.objects)
    data.update(zip(job.fqns, pieces, strict=True))
    if not job.stage:
        return (_write(job, data),)
    staged = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in data.items()}
    return (Pending(job, staged),)


def _write(job: WriteJob, data: dict[str, Any]) -> list[Any]:
    os.makedirs(job.path, exist_ok=True)
    return FileSystemWriter(job.path).write_data(job.plan, _Pieces(data)).wait()


def wait(pending: Pending) -> tuple[list[Any]]:
    return (pending.wait(),)


def finish(job: FinishJob | None) -> tuple[bool]:
    """On the first rank: write the metadata into the temporary directory, then move it to the id."""
    if job is None:
        return (False,)
    _Writer(job.path, job.final).finish(job.metadata, [list(r) for r in job.results])
    replace(job.path, job.final)
    return (True,)


def abort(path: str | None) -> tuple[bool]:
    """On the first rank: remove what a failed save wrote (the checkpoint id itself is untouched)."""
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)
    return (path is not None,)


def check_target(final: str) -> None:
    """A save may replace an absent or empty directory, or a checkpoint; never a directory of other files."""
    if os.path.isdir(final) and os.listdir(final) and not os.path.exists(os.path.join(final, METADATA)):
        raise FileExistsError(f"{final} is a directory with files but no {METADATA}: not a checkpoint, so a save "
                              "will not replace it; choose another checkpoint_id or empty it")
    if os.path.exists(final) and not os.path.isdir(final):
        raise NotADirectoryError(f"{final} is a file; a checkpoint id names a directory")


def replace(path: str, final: str) -> None:
    """Move the finished directory `path` to `final`; an earlier checkpoint there is removed only after."""
    old = f"{path}.old"
    if os.path.exists(final):
        os.rename(final, old)
    os.rename(path, final)
    shutil.rmtree(old, ignore_errors=True)


def sweep(final: str, keep: str | None = None) -> None:
    """Clear what a save killed midway left beside `final`: its temporary directories (`<id>.tmp-<hex>`);
    a previous checkpoint moved aside (`<id>.tmp-<hex>.old`) goes back into place when `final` is missing
    (the kill came between the two renames of `replace`), else it is removed too."""
    parent, base = os.path.split(final)
    if not os.path.isdir(parent or "."):
        return
    pattern = re.compile(re.escape(base) + r"\.tmp-[0-9a-f]{8}(\.old)?")
    for name in sorted(os.listdir(parent or "."), key=lambda n: not n.endswith(".old")):
        left = os.path.join(parent, name)
        match = pattern.fullmatch(name)
        if match is None or left == keep or not os.path.isdir(left) or os.path.islink(left):
            continue
        if match.group(1) and not os.path.exists(final) and os.path.exists(os.path.join(left, METADATA)):
            os.rename(left, final)
        else:
            shutil.rmtree(left, ignore_errors=True)


def metadata(path: str | None, trusted: bool = False) -> tuple[Metadata | str | bool]:
    """The checkpoint's metadata, or why `path` is not a checkpoint (False when another rank reads it)."""
    if path is None:
        return (False,)
    sweep(path)
    if not os.path.isdir(path):
        return (f"{path} does not exist or is not a directory",)
    if not os.path.exists(os.path.join(path, METADATA)):
        return (f"{path} has no {METADATA} file (not a DCP checkpoint, or a save that did not finish)",)
    try:
        return (SafeReader(path, trusted).read_metadata(),)
    except pickle.UnpicklingError as e:
        return (f"{e}; load(..., trusted=True) unpickles anything, for a checkpoint from a source you trust",)
    except Exception as e:  # noqa: BLE001 - a damaged file: say so instead of failing the rank
        return (f"its {METADATA} cannot be read ({type(e).__name__}: {e}); the file is damaged",)


def read(job: ReadJob) -> tuple[Any, ...]:
    """Read this rank's items: the tensors of `job.outs`, then a dict of the `whole` tensors and bytes."""
    into = {fqn: torch.empty(shape, dtype=dtype) for fqn, shape, dtype in job.outs}
    whole = {fqn: torch.empty(shape, dtype=dtype) for fqn, shape, dtype in job.whole}
    planner = _Into(into | whole)
    if job.items:
        reader = FileSystemReader(job.path)
        reader.set_up_storage_reader(Metadata({}, storage_data=job.storage), False)
        reader.read_data(LoadPlan(list(job.items)), planner).wait()
    return (*into.values(), planner.blobs | whole)


def rng_state() -> tuple[torch.Tensor]:
    """This worker's torch generator state."""
    return (torch.get_rng_state(),)


def set_rng_state(state: torch.Tensor) -> tuple[bool]:
    torch.set_rng_state(state)
    return (True,)


KERNELS = {"write": write, "wait": wait, "finish": finish, "abort": abort, "metadata": metadata, "read": read,
           "rng_state": rng_state, "set_rng_state": set_rng_state}
