"""The engine's GPU path against the GPU stand-in (tests/gpu_standin/): every op on stand-in GPU tensors
(tests/python/workers/gpu_device_ops.py) against the same op on host arrays, with the framework's kernel that
writes each input delayed on its stream (a missing wait reads the stand-in's 0xff fill), on ranks that share GPU 0
(host staging) and ranks with a GPU each (NCCL); and two hundred ops in a row (workers/gpu_steady_state.py), right
and without per-op CUDA event creation, device discovery or needless cudaSetDevice. Skipped where no C compiler is
found. About a minute and a half.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import gpu_standin
from jobs import PYTHON, WORKERS

LIBRARY = gpu_standin.library_or_skip()

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.timeout(300)
CASE = re.compile(r"^\[(\d+)\]<stdout>:case (\S+) (.*)$", re.MULTILINE)
DONE = re.compile(r"^\[(\d+)\]<stdout>:cases done (\d+)$", re.MULTILINE)


def run_cases(run_rvodrun, job_env, ranks: int, gpu_of_rank: str, **settings):
    job_env.update(gpu_standin.env(**settings))
    job_env.update({"STANDIN_DIR": str(HERE), "GPU_OF_RANK": gpu_of_rank, "RVOD_DYNAMIC_PROCESS_SETS": "1"})
    result = run_rvodrun(["-np", str(ranks), PYTHON, str(WORKERS / "gpu_device_ops.py")], timeout=240)
    report = f"exit {result.returncode}\nstdout:\n{result.stdout[-6000:]}\nstderr:\n{result.stderr[-6000:]}"
    wrong = [m.group(0) for m in CASE.finditer(result.stdout) if m.group(3) != "ok"]
    assert not wrong, "\n".join(wrong) + "\n" + report
    done = {int(m.group(1)): int(m.group(2)) for m in DONE.finditer(result.stdout)}
    assert sorted(done) == list(range(ranks)) and min(done.values()) > 80, report
    assert result.returncode == 0, report
    return result


@pytest.mark.parametrize("ranks", [2, 3])
def test_every_op_on_ranks_sharing_gpu_0_by_host_staging(run_rvodrun, job_env, ranks):
    run_cases(run_rvodrun, job_env, ranks, "same", devices=1, stream_delay_us=300)


@pytest.mark.parametrize(("ranks", "handed_back_early"), [(2, False), (3, False), (2, True)],
                         ids=["2", "3", "2-async-completion"])
def test_every_op_with_a_gpu_per_rank_through_nccl(run_rvodrun, job_env, ranks, handed_back_early):
    """Each rank on a GPU of its own: the process set takes NCCL (what plan.rs sends to host staging, e.g.
    Adasum, int16, scaled integer sums, uneven reducescatter, still stages, and every case must still pass). On 3
    ranks the process set of ranks 0 and 1 starts a communicator of its own. With RVOD_ENABLE_ASYNC_COMPLETION the
    ops complete once their work is queued: every result must still be read after it was written."""
    job_env["RVOD_LOG_LEVEL"] = "info"
    if handed_back_early:
        job_env["RVOD_ENABLE_ASYNC_COMPLETION"] = "1"
    result = run_cases(run_rvodrun, job_env, ranks, "own", devices=ranks, stream_delay_us=300)
    sets = [0, 1] if ranks == 3 else [0]
    for set_id in sets:
        for rank in range(ranks - set_id):
            assert (f"process set {set_id}: GPU collectives via NCCL (rank {rank} on GPU {rank}): every rank of the "
                    "process set has a GPU of its own; NCCL 2.21.5") in result.stderr, result.stderr[-3000:]


def test_a_freed_result_is_not_reused_before_the_framework_stream_has_read_it(run_rvodrun, job_env):
    """The framework frees a device result while a slow kernel and a read of it are still queued on its stream;
    rvod's next op of that size gets the same pooled buffer, and must not write it before that read ran."""
    job_env.update(gpu_standin.env(devices=1, kernel_us=300_000))
    job_env.update({"STANDIN_DIR": str(HERE)})
    result = run_rvodrun(["-np", "2", PYTHON, str(WORKERS / "gpu_pool_reuse.py")], timeout=90)
    report = f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr[-4000:]}"
    assert result.returncode == 0, report
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:case reuse True" in result.stdout, report  # else the test proves nothing
        assert f"[{rank}]<stdout>:case read ok" in result.stdout, report
        assert f"[{rank}]<stdout>:case second ok" in result.stdout, report


