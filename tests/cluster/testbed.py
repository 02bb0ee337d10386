"""Test hosts for the cluster tier: Linux network namespaces on a private bridge, each with its own
hostname (a UTS namespace), a real OpenSSH sshd and, on request, a real Slurm (slurmctld on the bridge
address, one slurmd per host, munge for authentication). Everything it creates it removes in `down()`,
which is idempotent and also clears what a crashed earlier run left. Needs root.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

BRIDGE = "mbr0"
SUBNET = "10.77.0"
GATEWAY = f"{SUBNET}.1"  # the controller's address on the bridge
MARK = "# monarch-testbed"  # tags the /etc/hosts lines this module adds
SLURMCTLD_HOST = "mctl"


def sh(*cmd: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=timeout)


def can_run() -> str:
    """Why the testbed cannot run here ("" when it can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, sshd, slurmd)"
    for tool in ("ip", "unshare", "nsenter", "/usr/sbin/sshd", "ssh-keygen", "ssh"):
        if not shutil.which(tool):
            return f"{tool} is not installed (apt-get install iproute2 util-linux openssh-server openssh-client)"
    return ""


def can_slurm() -> str:
    for tool in ("/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged", "srun", "salloc"):
        if not shutil.which(tool):
            return f"{tool} is not installed (apt-get install slurm-wlm munge)"
    return ""


