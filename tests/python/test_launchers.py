"""Jobs started without rvodrun: Open MPI's mpirun (for real, with and without mpi4py), torchrun (for real),
Slurm's srun and MPICH's hydra (by their environment variables: the test starts each rank itself).

Every rank runs workers/launched.py (exact collective results, plus the topology rvod reports) or, under
torchrun, workers/launched_torch.py (DistributedOptimizer against one-process training). Also: the refusal
to run unauthenticated across hosts, RVOD_INSECURE_RENDEZVOUS, a rank that cannot reach rank 0, a rank 0
that cannot serve, and torchrun's variables across two network namespaces (two "hosts"; root only).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import JOB_TAG_VARIABLE, kill_tagged
from jobs import WORKERS

LAUNCHED = str(WORKERS / "launched.py")
# mpirun --tag-output prefixes each line with [job,rank]<stdout>: (keeping the ranks' lines whole).
TAG = r"^(?:\[\d+,\d+\]<stdout>:)?"
VERDICT = re.compile(TAG + r"rank (\d+): (\d+) checks passed, (\d+) failed$", re.MULTILINE)
TOPOLOGY = re.compile(TAG + r"topology: (\{.*\})$", re.MULTILINE)
LAUNCHED_CHECKS = 8
RVOD_PREFIXES = ("RVOD_", "HOROVOD_", "OMPI_", "PMI_", "PMIX_", "SLURM_", "TORCHELASTIC_")
LAUNCHER_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                  "MASTER_ADDR", "MASTER_PORT", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"}


@pytest.fixture
def clean_env(job_env: dict[str, str]) -> dict[str, str]:
    """The job environment without any launcher's or rvod's variables from the outside."""
    env = {k: v for k, v in job_env.items()
           if k == JOB_TAG_VARIABLE or not (k.startswith(RVOD_PREFIXES) or k in LAUNCHER_NAMES)}
    env["RVOD_START_TIMEOUT"] = "30"
    env["RVOD_LOG_LEVEL"] = "info"  # each rank logs how it reached rank 0's store
    env["PYTHONUNBUFFERED"] = "1"
    return env


def without_mpi4py(env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """`env` where `import mpi4py` fails, as on a machine without it."""
    blocker = tmp_path / "no_mpi4py" / "mpi4py"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('mpi4py is hidden by the test')\n")
    env = dict(env)
    env["PYTHONPATH"] = os.pathsep.join([str(blocker.parent), env.get("PYTHONPATH", "")])
    return env


def verdicts(stdout: str) -> dict[int, tuple[int, int]]:
    return {int(r): (int(p), int(f)) for r, p, f in VERDICT.findall(stdout)}


def topologies(stdout: str) -> dict[int, dict]:
    found = [json.loads(text) for text in TOPOLOGY.findall(stdout)]
    return {t["rank"]: t for t in found}


def report(result) -> str:
    return f"exit {result.returncode}\nstdout:\n{result.stdout[-6000:]}\nstderr:\n{result.stderr[-6000:]}"


def run(command: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Runs a launcher to the end; on timeout kills the job and fails with its output."""
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               errors="replace")
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tagged(env[JOB_TAG_VARIABLE])
        process.kill()
        stdout, stderr = process.communicate()
        pytest.fail(f"{command[0]} did not finish within {timeout} s\nstdout:\n{stdout}\nstderr:\n{stderr}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def start_ranks(envs: list[dict[str, str]], tmp_path: Path, timeout: float, script: str = LAUNCHED,
                prefixes: list[list[str]] | None = None):
    """Starts one process per environment (as srun or hydra would; each command after its prefix, e.g.
    `ip netns exec NAME`) and waits for all; returns [(returncode, stdout, stderr)] in rank order. Whatever
    is left at the timeout is killed."""
    processes = []
    for index, env in enumerate(envs):
        out, err = tmp_path / f"rank{index}.out", tmp_path / f"rank{index}.err"
        command = [*(prefixes[index] if prefixes else []), sys.executable, script]
        with out.open("w") as stdout, err.open("w") as stderr:
            processes.append((subprocess.Popen(command, env=env, stdout=stdout, stderr=stderr), out, err))
    deadline = time.monotonic() + timeout
    results = []
    for process, out, err in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other, _, _ in processes:
                other.kill()
            process.wait()
        results.append((process.returncode, out.read_text(errors="replace"), err.read_text(errors="replace")))
    return results


