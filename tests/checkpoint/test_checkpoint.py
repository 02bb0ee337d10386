"""monarch.checkpoint on in-process meshes: DCP checkpoints that round-trip, reshard, and move to and from
plain torch.distributed.checkpoint.

Saved on dp=2 x tp=2 and loaded on dp=4, tp=4 and one rank, training resumes with the uninterrupted
losses (eager and compiled); a checkpoint is read by plain DCP in this process and one written by plain
DCP loads into a sharded model; async_save overlaps training; bad input raises CheckpointError with
nothing loaded; objects, plain tensors, Stateful values and the random stream come back.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import monarch
import monarch.checkpoint as mcp
from monarch import CheckpointError, Replicate, Shard
from monarch.runtime.engine import checkpoint as worker_side
from monarch.runtime.session.local import LocalMesh
from tests.checkpoint.ckpt_runs import T, batches, build, losses, plain_values, resume, stepper

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def dpxtp() -> LocalMesh:
    return LocalMesh({"dp": 2, "tp": 2})


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_resume_on_other_mesh_shapes_gives_the_uninterrupted_losses(tmp_path: Path, compiled: bool) -> None:
    resume(dpxtp(), [dpxtp(), LocalMesh({"dp": 4}), LocalMesh({"tp": 4}), LocalMesh({"dp": 1})],
           tmp_path / "ckpt", compiled)


def test_every_rank_writes_its_own_pieces_once(tmp_path: Path) -> None:
    """dp=2 x tp=2: the four ranks share the writes (one writer per replicated piece), and the chunks of
    each tensor tile it exactly once."""
    model, opt = build(dpxtp())
    losses(stepper(model, opt, False), batches(1))
    md = mcp.save(mcp.get_state_dict(model, opt), checkpoint_id=tmp_path / "c", timeout=T)
    files = sorted(p.name for p in (tmp_path / "c").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]
    sizes = [os.path.getsize(tmp_path / "c" / f) for f in files[1:]]
    assert max(sizes) < 2 * min(sizes), sizes
    up = md.state_dict_metadata["model.up.weight"]
    assert tuple(up.size) == (64, 16) and sorted(tuple(c.offsets) for c in up.chunks) == [(0, 0), (32, 0)]
    for key, entry in md.state_dict_metadata.items():
        if hasattr(entry, "chunks"):
            volume = sum(torch.Size(c.sizes).numel() for c in entry.chunks)
            assert volume == torch.Size(entry.size).numel(), key
    assert not list(tmp_path.glob("c.tmp-*")), "the temporary directory was renamed into place"


def plain_model_state(path: Path, *extra: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    """A plain model and optimizer (and `extra` keys) loaded from `path` with plain DCP in this process."""
    model, opt = build(None, seed=5)
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd, **dict.fromkeys(extra, 0)}
    dcp.load(sd, checkpoint_id=path, no_dist=True)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return model, opt, sd


def test_plain_dcp_reads_a_monarch_checkpoint(tmp_path: Path) -> None:
    """torch.distributed.checkpoint.load in one plain process gives the model and optimizer monarch saved,
    and both train on identically."""
    mesh = dpxtp()
    model, opt = build(mesh)
    data = batches(3)
    losses(stepper(model, opt, False), data[:1])
    mcp.save(mcp.get_state_dict(model, opt) | {"step": 1}, checkpoint_id=tmp_path / "c", timeout=T)
    plain, plain_opt, sd = plain_model_state(tmp_path / "c", "step")
    assert sd["step"] == 1
    for name, value in plain_values(model).items():
        torch.testing.assert_close(plain.state_dict()[name], value, rtol=0, atol=0)
    got_opt = plain_opt.state_dict()["state"]
    for i, entry in plain_values(opt)["state"].items():
        for k, v in entry.items():
            torch.testing.assert_close(got_opt[i][k], v, rtol=0, atol=0)
    plain.eval(), model.eval()  # dropout draws from monarch's stream on the mesh, from torch's in plain torch
    assert losses(stepper(plain, plain_opt, False), data[1:]) == pytest.approx(
        losses(stepper(model, opt, False), data[1:]), rel=1e-6)


def test_a_plain_dcp_checkpoint_loads_into_a_sharded_model(tmp_path: Path) -> None:
    plain, plain_opt = build(None)
    plain.eval()
    losses(stepper(plain, plain_opt, False), batches(1))
    msd, osd = get_state_dict(plain, plain_opt)
    dcp.save({"model": msd, "optim": osd, "step": 4}, checkpoint_id=tmp_path / "plain", no_dist=True)
    model, opt = build(dpxtp(), seed=9)
    sd = mcp.get_state_dict(model, opt) | {"step": 0}
    mcp.load(sd, checkpoint_id=tmp_path / "plain", timeout=T)
    mcp.set_state_dict(model, opt, sd)
    assert sd["step"] == 4
    assert model.up.weight.placements == (Replicate(), Shard(0))
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(plain_values(model)[name], value, rtol=0, atol=0)
    model.eval()
    data = batches(2, seed=4)
    assert losses(stepper(model, opt, False), data) == pytest.approx(losses(stepper(plain, plain_opt, False), data),
                                                                     rel=1e-6)


def test_objects_plain_tensors_and_stateful_values_come_back(tmp_path: Path) -> None:
    class Loader:
        def __init__(self) -> None:
            self.position = 0

        def state_dict(self) -> dict:
            return {"position": self.position}

        def load_state_dict(self, sd: dict) -> None:
            self.position = sd["position"]

    mesh = dpxtp()
    loader = Loader()
    loader.position = 17
    w = monarch.distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh, {"dp": Shard(0)})
    sd = {"w": w, "meta": {"lr": 0.5, "tags": ["a", "b"]}, "plain": torch.tensor([1.5, 2.5]), "loader": loader}
    mcp.save(sd, checkpoint_id=tmp_path / "c", timeout=T)
    fresh_loader = Loader()
    target = {"w": monarch.zeros(4, 3, mesh=mesh, placements={"tp": Shard(1)}), "meta": {"lr": 0.0, "tags": []},
              "plain": torch.zeros(2), "loader": fresh_loader}
    plain = target["plain"]
    mcp.load(target, checkpoint_id=tmp_path / "c", timeout=T)
    assert torch.equal(target["w"].full_tensor(timeout=T), torch.arange(12.0).reshape(4, 3))
    assert target["w"].placements == (Replicate(), Shard(1))
    assert target["meta"] == {"lr": 0.5, "tags": ["a", "b"]}
    assert target["plain"] is plain and torch.equal(plain, torch.tensor([1.5, 2.5]))
    assert target["loader"] is fresh_loader and fresh_loader.position == 17


def test_the_random_stream_resumes_exactly(tmp_path: Path) -> None:
    mesh = dpxtp()
    monarch.manual_seed(3)
    monarch.randn(4, 4, mesh=mesh)
    mcp.save({"rng": mcp.RNGState(mesh)}, checkpoint_id=tmp_path / "c", timeout=T)
    want = monarch.randn(6, 4, mesh=mesh, placements={"dp": Shard(0)}).full_tensor(timeout=T)
    monarch.manual_seed(99)
    mcp.load({"rng": mcp.RNGState(LocalMesh({"tp": 4}))}, checkpoint_id=tmp_path / "c", timeout=T)
    got = monarch.randn(6, 4, mesh=LocalMesh({"tp": 4}), placements={"tp": Shard(1)}).full_tensor(timeout=T)
    assert torch.equal(got, want)


def test_async_save_returns_before_the_disk_and_keeps_the_values_it_was_given(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The writes wait on a gate that opens only after a training step ran: async_save and that step
    return, and the checkpoint holds the values of the async_save call, not the later ones."""
    gate = threading.Event()
    write = worker_side._write

    def gated(job: worker_side.WriteJob, data: dict) -> list:
        assert gate.wait(T), "the gate never opened"
        return write(job, data)
    monkeypatch.setattr(worker_side, "_write", gated)
    mesh = dpxtp()
    model, opt = build(mesh)
    step = stepper(model, opt, False)
    data = batches(2)
    losses(step, data[:1])
    saved = plain_values(model)
    fut = mcp.async_save(mcp.get_state_dict(model, opt), checkpoint_id=tmp_path / "c")
    losses(step, data[1:])  # runs while every rank's write waits
    assert not (tmp_path / "c").exists()
    gate.set()
    md = fut.get(T)
    assert "model.up.weight" in md.state_dict_metadata
    plain, _, _ = plain_model_state(tmp_path / "c")
    for name, value in saved.items():
        torch.testing.assert_close(plain.state_dict()[name], value, rtol=0, atol=0)


