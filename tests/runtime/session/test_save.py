"""torch.save of MeshTensors fails with a MonarchError naming monarch.full_state_dict, and saves nothing.

Saving is a controller-side matter, so an in-process LocalMesh serves. A state dict (or a model) holding
MeshTensors is refused before torch opens its target: no file appears, an existing checkpoint stays as
it was, a buffer stays empty. A MeshTensor hidden in an arbitrary object is met only while torch pickles,
after it opened the target: the file is removed, the buffer is cut back to where the save began.
Gathered state dicts save and load as plain torch ones.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import monarch
from monarch.runtime.session.local import LocalMesh


class Holder:
    """An arbitrary picklable object with a tensor attribute."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    monarch.data_parallel(m, LocalMesh({"dp": 2}))
    return m


def refused(obj: Any, target: Any, match: str = "full_state_dict") -> monarch.MonarchError:
    with pytest.raises(monarch.MonarchError, match=match) as e:
        torch.save(obj, target)
    return e.value


def test_state_dict_of_mesh_tensors_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    m = model()
    path = tmp_path / "ckpt.pt"
    err = refused(m.state_dict(), path)
    assert "obj['0.weight'] is a MeshTensor" in str(err) and "Nothing was written" in str(err)
    assert not path.exists()
    refused(m, str(path))  # the model itself
    assert not path.exists()
    buf = io.BytesIO()
    refused({"model": m.state_dict(), "step": 3}, buf, r"obj\['model'\]\['0.weight'\]")
    assert buf.getvalue() == b""


def test_an_existing_checkpoint_survives_a_refused_save(tmp_path: Path) -> None:
    m = model()
    path = tmp_path / "ckpt.pt"
    torch.save(monarch.full_state_dict(m), path)
    before = path.read_bytes()
    refused([m.state_dict()], path)
    assert path.read_bytes() == before
    fresh = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    fresh.load_state_dict(torch.load(path))
    for name, t in fresh.state_dict().items():
        assert torch.equal(t, m.state_dict()[name].full_tensor()), name


def test_a_mesh_tensor_inside_an_object_leaves_nothing_behind(tmp_path: Path) -> None:
    hidden = Holder(model()[0].weight)
    path = tmp_path / "obj.pt"
    refused(hidden, path)
    assert not path.exists()
    buf = io.BytesIO(b"header")
    buf.seek(0, io.SEEK_END)
    refused(hidden, buf)
    assert buf.getvalue() == b"header"


def test_plain_saves_are_unchanged(tmp_path: Path) -> None:
    obj = {"w": torch.arange(6.0).reshape(2, 3), "nested": [torch.ones(2), (1, "x")], "holder": Holder(torch.zeros(1))}
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    assert torch.equal(back["w"], obj["w"]) and back["nested"][1] == (1, "x") and torch.equal(back["holder"].t,
                                                                                              torch.zeros(1))
    torch.save(obj["w"], tmp_path / "w.pt")
    assert torch.equal(torch.load(tmp_path / "w.pt"), obj["w"])
