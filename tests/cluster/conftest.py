"""The cluster tier's test hosts: one testbed (network namespaces with sshd and Slurm) for the session.

Tests that use it, and every test of this folder, are marked `cluster` (`make test-cluster` runs them, `make test`
leaves them out); without root (or the Debian packages) those on the test hosts skip with one line. MPICH moves
data over its OFI netmod in this tier, so that bytes between ranks of different hosts cross the veths.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from testbed import Testbed, can_run, can_slurm

TIER_ENV = {"MPIR_CVAR_CH4_NETMOD": "ofi"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test of this folder (launchers: ssh, Slurm, attach agents, Kubernetes) and every test that uses the
    test hosts belongs to the cluster tier."""
    here = Path(__file__).resolve().parent
    for item in items:
        if "testbed" in getattr(item, "fixturenames", ()) or here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.cluster)


@pytest.fixture(scope="session")
def testbed() -> Iterator[Testbed]:
    why = can_run()
    if why:
        pytest.skip(f"cluster tier: {why}")
    bed = Testbed(slurm=not can_slurm()).up()
    saved = {k: os.environ.get(k) for k in [*bed.env, *TIER_ENV]}
    os.environ.update(bed.env | TIER_ENV)
    try:
        yield bed
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        bed.down()


@pytest.fixture
def slurm(testbed: Testbed) -> Testbed:
    if not testbed.slurm:
        pytest.skip(f"cluster tier: {can_slurm()}")
    return testbed
