"""Starting one benchmark job (all ranks of one implementation for one round) and waiting for it.

rvod ranks are started by `rvodrun -np N`, exactly as a user would, with RVOD_SHM=1 (rvod-shm) or RVOD_SHM=0
(rvod-tcp) in the job's environment; Horovod ranks by `horovodrun -np N -H localhost:N`; gloo ranks are N
plain subprocesses with torch.distributed's env:// variables (MASTER_ADDR=127.0.0.1 and a free port); MPI ranks by
Open MPI's `mpirun -np N` (as root where needed, no core binding, so every job shares the cores alike). Every
job runs in its own process group with a time limit, and its combined output goes to a log file that is
shown if it fails.
"""

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from collectives_backends import IMPLS

HERE = Path(__file__).resolve().parent
WORKER = HERE / "collectives_worker.py"

# What RVOD_SHM each rvod implementation's job gets.
RVOD_SHM = {impl: "1" if transport == "shm" else "0" for impl, (family, transport) in IMPLS.items()
            if family == "rvod"}


def horovod_available():
    return importlib.util.find_spec("horovod") is not None


def mpi_available():
    return importlib.util.find_spec("mpi4py") is not None and shutil.which("mpirun") is not None


def default_impls():
    return (["rvod-shm", "rvod-tcp", "gloo"] + (["horovod"] if horovod_available() else [])
            + (["mpi"] if mpi_available() else []))


def find_launcher(name, explicit=None):
    """`rvodrun` / `horovodrun`: the one given, else the one beside this Python, else the one on PATH."""
    if explicit:
        return explicit
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else (shutil.which(name) or name)


def find_rvodrun(explicit=None):
    return find_launcher("rvodrun", explicit)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _base_env():
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def _worker_args(impl, plan_path, raw_dir, round_index):
    return [sys.executable, str(WORKER), "--impl", impl, "--plan", str(plan_path), "--out", str(raw_dir),
            "--round", str(round_index)]


def _wait_all(procs, timeout):
    """Wait for every process; on timeout or the first failure, stop the rest. Returns the exit codes."""
    deadline = time.monotonic() + timeout
    codes = [None] * len(procs)
    while any(c is None for c in codes):
        for i, p in enumerate(procs):
            if codes[i] is None:
                codes[i] = p.poll()
        failed = any(c not in (None, 0) for c in codes)
        if failed or time.monotonic() > deadline:
            for p, c in zip(procs, codes):
                if c is None:
                    os.killpg(p.pid, signal.SIGTERM)
            for i, p in enumerate(procs):
                if codes[i] is None:
                    try:
                        codes[i] = p.wait(10)
                    except subprocess.TimeoutExpired:
                        os.killpg(p.pid, signal.SIGKILL)
                        codes[i] = p.wait()
            break
        time.sleep(0.05)
    return codes


def _start(impl, np_, args, env, log, rvodrun):
    """The processes of one job: one launcher (rvodrun, horovodrun) or one process per gloo rank."""
    popen = dict(stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    if impl in ("horovod",) + tuple(RVOD_SHM):
        # The fusion phase cycles through 1,024 tensor names and a barrier: one more than the default response
        # cache holds, and a least-recently-used cache then misses every lookup (both say so in a warning).
        # Sized for the run, as a user with that many tensors would.
        env.setdefault("RVOD_CACHE_CAPACITY", "4096")
        env.setdefault("HOROVOD_CACHE_CAPACITY", "4096")
    if impl in RVOD_SHM:
        env["RVOD_SHM"] = RVOD_SHM[impl]
        return [subprocess.Popen([find_rvodrun(rvodrun), "-np", str(np_)] + args, env=env, **popen)]
    if impl == "horovod":
        cmd = [find_launcher("horovodrun"), "-np", str(np_), "-H", f"localhost:{np_}"]
        return [subprocess.Popen(cmd + args, env=env, **popen)]
    if impl == "mpi":
        cmd = ["mpirun", "-np", str(np_), "--bind-to", "none", "--oversubscribe"]
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        return [subprocess.Popen(cmd + args, env=env, **popen)]
    if impl == "gloo":
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(np_),
                   GLOO_SOCKET_IFNAME="lo")
        return [subprocess.Popen(args, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), **popen) for r in range(np_)]
    raise ValueError(f"unknown implementation {impl!r} (known: {', '.join(IMPLS)})")


def run_job(impl, np_, plan_path, raw_dir, round_index, log_path, timeout, rvodrun=None):
    """Run one job to completion; raises RuntimeError (with the log's tail) if any rank fails."""
    with open(log_path, "w") as log:
        procs = _start(impl, np_, _worker_args(impl, plan_path, raw_dir, round_index), _base_env(), log, rvodrun)
        codes = _wait_all(procs, timeout)
    if any(codes):
        tail = Path(log_path).read_text(errors="replace")[-4000:]
        raise RuntimeError(f"{impl} job (round {round_index}) failed, exit codes {codes}; log {log_path}:\n{tail}")
