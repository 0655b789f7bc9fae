"""rvodrun's elastic driver: runs a job whose workers come and go (--min-np, --host-discovery-script).

The driver reruns the discovery script every second, and forms worlds: a world is a dense numbering
0..size-1 of live workers, published in the rendezvous store (protocol in ``rvod.common.elastic_worker``). It
forms a new world when a worker fails (its host is blacklisted, for the cooldown if one is given), when a
worker's collective failed and it asks for one, or when the hosts change: workers on a removed host are
told to leave, and free slots on added hosts get new workers, up to --max-np. The workers that carried
the job come first in every new world, in their old order, so rank 0 always holds the last commit.

A worker that is alive but makes no progress for RVOD_ELASTIC_HUNG_TIMEOUT seconds (--elastic-hung-timeout;
frozen, or blocked in the script while the others wait for it: ``rvod.runner.hung``) is killed and counts as
failed.

The job ends when its workers end: status 0 when every worker of the last world exited 0. It fails, with
a line saying why, when fewer than --min-np slots stay usable for --elastic-timeout seconds, when more
than --reset-limit resets would be needed, or when every discovered host is blacklisted for good.

The driver knows workers only as handles (``WorkerHandle``) made by a ``Launcher``: ``ProcessLauncher``
starts processes (locally or over ssh) for rvodrun and rvod.run; rvod.ray's elastic executor starts Ray
actors. Hosts come from a ``discover()`` callable (rvodrun's: ``discover(settings)``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rvod.runner import network, store
from rvod.runner.hosts import Host, Slot, local_names
from rvod.runner.hung import HEARTBEAT_KEY, HungWatch
from rvod.runner.job import JobSpec
from rvod.runner.ssh import SshSettings, forwarded_environment, remote_python_command
from rvod.runner.supervisor import STOP_GRACE_SECONDS, WorkerProcess, WorkerSpec, signal_name
from rvod.runner.worker_env import worker_env

DEFAULT_ELASTIC_TIMEOUT = 600.0
DISCOVERY_INTERVAL = 1.0
DISCOVERY_SCRIPT_TIMEOUT = 30.0
# How long a worker's request for a new world waits for the other workers' (or for a death to be noticed).
_RESET_GATHER_SECONDS = 1.0
_POLL_SECONDS = 0.02
_FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class ElasticFailure(RuntimeError):
    """The elastic job cannot go on; the message says why."""


@dataclass(frozen=True)
class ElasticSettings:
    min_np: int
    max_np: int | None
    discovery_script: str | None
    fixed_hosts: list[Host] | None
    slots_per_host: int | None
    elastic_timeout: float
    reset_limit: int | None
    cooldown_range: tuple[int, int] | None


def parse_discovery_output(text: str, slots_per_host: int | None) -> dict[str, int]:
    """`host[:slots]` lines (blank lines and `#` comments skipped) -> host -> slots, in the order given.
    A line without a count gets --slots-per-host, else 1."""
    hosts: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        entry = line.partition("#")[0].strip()
        if not entry:
            continue
        name, colon, count = entry.partition(":")
        if not name or (colon and not count.strip().isdigit()) or (colon and int(count) < 1):
            raise ValueError(f"line {number}: expected 'host' or 'host:slots' with slots >= 1, got {line!r}")
        hosts[name.strip()] = int(count) if colon else (slots_per_host or 1)
    return hosts


def discover(settings: ElasticSettings) -> dict[str, int]:
    """The hosts available now (ValueError with the reason when the script fails)."""
    if settings.discovery_script is None:
        return {host.name: host.slots for host in settings.fixed_hosts or []}
    try:
        done = subprocess.run(settings.discovery_script, shell=True, capture_output=True, text=True,
                              timeout=DISCOVERY_SCRIPT_TIMEOUT, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise ValueError(f"did not finish within {DISCOVERY_SCRIPT_TIMEOUT:.0f} s") from None
    if done.returncode != 0:
        raise ValueError(f"exited with code {done.returncode}: {done.stderr.strip()[-500:]}")
    return parse_discovery_output(done.stdout, settings.slots_per_host)


class Blacklist:
    """Hosts whose workers failed. Without a cooldown range a host stays out for good; with one, it comes
    back after a random delay in the range, doubled for each earlier failure (capped at the range's top
    times 2**4)."""

    def __init__(self, cooldown_range: tuple[int, int] | None):
        self._range = cooldown_range
        self._failures: dict[str, int] = {}
        self._until: dict[str, float] = {}

    def add(self, host: str, now: float) -> str:
        count = self._failures[host] = self._failures.get(host, 0) + 1
        if self._range is None:
            self._until[host] = float("inf")
            return f"host {host} is blacklisted"
        low, high = self._range
        delay = random.uniform(low, high) * 2 ** min(count - 1, 4)
        self._until[host] = now + delay
        return f"host {host} is blacklisted for {delay:.1f} s (failure {count})"

    def blocked(self, host: str, now: float) -> bool:
        return self._until.get(host, 0.0) > now

    def for_good(self, host: str) -> bool:
        return self._until.get(host, 0.0) == float("inf")


class WorkerHandle(Protocol):
    """One started worker, as the driver sees it."""

    @property
    def returncode(self) -> int | None:
        """None while it runs; 0 when it ended well (it finished, or left the job when told to)."""

    def finished(self) -> bool:
        """It ended and what it had to say (its output) has come through."""

    def describe_exit(self) -> str:
        """How it ended, for a message ("exited with code 1")."""


class Launcher(Protocol):
    """How an elastic job's workers start and stop: processes (``ProcessLauncher``) or Ray actors."""

    def rendezvous_address(self, hosts: Sequence[str]) -> str:
        """The address the job's store listens on, reachable from ``hosts`` (the hosts discovered first)."""

    def start(self, worker_id: int, slot: Slot, env: dict[str, str]) -> WorkerHandle:
        """Starts a worker with the job's ``env`` (rendezvous, identity, elastic variables) on ``slot``'s host."""

    def stop(self, handles: list[WorkerHandle]) -> None:
        """Stops every worker of ``handles`` still running, and waits for them (bounded)."""

    def kill(self, handle: WorkerHandle) -> None:
        """Kills a worker that makes no progress, without waiting (it may be stopped: SIGKILL ends it anyway)."""


