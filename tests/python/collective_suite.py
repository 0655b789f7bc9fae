"""The pytest side of the collective cases (collective_cases.py): one test item per case, one rvodrun job
per group of the cases pytest selected.

A group is a framework, a transport and a job size. The first item of a group to run starts one job of
workers/collective_cases.py for exactly the selected cases of its group (so `-k allgather-int8-3ranks`
runs small jobs, and a full run one job per group); every item then reads its own case's verdict from
every rank and fails with that rank's traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from dataclasses import dataclass
from typing import NamedTuple

import pytest
from collective_cases import FRAMEWORKS, cases_for
from conftest import JOB_TAG_VARIABLE, RVOD_IMPORT_ROOT, RVODRUN, kill_tagged
from jobs import WORKERS, failures

# A job start costs seconds; a case a few milliseconds (more for tf.function). Generous: CI machines are shared.
JOB_SECONDS = 90
CASE_SECONDS = 0.4
ITEM_TIMEOUT = 600


class Group(NamedTuple):
    framework: str
    transport: str
    ranks: int

    @property
    def label(self) -> str:
        transport = f"-{self.transport}" if len(FRAMEWORKS[self.framework].transports) > 1 else ""
        return f"{self.framework}{transport}"


def parameters(frameworks: list[str], transports=None, rank_counts=None) -> list:
    """pytest.param(group, case id) for every case of `frameworks` (over `transports` and with `rank_counts`
    ranks, by default each framework's), with ids like numpy-shm-allgather-int8-3ranks."""
    params = []
    for framework in frameworks:
        for transport in transports or FRAMEWORKS[framework].transports:
            for ranks in rank_counts or FRAMEWORKS[framework].rank_counts:
                group = Group(framework, transport, ranks)
                params += [pytest.param(group, case.id, id=f"{group.label}-{case.id}")
                           for case in cases_for(framework, ranks)]
    return params


@dataclass
class JobResult:
    verdicts: dict[int, dict[str, dict]]  # rank -> case id -> {"failure": None or its text, "seconds": ...}
    report: str  # how the job ended and its output: shown by the first item that misses a verdict
    reported: bool = False


def run_group(group: Group, case_ids: list[str]) -> JobResult:
    """One rvodrun job running `case_ids` of `group`."""
    tag = uuid.uuid4().hex
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(RVOD_IMPORT_ROOT), env.get("PYTHONPATH")]))
    env[JOB_TAG_VARIABLE] = tag
    env["RVOD_SHM"] = "1" if group.transport == "shm" else "0"
    env["RVOD_TEST_TRANSPORT"] = group.transport
    timeout = JOB_SECONDS + CASE_SECONDS * len(case_ids)
    with tempfile.TemporaryDirectory(prefix="rvod-cases-") as workdir:
        cases_file = Path(workdir, "cases.json")
        cases_file.write_text(json.dumps(case_ids))
        env.update(RVOD_TEST_CASES=str(cases_file), RVOD_TEST_RESULTS=workdir)
        command = [sys.executable, *RVODRUN, "-np", str(group.ranks), sys.executable,
                   str(WORKERS / "collective_cases.py"), group.framework]
        process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   errors="replace")
        try:
            stdout, stderr = process.communicate(timeout=timeout)
            ending = f"exit {process.returncode}"
        except subprocess.TimeoutExpired:
            kill_tagged(tag)
            stdout, stderr = process.communicate()
            ending = f"did not finish within {timeout:.0f} s"
        finally:
            kill_tagged(tag)
        verdicts = {}
        for rank in range(group.ranks):
            path = Path(workdir, f"rank{rank}.json")
            if path.exists():
                verdicts[rank] = json.loads(path.read_text())
    report = f"the job {ending}\nstdout:\n{stdout[-5000:]}\nstderr:\n{failures(stderr)[-10000:]}"
    return JobResult(verdicts, report)


@pytest.fixture(scope="session")
def collective_jobs(request):
    """group -> JobResult, running each group's job once, for the cases of that group pytest selected."""
    done: dict[Group, JobResult] = {}

    def result(group: Group) -> JobResult:
        if group not in done:
            selected = [item.callspec.params["case"] for item in request.session.items
                        if getattr(item, "callspec", None) and item.callspec.params.get("group") == group]
            done[group] = run_group(group, selected)
        return done[group]

    return result


def assert_case_passed(result: JobResult, group: Group, case: str) -> None:
    missing = [rank for rank in range(group.ranks) if case not in result.verdicts.get(rank, {})]
    if missing:
        report = "(the job's output is in the first failure of this group)" if result.reported else result.report
        result.reported = True
        pytest.fail(f"no verdict for {case} from ranks {missing}\n{report}")
    failed = {rank: verdicts[case]["failure"] for rank, verdicts in result.verdicts.items()
              if verdicts[case]["failure"] is not None}
    assert not failed, "\n".join(f"rank {rank}:\n{text}" for rank, text in failed.items())
