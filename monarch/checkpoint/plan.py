"""Checkpoint planning on the controller: which rank writes which piece, and which chunks each rank reads.

A state dict is flattened as DCP flattens it (keys joined by dots, the mapping kept in the metadata),
so that plain `torch.distributed.checkpoint` reads what monarch writes and the other way round.
Saving: each distinct piece of a MeshTensor gets one writer among the ranks that hold it (the least
loaded, as DCP's dedup does); plain tensors and other objects go to the mesh's first rank. Loading:
every rank reads the saved chunks that overlap its piece (DCP's resharding), after every key, kind
and global shape was checked here, before anything is read.
"""
from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadItemType, ReadItem, SavePlan, TensorWriteData, WriteItem,
                                                  WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from monarch.errors import CheckpointError
from monarch.runtime.engine.checkpoint import ReadJob, WriteJob
from monarch.tensor.meshtensor import MeshTensor
from monarch.tensor.placement import Replicate
from monarch.tensor.spec import Spec, spec_of

Flat = dict[str, Any]


def flatten(state_dict: dict[str, Any]) -> tuple[Flat, dict[str, Any]]:
    """DCP's flattening: {"model": {"w": t}} -> {"model.w": t}, with the path of each key."""
    try:
        return flatten_state_dict(state_dict)
    except ValueError as e:
        raise CheckpointError(f"the state dict cannot be flattened as DCP flattens it: {e}; give every value "
                              "a key that stays distinct when nested keys are joined with '.'") from None


def session_of_values(flat: Flat) -> Any:
    """The one session whose MeshTensors the state dict holds (None when it holds none)."""
    sessions: dict[int, tuple[str, Any]] = {}
    for fqn, v in flat.items():
        if isinstance(v, MeshTensor):
            sessions.setdefault(id(v._backend), (fqn, v._backend))
    if len(sessions) > 1:
        (a, _), (b, _) = list(sessions.values())[:2]
        raise CheckpointError(f"the state dict holds MeshTensors of different meshes ({a!r} and {b!r}); save "
                              "each mesh's state dict as its own checkpoint")
    return next(iter(sessions.values()))[1] if sessions else None


def whole(t: MeshTensor) -> MeshTensor:
    """`t` with Partial dims reduced (a checkpoint holds values, not partial sums)."""
    ps = tuple(Replicate() if p.is_partial() else p for p in t._spec.placements)
    return t.detach().redistribute(ps) if ps != t._spec.placements else t.detach()


def _props(dtype: torch.dtype) -> TensorProperties:
    return TensorProperties(dtype=dtype)


def _tensor_item(fqn: str, kind: WriteItemType, offsets: tuple[int, ...], sizes: tuple[int, ...],
                 shape: tuple[int, ...], dtype: torch.dtype) -> WriteItem:
    chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
    return WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=kind,
                     tensor_data=TensorWriteData(chunk=chunk, properties=_props(dtype), size=torch.Size(shape)))


def _writers(spec: Spec) -> Iterator[tuple[tuple[tuple[int, int], ...], list[int]]]:
    """Each distinct piece (its bounds) with the ranks holding it; empty pieces are left out unless
    the tensor has no elements (then one empty piece stands for it)."""
    holders: dict[tuple[tuple[int, int], ...], list[int]] = {}
    for r, c in enumerate(spec.mesh.coords()):
        holders.setdefault(spec.bounds(c), []).append(r)
    full = [b for b in holders if all(n for _, n in b)]
    for b in full or list(holders)[:1]:
        yield b, holders[b]


@dataclass(frozen=True)
class SaveSet:
    """A planned save: the pieces to pass to every rank, and each rank's job; `metadata` lacks only
    the storage of each item (the write results)."""
    pieces: tuple[MeshTensor, ...]
    jobs: tuple[WriteJob, ...]
    metadata: Metadata


ITEM_BYTES = 1024  # what torch.save adds to each item's data in a DCP file, about


def plan_save(flat: Flat, mappings: dict[str, Any], n_ranks: int, path: str, final: str,
              stage: bool) -> SaveSet:
    items: list[list[WriteItem]] = [[] for _ in range(n_ranks)]
    objects: list[tuple[str, bytes | torch.Tensor]] = []
    pieces = {fqn: whole(v) for fqn, v in flat.items() if isinstance(v, MeshTensor)}
    for fqn, v in flat.items():
        if isinstance(v, MeshTensor):
            continue
        if isinstance(v, torch.Tensor):
            t = v.detach().cpu()
            items[0].append(_tensor_item(fqn, WriteItemType.TENSOR, (0,) * t.ndim, tuple(t.shape), tuple(t.shape),
                                         t.dtype))
            objects.append((fqn, t))
        else:
            blob = io.BytesIO()
            torch.save(v, blob)  # as DCP's planner stores an object
            items[0].append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
            objects.append((fqn, blob.getvalue()))
    load = [0] * n_ranks
    load[0] = sum(ITEM_BYTES + (len(o) if isinstance(o, bytes) else o.nbytes) for _, o in objects)
    shares = [(fqn, bounds, ranks) for fqn, t in pieces.items() for bounds, ranks in _writers(t._spec)]
    shares.sort(key=lambda s: -_numel(tuple(n for _, n in s[1])) * pieces[s[0]].dtype.itemsize)
    for fqn, bounds, ranks in shares:  # largest first, each to the least loaded rank holding it
        spec = pieces[fqn]._spec
        r = min(ranks, key=load.__getitem__)
        sizes = tuple(n for _, n in bounds)
        load[r] += ITEM_BYTES + spec.dtype.itemsize * _numel(sizes)
        items[r].append(_tensor_item(fqn, WriteItemType.SHARD, tuple(s for s, _ in bounds), sizes, spec.shape,
                                     spec.dtype))
    plans, metadata = create_default_global_save_plan([SavePlan(i) for i in items])
    plans = FileSystemWriter(path).prepare_global_plan(plans)  # each rank's file prefix
    metadata.planner_data = mappings
    fqns = tuple(pieces)
    jobs = tuple(WriteJob(path, final if r == 0 else "", p, fqns, tuple(objects) if r == 0 else (), stage)
                 for r, p in enumerate(plans))
    return SaveSet(tuple(pieces.values()), jobs, metadata)


