"""examples/meta_init.py --tiny runs as a user runs it: a GPT built under torch.device("meta"), tensor-parallel
over 4 worker processes with DTensor's names, materialised and initialised on the workers, one SGD step."""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def test_the_meta_init_example_trains_a_step() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "meta_init.py"), "--tiny"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    loss = re.search(r"one SGD step: loss ([\d.]+)", done.stdout)
    assert loss and math.isfinite(float(loss.group(1))) and float(loss.group(1)) > 0, done.stdout
    assert "on a tp=4 mesh" in done.stdout and "controller RSS:" in done.stdout, done.stdout