def ranks_report(results) -> str:
    return "\n".join(f"--- rank {i}: exit {code}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
                     for i, (code, out, err) in enumerate(results))


def assert_ranks_passed(results, launcher: str) -> dict[int, dict]:
    """Every rank exited 0 with all checks passed; returns the topology each reported."""
    text = ranks_report(results)
    assert all(code == 0 for code, _, _ in results), text
    found = {}
    for code, out, _ in results:
        found.update(topologies(out))
        for rank, (passed, failed) in verdicts(out).items():
            assert (passed, failed) == (LAUNCHED_CHECKS, 0), text
    assert sorted(found) == list(range(len(results))), text
    assert all(t["launcher"] == launcher for t in found.values()), text
    return found


def for_mpirun(env: dict[str, str]) -> dict[str, str]:
    """`env` without PYTHONUNBUFFERED: unbuffered, print() writes a line and its newline separately, and
    mpirun's --tag-output would tag them as two lines."""
    return {k: v for k, v in env.items() if k != "PYTHONUNBUFFERED"}


def mpirun_command(size: int, env: dict[str, str]) -> list[str]:
    command = [shutil.which("mpirun") or "mpirun", "--oversubscribe", "--tag-output", "-np", str(size)]
    if os.geteuid() == 0:
        command.append("--allow-run-as-root")
    for name in ("PYTHONPATH", JOB_TAG_VARIABLE, "RVOD_START_TIMEOUT", "RVOD_TEST_COMM", "RVOD_LOG_LEVEL",
                 "RVOD_RENDEZVOUS_PORT"):
        if name in env:
            command += ["-x", name]
    return command


def private_files(prefix: str) -> set[str]:
    directory = Path(os.environ.get("TMPDIR", "/tmp")) / f"rvod-{os.geteuid()}"
    return {p.name for p in directory.glob(f"{prefix}*.rendezvous")} if directory.is_dir() else set()


needs_mpirun = pytest.mark.skipif(shutil.which("mpirun") is None,
                                  reason="Open MPI's mpirun is not installed (scripts/setup-system.sh installs it)")


def assert_one_host_topology(found: dict[int, dict], size: int) -> None:
    for rank, topology in found.items():
        assert (topology["size"], topology["local_rank"], topology["local_size"]) == (size, rank, size), topology
        assert (topology["cross_rank"], topology["cross_size"]) == (0, 1), topology
        assert topology["transport"] == "shm", topology
        assert (topology["mpi_enabled"], topology["mpi_built"]) == (False, False), topology


@needs_mpirun
@pytest.mark.timeout(90)
@pytest.mark.parametrize("size", [2, 3])
def test_mpirun_with_mpi4py(clean_env, size):
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (scripts/run-tests.sh installs it)")
    before = private_files("openmpi-")
    env = for_mpirun(clean_env)
    result = run(mpirun_command(size, env) + [sys.executable, LAUNCHED], env, timeout=80)
    assert result.returncode == 0, report(result)
    assert verdicts(result.stdout) == {r: (LAUNCHED_CHECKS, 0) for r in range(size)}, report(result)
    found = topologies(result.stdout)
    assert sorted(found) == list(range(size)), report(result)
    assert {t["launcher"] for t in found.values()} == {"openmpi"}
    assert_one_host_topology(found, size)
    # Ranks 1.. reach rank 0's store twice (init, then init again after shutdown).
    assert result.stderr.count("(address and secret sent by rank 0 over MPI)") == 2 * (size - 1), report(result)
    assert private_files("openmpi-") == before


