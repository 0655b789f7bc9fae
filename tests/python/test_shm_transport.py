"""The shared-memory transport in real multi-process jobs: more ranks than cores, and the fallback to TCP
when the segment folder is too small. (The collective cases and the killed/frozen-rank tests run over both
transports in test_collectives.py, test_numpy_collectives.py and test_numpy_errors.py.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from jobs import WORKERS, assert_worker_job, failures, verdicts


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fusion_threshold", [None, 1 << 20], ids=["default-staging", "small-staging"])
def test_four_ranks_on_two_cores(run_rvodrun, job_env, fusion_threshold):
    job_env.update(RVOD_SHM="1", RVOD_TEST_TRANSPORT="shm")
    if fusion_threshold is not None:
        job_env["RVOD_FUSION_THRESHOLD"] = str(fusion_threshold)
    result = run_rvodrun(["-np", "4", sys.executable, str(WORKERS / "four_ranks.py")], timeout=100)
    assert_worker_job(result, {rank: 8 for rank in range(4)})


def _mounted_tmpfs(size):
    """Yields a tmpfs of `size`, unmounted afterwards (needs root to mount; the test is skipped otherwise)."""
    path = Path(tempfile.mkdtemp(prefix="rvod-small-shm-"))
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=1777", "tmpfs", str(path)], capture_output=True
    ).returncode == 0
    if not mounted:
        path.rmdir()
        pytest.skip("mounting a small tmpfs needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)
        path.rmdir()


@pytest.fixture
def tiny_tmpfs():
    """A 64 KiB tmpfs, far too small for any segment."""
    yield from _mounted_tmpfs("64k")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size, outcome", [("32m", "with 4 MiB ones"), ("16m", "without them")])
def test_no_room_for_staging_areas_keeps_shared_memory(run_rvodrun, job_env, size, outcome):
    """4 ranks need 12 MiB of channels and 4 x 64 MiB of staging areas: a 32 MiB tmpfs gets 4 MiB areas,
    a 16 MiB one none; either way the job runs over shared memory, with a warning saying so."""
    for folder in _mounted_tmpfs(size):
        job_env.update(RVOD_SHM="1", RVOD_SHM_DIR=str(folder), RVOD_TEST_TRANSPORT="shm")
        result = run_rvodrun(["-np", "4", sys.executable, str(WORKERS / "four_ranks.py")], timeout=100)
        assert_worker_job(result, {rank: 8 for rank in range(4)})
        warning = f"shared memory in {folder} has no room for 4 staging areas of 64 MiB"
        assert warning in result.stderr and f"share memory {outcome}" in result.stderr, result.stderr
        assert list(folder.iterdir()) == [], "a segment was left behind"


@pytest.mark.timeout(120)
def test_too_small_shm_folder_warns_and_falls_back_to_tcp(run_rvodrun, job_env, tiny_tmpfs):
    job_env.update(RVOD_SHM="1", RVOD_SHM_DIR=str(tiny_tmpfs), RVOD_TEST_TRANSPORT="tcp")
    result = run_rvodrun(["-np", "4", sys.executable, str(WORKERS / "four_ranks.py")], timeout=100)
    report = f"exit {result.returncode}\nstdout:\n{result.stdout[-4000:]}\nstderr:\n{failures(result.stderr)[-8000:]}"
    assert result.returncode == 0, report
    assert all(failed == 0 for _, failed in verdicts(result.stdout).values()), report
    assert f"shared memory in {tiny_tmpfs} is not usable" in result.stderr, report
    assert "use TCP instead" in result.stderr, report
    assert list(tiny_tmpfs.iterdir()) == [], "a failed segment was left behind"
