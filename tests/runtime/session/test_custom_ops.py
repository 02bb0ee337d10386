"""Ops monarch defines with torch.library (`monarch::matmul`) run on the workers from their kernel table:
each has an entry there, a worker's engine resolves it with the definition unimportable, and a fresh
mesh computes batched matmuls (forward, backward, compiled) equal to plain torch. tensor_split with
tensor indices (or a tensor count of sections), plain or MeshTensors, equals plain torch on every placement.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import monarch
from monarch.actor import this_host
from monarch.runtime.engine.kernels import KERNELS
from monarch.tensor import ops
from tests.strategies import placement_tuples, reference_mesh, tensor_meshes, tensor_shapes

T = 30.0  # seconds any single wait may take


def test_every_op_monarch_defines_has_a_worker_kernel() -> None:
    defined = [v for v in vars(ops).values() if isinstance(v, torch._library.custom_ops.CustomOpDef)]
    assert defined, "no torch.library op found in monarch.tensor.ops"
    for op in defined:
        assert op._qualname in KERNELS, f"{op._qualname}: no entry in the workers' kernel table"


def test_the_engine_resolves_monarch_ops_without_their_definition() -> None:
    code = textwrap.dedent("""
        import sys, torch
        sys.modules["monarch.tensor"] = None  # importing the tensor API (and monarch.tensor.ops) fails
        from monarch.runtime.engine.engine import kernel
        a, b = torch.randn(2, 3, 4), torch.randn(2, 4, 5)
        assert torch.equal(kernel("monarch::matmul")(a, b), a @ b)
        assert not hasattr(torch.ops.monarch, "matmul")
        print("OK")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "OK", done.stderr[-2000:]


def test_custom_op_on_a_fresh_mesh_equals_plain_torch() -> None:
    a, b = torch.randn(2, 4, 3, 5), torch.randn(2, 4, 5, 6)
    w = torch.randn(2, 4, 3, 6)
    with this_host().spawn_procs(per_host={"dp": 2, "tp": 2}) as procs:
        x = monarch.distribute_tensor(a, procs, {"dp": monarch.Shard(0), "tp": monarch.Shard(1)}).requires_grad_()
        y = monarch.distribute_tensor(b, procs, {"tp": monarch.Shard(1)}).requires_grad_()
        assert "monarch::matmul" in monarch.explain(lambda p, q: p @ q, x, y)
        out = x @ y
        (out * monarch.distribute_tensor(w, procs)).sum().backward()
        step = monarch.compile(lambda p, q: (p @ q).sum(-1))
        compiled = [step(x.detach(), y.detach()).full_tensor(timeout=T) for _ in range(2)]
        ra, rb = a.clone().requires_grad_(), b.clone().requires_grad_()
        want = ra @ rb
        (want * w).sum().backward()
        torch.testing.assert_close(out.full_tensor(timeout=T), want)
        torch.testing.assert_close(x.grad.full_tensor(timeout=T), ra.grad)
        torch.testing.assert_close(y.grad.full_tensor(timeout=T), rb.grad)
        for c in compiled:
            torch.testing.assert_close(c, want.detach().sum(-1))


@pytest.fixture(autouse=True)
def strict(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MONARCH_STRICT", "1")


SPLITS = {
    "indices tensor": lambda t: torch.tensor([1, 3]),
    "one index tensor": lambda t: torch.tensor([2]),
    "sections tensor": lambda t: torch.tensor(3),
    "indices list": lambda t: [0, 2, 2, 9],
}


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_tensor_split_with_tensor_indices_equals_plain_torch(data: st.DataObject) -> None:
    shape = data.draw(tensor_shapes(1, 3, max_size=6))
    dim = data.draw(st.integers(0, len(shape) - 1))
    split = SPLITS[data.draw(st.sampled_from(sorted(SPLITS)))](None)
    dims = data.draw(tensor_meshes())
    plain = torch.arange(1.0, 1 + torch.Size(shape).numel()).reshape(shape)
    x = monarch.distribute_tensor(plain, reference_mesh(dims), data.draw(placement_tuples(len(shape), len(dims))))
    if data.draw(st.booleans()) and isinstance(split, torch.Tensor):  # the indices a MeshTensor too
        split = monarch.distribute_tensor(split, reference_mesh(dims))
    got = torch.tensor_split(x, split, dim) if data.draw(st.booleans()) else x.tensor_split(split, dim=dim)
    want = torch.tensor_split(plain, split.full_tensor() if isinstance(split, monarch.MeshTensor) else split, dim)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.full_tensor(), w)
