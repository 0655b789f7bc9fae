"""The NCCL route of GPU collectives against the GPU stand-in (tests/gpu_standin/), 2 ranks with a GPU each
(tests/python/workers/gpu_nccl_route.py): a joined rank takes part in NCCL allreduces with zeros; a peer that dies
while an NCCL call waits for it, an NCCL error and a fusion buffer that does not fit raise on every rank that is
left (naming rank, GPU and NCCL's text) instead of hanging; RVOD_GPU_TRANSPORT=host stages with a GPU per rank,
and =nccl where ranks share a GPU is an error on every rank that leaves host collectives working. The route of
every op case is in test_gpu_device_path.py. Skipped where no C compiler is found. About 20 s.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import gpu_standin
from jobs import PYTHON, WORKERS

LIBRARY = gpu_standin.library_or_skip()

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.timeout(120)
NCCL_LINE = ("process set 0: GPU collectives via NCCL (rank {rank} on GPU {rank}): every rank of the process set has "
             "a GPU of its own; NCCL 2.21.5")


def run(run_rvodrun, job_env, scenario: str, gpu_of_rank: str = "own", **env: str):
    job_env.update(gpu_standin.env(devices=2))
    job_env.update({"STANDIN_DIR": str(HERE), "SCENARIO": scenario, "GPU_OF_RANK": gpu_of_rank,
                    "RVOD_TIMEOUT": "10", "RVOD_LOG_LEVEL": "info", **env})
    result = run_rvodrun(["-np", "2", PYTHON, str(WORKERS / "gpu_nccl_route.py")], timeout=90)
    said = {rank: re.findall(rf"^\[{rank}\]<stdout>:(.*)$", result.stdout, re.MULTILINE) for rank in (0, 1)}
    lines = {rank: [line for line in said[rank] if line != "finished"] for rank in (0, 1)}
    return result, lines, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr[-4000:]}"


def test_a_joined_rank_takes_part_in_nccl_allreduces_with_zeros(run_rvodrun, job_env):
    result, lines, report = run(run_rvodrun, job_env, "join")
    assert result.returncode == 0, report
    for rank in (0, 1):
        assert NCCL_LINE.format(rank=rank) in result.stderr, report
    assert lines[0] == ["first [2.0, 4.0]", "result [3.0, 4.0]", "result [5.0]", "result [6.0, 7.0] [8.0]",
                        "last joined 0"], report
    assert lines[1] == ["first [2.0, 4.0]", "last joined 0"], report


def test_a_rank_that_joined_before_any_gpu_tensor_makes_the_set_stage(run_rvodrun, job_env):
    result, lines, report = run(run_rvodrun, job_env, "join_first")
    assert result.returncode == 0, report
    assert ("process set 0: GPU collectives via host staging (rank 0 on GPU 0): rank 1 has no GPU rvod can use (it "
            "joined before it submitted a GPU tensor, or its GPU failed); staging through host memory") in result.stderr
    assert lines[0] == ["result [3.0, 4.0]", "last joined 0"], report


def names_the_failed_peer(line, nccl_error, suffix=""):
    """Whether rank 0's error (a `raised ...` line) after rank 1 failed or died under an NCCL allreduce names
    rank 1 as rank 0 can learn it: NCCL's own error (`nccl_error`, a pattern) or, when rank 1's end of the
    engine's connections reaches rank 0 first (its loop is free while the op's GPU work is queued), the
    negotiation's. `suffix`: what both say after that (literal)."""
    prefix = "raised RvodInternalError: "
    closed = f"{prefix}negotiation failed: rank 1 exited or closed its connection{suffix}"
    return line == closed or re.fullmatch(re.escape(prefix) + nccl_error + re.escape(suffix), line) is not None


def test_a_peer_that_dies_while_an_nccl_call_waits_for_it_raises_instead_of_hanging(run_rvodrun, job_env):
    result, lines, report = run(run_rvodrun, job_env, "dead")
    assert lines[0][0] == "first [2.0, 4.0]", report
    assert names_the_failed_peer(lines[0][1], r"NCCL error on rank 0 \(GPU 0\) in a collective \(reported by "
                                 r"ncclCommGetAsyncError\): ncclRemoteError \(6\): .* - rank 1 \(pid \d+, GPU 1\) "
                                 r"exited while rank 0 \(GPU 0\) waited for it in ncclAllReduce \(a peer failed or the "
                                 r"connection to it broke\)"), report


