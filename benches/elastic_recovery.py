"""Time from a worker's death to training resuming: rvodrun's elastic mode against torchrun's elastic
restart, same model, same machine, same run (issue 15's measurement).

    python benches/elastic_recovery.py [--kills 5] [--steps 200]

Both jobs train the same small MLP on 3 workers and kill one (SIGKILL) a few steps into each world:
- rvod: `rvodrun --min-np 2 --blacklist-cooldown-range 1 1` on three names of this machine (localhost,
  127.0.0.1, its host name); the survivors restore the last commit and go on as 2 ranks, and the job
  grows back to 3 when the host's cooldown ends, ready for the next kill;
- torchrun: `torchrun --standalone --nproc-per-node 3 --max-restarts K` restarts every worker of the job
  (new processes: import torch, init_process_group, DDP) after each death.
"Resumed" is the first time a worker of the new world starts training (after rvod's state sync, after
torchrun's DDP construction). Prints each job's recovery times and their median; a job that does not end
within --timeout seconds is stopped and reported with what it measured until then.
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


def record(out, name, **fields):
    fields.update(time=time.time(), pid=os.getpid())
    with open(os.path.join(out, name), "a") as file:
        file.write(json.dumps(fields) + "\n")


def make_model(torch):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def step(torch, out, world, die, model, optimizer, x, y):
    """One training step, or (``die``) this worker's death by SIGKILL, recorded first."""
    if die:
        record(out, "kills.jsonl", world=world)
        os.kill(os.getpid(), signal.SIGKILL)
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    time.sleep(0.02)


def rvod_worker(out, steps, kills):
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
        world = int(os.environ["RVOD_ELASTIC_ROUND"])
        record(out, "starts.jsonl", world=world, rank=hvd.rank())
        in_world = 0
        while state.step < steps:
            step(torch, out, world, hvd.rank() == 1 and world in kills and in_world == 5, model, optimizer, x, y)
            state.step += 1
            in_world += 1
            state.commit()

    train(state)


def torchrun_worker(out, steps, kills):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    model = torch.nn.parallel.DistributedDataParallel(make_model(torch))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    record(out, "starts.jsonl", world=restart, rank=dist.get_rank())
    for done in range(steps):
        step(torch, out, restart, dist.get_rank() == 1 and restart < kills and done == 5, model, optimizer, x, y)
    dist.destroy_process_group()


def recoveries(out):
    starts = sorted(json.loads(line)["time"] for line in (out / "starts.jsonl").read_text().splitlines())
    kills = [json.loads(line)["time"] for line in (out / "kills.jsonl").read_text().splitlines()]
    return [min(t for t in starts if t > kill) - kill for kill in kills if any(t > kill for t in starts)]


def _kill_workers_of(out):
    """Kills the processes whose command line names `out` (the job's workers)."""
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and str(out).encode() in (entry / "cmdline").read_bytes():
                os.kill(int(entry.name), signal.SIGKILL)
        except OSError:
            pass


def run_job(name, command, out, timeout):
    started = time.monotonic()
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)
    try:
        _, stderr = job.communicate(timeout=timeout)
        ended = f"exit {job.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        _kill_workers_of(out)  # torchrun starts its workers in sessions of their own
        _, stderr = job.communicate()
        ended = f"stopped after {timeout} s"
    if job.returncode != 0:
        print(f"{name}: {ended}; the end of its stderr:\n{stderr[-1500:]}", file=sys.stderr)
    kills = (out / "kills.jsonl").read_text().count("\n") if (out / "kills.jsonl").exists() else 0
    times = recoveries(out)
    median = f"{statistics.median(times) * 1000:.0f} ms" if times else "n/a"
    print(f"{name}: {kills} kills, {len(times)} recoveries, death to training resumed "
          f"{', '.join(f'{t * 1000:.0f}' for t in times) or '-'} ms; p50 {median} "
          f"(job {time.monotonic() - started:.0f} s, {ended})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--timeout", type=int, default=300, help="seconds each job may take")
    parser.add_argument("--worker", choices=["rvod", "torchrun"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "rvod":
        return rvod_worker(args.out, args.steps, set(range(1, 2 * args.kills, 2)))
    if args.worker == "torchrun":
        return torchrun_worker(args.out, args.steps, args.kills)
    me = str(Path(__file__).resolve())
    with tempfile.TemporaryDirectory() as rvod_out, tempfile.TemporaryDirectory() as torch_out:
        hosts = Path(rvod_out) / "hosts"
        hosts.write_text("".join(f"{h}:1\n" for h in ("localhost", "127.0.0.1", socket.gethostname())))
        run_job("rvod elastic", [sys.executable, "-m", "rvod.runner", "--min-np", "2", "--blacklist-cooldown-range",
                                 "1", "1", "--host-discovery-script", f"cat {hosts}", sys.executable, me,
                                 "--worker", "rvod", "--out", rvod_out, "--steps", str(args.steps),
                                 "--kills", str(args.kills)], Path(rvod_out), args.timeout)
        run_job("torchrun", [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                             "--max-restarts", str(args.kills), "--monitor-interval", "0.5", me, "--worker", "torchrun",
                             "--out", torch_out, "--steps", str(args.steps), "--kills", str(args.kills)],
                Path(torch_out), args.timeout)


if __name__ == "__main__":
    main()
