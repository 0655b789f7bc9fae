"""A chaos soak: elastic PyTorch training on namespace hosts while faults arrive at random, from a seed.

`Soak` starts rvodrun (in the launcher namespace of a `netns.Cluster`) with workers/elastic_torch.py on the
hosts a discovery script names, then injects faults one after another, each on a host or worker drawn from
the seeded random generator:

- ``kill``: kill -9 of a worker;
- ``stop_short`` / ``stop_long``: SIGSTOP of a worker, SIGCONT after a pause shorter / longer than RVOD_TIMEOUT;
- ``link_down``: a host's link taken down (`ip link set ... down`) and brought back;
- ``crawl``: a host's link shaped to a crawl with tc's token bucket (tbf), then unshaped;
- ``discovery``: a host removed from the discovery script's output, then returned.

Not injected: restarting rvodrun's own driver. The driver is the job: it holds the rendezvous store every
worker reads, and the workers are the children of its ssh sessions (and of its pipes, which carry their
output), so a driver that dies takes its workers with it by design (test_multihost tests that nothing is left
running then); a restarted driver would start a new job from the last checkpoint, which is the user's.

After every fault the soak checks that training is going again within `resume_bound` seconds of the fault's
end (a new commit of rank 0; in a new world for the faults that must re-form it) and on every slot again
within `settle_bound` seconds (hosts blacklisted by the fault come back after their cooldown of 1-2 s, doubled
for each earlier failure of the host, at most 32 s), and samples the resident memory of every worker. `finish()` stops the training at the end of an epoch (a stop file, read by rank 0 and
agreed by allreduce) and checks the rest: the job exits 0, every sample of every epoch was processed exactly
once, no process is left in any namespace, no shared-memory segment in the job's folder, no socket listening
but the sshds', no worker's private resident memory grew by more than `rss_slack` bytes while it lived, and
none mapped more shared memory than one world's segment.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import statistics
import subprocess
import time
from pathlib import Path

import netns
from test_elastic import ElasticJob, assert_every_sample_once_per_epoch, completed_epochs, read
from test_elastic_hosts import worker_pids

FAULT_KINDS = ("kill", "stop_short", "stop_long", "link_down", "crawl", "discovery")
# Faults after which the job must re-form (a new world) before it trains again.
REFORMING = {"kill", "stop_long", "discovery"}
SAMPLES = 120  # divisible by every world size from 1 to 6


@dataclasses.dataclass
class Fault:
    kind: str
    host: str
    started: float
    ended: float
    detail: str
    resumed: float | None = None
    full_again: float | None = None  # the first commit on every slot again

    @property
    def time_to_resume(self) -> float | None:
        """Seconds from the fault's end (a kill ends as it starts) to the first commit after it."""
        return None if self.resumed is None else self.resumed - self.ended


