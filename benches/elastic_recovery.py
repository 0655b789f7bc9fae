"""Elastic recovery times: rvodrun's elastic mode against torchrun's elastic restart, same model, same
simulated hosts, same run (issue 15's measurement).

    python benches/elastic_recovery.py [--kills 10] [--adds 3]

Three simulated hosts, one worker each, train the same small MLP: for rvod three names of this machine
(localhost, 127.0.0.1, its host name) in an rvodrun host discovery script; for torchrun three agents
(`torchrun --nnodes 2:3 --nproc-per-node 1`, c10d rendezvous at a store of its own), one per host. Two
figures, each with every sample and the median:
- death to training resumed: rank 1 of a 3-worker world kills itself (SIGKILL) 5 steps into that world,
  --kills times. rvod (`--min-np 2 --blacklist-cooldown-range 1 1`): the survivors restore the last commit
  and go on as 2 ranks, and the job grows back to 3 once the host's cooldown ends, ready for the next kill.
  torchrun (`--max-restarts`): every agent restarts its worker (new processes: import torch,
  init_process_group, DDP) in a new rendezvous of 3.
- host appearing to training on it: a job trains on 2 hosts; then a third appears (rvod: the discovery
  script lists it; torchrun: its agent starts), --adds times, a new job each time.
"Resumed"/"training" is the first time a worker of the new world starts training (after rvod's state sync,
after torchrun's DDP construction). A job that does not end within --timeout seconds is stopped and
reported with what it measured until then.
"""

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HOSTS = ("localhost", "127.0.0.1", socket.gethostname())
# Steps a world of 3 trains before the job may end (all ranks count the same steps, so they agree).
_STEPS_TO_END = 20


def record(out, name, **fields):
    fields.update(time=time.time(), pid=os.getpid())
    with open(os.path.join(out, name), "a") as file:
        file.write(json.dumps(fields) + "\n")


def count(out, name):
    path = Path(out) / name
    return path.read_text().count("\n") if path.exists() else 0


def make_model(torch):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def step(torch, model, optimizer, x, y):
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    time.sleep(0.02)


def die_now(out, mode, kills, rank, size, in_world):
    """Whether this worker kills itself now: rank 1 of a world of 3, 5 steps in, until --kills deaths."""
    return mode == "kill" and rank == 1 and size == 3 and in_world == 5 and count(out, "kills.jsonl") < kills


def die(out):
    record(out, "kills.jsonl")
    os.kill(os.getpid(), signal.SIGKILL)


def done(out, mode, kills, size, in_world, rank0_says):
    """Whether every rank stops now: a world of 3 trained _STEPS_TO_END steps and (kill mode) every death
    happened, as rank 0 sees it (``rank0_says(flag)`` broadcasts its flag)."""
    if size != 3 or in_world != _STEPS_TO_END:
        return False
    return mode == "add" or rank0_says(count(out, "kills.jsonl") >= kills)


def rvod_worker(out, mode, steps, kills):
    import torch

    import rvod.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    model = make_model(torch)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, optimizer, step=0)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))

    @hvd.elastic.run
    def train(state):
        record(out, "starts.jsonl", size=hvd.size(), rank=hvd.rank())
        in_world = 0
        while state.step < steps:
            if die_now(out, mode, kills, hvd.rank(), hvd.size(), in_world):
                die(out)
            if done(out, mode, kills, hvd.size(), in_world, lambda flag: hvd.broadcast_object(flag, 0)):
                return
            step(torch, model, optimizer, x, y)
            state.step += 1
            in_world += 1
            state.commit()

    train(state)


def torchrun_worker(out, mode, steps, kills):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(make_model(torch))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    rank, size = dist.get_rank(), dist.get_world_size()

    def rank0_says(flag):
        said = [flag]
        dist.broadcast_object_list(said, 0)
        return said[0]

    record(out, "starts.jsonl", size=size, rank=rank)
    for in_world in range(steps):
        if die_now(out, mode, kills, rank, size, in_world):
            die(out)
        if done(out, mode, kills, size, in_world, rank0_says):
            break
        step(torch, model, optimizer, x, y)
    dist.destroy_process_group()


def worker_args(me, framework, out, args, mode):
    return [me, "--worker", framework, "--mode", mode, "--out", str(out), "--steps", str(args.steps),
            "--kills", str(args.kills)]


def rvod_job(me, out, args, mode):
    """rvodrun on the hosts of its discovery script (2 of them first in "add" mode)."""
    hosts = out / "hosts"
    hosts.write_text("".join(f"{h}:1\n" for h in (HOSTS if mode == "kill" else HOSTS[:2])))
    command = [sys.executable, "-m", "rvod.runner", "--min-np", "2", "--max-np", "3", "--blacklist-cooldown-range",
               "1", "1", "--host-discovery-script", f"cat {hosts}", sys.executable,
               *worker_args(me, "rvod", out, args, mode)]
    return [_start(command)]


def add_rvod_host(out, jobs):
    (out / "hosts.new").write_text("".join(f"{h}:1\n" for h in HOSTS))
    (out / "hosts.new").replace(out / "hosts")


def _torchrun_agent(me, out, args, mode, port):
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE: with the store shared (the default), an agent that was in an earlier
    # round keeps that round's MASTER_ADDR and never publishes the new round's, so a joining agent waits for
    # it until it times out (torch 2.15): torchrun cannot grow onto a new host without this opt-out.
    command = ["env", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", sys.executable, "-m", "torch.distributed.run", "--nnodes", "2:3", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "bench",
               "--rdzv-conf", "last_call_timeout=1,is_host=false", "--max-restarts", str(2 * args.kills + 2),
               "--monitor-interval", "0.5", *worker_args(me, "torchrun", out, args, mode)]
    return _start(command)


