"""Shared fixtures for tests that start jobs with rvodrun.

Every job a test starts carries a unique tag in its environment, which its workers inherit; whatever
still carries the tag when the test ends (or times out) is killed, so a failing test leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

if importlib.util.find_spec("rvod") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))  # not installed: test the source tree
import rvod  # noqa: E402

# Where the rvod under test lives; jobs' processes import the same one.
RVOD_IMPORT_ROOT = Path(next(iter(rvod.__path__))).parent
JOB_TAG_VARIABLE = "RVOD_TEST_JOB_TAG"
RVODRUN = ("-m", "rvod.runner")


def tagged_pids(tag: str) -> list[int]:
    """Processes whose environment carries `tag` (Linux /proc)."""
    needle = f"{JOB_TAG_VARIABLE}={tag}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            pids.append(int(entry.name))
    return pids


def kill_tagged(tag: str) -> None:
    for pid in tagged_pids(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@contextlib.contextmanager
def ray_token_auth_disabled() -> Iterator[None]:
    """Every Ray cluster the tests start, or connect this process to, runs with ``RAY_AUTH_MODE=disabled``.
    A process keeps the authentication mode of its first ``ray.init()`` (a new local cluster turns token
    authentication on by default) for every later session: a driver still asking for tokens refuses the GCS
    of a cluster started without them, the GCS takes the driver for dead and removes its actors before they
    run (``ActorDiedError``: "all references to the actor were removed ... cancelled before it started
    running"). That is how test_ray_nodes failed after test_ray in one pytest process."""
    previous = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = previous


@pytest.fixture
def job_env() -> Iterator[dict[str, str]]:
    """An environment for rvodrun: this one, the rvod under test on PYTHONPATH, and a fresh job tag."""
    tag = uuid.uuid4().hex
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(RVOD_IMPORT_ROOT), env.get("PYTHONPATH")]))
    env[JOB_TAG_VARIABLE] = tag
    yield env
    kill_tagged(tag)


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A private folder on /dev/shm (the tmpfs segments normally live in) for a job's shared-memory segments
    (RVOD_SHM_DIR), so a test sees exactly what its job left there; removed afterwards."""
    base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())
    path = Path(tempfile.mkdtemp(prefix=f"rvod-test-{os.getpid()}-", dir=base))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def run_rvodrun(job_env: dict[str, str]) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Runs `python -m rvod.runner ARGS` to the end and returns its exit status and output.

    `entry` replaces `-m rvod.runner` (for example with `-c CODE` that wraps it). On timeout the job is
    killed and the test fails with what rvodrun printed so far.
    """

    def run(
        args: Sequence[str], timeout: float = 60, entry: Sequence[str] = RVODRUN
    ) -> subprocess.CompletedProcess[str]:
        return run_job([sys.executable, *entry, *args], job_env, timeout)

    return run


def run_job(command: Sequence[str], env: dict[str, str], timeout: float,
            cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Runs `command` (a job tagged by `env`) to the end; on timeout kills whatever carries the tag and fails
    the test with what the job printed so far."""
    process = subprocess.Popen(list(command), env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, errors="replace")
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tagged(env[JOB_TAG_VARIABLE])
        stdout, stderr = process.communicate()
        pytest.fail(f"{' '.join(command)} did not finish within {timeout} s\nstdout:\n{stdout[-4000:]}\n"
                    f"stderr:\n{stderr[-4000:]}")
    return subprocess.CompletedProcess(list(command), process.returncode, stdout, stderr)


# With CI set, a skip is a failure unless its reason is one of these: what CI can never have (a GPU), what
# runs in an environment of its own (MXNet's, with NumPy 1), or what a built extension makes moot. Anything
# else that skips there (ssh, mpirun, iproute2, network namespaces, Java, UCX, a Python package) means the
# set-up scripts missed an install, and a green run would hide it.
SKIPS_ALLOWED_IN_CI = (
    "gpu", "cuda", "nccl", "mxnet", "numpy 2 is covered", "rvod._rvod is built", "this rvod runs gpu collectives",
)  # matched without regard to case: pytest.importorskip("mxnet") says "could not import 'mxnet'"


def _skip_reason(longrepr: object) -> str:
    """A skip report's reason (pytest keeps it as (file, line, 'Skipped: reason'))."""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _skip_fails_in_ci(reason: str) -> bool:
    return bool(os.environ.get("CI")) and not any(allowed in reason.lower() for allowed in SKIPS_ALLOWED_IN_CI)


def _as_set_up_failure(report: pytest.TestReport | pytest.CollectReport) -> None:
    reason = _skip_reason(report.longrepr)
    if report.skipped and _skip_fails_in_ci(reason):
        report.outcome = "failed"
        report.longrepr = (f"skipped in CI, which means the set-up missed something: {reason} "
                           "(scripts/setup-system.sh and scripts/run-tests.sh install everything the tests need)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    _as_set_up_failure(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    _as_set_up_failure(outcome.get_result())


def pytest_report_header() -> str:
    """The run says which CPythons the wheel is tested under (test_wheel_install.py)."""
    from interpreters import supported_cpythons

    found = ", ".join(f"{version} ({path})" for version, path in supported_cpythons().items())
    return f"CPython >= 3.10 found for the wheel's test: {found or 'none'}"