@pytest.mark.parametrize("placement", ["same", "own", "both"], ids=["host-staging", "nccl", "two-gpus-per-rank"])
def test_many_ops_in_a_row_stay_right_and_cost_no_new_events_nor_device_discovery(run_rvodrun, job_env, placement):
    """Two hundred allreduces in a row per rank (workers/gpu_steady_state.py), results kept and then freed as they
    come: every result right and on its tensor's GPU, and in steady state no CUDA event created per op (each GPU's
    events are pooled and reused once dropped), no cudaGetDeviceCount (a GPU tensor's device is found usable once),
    no stream made, no cudaSetDevice where the thread is on the tensor's GPU already, and a freed result's buffer
    reused. "both": each rank alternates between GPUs 0 and 1 op by op (host staging), so each GPU's context, stream
    and events serve its own tensors only (the stand-in refuses an event recorded on another GPU's stream)."""
    job_env.update(gpu_standin.env(devices=2, stream_delay_us=300))
    job_env.update({"STANDIN_DIR": str(HERE), "GPU_OF_RANK": placement})
    if placement == "both":
        job_env["RVOD_GPU_TRANSPORT"] = "host"
    result = run_rvodrun(["-np", "2", PYTHON, str(WORKERS / "gpu_steady_state.py")], timeout=180)
    report = f"exit {result.returncode}\nstdout:\n{result.stdout[-6000:]}\nstderr:\n{result.stderr[-6000:]}"
    wrong = [m.group(0) for m in CASE.finditer(result.stdout) if m.group(3) != "ok"]
    assert not wrong, "\n".join(wrong) + "\n" + report
    assert result.returncode == 0, report
    for rank in (0, 1):
        expected = {"values.kept", "values.freed", "events.kept", "events.freed", "discovery", "streams",
                    "buffers.reused"}
        if placement == "same" or placement == "own" and rank == 0:
            expected.add("set_device.kept")  # only GPU 0 in this process: every thread is on it already
        if placement == "both":
            expected.add("device_streams")
        found = {m.group(2) for m in CASE.finditer(result.stdout) if int(m.group(1)) == rank}
        assert found == expected, report


def run_failure(run_rvodrun, job_env, failure: str, **settings):
    job_env.update(gpu_standin.env(devices=1, **settings))
    job_env.update({"STANDIN_DIR": str(HERE), "FAILURE": failure, "RVOD_TIMEOUT": "10"})
    result = run_rvodrun(["-np", "2", PYTHON, str(WORKERS / "gpu_device_failures.py")], timeout=90)
    lines = {int(m.group(1)): m.group(2) for m in re.finditer(r"^\[(\d+)\]<stdout>:(raised .*|no error)$",
                                                                result.stdout, re.MULTILINE)}
    return result, lines


def test_a_peer_that_dies_fails_a_staged_op_instead_of_hanging(run_rvodrun, job_env):
    result, lines = run_failure(run_rvodrun, job_env, "dead")
    assert "[0]<stdout>:first [2.0, 2.0, 2.0, 2.0]" in result.stdout, result.stdout + result.stderr
    assert lines[0].startswith("raised RvodInternalError: ") and "rank 1" in lines[0], result.stdout + result.stderr


def test_a_failed_cuda_copy_names_rank_gpu_and_call_and_fails_the_peers_too(run_rvodrun, job_env):
    result, lines = run_failure(run_rvodrun, job_env, "cuda")
    report = result.stdout + result.stderr
    assert sorted(lines) == [0, 1], report
    assert lines[1] == ("raised RvodInternalError: rank 1: cudaMemcpyAsync (device to host) failed on GPU 0: out of "
                        "memory (cudaErrorMemoryAllocation)"), report
    assert lines[0].startswith("raised "), report


def test_a_result_that_does_not_fit_in_gpu_memory_is_a_clear_error_on_every_rank(run_rvodrun, job_env):
    result, lines = run_failure(run_rvodrun, job_env, "oom", device_memory="128K")
    report = result.stdout + result.stderr
    for rank in (0, 1):
        assert lines.get(rank) == (f"raised RvodInternalError: rank {rank}: cudaMalloc of 131072 bytes failed on GPU 0: "
                                   "out of memory (cudaErrorMemoryAllocation)"), report


def test_verbose_says_which_route_each_process_set_takes(run_rvodrun, job_env):
    # rvodrun --verbose puts the ranks' log at INFO, where the engine announces its route once per process set.
    job_env.update(gpu_standin.env(devices=1))
    job_env.update({"STANDIN_DIR": str(HERE), "FAILURE": "none"})
    job_env.pop("RVOD_LOG_LEVEL", None)
    result = run_rvodrun(["-np", "2", "--verbose", PYTHON, str(WORKERS / "gpu_device_failures.py")], timeout=90)
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in (0, 1):
        assert re.search(rf"process set 0: GPU collectives via host staging \(rank {rank} on GPU 0\): ranks 0 and 1 "
                         r"share GPU 00000000:10:00.0 on host \S+; NCCL refuses a GPU shared by two ranks, so "
                         r"collectives stage through host memory", result.stderr), result.stderr