class Soak:
    def __init__(self, cluster: netns.Cluster, job_env: dict[str, str], out: Path, shm_dir: Path, seed: int,
                 slots: dict[str, int], timeout: float = 6.0, resume_bound: float = 90.0,
                 settle_bound: float = 120.0, rss_slack: int = 64 << 20):
        self.cluster, self.out, self.shm_dir = cluster, out, shm_dir
        self.random = random.Random(seed)
        self.slots = slots
        self.timeout, self.resume_bound, self.settle_bound = timeout, resume_bound, settle_bound
        self.rss_slack = rss_slack
        self.faults: list[Fault] = []
        self.rss: dict[int, list[int]] = {}
        self.shmem: dict[int, tuple[str, list[int]]] = {}
        self.stop_file = out / "stop"
        env = cluster.env(job_env)
        env.update(RVOD_TIMEOUT=str(timeout), RVOD_SHM_DIR=str(shm_dir))
        total = sum(slots.values())
        self.job = ElasticJob(env, out, self._hosts_text(slots),
                              ["--min-np", "2", "--max-np", str(total), "--blacklist-cooldown-range", "1", "2",
                               "--elastic-timeout", "120"],
                              wrap=cluster.launch_args, to_files=True, ELASTIC_SAMPLES=str(SAMPLES), ELASTIC_EPOCHS="100000",
                              ELASTIC_STEP_SECONDS="0.02", ELASTIC_STOP_FILE=str(self.stop_file))
        self.discovered = dict(slots)

    @staticmethod
    def _hosts_text(slots: dict[str, int]) -> str:
        return "".join(f"{host}:{count}\n" for host, count in slots.items())

    # ------------------------------------------------------------------------------------- observing

    def commits(self) -> list[dict]:
        return read(self.out, "progress.jsonl")

    def wait_training(self, after: float, new_world_after: int | None, bound: float, size: int | None = None) -> float:
        """The time of rank 0's first commit after `after` (in a world later than `new_world_after`, and of `size`
        ranks, if given); fails the soak if none comes within `bound` seconds of `after`."""
        deadline = after + bound
        while True:
            for entry in self.commits():
                if entry["time"] > after and (new_world_after is None or entry["round"] > new_world_after) \
                        and (size is None or entry["size"] == size):
                    return entry["time"]
            if self.job.process.poll() is not None:
                raise AssertionError(f"the job ended during the soak\n{self.describe()}\n{self.job_report()}")
            if time.time() > deadline:
                raise AssertionError(f"no training within {bound} s of {after:.1f}\n{self.describe()}\n"
                                     f"{self.job_report()}")
            time.sleep(0.1)

    def current_world(self) -> int:
        commits = self.commits()
        return commits[-1]["round"] if commits else 0

    def workers(self, host: str) -> list[int]:
        return sorted(worker_pids(self.cluster, host))

    def sample_rss(self) -> None:
        """Each worker's private resident memory (RssAnon: what a leak grows) and its resident shared memory
        (RssShmem: the job's shared-memory segment, mapped with MAP_POPULATE, so a world with two ranks on a
        host adds its staging areas at once and a world with one gives them back)."""
        for host in self.cluster.names:
            for pid in self.workers(host):
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                except OSError:
                    continue
                kib = {line.split(":")[0]: int(line.split()[1]) for line in status.splitlines()
                       if line.startswith(("RssAnon:", "RssShmem:"))}
                if len(kib) == 2:
                    self.rss.setdefault(pid, []).append(kib["RssAnon"] << 10)
                    self.shmem.setdefault(pid, (host, []))[1].append(kib["RssShmem"] << 10)

    def shmem_bound(self, host: str) -> int:
        """The most shared memory a worker on `host` may map: a staging area of at most 64 MiB for each rank
        the host can hold, plus 64 MiB for the channels; more would be segments of earlier worlds kept."""
        return (self.slots[host] * 64 + 64) << 20

    # ------------------------------------------------------------------------------------- faults

    def _nic(self, host: str, *args: str) -> None:
        subprocess.run(self.cluster.exec_args(host, list(args)), check=True, capture_output=True, timeout=20)

    def members(self) -> dict[str, list[int]]:
        """The running world's workers by host (their pids, from the lines they wrote as they started training),
        leaving out any worker still exiting from an earlier world: a fault must hit the job, not a leaver."""
        world = self.current_world()
        members: dict[str, list[int]] = {}
        for entry in read(self.out, "starts.jsonl"):
            if entry["round"] == world and entry["pid"] in self.workers(entry["host"]):
                members.setdefault(entry["host"], []).append(entry["pid"])
        return {host: sorted(set(pids)) for host, pids in sorted(members.items())}

    def inject(self, kind: str) -> Fault:
        members = self.members()
        host = self.random.choice(sorted(members))
        pid = self.random.choice(members[host])
        started = time.time()
        if kind == "kill":
            os.kill(pid, signal.SIGKILL)
            detail = f"SIGKILL to pid {pid}"
        elif kind in ("stop_short", "stop_long"):
            pause = (self.random.uniform(0.3, 0.6) * self.timeout if kind == "stop_short"
                     else self.random.uniform(1.3, 1.8) * self.timeout)
            os.kill(pid, signal.SIGSTOP)
            time.sleep(pause)
            detail = f"pid {pid} stopped for {pause:.1f} s"
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:  # RVOD_ELASTIC_HUNG_TIMEOUT: the driver killed it as hung
                detail += ", killed by the driver meanwhile"
        elif kind == "link_down":
            pause = self.random.uniform(0.5, 2.0) * self.timeout
            self._nic(host, "ip", "link", "set", netns.NIC, "down")
            try:
                time.sleep(pause)
            finally:
                self._nic(host, "ip", "link", "set", netns.NIC, "up")
            detail = f"link down for {pause:.1f} s"
        elif kind == "crawl":
            pause = self.random.uniform(2.0, 6.0)
            self._nic(host, "tc", "qdisc", "add", "dev", netns.NIC, "root", "tbf", "rate", "1mbit", "burst", "16kb",
                      "latency", "200ms")
            try:
                time.sleep(pause)
            finally:
                self._nic(host, "tc", "qdisc", "del", "dev", netns.NIC, "root")
            detail = f"shaped to 1 Mbit/s for {pause:.1f} s"
        elif kind == "discovery":
            pause = self.random.uniform(3.0, 8.0)
            left = {h: n for h, n in self.discovered.items() if h != host}
            self.job.set_hosts(self._hosts_text(left))
            time.sleep(pause)
            self.job.set_hosts(self._hosts_text(self.discovered))
            detail = f"out of discovery for {pause:.1f} s"
        else:
            raise ValueError(f"unknown fault kind {kind!r}; known: {FAULT_KINDS}")
        fault = Fault(kind, host, started, started if kind == "kill" else time.time(), detail)
        self.faults.append(fault)
        return fault

    def run(self, count: int, kinds: tuple[str, ...] = FAULT_KINDS, gap: tuple[float, float] = (1.0, 4.0)) -> None:
        """`count` faults, each kind in turn first (so a short run has every kind), then drawn at random. Each
        comes a random `gap` after the job trains again on every slot (hosts blacklisted by the last fault come
        back after their cooldown), so that each fault's time to resume is its own."""
        full = sum(self.slots.values())
        settled = self.wait_training(time.time() - 1.0, None, self.resume_bound, size=full)
        for index in range(count):
            time.sleep(self.random.uniform(*gap))
            kind = kinds[index] if index < len(kinds) else self.random.choice(kinds)
            world = self.current_world()
            fault = self.inject(kind)
            fault.resumed = self.wait_training(fault.ended, world if kind in REFORMING else None, self.resume_bound)
            self.sample_rss()
            settled = self.wait_training(fault.resumed - 0.001, None, self.settle_bound, size=full)
            fault.full_again = settled

    # ------------------------------------------------------------------------------------- the end

    def finish(self, timeout: float = 180.0) -> None:
        self.stop_file.write_text("stop\n")
        code = self.job.finish(timeout)
        assert code == 0, f"rvodrun exited with {code}\n{self.describe()}\n{self.job_report()}"
        epochs = completed_epochs(self.out)
        assert epochs, "no epoch was completed"
        assert_every_sample_once_per_epoch(self.out, len(epochs), SAMPLES)
        stray = self.cluster.wait_until_empty()
        assert stray == {}, f"processes left behind: {stray}"
        segments = list(self.shm_dir.iterdir())
        assert segments == [], f"shared-memory segments left behind: {segments}"
        listening = self.listening_ports()
        assert all(ports <= {22} for ports in listening.values()), f"sockets still listening: {listening}"
        grown = {pid: (samples[0], max(samples)) for pid, samples in self.rss.items()
                 if max(samples) - samples[0] > self.rss_slack}
        assert not grown, (f"private resident memory (RssAnon) grew by more than {self.rss_slack >> 20} MiB "
                           f"(first, most): {grown}")
        mapped = {pid: (host, max(samples)) for pid, (host, samples) in self.shmem.items()
                  if max(samples) > self.shmem_bound(host)}
        assert not mapped, f"more shared memory mapped than one world's segment (host, most): {mapped}"

    def listening_ports(self) -> dict[str, set[int]]:
        ports = {}
        for host, sshd in self.cluster.sshds.items():
            tables = "".join(Path(f"/proc/{sshd.pid}/net/{table}").read_text() for table in ("tcp", "tcp6"))
            ports[host] = netns._listening_ports(tables)
        return ports

    def describe(self) -> str:
        lines = [f"{f.kind:<10} host {f.host} at {f.started:.1f}: {f.detail}; "
                 f"{'not resumed' if f.resumed is None else f'resumed after {f.time_to_resume:.1f} s'}"
                 f"{'' if f.full_again is None else f', every slot after {f.full_again - f.ended:.1f} s'}"
                 for f in self.faults]
        return "faults:\n" + "\n".join(lines)

    def job_report(self) -> str:
        """The end of what rvodrun printed so far (its output goes to files in the job's folder)."""
        stderr = (self.out / "rvodrun.stderr").read_text(errors="replace")
        running = "still running" if self.job.process.poll() is None else f"exited {self.job.process.returncode}"
        return f"rvodrun ({running}), the end of its stderr:\n{stderr[-8000:]}"

    def samples_off(self) -> int:
        """Samples not trained on exactly once, summed over the finished epochs (0 when every epoch counted each
        sample once), plus every sample of an epoch missing between the first and the last finished one."""
        records = read(self.out, "epochs.jsonl")
        epochs = completed_epochs(self.out)
        off = sum(sum(abs(count - 1.0) for count in record["counts"]) for record in
                  {record["epoch"]: record for record in records}.values())
        missing = len(set(range(epochs[-1] + 1)) - set(epochs)) if epochs else 0
        return int(off + missing * SAMPLES)

    def summary(self) -> dict:
        """Faults by kind, survived, time to resume (p50, p99), epochs and samples lost or repeated (must be 0)."""
        resumes = sorted(f.time_to_resume for f in self.faults if f.time_to_resume is not None)
        full = sorted(f.full_again - f.ended for f in self.faults if f.full_again is not None)
        by_kind: dict[str, int] = {}
        for fault in self.faults:
            by_kind[fault.kind] = by_kind.get(fault.kind, 0) + 1
        p99 = resumes[min(len(resumes) - 1, round(0.99 * (len(resumes) - 1)))] if resumes else None
        return {"faults": len(self.faults), "by_kind": by_kind, "survived": len(resumes),
                "resume_p50_s": statistics.median(resumes) if resumes else None, "resume_p99_s": p99,
                "resume_max_s": max(resumes) if resumes else None,
                "every_slot_p50_s": statistics.median(full) if full else None,
                "every_slot_max_s": max(full) if full else None,
                "worlds": self.current_world(), "epochs": len(completed_epochs(self.out)),
                "samples_lost_or_repeated": self.samples_off(),
                "rss_anon_growth_max_mib": max((max(v) - v[0] for v in self.rss.values()), default=0) / (1 << 20),
                "rss_shmem_max_mib": max((max(v) for _, v in self.shmem.values()), default=0) / (1 << 20),
                "workers_sampled": len(self.rss)}