def torchrun_job(me, out, args, mode):
    """One torchrun agent per simulated host (2 of them first in "add" mode), meeting at a c10d rendezvous
    store in a process of its own, as at a cluster's rendezvous endpoint (no agent's restart or exit
    touches it)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    (out / "port").write_text(str(port))
    store = _start([sys.executable, "-c", "import sys, time, torch.distributed as d; "
                    "s = d.TCPStore('127.0.0.1', int(sys.argv[1]), is_master=True, wait_for_workers=False); "
                    "print('ready', flush=True); time.sleep(100000)", str(port), str(out)], stdout=subprocess.PIPE)
    assert store.stdout.readline().strip() == "ready", store.stderr.read()
    store.service = True  # stopped when the agents end
    return [store] + [_torchrun_agent(me, out, args, mode, port) for _ in range(3 if mode == "kill" else 2)]


def add_torchrun_host(me, out, args, jobs):
    jobs.append(_torchrun_agent(me, out, args, "add", int((out / "port").read_text())))


def _start(command, stdout=subprocess.DEVNULL):
    return subprocess.Popen(command, stdout=stdout, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)


def _kill_workers_of(out):
    """Kills the processes whose command line names `out` (the job's workers and agents)."""
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and str(out).encode() in (entry / "cmdline").read_bytes():
                os.kill(int(entry.name), signal.SIGKILL)
        except OSError:
            pass


def starts(out):
    path = out / "starts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run_job(name, start, out, args, mode, add=None):
    """Runs one job to its end; returns (times, a line describing how it ended). In "add" mode, ``add()``
    makes the third host appear once the job has trained on two for a few seconds."""
    started = time.monotonic()
    deadline = started + args.timeout
    jobs = start(out, mode)
    appeared = None
    ended = "ended"
    while any(job.poll() is None for job in jobs if not getattr(job, "service", False)):
        if time.monotonic() > deadline:
            for job in jobs:
                if job.poll() is None:
                    os.killpg(job.pid, signal.SIGKILL)
            _kill_workers_of(out)  # torchrun starts its workers in sessions of their own
            ended = f"stopped after {args.timeout} s"
            break
        if add is not None and appeared is None and len([s for s in starts(out) if s["size"] == 2]) >= 2:
            time.sleep(3)
            appeared = time.time()
            add(out, jobs)
        time.sleep(0.05)
    for job in jobs:
        if getattr(job, "service", False):
            os.killpg(job.pid, signal.SIGKILL)
    failed = [job for job in jobs if job.wait() != 0 and not getattr(job, "service", False)]
    for job in failed:
        print(f"{name}: a process ended with {job.returncode}; the end of its stderr:\n{job.stderr.read()[-1500:]}",
              file=sys.stderr)
    times = sorted(s["time"] for s in starts(out))
    if mode == "kill":
        path = out / "kills.jsonl"
        events = [json.loads(line)["time"] for line in path.read_text().splitlines()] if path.exists() else []
        found = [min(t for t in times if t > e) - e for e in events if any(t > e for t in times)]
    else:
        grown = sorted(s["time"] for s in starts(out) if s["size"] == 3)
        found = [grown[0] - appeared] if appeared is not None and grown else []
    return found, f"job {time.monotonic() - started:.0f} s, {ended}" + (", a process failed" if failed else "")


def report(name, what, times, notes):
    median = f"{statistics.median(times) * 1000:.0f} ms" if times else "n/a"
    print(f"{name}: {what}: {len(times)} samples, {', '.join(f'{t * 1000:.0f}' for t in times) or '-'} ms; "
          f"p50 {median} ({'; '.join(notes)})", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--adds", type=int, default=3, help="jobs that each see a host appear")
    parser.add_argument("--steps", type=int, default=10000, help="most steps a job trains")
    parser.add_argument("--timeout", type=int, default=400, help="seconds each job may take")
    parser.add_argument("--only", choices=["rvod", "torchrun"], help="run one framework's jobs")
    parser.add_argument("--worker", choices=["rvod", "torchrun"], help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["kill", "add"], default="kill", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "rvod":
        return rvod_worker(args.out, args.mode, args.steps, args.kills)
    if args.worker == "torchrun":
        return torchrun_worker(args.out, args.mode, args.steps, args.kills)
    me = str(Path(__file__).resolve())
    frameworks = {
        "rvod elastic": (lambda out, mode: rvod_job(me, out, args, mode), add_rvod_host),
        "torchrun": (lambda out, mode: torchrun_job(me, out, args, mode),
                     lambda out, jobs: add_torchrun_host(me, out, args, jobs)),
    }
    for name, (start, add) in frameworks.items():
        if args.only and not name.startswith(args.only):
            continue
        with tempfile.TemporaryDirectory() as out:
            times, note = run_job(name, start, Path(out), args, "kill")
        report(name, "death to training resumed", times, [note])
        grown, notes = [], []
        for _ in range(args.adds):
            with tempfile.TemporaryDirectory() as out:
                times, note = run_job(name, start, Path(out), args, "add", add)
            grown += times
            notes.append(note)
        report(name, "host appearing to training on it", grown, notes)


if __name__ == "__main__":
    main()