@dataclass
class Testbed:
    __test__ = False  # not a test class, whatever pytest thinks of its name
    names: tuple[str, ...] = ("mh1", "mh2", "mh3")
    slurm: bool = True
    dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="monarch-testbed-")))
    daemons: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def address(self, name: str) -> str:
        return f"{SUBNET}.{11 + self.names.index(name)}"

    def veth(self, name: str) -> str:
        return f"mv{self.names.index(name) + 1}"

    @property
    def ssh_command(self) -> str:
        """What MONARCH_SSH is set to: ssh with this testbed's client config."""
        return f"ssh -F {self.dir / 'ssh_config'}"

    @property
    def env(self) -> dict[str, str]:
        """Variables a controller process needs to use the testbed."""
        env = {"MONARCH_SSH": self.ssh_command}
        if self.slurm:
            env["SLURM_CONF"] = str(self.dir / "slurm.conf")
        return env

    # -- bring up ----------------------------------------------------------------------------------
    def up(self) -> Testbed:
        try:
            self._network()
            self._sshd()
            if self.slurm:
                self._slurm()
        except BaseException:
            self.down()
            raise
        return self

    def _network(self) -> None:
        sh("ip", "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "addr", "add", f"{GATEWAY}/24", "dev", BRIDGE)
        sh("ip", "link", "set", BRIDGE, "up")
        lines = [f"{GATEWAY} {SLURMCTLD_HOST} {MARK}"]
        for n in self.names:
            sh("ip", "netns", "add", n)
            sh("ip", "link", "add", self.veth(n), "type", "veth", "peer", "name", "eth0", "netns", n)
            sh("ip", "link", "set", self.veth(n), "master", BRIDGE, "up")
            sh("ip", "netns", "exec", n, "ip", "addr", "add", f"{self.address(n)}/24", "dev", "eth0")
            sh("ip", "netns", "exec", n, "ip", "link", "set", "eth0", "up")
            sh("ip", "netns", "exec", n, "ip", "link", "set", "lo", "up")
            sh("ip", "netns", "exec", n, "ip", "route", "add", "default", "via", GATEWAY)
            lines.append(f"{self.address(n)} {n} {MARK}")
        with open("/etc/hosts", "a") as f:
            f.write("".join(line + "\n" for line in lines))

    def _in_host(self, name: str, command: str, log: str) -> subprocess.Popen[bytes]:
        """Start `command` inside host `name`: its network namespace and a UTS namespace with its hostname
        (nsenter, not `ip netns exec`, which would mount a /sys without the cgroup tree slurmd wants)."""
        out = open(self.dir / log, "wb")
        proc = subprocess.Popen(["nsenter", f"--net=/run/netns/{name}", "unshare", "--uts", "sh", "-c",
                                 f"hostname {name} && exec {command}"], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        self.daemons.append(proc)
        return proc

    def _sshd(self) -> None:
        d = self.dir
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "host_key"))
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "id"))
        shutil.copy(d / "id.pub", d / "authorized_keys")
        (d / "sshd_config").write_text(
            f"HostKey {d}/host_key\nAuthorizedKeysFile {d}/authorized_keys\nPermitRootLogin prohibit-password\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
            f"PidFile none\nAcceptEnv *\nPermitUserEnvironment no\nListenAddress 0.0.0.0:22\n")
        (d / "ssh_config").write_text(
            f"Host *\n  IdentityFile {d}/id\n  IdentitiesOnly yes\n  StrictHostKeyChecking no\n"
            "  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n  BatchMode yes\n  User root\n  ConnectTimeout 5\n")
        Path("/run/sshd").mkdir(exist_ok=True)
        for n in self.names:
            self._in_host(n, f"/usr/sbin/sshd -D -e -f {d}/sshd_config", f"sshd-{n}.log")
        for n in self.names:
            wait_port(self.address(n), 22)

    def _slurm(self) -> None:
        d = self.dir
        (d / "munge.key").write_bytes(os.urandom(1024))
        os.chmod(d / "munge.key", 0o600)
        for sub in ("state", "spool", "munge", *(f"spool/{n}" for n in self.names)):
            (d / sub).mkdir()
        os.chmod(d / "munge", 0o700)
        self.daemons.append(subprocess.Popen(
            ["/usr/sbin/munged", "-F", "--force", f"--key-file={d}/munge.key", f"--socket={d}/munge/socket",
             f"--pid-file={d}/munge/pid", f"--log-file={d}/munge/log", f"--seed-file={d}/munge/seed"],
            stdout=open(d / "munged.out", "wb"), stderr=subprocess.STDOUT, start_new_session=True))
        wait_path(d / "munge" / "socket")
        (d / "slurm.conf").write_text(self._slurm_conf())
        self._in_host_root(f"/usr/sbin/slurmctld -D -f {d}/slurm.conf", "slurmctld.out")
        wait_port(GATEWAY, 6817)
        for n in self.names:
            self._in_host(n, f"/usr/sbin/slurmd -D -N {n} -f {d}/slurm.conf", f"slurmd-{n}.out")
        env = dict(os.environ, SLURM_CONF=str(d / "slurm.conf"))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            out = subprocess.run(["sinfo", "-h", "-o", "%T", "-N"], capture_output=True, text=True, env=env).stdout
            states = out.split()
            if len(states) == len(self.names) and all(s == "idle" for s in states):
                return
            time.sleep(0.3)
        raise RuntimeError(f"slurmd nodes not idle after 60 s: {out!r}\n{self.logs()}")

    def _in_host_root(self, command: str, log: str) -> None:
        """slurmctld runs in this network namespace, under its own hostname (what SlurmctldHost names)."""
        self.daemons.append(subprocess.Popen(
            ["unshare", "--uts", "sh", "-c", f"hostname {SLURMCTLD_HOST} && exec {command}"],
            stdout=open(self.dir / log, "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True))

    def _slurm_conf(self) -> str:
        d = self.dir
        nodes = "".join(f"NodeName={n} NodeAddr={self.address(n)} CPUs=4 RealMemory=1000 State=UNKNOWN\n"
                        for n in self.names)
        return (f"ClusterName=monarchtest\nSlurmctldHost={SLURMCTLD_HOST}({GATEWAY})\nSlurmUser=root\n"
                f"SlurmdUser=root\nAuthType=auth/munge\nCredType=cred/munge\nAuthInfo=socket={d}/munge/socket\n"
                f"StateSaveLocation={d}/state\nSlurmdSpoolDir={d}/spool/%n\nSlurmctldPidFile={d}/slurmctld.pid\n"
                f"SlurmdPidFile={d}/slurmd.%n.pid\nSlurmctldLogFile={d}/slurmctld.log\n"
                f"SlurmdLogFile={d}/slurmd.%n.log\nProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
                "JobAcctGatherType=jobacct_gather/none\nAccountingStorageType=accounting_storage/none\n"
                "SwitchType=switch/none\nMpiDefault=none\nSchedulerType=sched/builtin\n"
                "SelectType=select/cons_tres\nSelectTypeParameters=CR_Core\nReturnToService=2\n"
                "SlurmdParameters=config_overrides\nSlurmctldPort=6817\nSlurmdPort=6818\nSlurmdTimeout=30\n"
                "InactiveLimit=0\nKillWait=2\nMinJobAge=5\nSlurmctldDebug=info\nSlurmdDebug=info\n"
                f"{nodes}PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE\n")

    # -- tear down ---------------------------------------------------------------------------------
    def down(self) -> None:
        """Remove everything: processes in the hosts, daemons, namespaces, the bridge, /etc/hosts lines, files."""
        for n in self.names:
            pids = sh("ip", "netns", "pids", n, check=False).stdout.split()
            for pid in pids:
                with _quiet():
                    os.kill(int(pid), 9)
        for proc in self.daemons:
            with _quiet():
                os.killpg(proc.pid, 9)
            with _quiet():
                proc.wait(timeout=5)
        self.daemons.clear()
        for n in self.names:
            sh("ip", "netns", "del", n, check=False)
        sh("ip", "link", "del", BRIDGE, check=False)
        try:
            kept = [ln for ln in Path("/etc/hosts").read_text().splitlines(keepends=True) if MARK not in ln]
            Path("/etc/hosts").write_text("".join(kept))
        except OSError:
            pass
        shutil.rmtree(self.dir, ignore_errors=True)

    def logs(self, lines: int = 15) -> str:
        """The last lines of every daemon's log, for an error message."""
        parts = []
        for f in sorted([*self.dir.glob("*.out"), *self.dir.glob("*.log")]):
            tail = f.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {f.name}\n" + "\n".join(tail))
        return "\n".join(parts)

    # -- what tests look at ------------------------------------------------------------------------
    def veth_bytes(self) -> int:
        """Bytes that crossed the hosts' veths (both directions), from the kernel's counters."""
        total = 0
        for n in self.names:
            stats = Path(f"/sys/class/net/{self.veth(n)}/statistics")
            total += int((stats / "rx_bytes").read_text()) + int((stats / "tx_bytes").read_text())
        return total

    def exec(self, name: str, *cmd: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """Run a command inside host `name` (its namespace, not its UTS hostname)."""
        return sh("ip", "netns", "exec", name, *cmd, check=False, timeout=timeout)

    def pids(self, name: str) -> set[int]:
        return {int(p) for p in sh("ip", "netns", "pids", name, check=False).stdout.split()}

    def all_pids(self) -> set[int]:
        return set().union(*(self.pids(n) for n in self.names))

    def strays(self, keep: set[int] = frozenset(), timeout: float = 10.0) -> dict[int, str]:  # type: ignore[assignment]
        """Processes left in the hosts besides the daemons and `keep` (waits up to `timeout` s for them to go)."""
        daemons = {p.pid for p in self.daemons} | set(keep)
        deadline = time.monotonic() + timeout
        while True:
            left = {}
            for n in self.names:
                for pid in self.pids(n) - daemons:
                    try:
                        left[pid] = f"{n}: " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                    except OSError:
                        pass
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.1)

    def restart(self, name: str) -> None:
        """Start host `name`'s daemons again (after a test killed every process of it)."""
        for proc in [p for p in self.daemons if p.poll() is not None]:
            self.daemons.remove(proc)
        self._in_host(name, f"/usr/sbin/sshd -D -e -f {self.dir}/sshd_config", f"sshd-{name}.log")
        if self.slurm:
            self._in_host(name, f"/usr/sbin/slurmd -D -N {name} -f {self.dir}/slurm.conf", f"slurmd-{name}.out")
        wait_port(self.address(name), 22)

    def link(self, name: str, up: bool) -> None:
        """Cut host `name` off the network (or reconnect it): its veth goes down."""
        sh("ip", "link", "set", self.veth(name), "up" if up else "down")


class _quiet:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return exc[0] is not None and issubclass(exc[0], (OSError, subprocess.TimeoutExpired))  # type: ignore[arg-type]


def wait_port(host: str, port: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing listens on {host}:{port} after {timeout} s") from None
            time.sleep(0.1)


def wait_path(path: Path, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} did not appear in {timeout} s")
        time.sleep(0.05)
