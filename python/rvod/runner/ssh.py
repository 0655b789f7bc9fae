"""Reaching other hosts with the system's ssh client: command lines, host resolution, and the pre-start probe.

Every ssh runs with BatchMode (never a password prompt), the port and identity file of -p/-i, and the
configuration file of --ssh-config-file (default: ssh's own). Host keys are trusted on first use
(StrictHostKeyChecking=accept-new): a new host is added to known_hosts, a changed key is refused.

Before a job starts, `probe_hosts` asks every remote host, in parallel and within the start timeout, for its
Python and rvod versions, using the interpreter path rvodrun runs under (the remote bootstrap needs it), so
an unreachable host, a host without rvod, or a host with another Python or rvod is named before any rank
starts. Problems are `HostProblem`s (a `ValueError`) whose message names the host.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# The probe prints one line starting with this marker, so a login banner or a shell's chatter is skipped.
_PROBE_MARKER = "rvod-probe:"
_PROBE_CODE = (
    "import json, platform, socket, sys\n"
    "reply = {'python': platform.python_version(), 'nics': [name for _, name in socket.if_nameindex()]}\n"
    "try:\n"
    "    import rvod.runner.remote\n"
    "    reply['rvod'] = rvod.__version__\n"
    "except Exception as error:\n"
    "    reply['error'] = f'{type(error).__name__}: {error}'\n"
    f"print({_PROBE_MARKER!r} + json.dumps(reply), flush=True)\n"
)
# Exit status of ssh itself when it fails (cannot connect, cannot authenticate, unknown host).
SSH_FAILED = 255
# Status of a shell that cannot find or execute the command.
_NOT_FOUND = 127
_NOT_EXECUTABLE = 126


class HostProblem(ValueError):
    """A host cannot run the job; the message names it."""


@dataclass(frozen=True)
class SshSettings:
    """How to reach the other hosts: -p, -i and --ssh-config-file."""

    port: int | None = None
    identity_file: str | None = None
    config_file: str | None = None
    connect_timeout: float = 30.0

    def command(self, host: str, remote_command: str) -> list[str]:
        """The ssh command line that runs the shell command `remote_command` on `host`."""
        args = ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new",
                "-o", f"ConnectTimeout={max(1, int(self.connect_timeout))}"]
        if self.config_file is not None:
            args += ["-F", self.config_file]
        if self.port is not None:
            args += ["-p", str(self.port)]
        if self.identity_file is not None:
            args += ["-i", self.identity_file]
        return args + ["--", host, remote_command]

    def resolved_hostname(self, host: str) -> str:
        """The name or address ssh connects to for `host` after its configuration (`HostName` lines)."""
        args = ["ssh", "-G"] + (["-F", self.config_file] if self.config_file else []) + ["--", host]
        try:
            result = subprocess.run(args, capture_output=True, text=True, timeout=10, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as error:
            raise HostProblem(f"cannot run ssh to look up host {host!r}: {error}") from None
        if result.returncode != 0:
            raise HostProblem(f"host {host!r}: ssh cannot use it: {last_line(result.stderr)}")
        for line in result.stdout.splitlines():
            key, _, value = line.partition(" ")
            if key == "hostname":
                return value.strip()
        return host


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "(no message)"


def remote_python_command(environment: Mapping[str, str], arguments: Sequence[str]) -> str:
    """The shell command that runs this interpreter's path with `arguments` on a remote host, importing rvod
    from where the job's ranks will (the job's PYTHONPATH)."""
    words = [sys.executable, *arguments]
    pythonpath = environment.get("PYTHONPATH")
    prefix = f"PYTHONPATH={shlex.quote(pythonpath)} " if pythonpath else ""
    return prefix + "exec " + shlex.join(words)


def _probe_one(settings: SshSettings, host: str, environment: Mapping[str, str], timeout: float) -> dict | str:
    """The host's probe reply, or a sentence saying what went wrong."""
    command = settings.command(host, remote_python_command(environment, ["-c", _PROBE_CODE]))
    try:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True)
    except OSError as error:
        return f"cannot run ssh: {error}"
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        return f"did not answer over ssh within {timeout:g} s (--start-timeout)"
    for line in stdout.splitlines():
        if line.startswith(_PROBE_MARKER):
            try:
                return json.loads(line[len(_PROBE_MARKER):])
            except ValueError:
                break
    if process.returncode == SSH_FAILED:
        return f"is not reachable over ssh: {last_line(stderr)}"
    if process.returncode in (_NOT_FOUND, _NOT_EXECUTABLE):
        return f"cannot run {sys.executable} there (rvodrun starts ranks with the interpreter it runs under): " \
               f"{last_line(stderr)}"
    return f"the Python probe failed with exit status {process.returncode}: {last_line(stderr + stdout)}"


def probe_hosts(settings: SshSettings, hosts: Sequence[str], environment: Mapping[str, str],
                timeout: float, nics: Sequence[str] = ()) -> None:
    """Checks, in parallel, that every host answers over ssh within `timeout` seconds, runs the same Python
    (major.minor) and rvod version as this machine, and has the network interfaces `nics`; raises
    HostProblem naming every bad host."""
    replies: dict[str, dict | str] = {}

    def probe(host: str) -> None:
        replies[host] = _probe_one(settings, host, environment, timeout)

    threads = [threading.Thread(target=probe, args=(host,), name=f"rvodrun-probe {host}", daemon=True)
               for host in hosts]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout + 5
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    from rvod import __version__

    here = ".".join(map(str, sys.version_info[:2]))
    problems = []
    for host in hosts:
        reply = replies.get(host, f"did not answer over ssh within {timeout:g} s (--start-timeout)")
        if isinstance(reply, str):
            problems.append(f"host {host!r} {reply}")
        elif "error" in reply:
            problems.append(f"host {host!r}: rvod cannot be imported by {sys.executable} there ({reply['error']}); "
                            f"install rvod {__version__} on it")
        elif ".".join(str(reply.get("python", "?")).split(".")[:2]) != here or reply.get("rvod") != __version__:
            problems.append(f"host {host!r} runs Python {reply.get('python')} with rvod {reply.get('rvod')}, this "
                            f"machine Python {sys.version.split()[0]} with rvod {__version__}: every host needs the "
                            "same Python version and rvod version")
        elif any(nic not in reply.get("nics", []) for nic in nics):
            missing = [nic for nic in nics if nic not in reply.get("nics", [])]
            problems.append(f"host {host!r} has no network interface {', '.join(map(repr, missing))} "
                            f"(it has {', '.join(reply.get('nics', []))})")
    if problems:
        raise HostProblem("; ".join(problems))


def forwarded_environment(environment: Mapping[str, str]) -> dict[str, str]:
    """The part of the job's environment that makes sense on another host (as horovodrun, everything but
    what describes this machine or this login)."""
    skipped_names = {"HOSTNAME", "OLDPWD", "PWD", "SHLVL", "_", "XDG_RUNTIME_DIR", "DISPLAY"}
    skipped_prefixes = ("BASH_FUNC_", "SSH_", "XDG_SESSION_")
    return {name: value for name, value in environment.items()
            if name not in skipped_names and not name.startswith(skipped_prefixes)}

