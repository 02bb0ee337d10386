"""Helpers for tests that look at processes: the workers a controller started, and a controller run as a
separate process. Imported by name (`from processes import ...`); tests/conftest.py uses them too."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path


def owned_processes(owner: int) -> dict[int, str]:
    """pid -> command line of live processes started for controller `owner`."""
    mark = f"--owner\0{owner}\0"
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().decode(errors="replace")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if mark in cmd and state != "Z":
            found[int(d.name)] = cmd.replace("\0", " ")
    return found


def run_script(body: str) -> subprocess.Popen:
    """Run `body` (dedented) as a separate controller process, its stdout piped back as text."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(body)], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ))


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd) if fd.is_symlink() else ""
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                raw, port = fields[1].split(":")
                packed = bytes.fromhex(raw)
                packed = b"".join(packed[i:i + 4][::-1] for i in range(0, len(packed), 4))  # little-endian words
                found.append((socket.inet_ntop(family, packed), int(port, 16)))
    return found
