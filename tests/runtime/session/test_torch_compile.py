"""torch.compile on MeshTensors inside a mesh: Dynamo graph-breaks at MeshTensor and runs the recording
eagerly, so a compiled model (forward and backward) and a compiled function give the values eager mode
gives, in a controller process of their own whose stderr stays clean (no Dynamo warnings, no traceback,
nothing "ignored" in a destructor). With fullgraph=True, which allows no graph break, the call raises one
TraceError pointing to monarch.compile, every time, and the same function without it still works; also
where the first MeshTensor is made inside the compiled code (a data-parallel model's input hook, a call
of monarch.distribute_tensor).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = """
import copy
import torch, monarch
from monarch.actor import this_host

def same(a, b):
    return torch.allclose(a.full_tensor(timeout=30), b.full_tensor(timeout=30), atol=1e-6)

with this_host().spawn_procs(per_host={"dp": 2, "tp": 2}) as procs:
    monarch.manual_seed(0)
    with procs.activate():
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x = monarch.distribute_tensor(torch.randn(6, 4), procs, {"dp": monarch.Shard(0)})
    compiled = torch.compile(model)
    y, want = compiled(x), model(x)
    assert same(y, want)
    y.sum().backward()
    g = model[0].weight.grad.full_tensor(timeout=30).clone()
    model.zero_grad()
    want.sum().backward()
    assert torch.allclose(g, model[0].weight.grad.full_tensor(timeout=30))
    fn = torch.compile(lambda a, b: (a @ b).softmax(-1) * 2)
    a = monarch.distribute_tensor(torch.randn(2, 3, 4), procs, {"tp": monarch.Shard(0)})
    b = monarch.distribute_tensor(torch.randn(2, 4, 5), procs, {"tp": monarch.Shard(0)})
    for _ in range(2):  # the second call runs what Dynamo cached
        assert same(fn(a, b), (a @ b).softmax(-1) * 2)
    cases = [(lambda t: t.transpose(-1, -2) * 2, a), (lambda t: model(t).sum(), x),
             (lambda t: t @ b.transpose(-1, -2), b)]  # a method call, a module, an operator
    for f, arg in cases:
        full = torch.compile(f, fullgraph=True)
        for _ in range(2):
            try:
                full(arg)
                raise AssertionError("fullgraph=True compiled MeshTensor ops")
            except monarch.TraceError as e:
                assert "fullgraph=True" in str(e) and "@monarch.compile" in str(e), str(e)
                assert "from user code" not in str(e), str(e)
        assert same(torch.compile(f)(arg), f(arg))
    torch.manual_seed(0)  # a data-parallel encoder: its input hook distributes a plain batch inside forward
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    plain = copy.deepcopy(encoder)
    monarch.data_parallel(encoder, procs, dim="dp")
    batch = torch.randn(4, 5, 16)
    for f in (encoder, lambda t: monarch.distribute_tensor(t, procs) * 2):
        for _ in range(2):
            try:
                torch.compile(f, fullgraph=True)(batch)
                raise AssertionError("fullgraph=True compiled a data-parallel model")
            except monarch.TraceError as e:
                assert "@monarch.compile" in str(e), str(e)
    for _ in range(2):
        assert torch.allclose(torch.compile(encoder)(batch).full_tensor(timeout=30), plain(batch), atol=1e-5)
    print("OK")
"""


def test_torch_compile_gives_eager_values_and_a_clean_stderr() -> None:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT)], capture_output=True, text=True,
                          timeout=240, env=dict(os.environ))
    assert done.returncode == 0 and done.stdout.strip() == "OK", done.stderr[-3000:]
    for noise in ("Traceback", "Exception ignored", "Dynamo", "UserWarning"):
        assert noise not in done.stderr, done.stderr[-3000:]
