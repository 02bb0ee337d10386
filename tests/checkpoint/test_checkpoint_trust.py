"""Loading a checkpoint runs no code the files name, and a save killed midway leaves nothing behind.

On a real 2x2 mesh and in the controller alone (a state dict without MeshTensors goes through plain
DCP): a crafted `.metadata` and a crafted object entry (a pickle whose reduction opens a file) are refused
with a CheckpointError that names `trusted=True`, and the file is never created; with `trusted=True` the
object entry loads. Plain objects (ints, dicts, tuples of tensors) still load without it. Damaged metadata
(single-byte flips) raises CheckpointError or loads, never another exception. Leftovers of a killed save
(`<id>.tmp-<hex>`, `<id>.tmp-<hex>.old`) are cleared by the next save or load of that id, and a previous
checkpoint moved aside is put back when the id itself is missing.
"""
from __future__ import annotations

import enum
import io
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import monarch
import monarch.checkpoint as mcp
from monarch import CheckpointError, Shard
from monarch.actor import ProcMesh

T = 60.0  # seconds any single wait may take
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Opens:
    """Unpickling it opens (creates) `path`: what a crafted pickle does with a more harmful function."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


class EnumsByName(pickle.Pickler):
    """Pickles enum members as Python 3.11.0-3.11.4 do (Debian 12's python3 among them): getattr(class, name)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


class Getattr:
    """Unpickling it reads an attribute that is no enum member, of a class DCP metadata may name."""

    def __reduce__(self) -> tuple[Any, ...]:
        from torch.distributed.checkpoint.metadata import Metadata
        return (getattr, (Metadata, "__subclasses__"))


def sharded(procs: ProcMesh, value: float = 1.0) -> torch.Tensor:
    return monarch.distribute_tensor(torch.full((4, 2), value), procs, {"dp": Shard(0)})


def on_mesh(procs: ProcMesh, tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    ckpt = tmp_path / "c"
    mcp.save({"w": sharded(procs, 2.0), "step": 3}, checkpoint_id=ckpt, timeout=T)
    return ckpt, {"w": sharded(procs), "step": 0}


def in_controller(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    ckpt = tmp_path / "c"
    mcp.save({"w": torch.full((4, 2), 2.0), "step": 3}, checkpoint_id=ckpt)
    return ckpt, {"w": torch.ones(4, 2), "step": 0}


@pytest.mark.parametrize("where", ["mesh", "controller"])
def test_a_crafted_metadata_runs_nothing(procs: ProcMesh, tmp_path: Path, where: str) -> None:
    ckpt, target = on_mesh(procs, tmp_path) if where == "mesh" else in_controller(tmp_path)
    marker = tmp_path / "ran"
    (ckpt / ".metadata").write_bytes(pickle.dumps(Opens(marker)))
    with pytest.raises(CheckpointError, match="trusted=True") as e:
        mcp.load(target, checkpoint_id=ckpt, timeout=T)
    assert "io.open" in str(e.value)
    assert not marker.exists() and target["step"] == 0


@pytest.mark.parametrize("where", ["mesh", "controller"])
def test_metadata_that_pickles_enums_by_name_loads(procs: ProcMesh, tmp_path: Path, where: str) -> None:
    ckpt, target = on_mesh(procs, tmp_path) if where == "mesh" else in_controller(tmp_path)
    meta = ckpt / ".metadata"
    with open(meta, "rb") as f:
        metadata = pickle.load(f)
    out = io.BytesIO()
    EnumsByName(out, protocol=2).dump(metadata)
    meta.write_bytes(out.getvalue())
    assert b"getattr" in meta.read_bytes()
    mcp.load(target, checkpoint_id=ckpt, timeout=T)
    w = target["w"].full_tensor() if where == "mesh" else target["w"]
    assert target["step"] == 3 and torch.equal(w, torch.full((4, 2), 2.0))


def test_a_getattr_of_anything_but_an_enum_member_is_refused(tmp_path: Path) -> None:
    ckpt, target = in_controller(tmp_path)
    (ckpt / ".metadata").write_bytes(pickle.dumps(Getattr()))
    with pytest.raises(CheckpointError, match="no enum member.*trusted=True"):
        mcp.load(target, checkpoint_id=ckpt)


@pytest.mark.parametrize("where", ["mesh", "controller"])
def test_a_crafted_object_entry_runs_nothing_unless_trusted(procs: ProcMesh, tmp_path: Path, where: str) -> None:
    marker, ckpt = tmp_path / "ran", tmp_path / "c"
    w = sharded(procs, 2.0) if where == "mesh" else torch.full((4, 2), 2.0)
    mcp.save({"w": w, "obj": Opens(marker)}, checkpoint_id=ckpt, timeout=T)
    assert not marker.exists()
    target = {"w": sharded(procs) if where == "mesh" else torch.ones(4, 2), "obj": None}
    with pytest.raises(CheckpointError, match="'obj'.*trusted=True"):
        mcp.load(target, checkpoint_id=ckpt, timeout=T)
    assert not marker.exists() and target["obj"] is None
    mcp.load(target, checkpoint_id=ckpt, timeout=T, trusted=True)
    assert marker.exists() and target["obj"] is not None
    target["obj"].close()


def test_plain_objects_load_without_trust(procs: ProcMesh, tmp_path: Path) -> None:
    saved = {"step": 7, "cfg": {"lr": 0.5, "betas": (0.9, 0.99), "name": "adam"},
             "pair": (torch.ones(2), torch.zeros(1))}
    mcp.save({"w": sharded(procs, 2.0), **saved}, checkpoint_id=tmp_path / "c", timeout=T)
    target = {"w": sharded(procs), "step": 0, "cfg": {"lr": 0.0, "betas": None, "name": ""},
              "pair": (torch.zeros(2), torch.ones(1))}
    mcp.load(target, checkpoint_id=tmp_path / "c", timeout=T)
    assert target["step"] == 7 and target["cfg"] == saved["cfg"]
    assert all(torch.equal(a, b) for a, b in zip(target["pair"], saved["pair"], strict=True))
    assert torch.equal(target["w"].full_tensor(timeout=T), torch.full((4, 2), 2.0))


def test_damaged_metadata_raises_checkpoint_errors(procs: ProcMesh, tmp_path: Path) -> None:
    ckpt, _ = on_mesh(procs, tmp_path)
    good = (ckpt / ".metadata").read_bytes()
    for i in range(0, len(good), max(1, len(good) // 24)):
        (ckpt / ".metadata").write_bytes(good[:i] + bytes([good[i] ^ 0xFF]) + good[i + 1:])
        try:
            mcp.load({"w": sharded(procs), "step": 0}, checkpoint_id=ckpt, timeout=T)
        except CheckpointError:
            pass


@pytest.mark.parametrize("where", ["mesh", "controller"])
def test_leftovers_of_a_killed_save_are_cleared(procs: ProcMesh, tmp_path: Path, where: str) -> None:
    ckpt, target = on_mesh(procs, tmp_path) if where == "mesh" else in_controller(tmp_path)
    for name in ("c.tmp-0badc0de", "c.tmp-0badc0de.old", "c.tmp-12345678"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__0_0.distcp").write_bytes(b"partial")
    (tmp_path / "c.tmp-notmine").mkdir()  # not a name a save makes: left alone
    mcp.load(target, checkpoint_id=ckpt, timeout=T)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "c.tmp-notmine"]
    assert target["step"] == 3


@pytest.mark.parametrize("where", ["mesh", "controller"])
def test_a_checkpoint_moved_aside_is_put_back(procs: ProcMesh, tmp_path: Path, where: str) -> None:
    """A kill between replace's two renames: the id is gone, the previous checkpoint sits in `.old`."""
    ckpt, target = on_mesh(procs, tmp_path) if where == "mesh" else in_controller(tmp_path)
    shutil.move(ckpt, tmp_path / "c.tmp-89abcdef.old")
    (tmp_path / "c.tmp-89abcdef").mkdir()
    mcp.load(target, checkpoint_id=ckpt, timeout=T)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    assert target["step"] == 3