@needs_mpirun
@pytest.mark.timeout(90)
def test_mpirun_without_mpi4py_meets_through_a_private_file(clean_env, tmp_path):
    env = for_mpirun(without_mpi4py(clean_env, tmp_path))
    before = private_files("openmpi-")
    result = run(mpirun_command(3, env) + [sys.executable, LAUNCHED], env, timeout=80)
    assert result.returncode == 0, report(result)
    assert verdicts(result.stdout) == {r: (LAUNCHED_CHECKS, 0) for r in range(3)}, report(result)
    assert_one_host_topology(topologies(result.stdout), 3)
    assert result.stderr.count("(port and secret from the private file") == 2 * 2, report(result)
    assert private_files("openmpi-") == before, "rank 0 removes its rendezvous file at shutdown"


@needs_mpirun
@pytest.mark.timeout(120)
@pytest.mark.parametrize("comm, sizes", [("world", {0: 3, 1: 3, 2: 3}), ("ranks:0,2", {0: 2, 1: 2}),
                                         ("split", {0: 2, 1: 2})])
def test_mpirun_init_with_a_communicator(clean_env, comm, sizes):
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (scripts/run-tests.sh installs it)")
    env = for_mpirun(dict(clean_env, RVOD_TEST_COMM=comm))
    result = run(mpirun_command(3, env) + [sys.executable, LAUNCHED], env, timeout=100)
    assert result.returncode == 0, report(result)
    passed = VERDICT.findall(result.stdout)
    found = [json.loads(text) for text in TOPOLOGY.findall(result.stdout)]
    if comm == "ranks:0,2":
        assert "[1,1]<stdout>:world rank not in comm" in result.stdout, report(result)
        assert len(found) == 2 and len(passed) == 2, report(result)
    elif comm == "split":
        # World ranks 0 and 2 form a job of two; world rank 1 is a job of its own.
        assert sorted((t["size"], t["rank"]) for t in found) == [(1, 0), (2, 0), (2, 1)], report(result)
        assert len(passed) == 3, report(result)
    else:
        assert sorted(t["rank"] for t in found) == [0, 1, 2], report(result)
    assert all(int(failed) == 0 and int(count) == LAUNCHED_CHECKS for _, count, failed in passed), report(result)
    for topology in found:
        assert (topology["local_rank"], topology["local_size"]) == (topology["rank"], topology["size"]), topology
        assert (topology["cross_rank"], topology["cross_size"]) == (0, 1), topology


@needs_mpirun
@pytest.mark.timeout(60)
def test_mpirun_rank_0_that_cannot_serve_fails_every_rank(clean_env):
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (scripts/run-tests.sh installs it)")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = for_mpirun(dict(clean_env, RVOD_RENDEZVOUS_PORT=str(port)))
        started = time.monotonic()
        result = run(mpirun_command(2, env) + [sys.executable, LAUNCHED], env, timeout=50)
    assert result.returncode != 0, report(result)
    assert time.monotonic() - started < 30, "the other rank does not wait for its start timeout"
    cause = rf"rank 0 of 2 \(started by Open MPI\): cannot start the rendezvous store on 127\.0\.0\.1:{port}: "
    assert re.search(rf"\[1,0\]<stderr>:rvod.exceptions.RvodInternalError: rvod initialization failed: {cause}", result.stderr), \
        report(result)
    assert re.search(rf"\[1,1\]<stderr>:rvod.exceptions.RvodInternalError: rvod initialization failed: rank 0 could not start the job's "
                     rf"rendezvous store: {cause}", result.stderr), report(result)


def torchrun_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


