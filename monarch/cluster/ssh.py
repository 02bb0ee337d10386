"""Meshes over hosts reached by ssh: one MPI job whose ranks MPICH's Hydra starts on each host with ssh.

The ssh command is MONARCH_SSH (e.g. `ssh -F ~/cluster.conf`); Hydra runs one executable, so a command
with arguments gets a small wrapper script in a private directory. Hydra's proxies dial back the address
of the interface that the advertised address belongs to (`-iface`), not this host's name. Every host
needs the same Python environment at the same path (the usual MPI assumption) or sync_workspace for code.
"""
from __future__ import annotations

import atexit
import os
import shlex
import shutil
import signal
import subprocess
import tempfile

from monarch import config
from monarch.cluster import net
from monarch.errors import SpawnError
from monarch.runtime.control import launch
from monarch.shape import Shape

_wrappers: dict[str, str] = {}  # ssh command line -> its wrapper script


def ssh_executable(command: str) -> str:
    """An executable that runs `command` with Hydra's arguments appended (`ssh -x host cmd...`)."""
    words = shlex.split(command)
    if not words:
        raise SpawnError("MONARCH_SSH is empty; set it to an ssh command, e.g. `ssh -F ~/cluster.conf`")
    if len(words) == 1:
        found = shutil.which(words[0])
        if not found:
            raise SpawnError(f"ssh command {words[0]!r} (MONARCH_SSH) is not on PATH; install openssh-client or "
                             "set MONARCH_SSH to the ssh to use")
        return found
    if command not in _wrappers:
        folder = tempfile.mkdtemp(prefix="monarch-ssh-")
        atexit.register(shutil.rmtree, folder, True)
        path = os.path.join(folder, "ssh")
        with open(path, "w") as f:
            f.write(f"#!/bin/sh\nexec {shlex.join(words)} \"$@\"\n")
        os.chmod(path, 0o700)
        _wrappers[command] = path
    return _wrappers[command]


def hydra_iface(advertise: str, route: str) -> list[str]:
    """`-iface NAME`: MONARCH_IFACE, else the interface of the advertised address, else that of the route to
    the hosts (for an advertised loopback or another machine's address); none if neither is on one here."""
    name = config.iface() or ("" if net.is_loopback(advertise) else net.iface_of(advertise)) or net.iface_of(route)
    return ["-iface", name] if name else []


class SshLauncher:
    """Ranks on `hosts`, started by Hydra over ssh; host i runs ranks i*k .. i*k+k-1."""
    local = False
    kill_signal = signal.SIGKILL  # the ssh sessions end with mpiexec; each host's proxy then kills its ranks

    def __init__(self, hosts: list[str]) -> None:
        self.hosts = list(hosts)

    def route(self) -> str:
        return net.route_to(self.hosts[0])

    def command(self, shape: Shape, worker: list[str], advertise: str) -> list[str]:
        per_host = len(shape) // len(self.hosts)
        return [launch.find_mpiexec(), "-n", str(len(shape)), "-hosts", ",".join(self.hosts), "-ppn",
                str(per_host), "-launcher", "ssh", "-launcher-exec", ssh_executable(config.ssh()),
                *hydra_iface(advertise, self.route()), *worker]

    def start(self, cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        return launch.start(cmd, env)

    def hand_over(self, token: str, directory: str, per_host: int) -> None:
        """One ssh per host, at once: the token on stdin, `launch.token_script` writes its ranks' files."""
        ssh = ssh_executable(config.ssh())
        runs = {h: subprocess.Popen([ssh, h, launch.token_script(directory, " ".join(
                    str(i * per_host + j) for j in range(per_host)))], stdin=subprocess.PIPE,
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for i, h in enumerate(self.hosts)}
        for host, run in runs.items():
            try:
                _, err = run.communicate(token.encode(), timeout=config.spawn_timeout())
            except subprocess.TimeoutExpired:
                run.kill()
                run.wait()
                err = b"timed out (MONARCH_SPAWN_TIMEOUT)"
            if run.returncode:
                raise SpawnError(f"could not reach host {host!r} with `{config.ssh()} {host}` (MONARCH_SSH) to hand "
                                 f"over the mesh token: {err.decode(errors='replace').strip()}; check that "
                                 f"`{config.ssh()} {host} true` works without a prompt")

    def release(self) -> None:
        return None  # nothing is held between meshes

    def subset(self, hosts: list[str]) -> SshLauncher:
        return SshLauncher(hosts)