@dataclass
class _ElasticWorker:
    id: int
    host: str
    process: WorkerHandle
    rank: int | None = None
    leaving: bool = False
    reported: bool = False
    joined: bool = False  # has been in a world whose engines started
    killed: bool = False  # found hung and killed


@dataclass
class _World:
    round: int
    members: list[_ElasticWorker]
    ready: set[int] = field(default_factory=set)
    started: bool = False
    ranks: dict[int, int] = field(default_factory=dict)  # rank -> worker id


def topology(placed: list[tuple[int, str]]) -> dict[int, Slot]:
    """worker id -> its Slot, for workers listed in rank order with their hosts. A rank's local rank counts
    the ranks before it on its host; its cross rank counts the hosts (in order of first rank) before its own
    that have a rank with the same local rank."""
    per_host: dict[str, list[int]] = {}
    for worker, host in placed:
        per_host.setdefault(host, []).append(worker)
    host_order = list(per_host)
    slots = {}
    for rank, (worker, host) in enumerate(placed):
        local_rank = per_host[host].index(worker)
        peers = [h for h in host_order if len(per_host[h]) > local_rank]
        slots[worker] = Slot(hostname=host, rank=rank, size=len(placed), local_rank=local_rank,
                             local_size=len(per_host[host]), cross_rank=peers.index(host), cross_size=len(peers))
    return slots


def _say(text: str, who: str = "rvodrun") -> None:
    print(f"{who}: {text}", file=sys.stderr, flush=True)


