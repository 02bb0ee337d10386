"""One-sided transfers with Meta Monarch's API: `RDMABuffer`, `RDMAAction`, and what this process can use.

Backends are chosen per transfer (runtime/engine/transport/onesided.py): ibverbs through pyverbs where both
ends have an RDMA device, cross-memory attach between processes of one host, TCP otherwise (with a warning).
"""
from __future__ import annotations

from monarch.rdma.buffer import LocalMemory, RDMAAction, RDMABuffer
from monarch.runtime.engine.transport import verbs
from monarch.runtime.engine.transport.onesided import (RDMAReadTransferWarning, RDMAWriteTransferWarning,
                                                       network_backend)


def get_rdma_backend() -> str:
    """What carries transfers between hosts from this process: 'ibverbs' with an RDMA device, else 'tcp'
    (the fallback; 'none' when MONARCH_RDMA_ALLOW_TCP_FALLBACK=0). Processes of one host always use
    cross-memory attach; `RDMABuffer.backend` tells the path to one buffer's owner."""
    return network_backend()


def is_ibverbs_available() -> bool:
    """Whether this process has an RDMA device that transfers can use (pyverbs finds one with an active port)."""
    return verbs.device() is not None


def is_rdma_available() -> bool:
    """Whether RDMABuffer transfers work from this process: with an RDMA device, or through the TCP fallback."""
    return network_backend() != "none"


__all__ = ["LocalMemory", "RDMAAction", "RDMABuffer", "RDMAReadTransferWarning", "RDMAWriteTransferWarning",
           "get_rdma_backend", "is_ibverbs_available", "is_rdma_available"]