def test_a_later_save_waits_for_an_async_one(tmp_path: Path) -> None:
    mesh = dpxtp()
    w = monarch.distribute_tensor(torch.ones(4), mesh, {"dp": Shard(0)})
    fut = mcp.async_save({"w": w}, checkpoint_id=tmp_path / "a")
    mcp.save({"w": w * 2}, checkpoint_id=tmp_path / "b", timeout=T)
    assert (tmp_path / "a" / ".metadata").exists() and fut.get(T) is not None


def test_a_save_futures_repr_is_short(tmp_path: Path) -> None:
    model, opt = build(dpxtp())
    fut = mcp.async_save(mcp.get_state_dict(model, opt), checkpoint_id=tmp_path / "c")
    pending = repr(fut)
    fut.get(T)
    assert pending == f"<SaveFuture {str(tmp_path / 'c')!r} pending>" and repr(fut).endswith(" done>")
    assert len(repr(fut)) < 300, repr(fut)[:300]


# -- bad input ---------------------------------------------------------------------------------
def saved(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    model, opt = build(dpxtp())
    mcp.save(mcp.get_state_dict(model, opt), checkpoint_id=tmp_path / "c", timeout=T)
    return tmp_path / "c", model


def test_a_shape_mismatch_names_the_key_and_both_shapes_and_loads_nothing(tmp_path: Path) -> None:
    path, _ = saved(tmp_path)
    model, _ = build(dpxtp(), seed=4)
    model.head.weight = torch.nn.Parameter(monarch.zeros(33, 16, mesh=model.head.weight.mesh))
    before = plain_values(model)
    sd = mcp.get_state_dict(model)
    with pytest.raises(CheckpointError, match=r"'model.head.weight' has global shape \(33, 16\) here, but "
                                              r"\(32, 16\) in the checkpoint"):
        mcp.load(sd, checkpoint_id=path, timeout=T)
    for name, value in plain_values(model).items():
        assert torch.equal(value, before[name]), f"{name} changed"


def test_a_missing_key_is_named(tmp_path: Path) -> None:
    path, _ = saved(tmp_path)
    w = monarch.zeros(3, mesh=dpxtp())
    with pytest.raises(CheckpointError, match="'extra.w' is not in the checkpoint"):
        mcp.load({"extra": {"w": w}}, checkpoint_id=path, timeout=T)


def test_a_path_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    w = monarch.zeros(3, mesh=dpxtp())
    with pytest.raises(CheckpointError, match="does not exist"):
        mcp.load({"w": w}, checkpoint_id=tmp_path / "nowhere", timeout=T)
    (tmp_path / "dir").mkdir()
    with pytest.raises(CheckpointError, match=r"no \.metadata"):
        mcp.load({"w": w}, checkpoint_id=tmp_path / "dir", timeout=T)


def test_a_save_never_replaces_a_directory_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    w = monarch.zeros(3, mesh=dpxtp())
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        mcp.save({"w": w}, checkpoint_id=tmp_path / "mine", timeout=T)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"], "the temporary directory was removed"


def test_saving_over_a_checkpoint_replaces_it(tmp_path: Path) -> None:
    mesh = dpxtp()
    mcp.save({"w": monarch.ones(4, mesh=mesh)}, checkpoint_id=tmp_path / "c", timeout=T)
    mcp.save({"w": monarch.full(4, fill_value=2.0, mesh=mesh)}, checkpoint_id=tmp_path / "c", timeout=T)
    target = {"w": monarch.zeros(4, mesh=mesh)}
    mcp.load(target, checkpoint_id=tmp_path / "c", timeout=T)
    assert torch.equal(target["w"].full_tensor(timeout=T), torch.full((4,), 2.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_partial_values_are_saved_reduced(tmp_path: Path) -> None:
    mesh = dpxtp()
    x = monarch.distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, {"dp": Shard(0)})
    total = x.sum(0)  # Partial over dp
    mcp.save({"t": total}, checkpoint_id=tmp_path / "c", timeout=T)
    sd = {"t": torch.zeros(2)}
    dcp.load(sd, checkpoint_id=tmp_path / "c", no_dist=True)
    assert torch.equal(sd["t"], torch.tensor([12.0, 16.0]))


def test_a_state_dict_without_mesh_tensors_uses_plain_dcp(tmp_path: Path) -> None:
    mcp.save({"a": torch.arange(3.0), "n": 5}, checkpoint_id=tmp_path / "c")
    sd = {"a": torch.zeros(3), "n": 0}
    mcp.load(sd, checkpoint_id=tmp_path / "c")
    assert torch.equal(sd["a"], torch.arange(3.0)) and sd["n"] == 5
