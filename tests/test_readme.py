"""Every ```python snippet of README.md runs as pasted, in order, in one fresh controller process on this
machine: the actor example, sharded tensors, training, checkpoints (in a temporary directory) and telemetry.
The snippets of "Running on a cluster" name machines of a cluster (node1, a Slurm allocation, agents);
the cluster tier (tests/cluster) runs those calls against its test hosts.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = "## Running on a cluster"
RUNNER = """
import sys, traceback
blocks = {blocks!r}
scope = {{"__name__": "__main__"}}
for i, (where, code) in enumerate(blocks):
    try:
        exec(compile(code, f"<README.md snippet {{i + 1}} ({{where}})>", "exec"), scope)
    except BaseException:
        traceback.print_exc()
        sys.exit(f"README.md snippet {{i + 1}} ({{where}}) failed")
print("README OK")
"""


def snippets(text: str) -> list[tuple[str, str]]:
    """(section heading, code) of every ```python block, in order, but those of the cluster section."""
    out, section = [], ""
    for m in re.finditer(r"^(##? [^\n]*)$|^```python\n(.*?)^```$", text, re.M | re.S):
        if m.group(1):
            section = m.group(1)
        elif section != CLUSTER:
            out.append((section.lstrip("# "), m.group(2)))
    return out


def test_the_snippets_cover_every_section() -> None:
    sections = {s for s, _ in snippets((ROOT / "README.md").read_text())}
    assert {"Example", "Sharded tensors", "Training", "Observability"} <= sections, sections


def test_readme_snippets_run_as_pasted(tmp_path: Path) -> None:
    blocks = snippets((ROOT / "README.md").read_text())
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", RUNNER.format(blocks=blocks)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.rstrip().endswith("README OK"), \
        f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    assert "Traceback" not in done.stderr, done.stderr[-4000:]