@pytest.mark.timeout(150)
def test_torchrun_collectives_and_distributed_optimizer(clean_env):
    pytest.importorskip("torch", reason="torchrun comes with PyTorch")
    result = run(torchrun_command("--standalone", "--nproc-per-node", "2", LAUNCHED), clean_env, timeout=80)
    assert result.returncode == 0, report(result)
    assert verdicts(result.stdout) == {0: (LAUNCHED_CHECKS, 0), 1: (LAUNCHED_CHECKS, 0)}, report(result)
    found = topologies(result.stdout)
    assert {t["launcher"] for t in found.values()} == {"torchrun"}, report(result)
    assert_one_host_topology(found, 2)
    # The c10d rendezvous backend on loopback, training with DistributedOptimizer.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    training = torchrun_command("--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", uuid.uuid4().hex,
                                str(WORKERS / "launched_torch.py"))
    result = run(training, clean_env, timeout=120)
    assert result.returncode == 0, report(result)
    assert verdicts(result.stdout) == {0: (10, 0), 1: (10, 0)}, report(result)


def slurm_env(base: dict[str, str], rank: int, tasks_per_node: list[int], job_id: int, **extra: str):
    """What srun gives task `rank` of a step spread over `tasks_per_node` (nodes named node1, node2, ...)."""
    node = next(i for i in range(len(tasks_per_node)) if rank < sum(tasks_per_node[:i + 1]))
    env = dict(base, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank - sum(tasks_per_node[:node])),
               SLURM_NODEID=str(node), SLURM_STEP_ID="0", SLURM_JOB_ID=str(job_id),
               SLURM_STEP_NUM_TASKS=str(sum(tasks_per_node)), SLURM_NTASKS=str(sum(tasks_per_node)),
               SLURM_STEP_NUM_NODES=str(len(tasks_per_node)),
               SLURM_STEP_TASKS_PER_NODE=",".join(map(str, tasks_per_node)),
               SLURM_JOB_NODELIST="localhost" if len(tasks_per_node) == 1 else f"node[1-{len(tasks_per_node)}]",
               SLURMD_NODENAME=f"node{node + 1}")
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.timeout(60)
def test_slurm_step_on_one_node(clean_env, tmp_path):
    job = 100000 + os.getpid()
    envs = [slurm_env(clean_env, r, [3], job) for r in range(3)]
    results = start_ranks(envs, tmp_path, timeout=50)
    found = assert_ranks_passed(results, "slurm")
    assert all("(port and secret from the private file" in err for _, _, err in results[1:]), ranks_report(results)
    assert_one_host_topology(found, 3)
    assert not private_files(f"slurm-{job}."), "rank 0 removes its rendezvous file at shutdown"


@pytest.mark.timeout(60)
def test_slurm_step_on_two_nodes_with_a_secret(clean_env, tmp_path):
    # "node1" and "node2" are both this machine: the first host of the node list is reached through
    # RVOD_RENDEZVOUS_ADDR, which wins over it; ranks on different "nodes" talk over TCP, ranks on one node through shared memory.
    secret_file = tmp_path / "secret"
    secret_file.write_text(os.urandom(32).hex() + "\n")
    secret_file.chmod(0o600)
    extra = {"RVOD_RENDEZVOUS_ADDR": "127.0.0.1", "RVOD_RENDEZVOUS_PORT": str(free_port()),
             "RVOD_SECRET_FILE": str(secret_file)}
    envs = [slurm_env(clean_env, r, [2, 1], 200000 + os.getpid(), **extra) for r in range(3)]
    results = start_ranks(envs, tmp_path, timeout=50)
    found = assert_ranks_passed(results, "slurm")
    assert all("(RVOD_RENDEZVOUS_ADDR, port RVOD_RENDEZVOUS_PORT)" in err for _, _, err in results[1:]), \
        ranks_report(results)
    # Horovod's cross ranks: local rank 0 runs on both nodes, local rank 1 only on node1.
    expected = {0: (0, 2, 0, 2), 1: (1, 2, 0, 1), 2: (0, 1, 1, 2)}
    for rank, topology in found.items():
        got = (topology["local_rank"], topology["local_size"], topology["cross_rank"], topology["cross_size"])
        assert got == expected[rank], (rank, topology)
        # One communicator across the nodes: shared memory on node1, TCP between the nodes.
        assert topology["transport"] == "shm+tcp", topology