@pytest.mark.parametrize("early", [False, True], ids=["completed-after-the-work", "async-completion"])
def test_an_op_completes_after_its_gpu_work_unless_async_completion_hands_it_back_at_once(run_rvodrun, job_env,
                                                                                        early):
    settings = {"HOROVOD_ENABLE_ASYNC_COMPLETION": "1"} if early else {}
    result, lines, report = run(run_rvodrun, job_env, "handed_back", **settings)
    assert result.returncode == 0, report
    for rank in (0, 1):
        assert lines[rank] == [f"early {early}", "result [2.0, 4.0]", "result [10.0]"], report


def test_a_peer_that_dies_under_an_op_handed_back_early_makes_the_wait_and_the_next_op_raise(run_rvodrun, job_env):
    result, lines, report = run(run_rvodrun, job_env, "handed_back_dead", RVOD_ENABLE_ASYNC_COMPLETION="1")
    assert lines[0][0] == "first [2.0, 4.0]", report
    assert names_the_failed_peer(lines[0][1], r"NCCL error on rank 0 \(GPU 0\) in a collective \(reported by "
                                 r"ncclCommGetAsyncError\): ncclRemoteError \(6\): .* - rank 1 \(pid \d+, GPU 1\) "
                                 r"exited while rank 0 \(GPU 0\) waited for it in ncclAllReduce .*",
                                 suffix=" (the op was handed back before its GPU work ran: RVOD_ENABLE_ASYNC_COMPLETION)"), \
        report
    assert lines[0][2].startswith("raised RvodInternalError: "), report
    assert "ncclRemoteError" in lines[0][2] or "rank 1 exited or closed its connection" in lines[0][2], report


def assert_peer_of_a_failed_rank_raised(line, report):
    """Rank 0's error after rank 1 failed (not died) under an NCCL allreduce (see names_the_failed_peer)."""
    assert names_the_failed_peer(line, r"NCCL error on rank 0 \(GPU 0\) .*ncclRemoteError \(6\).* rank 1 \(pid \d+, "
                                 r"GPU 1\) aborted its communicator while rank 0 \(GPU 0\) waited for it in "
                                 r"ncclAllReduce .*"), report


def test_an_nccl_error_raises_on_its_rank_with_ncclss_text_and_on_the_peer(run_rvodrun, job_env):
    result, lines, report = run(run_rvodrun, job_env, "nccl_error")
    assert lines[1][1] == ("raised RvodInternalError: NCCL error on rank 1 (GPU 1) in ncclAllReduce: ncclSystemError "
                           "(2): unhandled system error (run with NCCL_DEBUG=INFO for details) - injected: NET/Socket "
                           "connection closed (a system call or the network failed; run with NCCL_DEBUG=WARN for "
                           "NCCL's own log)"), report
    assert_peer_of_a_failed_rank_raised(lines[0][1], report)


def test_a_fusion_buffer_that_does_not_fit_is_a_clear_error_and_the_peer_raises_too(run_rvodrun, job_env):
    result, lines, report = run(run_rvodrun, job_env, "oom")
    assert lines[1][1] == ("raised RvodInternalError: rank 1: cannot allocate the fusion buffer (160000 bytes) on GPU 1: "
                           "cudaMalloc of 262144 bytes failed on GPU 1: out of memory (cudaErrorMemoryAllocation); a "
                           "smaller RVOD_FUSION_THRESHOLD makes the fusion buffer smaller"), report
    assert_peer_of_a_failed_rank_raised(lines[0][1], report)


def test_host_staging_when_asked_even_with_a_gpu_per_rank(run_rvodrun, job_env):
    result, lines, report = run(run_rvodrun, job_env, "plain", RVOD_GPU_TRANSPORT="host")
    assert result.returncode == 0, report
    for rank in (0, 1):
        assert (f"process set 0: GPU collectives via host staging (rank {rank} on GPU {rank}): "
                "RVOD_GPU_TRANSPORT=host") in result.stderr, report
        assert lines[rank] == ["first [2.0, 4.0]", "cpu [2.0, 2.0]"], report


def test_nccl_demanded_where_ranks_share_a_gpu_fails_gpu_ops_on_every_rank_and_nothing_else(run_rvodrun, job_env):
    result, lines, report = run(run_rvodrun, job_env, "plain", gpu_of_rank="same", RVOD_GPU_TRANSPORT="nccl")
    assert result.returncode == 0, report
    for rank in (0, 1):
        assert re.fullmatch(r"raised RvodInternalError: RVOD_GPU_TRANSPORT=nccl, but ranks 0 and 1 share GPU "
                            r"00000000:10:00\.0 on host \S+, and NCCL refuses a GPU shared by two ranks \(\"Duplicate "
                            r"GPU detected\"\); give each rank its own GPU .*", lines[rank][0]), report
        assert lines[rank][1] == "cpu [2.0, 2.0]", report
