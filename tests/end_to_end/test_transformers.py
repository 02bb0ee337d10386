"""Stock PyTorch attention models of the zoo (examples/zoo.py) train sharded: nn.MultiheadAttention
(need_weights either way, key padding and attention masks, batch first or not), the pre-norm
nn.TransformerEncoder and nn.TransformerDecoder. On meshes dp=2, tp=2 and dp=2 x tp=2, eager and compiled,
five steps give the losses and parameters of plain torch, with every op covered by a sharding rule
(MONARCH_STRICT=1); once on real processes. The LLaMA block's attention moves nothing over tp. (The
encoder and the LLaMA block train in tests/end_to_end/test_zoo.py.)
"""
from __future__ import annotations

import pytest
import torch

import monarch
from monarch.actor import ProcMesh
from monarch.runtime.session.local import LocalMesh
from tests.end_to_end.zoo_runs import check_same, parallelize, zoo

pytestmark = pytest.mark.usefixtures("strict")
MESHES = [{"dp": 2}, {"tp": 2}, {"dp": 2, "tp": 2}]
KINDS = ["mha", "mha-weights", "mha-masks", "mha-seq-first-masks-weights", "encoder-norm-first", "decoder"]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dims", MESHES, ids=["x".join(d) for d in MESHES])
@pytest.mark.parametrize("kind", KINDS)
def test_training_matches_torch(kind: str, dims: dict[str, int], compiled: bool) -> None:
    check_same(zoo.VARIANTS[kind], LocalMesh(dims), compiled)


def test_llama_attention_keeps_heads_sharded() -> None:
    """Under the tensor-parallel plan the attention itself moves nothing over tp: one all_reduce each
    after wo and w2, none before."""
    torch.manual_seed(0)
    mesh, size = LocalMesh({"tp": 2}), zoo.Size()
    model = parallelize(zoo.Llama(size), mesh, zoo.ZOO["llama"], size)
    x = monarch.distribute_tensor(torch.randn(2, size.seq, size.width), mesh, [monarch.Replicate()])
    s = mesh.session
    s.flush()
    n = len(s.collectives)
    out = model(x, None)
    s.flush()
    del out
    assert s.collectives[n:] == ["all_reduce[tp]", "all_reduce[tp]"], s.collectives[n:]


def test_training_on_procs(procs: ProcMesh) -> None:
    check_same(zoo.VARIANTS["mha-seq-first-masks-weights"], procs, compiled=True)