@pytest.mark.timeout(60)
def test_two_nodes_without_a_secret_are_refused_unless_insecure_is_asked_for(clean_env, tmp_path):
    port = free_port()
    extra = {"RVOD_RENDEZVOUS_ADDR": "127.0.0.1", "RVOD_RENDEZVOUS_PORT": str(port)}
    envs = [slurm_env(clean_env, r, [1, 1], 300000 + os.getpid(), **extra) for r in range(2)]
    (tmp_path / "refused").mkdir()
    started = time.monotonic()
    results = start_ranks(envs, tmp_path / "refused", timeout=30)
    assert time.monotonic() - started < 20, "the refusal comes before any waiting"
    for code, _, err in results:
        assert code != 0, ranks_report(results)
        assert "ValueError" in err and "no secret is set" in err, ranks_report(results)
        assert "RVOD_SECRET" in err and "RVOD_SECRET_FILE" in err and "RVOD_INSECURE_RENDEZVOUS=1" in err, err
    insecure = [dict(env, RVOD_INSECURE_RENDEZVOUS="1") for env in envs]
    (tmp_path / "insecure").mkdir()
    results = start_ranks(insecure, tmp_path / "insecure", timeout=50)
    assert_ranks_passed(results, "slurm")
    assert all("RVOD_INSECURE_RENDEZVOUS is set" in err for _, _, err in results), ranks_report(results)


@pytest.mark.timeout(60)
def test_mpich_style_pmi_variables(clean_env, tmp_path):
    kvs = f"kvs_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    env = without_mpi4py(clean_env, tmp_path)
    envs = [dict(env, PMI_RANK=str(r), PMI_SIZE="3", MPI_LOCALRANKID=str(r), MPI_LOCALNRANKS="3", PMI_KVSNAME=kvs)
            for r in range(3)]
    found = assert_ranks_passed(start_ranks(envs, tmp_path, timeout=50), "pmi")
    assert_one_host_topology(found, 3)
    assert not private_files(f"pmi-{kvs}"), "rank 0 removes its rendezvous file at shutdown"


@pytest.mark.timeout(30)
def test_a_rank_that_cannot_reach_rank_0_says_so_within_the_start_timeout(clean_env, tmp_path):
    port = free_port()  # nothing listens on port + 1 ... rank 0 never starts
    torchrun_rank_1 = dict(clean_env, RANK="1", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                           GROUP_RANK="1", GROUP_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port - 1),
                           RVOD_SECRET=os.urandom(16).hex(), RVOD_START_TIMEOUT="2")
    pmi_rank_1 = dict(without_mpi4py(clean_env, tmp_path), PMI_RANK="1", PMI_SIZE="2", MPI_LOCALRANKID="1",
                      MPI_LOCALNRANKS="2", PMI_KVSNAME=f"kvs_{uuid.uuid4().hex}", RVOD_START_TIMEOUT="2")
    started = time.monotonic()
    (code_a, _, err_a), (code_b, _, err_b) = start_ranks([torchrun_rank_1, pmi_rank_1], tmp_path, timeout=20)
    assert time.monotonic() - started < 15
    assert code_a != 0 and code_b != 0, (err_a, err_b)
    assert "RvodTimeoutError" in err_a and "RvodTimeoutError" in err_b, (err_a, err_b)
    assert re.search(rf"rank 1 of 2 \(started by torchrun\): could not reach rank 0's rendezvous store at "
                     rf"127\.0\.0\.1 port {port} \(MASTER_ADDR, port MASTER_PORT \+ 1\) within 2\.0 s", err_a), err_a
    assert re.search(r"rank 1 of 2 \(started by MPICH/Intel MPI \(PMI\)\): rank 0 did not publish a reachable "
                     r"rendezvous store in .*kvs_\w+\.rendezvous within 2\.0 s", err_b), err_b


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair (198.51.100.1 and .2): two "hosts" on this machine.
    Deleted (with whatever still runs in them) whatever happens."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    tag = f"{os.getpid() % 100000}"
    names = [f"rvodl{tag}a", f"rvodl{tag}b"]
    links = [f"rvl{tag}a", f"rvl{tag}b"]
    try:
        for name in names:
            made = _ip("netns", "add", name)
            if made.returncode != 0:
                pytest.skip(f"cannot make a network namespace: {made.stderr.strip()}")
        steps = [("link", "add", links[0], "type", "veth", "peer", "name", links[1])]
        for index, (name, link) in enumerate(zip(names, links)):
            steps += [("link", "set", link, "netns", name),
                      ("-n", name, "addr", "add", f"198.51.100.{index + 1}/24", "dev", link),
                      ("-n", name, "link", "set", link, "up"), ("-n", name, "link", "set", "lo", "up")]
        for step in steps:
            done = _ip(*step)
            assert done.returncode == 0, (step, done.stderr)
        yield names
    finally:
        for name in names:
            pids = _ip("netns", "pids", name).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", name)


