"""The examples that move tensors between meshes: two-stage pipeline-parallel GPT training on two sub-meshes
(examples/pipeline.py, GPipe microbatches) and an RL-style weight sync from a trainer mesh to a generator mesh
(examples/weight_sync.py), each equal to plain torch.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import gpt  # noqa: E402
import pipeline  # noqa: E402
import weight_sync  # noqa: E402

CFG = gpt.GPTConfig(d_model=32, n_layer=2, n_head=2, context=16)


def test_pipeline_training_on_two_stages_equals_plain_torch() -> None:
    data = gpt.load_text()
    mesh = pipeline.train(CFG, 2, data, batch=4, micro=2)
    plain = pipeline.train(CFG, 2, data, batch=4, micro=2, on_mesh=False)
    assert len(mesh) == 2 and all(abs(m - p) < 1e-4 for m, p in zip(mesh, plain, strict=True)), (mesh, plain)
    assert mesh[1] != mesh[0]  # it trained


def test_weight_sync_gives_the_generator_the_trainers_weights() -> None:
    data = gpt.load_text()
    mesh = weight_sync.run(CFG, 2, 2, data, batch=4)
    assert mesh == weight_sync.run(CFG, 2, 2, data, batch=4, on_mesh=False)
