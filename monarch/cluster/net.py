"""Addresses for meshes that span hosts: which local address reaches a host, and on which interface.

The controller advertises to remote workers the local end of the route to their first host, so that
nobody has to know it; MPICH's Hydra is told the interface of that address (`-iface`), so that its
proxies on the other hosts dial an address they can reach rather than this host's name.
"""
from __future__ import annotations

import fcntl
import socket
import struct

from monarch.errors import SpawnError

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def resolve(host: str) -> str:
    """The IPv4 address of `host` (a name or an address)."""
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror as e:
        raise SpawnError(f"cannot resolve host {host!r}: {e}; check its name (DNS or /etc/hosts)") from None


def route_to(host: str) -> str:
    """This host's address on the route to `host` (the kernel's routing table decides; nothing is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((resolve(host), 9))
        except OSError as e:
            raise SpawnError(f"no route to host {host!r}: {e}; set MONARCH_ADVERTISE to an address of this "
                             "host that it reaches") from None
        return s.getsockname()[0]


def iface_of(address: str) -> str:
    """The name of the interface that holds IPv4 `address`, or "" when none does (a wildcard, a NAT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                res = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue  # no IPv4 address on this interface
            if socket.inet_ntoa(res[20:24]) == address:
                return name
    return ""


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")