@pytest.mark.timeout(60)
def test_torchrun_variables_across_two_hosts(clean_env, two_hosts, tmp_path):
    # 2 hosts x 2 ranks, started as torchrun would (GROUP_RANK is the host); rank 0's store on 198.51.100.1.
    secret = os.urandom(32).hex()
    envs, prefixes = [], []
    for rank in range(4):
        host = rank // 2
        envs.append(dict(clean_env, RANK=str(rank), WORLD_SIZE="4", LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2",
                         GROUP_RANK=str(host), GROUP_WORLD_SIZE="2", MASTER_ADDR="198.51.100.1",
                         MASTER_PORT="29400", TORCHELASTIC_RUN_ID=uuid.uuid4().hex, RVOD_SECRET=secret,
                         RVOD_HOSTNAME=f"host{host}"))
        prefixes.append(["ip", "netns", "exec", two_hosts[host]])
    results = start_ranks(envs, tmp_path, timeout=50, prefixes=prefixes)
    found = assert_ranks_passed(results, "torchrun")
    for rank, topology in found.items():
        got = (topology["local_rank"], topology["local_size"], topology["cross_rank"], topology["cross_size"])
        assert got == (rank % 2, 2, rank // 2, 2), (rank, topology)
        assert topology["transport"] == "shm+tcp", topology
    for _, _, err in results[1:]:
        assert "reached rank 0's rendezvous store at 198.51.100.1:29401 (MASTER_ADDR, port MASTER_PORT + 1)" in err, \
            ranks_report(results)


INIT_WITH_COMM = """
import sys, rvod.numpy as hvd
comm = eval(sys.argv[1])
try:
    hvd.init(comm=comm)
except Exception as error:
    print(f"{type(error).__name__}: {error}")
else:
    print(f"job of {hvd.size()}: rank {hvd.rank()}, allreduce {hvd.allreduce(__import__('numpy').ones(2), op=hvd.Sum).tolist()}")
    hvd.shutdown()
"""


@pytest.mark.timeout(60)
def test_init_with_a_communicator_in_one_process(clean_env, tmp_path):
    def init_with(comm: str, env: dict[str, str]) -> str:
        done = subprocess.run([sys.executable, "-c", INIT_WITH_COMM, comm], env=env, capture_output=True, text=True,
                              timeout=40)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    hidden = without_mpi4py(clean_env, tmp_path)
    assert init_with("[0]", hidden).startswith(
        "ValueError: init(comm=...) takes an mpi4py communicator or a list of MPI_COMM_WORLD ranks, which needs "
        "mpi4py (pip install mpi4py)")
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (scripts/run-tests.sh installs it)")
    assert init_with("[0]", clean_env) == "job of 1: rank 0, allreduce [1.0, 1.0]"
    assert init_with("__import__('mpi4py.MPI').MPI.COMM_WORLD", clean_env) == "job of 1: rank 0, allreduce [1.0, 1.0]"
    assert init_with("[1]", clean_env) == "ValueError: init(comm=[1]): ranks must be in 0..0 (MPI_COMM_WORLD)"
    assert init_with("'world'", clean_env).startswith("TypeError: init(comm=...) takes an mpi4py communicator")