def _numel(sizes: tuple[int, ...]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


# -- loading -----------------------------------------------------------------------------------
def check_load(flat: Flat, md: Metadata, where: str) -> None:
    """Every key of the state dict is in the checkpoint, as the same kind of value with the same global
    shape; raises one CheckpointError naming all that differ."""
    saved = md.state_dict_metadata
    problems = []
    for fqn, v in flat.items():
        got = saved.get(fqn)
        if got is None:
            near = [k for k in saved if k.rsplit(".", 1)[-1] == fqn.rsplit(".", 1)[-1]][:3]
            problems.append(f"{fqn!r} is not in the checkpoint" + (f" (it has {near})" if near else ""))
        elif isinstance(v, torch.Tensor) and isinstance(got, BytesStorageMetadata):
            problems.append(f"{fqn!r} is a tensor of shape {tuple(v.shape)} here, but an object in the checkpoint")
        elif isinstance(v, torch.Tensor) and tuple(got.size) != tuple(v.shape):
            problems.append(f"{fqn!r} has global shape {tuple(v.shape)} here, but {tuple(got.size)} in the "
                            "checkpoint")
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise CheckpointError(f"cannot load {where}: {shown}. Nothing was loaded; build the model and optimizer "
                              "with the shapes and keys they had when the checkpoint was saved")


@dataclass(frozen=True)
class LoadSet:
    """A planned load: each MeshTensor key with the spec its loaded copy gets, and each rank's job
    (the first rank also reads the plain tensors and objects, which come back by key)."""
    targets: tuple[tuple[str, MeshTensor, Spec], ...]
    jobs: tuple[ReadJob, ...]


def plan_load(flat: Flat, md: Metadata, session: Any, path: str) -> LoadSet:
    coords = list(session.abstract.coords())
    targets = [(fqn, v, _loaded_spec(v)) for fqn, v in flat.items() if isinstance(v, MeshTensor)]
    outs: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = [[] for _ in coords]
    reads: list[list[ReadItem]] = [[] for _ in coords]
    for fqn, _, spec in targets:
        for r, c in enumerate(coords):
            bounds = spec.bounds(c)
            local = tuple(n for _, n in bounds)
            outs[r].append((fqn, local, spec.dtype))
            reads[r] += _reads(fqn, md, tuple(s for s, _ in bounds), local)
    whole_outs: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    for fqn, v in flat.items():
        got = md.state_dict_metadata[fqn]
        if isinstance(v, MeshTensor):
            continue
        if isinstance(got, TensorStorageMetadata):
            shape = tuple(got.size)
            whole_outs.append((fqn, shape, v.dtype if isinstance(v, torch.Tensor) else got.properties.dtype))
            reads[0] += _reads(fqn, md, (0,) * len(shape), shape)
        else:
            reads[0].append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(fqn),
                                     dest_offsets=torch.Size(()), storage_index=MetadataIndex(fqn),
                                     storage_offsets=torch.Size(()), lengths=torch.Size(())))
    jobs = tuple(ReadJob(path, {i.storage_index: md.storage_data[i.storage_index] for i in reads[r]}, tuple(reads[r]),
                         tuple(outs[r]), tuple(whole_outs) if r == 0 else ()) for r in range(len(coords)))
    return LoadSet(tuple(targets), jobs)


def _loaded_spec(t: MeshTensor) -> Spec:
    """The spec of a loaded copy of `t`: its placements without Partial, contiguous."""
    ps = tuple(Replicate() if p.is_partial() else p for p in t._spec.placements)
    return spec_of(torch.empty(t.shape, dtype=t.dtype, device="meta"), ps, t._spec.mesh)


def _reads(fqn: str, md: Metadata, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> list[ReadItem]:
    if not all(sizes) and sizes:
        return []
    chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
    got = md.state_dict_metadata[fqn]
    assert isinstance(got, TensorStorageMetadata), f"{fqn}: {got}"
    return create_read_items_for_chunk_list(fqn, got, [chunk])
