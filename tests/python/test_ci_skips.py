"""In CI a skip that hides a missing install fails the run; skips CI can never avoid (no GPU, MXNet's own
environment) stay skips and are listed with their reasons (scripts/run-tests.sh passes -rs)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

PROBE = '''
import pytest
{module_level}
def test_needs_sshd():
    pytest.skip("an sshd is needed for the namespace hosts")
def test_needs_a_gpu():
    pytest.skip("no usable GPU here")
'''


def _run_probe(ci: bool, module_level: str = "") -> subprocess.CompletedProcess[str]:
    here = Path(__file__).resolve().parent
    probe = here / f"test_probe_{uuid.uuid4().hex}.py"  # beside conftest.py, so its hooks apply
    probe.write_text(PROBE.format(module_level=module_level))
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci:
        env["CI"] = "true"
    try:
        return subprocess.run([sys.executable, "-m", "pytest", str(probe), "-q", "-rs", "-p", "no:cacheprovider"],
                              cwd=here, env=env, capture_output=True, text=True, timeout=120)
    finally:
        probe.unlink()


@pytest.mark.timeout(150)
def test_in_ci_a_missing_install_fails_and_a_missing_gpu_skips():
    run = _run_probe(ci=True)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "1 failed, 1 skipped" in run.stdout
    assert "skipped in CI, which means the set-up missed something: an sshd is needed" in run.stdout
    assert "SKIPPED [1]" in run.stdout and "no usable GPU here" in run.stdout


@pytest.mark.timeout(150)
def test_outside_ci_both_skip():
    run = _run_probe(ci=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 skipped" in run.stdout


@pytest.mark.timeout(150)
def test_in_ci_mxnet_missing_from_the_main_environment_skips_however_it_is_said():
    """MXNet's tests run in an environment of their own; `importorskip("mxnet")` without a reason says
    "could not import 'mxnet'" (lower case), which must count as MXNet's skip."""
    run = _run_probe(ci=True, module_level='pytest.importorskip("no_such_mxnet_module_for_rvod")')
    # pytest exits with 5 when a module-level skip leaves no test to run; a failure would exit with 1
    assert run.returncode == 5, run.stdout + run.stderr
    assert "1 skipped" in run.stdout and "failed" not in run.stdout


@pytest.mark.timeout(150)
def test_in_ci_a_module_that_cannot_import_what_it_needs_fails():
    run = _run_probe(ci=True, module_level='pytest.importorskip("no_such_module_rvod", reason="UCX tools missing")')
    assert run.returncode != 0, run.stdout + run.stderr
    assert "skipped in CI, which means the set-up missed something: UCX tools missing" in run.stdout
