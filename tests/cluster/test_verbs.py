"""The verbs backend with rdma-core's real pyverbs, which .ci/cluster-packages installs for this tier: on a
host without an RDMA device transfers fall back (the reason is pyverbs' own), with one they take ibverbs.
The check is tests/runtime/engine/test_verbs_selection.py's, which skips where the package is absent."""
from __future__ import annotations

import importlib.machinery
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SYSTEM_PYVERBS = Path("/usr/lib/python3/dist-packages/pyverbs")
CHECK = ROOT / "tests" / "runtime" / "engine" / "test_verbs_selection.py"


@pytest.mark.cluster
def test_real_pyverbs_runs_here() -> None:
    device = SYSTEM_PYVERBS / f"device{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    if not device.exists():
        pytest.skip(f"cluster tier: {device} is absent (.ci/cluster-packages installs python3-pyverbs as root)")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                           f"{CHECK}::test_real_pyverbs"], capture_output=True, text=True, timeout=110, cwd=ROOT)
    assert done.returncode == 0 and "1 passed" in done.stdout, (done.stdout + done.stderr)[-3000:]
