"""Without a usable RDMA device one-sided transfers leave verbs aside: pyverbs missing or broken, its device
list raising or empty, or no active port each leave `verbs.device()` None with the reason in `why_not()`,
`monarch.rdma` reports tcp, and a transfer between the controller and a worker still moves the bytes.

Each case runs this file as a script in a subprocess whose PYTHONPATH puts first a `pyverbs` package written
for the case (or rdma-core's real one, when this host has it); on a host with an RDMA device the real case
checks that the transfer takes ibverbs instead.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from monarch.actor import Actor, ActorMesh, endpoint, this_host
from monarch.errors import TransportError
from monarch.rdma import RDMABuffer, get_rdma_backend, is_rdma_available

ROOT = Path(__file__).resolve().parents[3]
SYSTEM_PYVERBS = Path("/usr/lib/python3/dist-packages/pyverbs")
EMULATED = Path(__file__).with_name("emulated_pyverbs")  # a pyverbs whose device copies between processes
T = 120.0

ERRORS = "class PyverbsError(Exception): ...\nclass PyverbsRDMAError(PyverbsError): ...\n"
FAKES = {  # case: (files of the fake pyverbs package, what why_not() says)
    "broken": ({"__init__.py": "raise ImportError('libibverbs.so.1: cannot open shared object file')\n"},
               "cannot be imported (libibverbs.so.1"),
    "raises": ({"device.py": "from pyverbs.pyverbs_error import PyverbsRDMAError\n"
                             "def get_device_list():\n    raise PyverbsRDMAError('Failed to get devices list')\n"},
               "could not list devices (PyverbsRDMAError: Failed to get devices list"),
    "empty": ({"device.py": "def get_device_list():\n    return []\n"}, "pyverbs found none"),
    "inactive": ({"enums.py": "IBV_PORT_ACTIVE = 4\n",
                  "device.py": "from types import SimpleNamespace\n"
                               "def get_device_list():\n    return [SimpleNamespace(name=b'fake_mlx5_0')]\n"
                               "class Context:\n"
                               "    def __init__(self, name):\n        assert name == 'fake_mlx5_0', name\n"
                               "    def query_device(self):\n        return SimpleNamespace(phys_port_cnt=2)\n"
                               "    def query_port(self, port):\n"
                               "        return SimpleNamespace(state=1, link_layer=1)\n"
                               "    def close(self):\n        pass\n"},
                 "no port is active with an address (fake_mlx5_0 port 1, fake_mlx5_0 port 2)"),
}


def fake_pyverbs(where: Path, case: str) -> Path:
    """A directory holding a `pyverbs` package with the files of `case`."""
    package = where / "pyverbs"
    package.mkdir(parents=True)
    for name, text in {"__init__.py": "", "pyverbs_error.py": ERRORS, **FAKES[case][0]}.items():
        (package / name).write_text(text)
    return where


def run_check(pythonpath: list[Path], expect: str, env: dict[str, str] | None = None) -> str:
    """Run this file as the check script; its output (it printed "verbs check ok" when every check held)."""
    env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(map(str, [*pythonpath, ROOT]))}
    done = subprocess.run([sys.executable, __file__, expect], capture_output=True, text=True, timeout=T, cwd=ROOT,
                          env=env)
    assert done.returncode == 0 and "verbs check ok" in done.stdout, (done.stdout + done.stderr)[-4000:]
    return done.stdout


@pytest.mark.parametrize("case", sorted(FAKES))
def test_no_usable_device_falls_back(tmp_path: Path, case: str) -> None:
    out = run_check([fake_pyverbs(tmp_path, case)], FAKES[case][1])
    assert "worker read via shm" in out and "worker wrote via shm" in out, out


def test_the_device_flag_names_one_this_host_lacks(tmp_path: Path) -> None:
    code = ("from monarch.runtime.engine.transport import verbs\nassert verbs.device() is None\n"
            "print(verbs.why_not())\n")
    env = {**os.environ, "MONARCH_RDMA_DEVICE": "mlx5_9:1",
           "PYTHONPATH": os.pathsep.join(map(str, [fake_pyverbs(tmp_path, "inactive"), ROOT]))}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=T, env=env)
    assert "MONARCH_RDMA_DEVICE=mlx5_9 names none of this host's devices (fake_mlx5_0)" in done.stdout, done.stderr
    bad = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=T,
                         env={**env, "MONARCH_RDMA_DEVICE": "mlx5_0:x"})
    assert bad.returncode != 0 and "MONARCH_RDMA_DEVICE='mlx5_0:x' is not valid" in bad.stderr, bad.stderr


def real_pyverbs(where: Path) -> list[Path]:
    """What PYTHONPATH needs for rdma-core's pyverbs (nothing when the venv imports it); skip without it."""
    if importlib.util.find_spec("pyverbs") is not None:
        return []
    suffix = str(importlib.machinery.EXTENSION_SUFFIXES[0])
    if not (SYSTEM_PYVERBS / f"device{suffix}").exists():
        pytest.skip(f"rdma-core's pyverbs for this python ({SYSTEM_PYVERBS}/device{suffix}) is not installed: "
                    "apt-get install python3-pyverbs (the cluster tier's packages)")
    (where / "pyverbs").symlink_to(SYSTEM_PYVERBS)
    return [where]


