"""Hosts simulated on this machine for multi-host tests: network namespaces with an sshd each, on a bridge.

`Cluster(names)` makes one namespace per name, joined by a bridge that lives in the test's own (host)
namespace with the first address of a free /28 taken from the documentation ranges 198.51.100.0/24 and
192.0.2.0/24 (a range this machine's own interfaces use, as 192.0.2.0/24 on some CI machines, is
skipped). Inside each namespace the interface has the bridge's name too, so one --network-interface name is valid on every host, as on a real cluster. Each namespace runs an sshd with a
host key and a root login key made by the test in a temporary directory; `ssh_config` maps the host names
to their addresses (rvodrun reads it through RVOD_SSH_CONFIG_FILE), with the host keys already known.

Everything is removed on `close()` (and at interpreter exit, whatever happened): processes left in the
namespaces are killed, the sshds stopped, the namespaces and the bridge deleted. Names include the pid,
so tests of several checkouts can run side by side; the /28 is chosen under a lock among those that no
interface of this machine already uses. `skip_reason()` says why a machine cannot run these tests.
"""

from __future__ import annotations

import atexit
import fcntl
import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

SSHD = "/usr/sbin/sshd"
_RANGES = (ipaddress.ip_network("198.51.100.0/24"), ipaddress.ip_network("192.0.2.0/24"))
_LOCK_FILE = "/tmp/rvod-test-netns.lock"
# Where sshd separates privileges (Debian's package makes it at boot, a container may not have it).
_PRIVSEP_DIR = Path("/run/sshd")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


def skip_reason() -> str | None:
    """Why namespaced hosts cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "multi-host tests make network namespaces, which needs root"
    for tool in ("ip", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"multi-host tests need {tool!r} (iproute2, openssh-client)"
    if not Path(SSHD).exists():
        return f"multi-host tests need an sshd at {SSHD} (openssh-server; scripts/setup-system.sh installs it)"
    probe = f"rvp{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot make a network namespace (`ip netns add` failed: {made.stderr.strip()})"
    _ip("netns", "del", probe, check=False)
    return None


def _used_networks() -> list[ipaddress.IPv4Network]:
    out = _ip("-4", "-o", "addr", "show").stdout
    networks = []
    for line in out.splitlines():
        fields = line.split()
        if "inet" in fields:
            networks.append(ipaddress.ip_interface(fields[fields.index("inet") + 1]).network)
    return networks


class Cluster:
    """Namespaced hosts named `names`, reachable as those names over ssh (see the module doc)."""

    def __init__(self, names: list[str], mounts: dict[str, list[tuple[Path, Path]]] | None = None,
                 ports: dict[str, int] | None = None):
        """`mounts`: per host, (source, target) bind mounts that only its sshd's sessions see (a directory
        hidden under an empty one, a program replaced), to simulate a host set up differently. `ports`: hosts
        whose sshd listens on another port than 22 (the ssh configuration says so)."""
        self.mounts = mounts or {}
        self.ports = {name: (ports or {}).get(name, 22) for name in names}
        self.tag = f"rv{os.getpid() % 100000}"
        self.bridge = f"{self.tag}br"
        self.names = list(names)
        self.namespaces = {name: f"{self.tag}{name}" for name in names}
        self.addresses: dict[str, str] = {}
        self.sshds: dict[str, subprocess.Popen[bytes]] = {}
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{self.tag}-hosts-"))
        self.ssh_config = self.workdir / "ssh_config"
        self.local_address = ""
        self._closed = False
        atexit.register(self.close)
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------------------------------- setup

    def _pick_subnet(self) -> ipaddress.IPv4Network:
        used = _used_networks()
        for documentation_range in _RANGES:
            for subnet in documentation_range.subnets(new_prefix=28):
                if not any(subnet.overlaps(network) for network in used):
                    return subnet
        raise RuntimeError("no free /28 left in 198.51.100.0/24 or 192.0.2.0/24 for the test's namespaces")

    def _make(self) -> None:
        key = self.workdir / "id_ed25519"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True, timeout=30)
        (self.workdir / "authorized_keys").write_text((self.workdir / "id_ed25519.pub").read_text())
        _PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
        with open(_LOCK_FILE, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            subnet = self._pick_subnet()
            hosts = list(subnet.hosts())
            self.local_address = str(hosts[0])
            self.unused_address = str(hosts[-1])
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.local_address}/28", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        known_hosts = []
        for index, name in enumerate(self.names):
            namespace = self.namespaces[name]
            address = str(hosts[index + 1])
            self.addresses[name] = address
            outside = f"{self.tag}v{name}"
            _ip("netns", "add", namespace)
            _ip("link", "add", outside, "type", "veth", "peer", "name", f"{self.tag}p{name}")
            _ip("link", "set", f"{self.tag}p{name}", "netns", namespace)
            _ip("link", "set", outside, "master", self.bridge, "up")
            _ip("-n", namespace, "link", "set", f"{self.tag}p{name}", "name", self.bridge)
            _ip("-n", namespace, "addr", "add", f"{address}/28", "dev", self.bridge)
            _ip("-n", namespace, "link", "set", self.bridge, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
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
            self.sshds[name] = subprocess.Popen(
                ["ip", "netns", "exec", namespace, *sshd],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(self.workdir / f"sshd_{name}.log", "wb"),
            )
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
        deadline = time.monotonic() + timeout
        while True:
            if self.sshds[name].poll() is not None:
                log = (self.workdir / f"sshd_{name}.log").read_text(errors="replace")
                raise RuntimeError(f"sshd of host {name} exited: {log}")
            try:
                with socket.create_connection((self.addresses[name], self.ports[name]), timeout=1):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"sshd of host {name} did not listen within {timeout} s") from None
                time.sleep(0.05)

    # ------------------------------------------------------------------------------------------- use

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """`base` with rvodrun told to reach the hosts through this cluster's ssh configuration."""
        return {**base, "RVOD_SSH_CONFIG_FILE": str(self.ssh_config)}

    def exec_args(self, name: str, args: list[str]) -> list[str]:
        """A command line that runs `args` inside host `name`'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[name], *args]

    def pids(self, name: str) -> set[int]:
        """Processes in host `name`'s namespace, other than its sshd listener."""
        result = _ip("netns", "pids", self.namespaces[name], check=False)
        pids = {int(pid) for pid in result.stdout.split()}
        return pids - {self.sshds[name].pid} - _children(self.sshds[name].pid)

    def stray_processes(self) -> dict[str, list[str]]:
        """host -> command lines of processes still running in its namespace (besides its sshd)."""
        found = {}
        for name in self.names:
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
        for name, namespace in self.namespaces.items():
            result = _ip("netns", "pids", namespace, check=False)
            for pid in result.stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        for sshd in self.sshds.values():
            if sshd.poll() is None:
                sshd.kill()
            sshd.wait()
        for namespace in self.namespaces.values():
            _ip("netns", "del", namespace, check=False)
        _ip("link", "del", self.bridge, check=False)
        shutil.rmtree(self.workdir, ignore_errors=True)


def _children(pid: int) -> set[int]:
    """`pid`'s direct children (`ip netns exec` runs sshd as its child when it cannot exec in place)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return set()
    return {int(child) for child in text.split()}