class ElasticDriver:
    """Forms the worlds of one elastic job. ``discover()``: the hosts available now (host -> slots; ValueError
    with the reason when they cannot be known); ``engine_settings``: RVOD_* variables every worker gets;
    ``who``: the name its messages start with."""

    def __init__(self, settings: ElasticSettings, launcher: Launcher, discover: Callable[[], dict[str, int]], *,
                 engine_settings: dict[str, str], verbose: bool = False, who: str = "rvodrun"):
        self.settings = settings
        self.launcher = launcher
        self.discover = discover
        self.engine_settings = engine_settings
        self.verbose = verbose
        self.who = who
        self.secret = os.urandom(32)
        self.blacklist = Blacklist(settings.cooldown_range)
        self.hosts: dict[str, int] = {}
        self.workers: list[_ElasticWorker] = []
        self.world: _World | None = None
        self.started_world: _World | None = None  # the newest world whose engines started
        self.round = 0
        self.resets = 0
        self.failure: str | None = None
        self._next_id = 0
        self._received: list[int] = []
        self.hung_watch: HungWatch | None = None

    def _say(self, text: str) -> None:
        _say(text, self.who)

    # -- hosts ---------------------------------------------------------------------------------------

    def _refresh_hosts(self) -> None:
        try:
            self.hosts = self.discover()
        except ValueError as error:
            what = (f"host discovery script {self.settings.discovery_script!r}" if self.settings.discovery_script
                    else "host discovery")
            self._say(f"{what} failed ({error}); keeping the hosts it listed last")

    def _usable(self, now: float) -> dict[str, int]:
        return {host: slots for host, slots in self.hosts.items() if not self.blacklist.blocked(host, now)}

    # -- worlds --------------------------------------------------------------------------------------

    def _live(self) -> list[_ElasticWorker]:
        return [w for w in self.workers if w.process.returncode is None and not w.leaving]

    def _plan(self, now: float) -> tuple[list[_ElasticWorker], list[str]] | None:
        """(workers kept, hosts of the workers to start) for the next world, or None below --min-np."""
        usable = self._usable(now)
        kept: list[_ElasticWorker] = []
        used: dict[str, int] = {}
        max_np = self.settings.max_np
        for worker in sorted(self._live(), key=lambda w: (w.rank is None, w.rank or 0, w.id)):
            if used.get(worker.host, 0) < usable.get(worker.host, 0) and (max_np is None or len(kept) < max_np):
                kept.append(worker)
                used[worker.host] = used.get(worker.host, 0) + 1
        added: list[str] = []
        for host, slots in usable.items():
            for _ in range(slots - used.get(host, 0)):
                if max_np is None or len(kept) + len(added) < max_np:
                    added.append(host)
        if len(kept) + len(added) < self.settings.min_np:
            return None
        return kept, added

    def _hosts_changed(self, now: float) -> str | None:
        """'removed' or 'added' when the usable hosts call for a new world, else None."""
        if self.world is None:
            return None
        kept, added = self._plan(now) or (None, None)
        if kept is None:
            return "removed"
        if len(kept) < len(self.world.members):
            return "removed"
        return "added" if added else None

    def _form(self, cause: str, now: float, store_client) -> bool:
        """Forms and publishes a new world; False when the hosts do not allow --min-np workers."""
        plan = self._plan(now)
        if plan is None:
            return False
        kept, added_hosts = plan
        if self.world is not None:
            limit = self.settings.reset_limit
            if limit is not None and self.resets >= limit:
                raise ElasticFailure(f"the job needed a new world ({cause}) after {self.resets} resets, and "
                                     f"--reset-limit is {limit}")
            self.resets += 1
        self.round += 1
        new = [(self._reserve_id(), host) for host in added_hosts]
        placed = [(w.id, w.host) for w in kept] + new
        slots = topology(placed)
        prefix = f"elastic/round/{self.round}"
        store_client.set(f"{prefix}/cause", cause.encode())
        for worker in self.workers:
            if worker.process.returncode is not None:
                continue
            if worker.id in slots:
                store_client.set(f"{prefix}/assign/{worker.id}", json.dumps(_place(slots[worker.id])).encode())
            else:
                # Also a worker told to leave in an earlier world that has not exited yet: a worker reads only
                # the latest world, so one that missed the world that told it would wait for a place in this one.
                store_client.set(f"{prefix}/assign/{worker.id}", b'{"leave": true}')
                worker.leaving = True
        for worker_id, _ in new:
            store_client.set(f"{prefix}/assign/{worker_id}", json.dumps(_place(slots[worker_id])).encode())
        store_client.set("elastic/round", str(self.round).encode())
        members = list(kept)
        for worker_id, host in new:
            members.append(self._start(worker_id, slots[worker_id]))
        for worker in members:
            worker.rank = slots[worker.id].rank
        self.world = _World(self.round, members, ranks={worker.rank: worker.id for worker in members})
        self._say(f"world {self.round} ({cause}): {len(members)} ranks on "
             f"{', '.join(sorted({w.host for w in members}))}" + (f"; {len(new)} started" if new else ""))
        return True

    def _reserve_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _start(self, worker_id: int, slot: Slot) -> _ElasticWorker:
        env = worker_env({}, slot, rendezvous_addr=self.rendezvous_addr, rendezvous_port=self.port,
                         secret=self.secret, settings=self.engine_settings)
        env.update({"RVOD_ELASTIC_WORKER_ID": str(worker_id), "RVOD_ELASTIC_ROUND": str(self.round),
                    "RVOD_ELASTIC_TIMEOUT": repr(self.settings.elastic_timeout)})
        worker = _ElasticWorker(worker_id, slot.hostname, self.launcher.start(worker_id, slot, env))
        self.workers.append(worker)
        return worker

    # -- the job -------------------------------------------------------------------------------------

    def run(self, publish: Callable[[Any], None] | None = None, collect: Callable[[Any], None] | None = None) -> int:
        """Runs the job to its end; returns its exit status. ``publish(store_client)`` runs once the store
        serves, before any worker starts; ``collect(store_client)`` once the job's workers ended, while
        the store still serves (rvod.run puts its function there and reads the results back)."""
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for signum in _FORWARDED_SIGNALS:
                previous[signum] = signal.signal(signum, lambda number, _frame: self._received.append(number))
        try:
            self.hung_watch = _hung_watch(self.engine_settings)
            self._refresh_hosts()
            self.rendezvous_addr = self.launcher.rendezvous_address(list(self.hosts))
            server = store.start_store(self.rendezvous_addr, self.secret)
            try:
                from rvod._rvod import StoreClient

                self.port = server.port
                client = StoreClient(self.rendezvous_addr, self.port, self.secret, 10.0)
                if publish is not None:
                    publish(client)
                status = self._supervise(client)
                if collect is not None:
                    collect(client)
                return status
            finally:
                self.launcher.stop([worker.process for worker in self.workers])
                server.close()
        except ElasticFailure as error:
            self.failure = str(error)
            self._say(f"elastic job failed: {error}")
            return 1
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _supervise(self, client) -> int:
        next_discovery = time.monotonic() + DISCOVERY_INTERVAL
        wanted: str | None = "start"
        short_since: float | None = None
        reset_asked_at: float | None = None
        finishing = False
        status = 0
        next_hung_check = time.monotonic()
        while True:
            time.sleep(_POLL_SECONDS)
            now = time.monotonic()
            if self._received:
                signum = self._received.pop(0)
                self.failure = f"{self.who} received {signal_name(signum)}"
                self._say(f"received {signal_name(signum)}, stopping the job")
                return 128 + signum
            # A remote worker's death is known from its host's status line before ssh exits and its output
            # is drained (finished()); acting on it at once keeps the next world from planning around a
            # dead worker whose host is not blacklisted yet.
            for worker in [w for w in self.workers
                           if not w.reported and (w.process.finished() or w.process.returncode is not None)]:
                worker.reported = True
                code = worker.process.returncode
                assert code is not None
                where = f"worker {worker.id} (rank {worker.rank} on {worker.host})"
                if worker.leaving:
                    if self.verbose:
                        self._say(f"{where} left the job: it {worker.process.describe_exit()}")
                elif code == 0:
                    if not finishing:
                        self._finish(client)
                    finishing = True
                    if self.verbose:
                        self._say(f"{where} finished")
                elif finishing:
                    status = status or (128 - code if code < 0 else code)
                    self.failure = f"{where} {worker.process.describe_exit()}"
                    self._say(self.failure)
                else:
                    self._say(f"{where} {worker.process.describe_exit()}; {self.blacklist.add(worker.host, now)}")
                    wanted = wanted or "failure"
            if finishing:
                if not any(w.process.returncode is None for w in self.workers if not w.leaving):
                    return status
                continue
            if self.hung_watch is not None and now >= next_hung_check:
                next_hung_check = now + self.hung_watch.interval
                self._kill_hung(client, now)
            if now >= next_discovery:
                next_discovery = now + DISCOVERY_INTERVAL
                self._refresh_hosts()
                if wanted is None:
                    wanted = self._hosts_changed(now)
            if wanted is None and self.world is not None:
                asked = [w for w in self.world.members
                         if client.try_get(f"elastic/reset/{w.id}/{self.world.round}", 0) is not None]
                if asked:
                    reset_asked_at = reset_asked_at or now
                    everyone = all(w in asked for w in self.world.members if w.process.returncode is None)
                    if everyone or now - reset_asked_at >= _RESET_GATHER_SECONDS:
                        wanted = "failure"
            if wanted is not None:
                if self._form(wanted, now, client):
                    wanted, short_since, reset_asked_at = None, None, None
                else:
                    self._check_short(now, short_since)
                    short_since = short_since or now
            if self.world is not None and not self.world.started:
                self._release_world(client)

    def _kill_hung(self, client, now: float) -> None:
        """Kills the workers found hung (``rvod.runner.hung``); their deaths are then handled as failures."""
        assert self.hung_watch is not None
        watched = [w for w in self._live() if not w.killed]
        beats = {w.id: client.try_get(HEARTBEAT_KEY.format(worker=w.id), 0) for w in watched}
        world = self.started_world
        found = self.hung_watch.check(beats, world.round if world else None, world.ranks if world else {}, now)
        for hung in found:
            worker = next(w for w in watched if w.id == hung.worker)
            self._say(f"worker {worker.id} (rank {worker.rank} on {worker.host}) {hung.reason}; killing it")
            worker.killed = True
            self.launcher.kill(worker.process)

    def _check_short(self, now: float, short_since: float | None) -> None:
        usable = self._usable(now)
        if self.hosts and all(self.blacklist.for_good(host) for host in self.hosts):
            raise ElasticFailure(f"every host ({', '.join(self.hosts)}) is blacklisted after its workers failed")
        if short_since is not None and now - short_since >= self.settings.elastic_timeout:
            raise ElasticFailure(
                f"only {sum(usable.values())} usable slots ({_describe(usable)}) for "
                f"{self.settings.elastic_timeout:.0f} s (--elastic-timeout), fewer than --min-np "
                f"{self.settings.min_np}")

    def _release_world(self, client) -> None:
        """Lets the workers of the newest world start their engines once every one of them is waiting."""
        world = self.world
        assert world is not None
        for worker in world.members:
            if worker.id not in world.ready and client.try_get(
                    f"elastic/round/{world.round}/ready/{worker.id}", 0) is not None:
                world.ready.add(worker.id)
        if len(world.ready) == len(world.members):
            client.set(f"elastic/round/{world.round}/go", b"1")
            world.started = True
            self.started_world = world
            for worker in world.members:
                worker.joined = True

    def _finish(self, client) -> None:
        """A worker finished training: no new world will be formed; workers that never joined one leave."""
        client.set("elastic/finished", b"1")
        for worker in self._live():
            if not worker.joined:
                worker.leaving = True


