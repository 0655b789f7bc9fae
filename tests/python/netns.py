"""Hosts simulated on this machine for multi-host tests: network namespaces with an sshd each, cabled to a
switch namespace (a bridge), and a launcher namespace that plays the machine jobs are started from.

Each host namespace has an sshd (keys made by the test) and interface `NIC`, the same name everywhere as on
a real cluster, with an address from 198.51.100.0/25. The launcher is where the test runs rvodrun, ssh,
mpirun, "localhost" ranks and rvod.run drivers (`launch_args`); it also has `LAUNCHER_ONLY_NIC`, which no
host has. `ssh_config` maps host names to addresses (rvodrun reads it through RVOD_SSH_CONFIG_FILE).

Why a launcher namespace: documentation-range addresses may exist only inside namespaces a test made,
never in the root namespace, so issue 12's "jobs started from the host namespace" run in this test-made
namespace instead, the accepted substitute. Nothing is added to the root namespace (veth pairs are made
with both ends inside test namespaces), the root namespace sends nothing to these addresses (sshd
readiness is read from /proc), and no namespace routes beyond 198.51.100.0/24. `ip netns exec` execs its
command, so signals reach the launched process itself.

`close()` kills every process in the namespaces and deletes them; the fixture's finaliser and atexit both
call it, and while a cluster exists SIGTERM raises KeyboardInterrupt so that they run (only SIGKILL leaves
namespaces behind). Names carry the test's pid, so checkouts can run side by side. `skip_reason()` says why
a machine cannot make these hosts.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

SSHD = "/usr/sbin/sshd"
# The interface each host and the launcher has on the switch, and one only the launcher has.
NIC = "rvnet0"
LAUNCHER_ONLY_NIC = "rvonly0"
_SUBNET = ipaddress.ip_network("198.51.100.0/25")
_LAUNCHER_ONLY_ADDRESS = "198.51.100.129/25"
LAUNCHER = "launcher"
# Where sshd separates privileges (Debian's package makes it at boot, a container may not have it).
_PRIVSEP_DIR = Path("/run/sshd")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if check and done.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done


def skip_reason() -> str | None:
    """Why namespaced hosts cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "multi-host tests make network namespaces, which needs root"
    for tool in ("ip", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"multi-host tests need {tool!r} (iproute2, openssh-client)"
    if not Path(SSHD).exists():
        return f"multi-host tests need an sshd at {SSHD} (openssh-server; scripts/setup-system.sh installs it)"
    probe = f"rvh{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot make a network namespace (`ip netns add` failed: {made.stderr.strip()})"
    try:
        for what, args in (("a bridge", ("bridge", "type", "bridge")),
                           ("a veth pair", ("v0", "type", "veth", "peer", "name", "v1"))):
            made = _ip("-n", probe, "link", "add", *args, check=False)
            if made.returncode != 0:
                return f"cannot make {what} in a network namespace (`ip link add` failed: {made.stderr.strip()})"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def namespace_pids(namespace: str) -> set[int]:
    """Processes in network namespace `namespace`."""
    return {int(pid) for pid in _ip("netns", "pids", namespace, check=False).stdout.split()}


class Cluster:
    """Namespaced hosts named `names`, reachable as those names over ssh from the launcher namespace (see
    the module doc)."""

    def __init__(self, names: list[str], mounts: dict[str, list[tuple[Path, Path]]] | None = None,
                 ports: dict[str, int] | None = None):
        """`mounts`: per host, (source, target) bind mounts that only its sshd's sessions see (a directory
        hidden under an empty one, a program replaced), to simulate a host set up differently. `ports`: hosts
        whose sshd listens on another port than 22 (the ssh configuration says so)."""
        if LAUNCHER in names:
            raise ValueError(f"{LAUNCHER!r} names the launcher namespace; call the host something else")
        self.mounts = mounts or {}
        self.ports = {name: (ports or {}).get(name, 22) for name in names}
        tag = f"rvh{os.getpid()}"
        self.names = list(names)
        self.switch = f"{tag}-switch"
        self.namespaces = {name: f"{tag}-{name}" for name in [LAUNCHER, *names]}
        addresses = [str(address) for address in _SUBNET.hosts()]
        self.launcher_address = addresses[0]
        self.addresses = {name: addresses[index + 1] for index, name in enumerate(names)}
        # On the subnet, but no namespace has it: ssh to it gets no answer.
        self.unused_address = addresses[-1]
        self.sshds: dict[str, subprocess.Popen[bytes]] = {}
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{tag}-hosts-"))
        self.ssh_config = self.workdir / "ssh_config"
        self._made: list[str] = []
        self._closed = False
        atexit.register(self.close)
        self._previous_sigterm = None
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            self._previous_sigterm = signal.signal(signal.SIGTERM, _interrupt)
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------------------------------- setup

    def _add_namespace(self, namespace: str) -> None:
        _ip("netns", "add", namespace)
        self._made.append(namespace)
        _ip("-n", namespace, "link", "set", "lo", "up")

    def _cable(self, index: int, namespace: str, address: str) -> None:
        """A veth pair from port `index` of the switch's bridge to `NIC` in `namespace`, with `address`."""
        port = f"port{index}"
        _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", NIC, "netns", namespace)
        _ip("-n", self.switch, "link", "set", port, "master", "bridge", "up")
        _ip("-n", namespace, "addr", "add", f"{address}/{_SUBNET.prefixlen}", "dev", NIC)
        _ip("-n", namespace, "link", "set", NIC, "up")

    def _make(self) -> None:
        key = self.workdir / "id_ed25519"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True, timeout=30)
        (self.workdir / "authorized_keys").write_text((self.workdir / "id_ed25519.pub").read_text())
        _PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
        self._add_namespace(self.switch)
        _ip("-n", self.switch, "link", "add", "bridge", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "bridge", "up")
        launcher = self.namespaces[LAUNCHER]
        self._add_namespace(launcher)
        self._cable(0, launcher, self.launcher_address)
        _ip("-n", launcher, "link", "add", LAUNCHER_ONLY_NIC, "type", "veth", "peer", "name", f"{LAUNCHER_ONLY_NIC}p")
        _ip("-n", launcher, "addr", "add", _LAUNCHER_ONLY_ADDRESS, "dev", LAUNCHER_ONLY_NIC)
        for link in (LAUNCHER_ONLY_NIC, f"{LAUNCHER_ONLY_NIC}p"):
            _ip("-n", launcher, "link", "set", link, "up")
        known_hosts = []
        for index, name in enumerate(self.names, start=1):
            namespace, address = self.namespaces[name], self.addresses[name]
            self._add_namespace(namespace)
            self._cable(index, namespace, address)
            host_key = self.workdir / f"host_key_{name}"
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(host_key)], check=True,
                           timeout=30)
            public = (self.workdir / f"host_key_{name}.pub").read_text().split()
            listed = address if self.ports[name] == 22 else f"[{address}]:{self.ports[name]}"
            known_hosts.append(f"{listed} {public[0]} {public[1]}")
            config = self.workdir / f"sshd_config_{name}"
            config.write_text(
                f"ListenAddress {address}\nPort {self.ports[name]}\nHostKey {host_key}\nPidFile none\n"
                f"AuthorizedKeysFile {self.workdir / 'authorized_keys'}\nPermitRootLogin prohibit-password\n"
                "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
                "PrintMotd no\nLogLevel ERROR\nMaxStartups 100\n"
            )
            sshd = [SSHD, "-D", "-e", "-f", str(config)]
            if self.mounts.get(name):
                binds = " && ".join(f"mount --bind {source} {target}" for source, target in self.mounts[name])
                sshd = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                        f"{binds} && exec {' '.join(sshd)}"]
            with open(self.workdir / f"sshd_{name}.log", "wb") as log:
                self.sshds[name] = subprocess.Popen(self.exec_args(name, sshd), stdin=subprocess.DEVNULL,
                                                    stdout=subprocess.DEVNULL, stderr=log)
        (self.workdir / "known_hosts").write_text("\n".join(known_hosts) + "\n")
        lines = []
        for name in self.names:
            lines += [f"Host {name}", f"    HostName {self.addresses[name]}", f"    Port {self.ports[name]}"]
        lines += [f"Host {self.unused_address} unreachable", f"    HostName {self.unused_address}"]
        lines += ["Host *", "    User root", f"    IdentityFile {key}", "    IdentitiesOnly yes",
                  f"    UserKnownHostsFile {self.workdir / 'known_hosts'}", "    GlobalKnownHostsFile /dev/null",
                  "    StrictHostKeyChecking yes", "    LogLevel ERROR"]
        self.ssh_config.write_text("\n".join(lines) + "\n")
        for name in self.names:
            self._wait_for_sshd(name)

    def _wait_for_sshd(self, name: str, timeout: float = 20.0) -> None:
        """Waits until host `name`'s sshd listens, reading its namespace's TCP table from /proc."""
        deadline = time.monotonic() + timeout
        sshd = self.sshds[name]
        inode = os.stat(f"/run/netns/{self.namespaces[name]}").st_ino
        while True:
            if sshd.poll() is not None:
                log = (self.workdir / f"sshd_{name}.log").read_text(errors="replace")
                raise RuntimeError(f"sshd of host {name} exited: {log}")
            try:
                # Until `ip netns exec` has entered the namespace, the process shows the root namespace's table.
                if os.stat(f"/proc/{sshd.pid}/ns/net").st_ino == inode and \
                        self.ports[name] in _listening_ports(Path(f"/proc/{sshd.pid}/net/tcp").read_text()):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd of host {name} did not listen within {timeout} s")
            time.sleep(0.05)

    # ------------------------------------------------------------------------------------------- use

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """`base` with rvodrun told to reach the hosts through this cluster's ssh configuration."""
        return {**base, "RVOD_SSH_CONFIG_FILE": str(self.ssh_config)}

    def exec_args(self, name: str, args: list[str]) -> list[str]:
        """A command line that runs `args` inside the namespace of host `name` (or of the launcher)."""
        return ["ip", "netns", "exec", self.namespaces[name], *args]

    def launch_args(self, args: list[str]) -> list[str]:
        """A command line that runs `args` in the launcher namespace, where jobs are started from."""
        return self.exec_args(LAUNCHER, args)

    def pids(self, name: str) -> set[int]:
        """Processes in the namespace of host `name` (or of the launcher), other than the host's sshd
        listener."""
        pids = namespace_pids(self.namespaces[name])
        sshd = self.sshds.get(name)
        return pids if sshd is None else pids - {sshd.pid} - _children(sshd.pid)

    def stray_processes(self) -> dict[str, list[str]]:
        """namespace -> command lines of processes still running there (besides the hosts' sshds), for the
        launcher and every host."""
        found = {}
        for name in [LAUNCHER, *self.names]:
            commands = []
            for pid in self.pids(name):
                try:
                    commands.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
                except OSError:
                    pass
            if commands:
                found[name] = commands
        return found

    def wait_until_empty(self, timeout: float = 15.0) -> dict[str, list[str]]:
        """Waits for every namespace to be free of job processes; returns what is still there."""
        deadline = time.monotonic() + timeout
        while True:
            stray = self.stray_processes()
            if not stray or time.monotonic() > deadline:
                return stray
            time.sleep(0.1)

    # ------------------------------------------------------------------------------------------- teardown

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # A dying process's parent may still fork (an sshd starting a session): kill until none is left.
        for _ in range(10):
            pids = set().union(*(namespace_pids(namespace) for namespace in self._made))
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        for sshd in self.sshds.values():
            if sshd.poll() is None:
                sshd.kill()
            sshd.wait()
        for namespace in reversed(self._made):
            _ip("netns", "del", namespace, check=False)
        shutil.rmtree(self.workdir, ignore_errors=True)
        if self._previous_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_sigterm)


def _interrupt(signum: int, _frame) -> None:
    """SIGTERM while namespaces exist: unwind as Ctrl-C does, so the fixture's finaliser and atexit run."""
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def _listening_ports(table: str) -> set[int]:
    """The ports in LISTEN state in a /proc/net/tcp table."""
    ports = set()
    for line in table.splitlines()[1:]:
        fields = line.split()
        if len(fields) > 3 and fields[3] == "0A":
            ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _children(pid: int) -> set[int]:
    """`pid`'s direct children (`ip netns exec` runs sshd as its child when it cannot exec in place)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return set()
    return {int(child) for child in text.split()}