def test_emulated_device_moves_the_bytes(tmp_path: Path) -> None:
    """The verbs backend end to end against an emulated device (EMULATED below): discovery picks the RoCE v2
    GID, the queue pairs connect through the owner's door, large transfers register the caller's memory in
    chunks, small ones bounce, a failed completion names both ends and the next transfer connects anew."""
    # one host: auto would pick cross-memory attach, so the emulated device is asked for by name
    out = run_check([EMULATED], "emulated", {"EMULATED_VERBS_DIR": str(tmp_path), "MONARCH_RDMA_BACKEND": "ibverbs"})
    assert "worker read via ibverbs" in out and "worker wrote via ibverbs" in out and "reconnected" in out, out


def test_real_pyverbs(tmp_path: Path) -> None:
    """rdma-core's pyverbs: on a host without a device the same fallback; with one, the transfer takes ibverbs."""
    out = run_check(real_pyverbs(tmp_path), "real")
    assert "worker read via" in out, out


# -- the check, run as a script in a subprocess ---------------------------------------------------------
class Peer(Actor):
    """A worker that reads a large and a small buffer (the verbs backend's two paths: the caller's memory
    registered, and the staging buffer), and writes into the large one."""

    @endpoint
    def read(self, large: RDMABuffer, small: RDMABuffer) -> tuple[torch.Tensor, torch.Tensor, str, str]:
        got = torch.empty(large.size() // 4, dtype=torch.int32), torch.empty(small.size() // 4, dtype=torch.int32)
        large.read_into(got[0]).get(timeout=T)
        small.read_into(got[1]).get(timeout=T)
        return *got, large.backend, get_rdma_backend()

    @endpoint
    def write(self, buf: RDMABuffer, value: int) -> str:
        buf.write_from(torch.full((buf.size() // 4,), value, dtype=torch.int32)).get(timeout=T)
        return buf.backend

    @endpoint
    def read_fails(self, buf: RDMABuffer) -> str:
        try:
            buf.read_into(torch.empty(buf.size(), dtype=torch.uint8)).get(timeout=T)
        except TransportError as e:
            return str(e)
        return "no error"


def check(expect: str) -> None:
    """`expect`: what why_not() says (no device), "real": whatever rdma-core finds on this host, or
    "emulated": the emulated device, with a failed transfer and the connection made again after it."""
    from monarch.runtime.engine.transport import verbs
    found = verbs.device() is not None
    assert expect in ("real", "emulated") or (not found and expect in verbs.why_not()), verbs.why_not()
    assert expect != "emulated" or found, verbs.why_not()
    device = verbs.device()
    print("device:", device.port if device is not None else verbs.why_not())
    network = "ibverbs" if found else "tcp"
    assert get_rdma_backend() == network and is_rdma_available(), get_rdma_backend()
    data = torch.arange(300_000, dtype=torch.int32)  # larger than the verbs backend's staging buffer
    buf, small = RDMABuffer(data), RDMABuffer(data[100:104])
    assert buf.backend == "local", buf.backend
    with this_host().spawn_procs(per_host={"gpus": 1}, name="verbs_check") as procs:
        peer = procs.spawn("peer", Peer)
        whole, part, via, theirs = peer.read.call_one(buf, small).get(timeout=T)
        assert torch.equal(whole, data) and torch.equal(part, data[100:104]), (whole[:8], part)
        assert theirs == network and via == ("ibverbs" if expect == "emulated" else "shm"), (via, theirs)
        print("worker read via", via)
        via = peer.write.call_one(buf, 7).get(timeout=T)
        assert bool((data == 7).all()), data[:8]
        print("worker wrote via", via)
        if expect == "emulated":
            after_a_failure(peer, buf, small, data)
    buf.drop().get(timeout=T)
    if expect != "emulated":
        small.drop().get(timeout=T)
    print("verbs check ok", flush=True)


def after_a_failure(peer: ActorMesh[Peer], buf: RDMABuffer, small: RDMABuffer, data: torch.Tensor) -> None:
    """A read of a dropped buffer fails naming both ends; the queue pairs it broke are replaced by the next
    transfer's (one left at each end)."""
    small.drop().get(timeout=T)
    error = peer.read_fails.call_one(small).get(timeout=T)
    assert "completed with status remote access error" in error and "and the controller" in error, error
    whole, part, via, _ = peer.read.call_one(buf, buf).get(timeout=T)
    assert torch.equal(whole, data) and torch.equal(part, data) and via == "ibverbs", via
    queue_pairs = sorted(p.name.split("-")[1] for p in Path(os.environ["EMULATED_VERBS_DIR"]).glob("qp-*"))
    assert len(queue_pairs) == 2 and str(os.getpid()) in queue_pairs, queue_pairs
    print("reconnected after", error)


if __name__ == "__main__":
    check(sys.argv[1])