class ProcessLauncher:
    """rvodrun's workers: ``command`` as a process on this machine, or over ssh on another host."""

    def __init__(self, spec: JobSpec, command: list[str], ssh: SshSettings):
        self.spec = spec
        self.command = command
        self.ssh = ssh
        self._local = local_names()

    def rendezvous_address(self, hosts: Sequence[str]) -> str:
        if self.spec.nics:
            return network.interface_address(self.spec.nics[0])
        remote = [host for host in hosts if host.lower() not in self._local]
        if remote:
            return network.route_source(network.resolve(self.ssh.resolved_hostname(remote[0])))
        return network.LOOPBACK

    def start(self, worker_id: int, slot: Slot, env: dict[str, str]) -> WorkerProcess:
        remote = slot.hostname.lower() not in self._local
        env = {**(forwarded_environment(os.environ) if remote else os.environ), **env}
        ssh_command = None
        if remote:
            ssh_command = self.ssh.command(slot.hostname, remote_python_command(env, ["-m", "rvod.runner.remote"]))
        worker_spec = WorkerSpec(rank=slot.rank, command=self.command, env=env, hostname=slot.hostname,
                                 ssh_command=ssh_command)
        process = WorkerProcess.start(worker_spec, timestamp=self.spec.prefix_timestamp)
        if self.spec.verbose:
            _say(f"started worker {worker_id} as rank {slot.rank} on {slot.hostname} (pid {process.process.pid})")
        return process

    def kill(self, handle: WorkerProcess) -> None:
        handle.signal_group(signal.SIGKILL)

    def stop(self, handles: list[WorkerProcess]) -> None:
        running = [process for process in handles if process.group_alive()]
        for process in running:
            process.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        while running and time.monotonic() < deadline:
            time.sleep(_POLL_SECONDS)
            running = [process for process in running if process.group_alive()]
        for process in running:
            process.signal_group(signal.SIGKILL)
        for process in handles:
            process.process.wait()
            process.finish_output(1.0)


def _place(slot: Slot) -> dict:
    return {"rank": slot.rank, "size": slot.size, "local_rank": slot.local_rank, "local_size": slot.local_size,
            "cross_rank": slot.cross_rank, "cross_size": slot.cross_size, "hostname": slot.hostname}


def _describe(hosts: dict[str, int]) -> str:
    return ", ".join(f"{host}:{slots}" for host, slots in hosts.items()) or "no hosts"


def elastic_settings(spec: JobSpec, fixed_hosts: list[Host] | None) -> ElasticSettings:
    """The job's elastic settings, checked (ValueError with a sentence for the user)."""
    min_np = spec.min_num_proc if spec.min_num_proc is not None else spec.num_proc
    if min_np is None:
        raise ValueError("elastic training needs --min-np (or -np) to know how few workers the job can run with")
    max_np = spec.max_num_proc
    if min_np < 1 or (max_np is not None and max_np < min_np):
        raise ValueError(f"--min-np must be at least 1 and --max-np at least --min-np (got {min_np}, {max_np})")
    if spec.host_discovery_script is None and fixed_hosts is None:
        raise ValueError("elastic training needs --host-discovery-script (or -H/--hostfile for a fixed set of hosts)")
    cooldown = spec.cooldown_range
    if cooldown is not None and not 0 <= cooldown[0] <= cooldown[1]:
        raise ValueError(f"--blacklist-cooldown-range MIN MAX needs 0 <= MIN <= MAX, got {cooldown[0]} {cooldown[1]}")
    return ElasticSettings(min_np=min_np, max_np=max_np, discovery_script=spec.host_discovery_script,
                           fixed_hosts=fixed_hosts, slots_per_host=spec.slots_per_host,
                           elastic_timeout=elastic_timeout(spec.elastic_timeout), reset_limit=spec.reset_limit,
                           cooldown_range=cooldown)


def _hung_watch(engine_settings: dict[str, str]) -> HungWatch | None:
    """The watch for hung workers with the job's RVOD_ELASTIC_HUNG_TIMEOUT (None: turned off); ElasticFailure
    naming the variable when its value is wrong."""
    try:
        from rvod._rvod import elastic_hung_timeout
    except ImportError:
        return None  # starting the store says what is missing
    try:
        timeout = elastic_hung_timeout({**os.environ, **engine_settings})
    except ValueError as error:
        raise ElasticFailure(str(error)) from None
    return HungWatch(timeout) if timeout is not None else None


def elastic_timeout(given: float | None) -> float:
    """``given``, else RVOD_ELASTIC_TIMEOUT (HOROVOD_ELASTIC_TIMEOUT), else the default (ValueError when the
    variable is not a number)."""
    for name in ("RVOD_ELASTIC_TIMEOUT", "HOROVOD_ELASTIC_TIMEOUT"):
        if given is None and os.environ.get(name):
            try:
                given = float(os.environ[name])
            except ValueError:
                raise ValueError(f"{name} must be a number of seconds, got {os.environ[name]!r}") from None
    return float(given if given is not None else DEFAULT_ELASTIC_TIMEOUT)

