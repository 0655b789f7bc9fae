"""The wheel users install works without a Rust toolchain, under every CPython it is tagged for.

Given RVOD_TEST_WHEEL (the manylinux2014 wheel of scripts/build-wheels.sh, which CI builds), install it with
NumPy into a fresh virtual environment, then, with a PATH holding no Rust tool and no C compiler and outside
the source tree, run a job of size 1 with plain `python` and a 2-rank job with the installed `rvodrun`; then install it
into one fresh environment per CPython >= 3.10 on the machine (interpreters.py; the run's header names them)
and run the job of size 1 under each.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from interpreters import supported_cpythons

WHEEL = os.environ.get("RVOD_TEST_WHEEL")
FRAMEWORKS = ("torch", "tensorflow", "jax", "mxnet", "keras")

pytestmark = pytest.mark.skipif(
    not WHEEL, reason="RVOD_TEST_WHEEL is not set: build a wheel with `maturin build --release` and point "
                      "RVOD_TEST_WHEEL at the .whl file to test installing it")


# Rust's tools and every C compiler: the wheel must need none of them where it is installed.
BUILD_TOOLS = ("cargo", "rustc", "rustup", "maturin", "cc", "gcc", "c++", "g++", "clang", "ld", "zig")


def toolchain_free_path(venv: Path) -> str:
    """The venv's bin directory, then every directory of PATH that holds none of BUILD_TOOLS (which drops
    /usr/bin; a shell is linked into a folder of its own, for any subprocess that wants one)."""
    shells = venv.parent / "shells"
    shells.mkdir(exist_ok=True)
    for shell in ("sh", "bash"):
        found = shutil.which(shell)
        if found and not (shells / shell).exists():
            (shells / shell).symlink_to(found)
    kept = [d for d in os.environ.get("PATH", "").split(os.pathsep)
            if d and not any(os.access(os.path.join(d, tool), os.X_OK) for tool in BUILD_TOOLS)]
    path = os.pathsep.join([str(venv / "bin"), str(shells), *kept])
    for tool in BUILD_TOOLS:
        assert shutil.which(tool, path=path) is None, f"{tool} is still reachable on {path}"
    return path


def clean_env(venv: Path, stubs: Path) -> dict[str, str]:
    """This environment without rvod's, Horovod's, Python's or Rust's variables, and no Rust tool on PATH."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RVOD_", "HOROVOD_", "PYTHON", "VIRTUAL_ENV", "CARGO", "RUSTUP"))}
    env.update({"PATH": toolchain_free_path(venv), "PYTHONPATH": str(stubs), "VIRTUAL_ENV": str(venv)})
    tag = os.environ.get("RVOD_TEST_JOB_TAG")
    if tag:
        env["RVOD_TEST_JOB_TAG"] = tag
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv, environment to run it with): a fresh venv holding the wheel and NumPy."""
    wheel = Path(WHEEL).resolve()
    assert wheel.is_file() and wheel.suffix == ".whl", f"RVOD_TEST_WHEEL={WHEEL} is not a wheel file"
    root = tmp_path_factory.mktemp("wheel")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    install = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(wheel), "numpy"],
                             capture_output=True, text=True, timeout=240)
    assert install.returncode == 0, f"pip install failed:\n{install.stdout}\n{install.stderr}"

    # Stand-ins for the deep-learning frameworks: importing rvod must not import any of them.
    stubs = root / "stubs"
    for name in FRAMEWORKS:
        (stubs / name).mkdir(parents=True)
        (stubs / name / "__init__.py").write_text("IMPORTED_BY_STUB = True\n")
    return venv, clean_env(venv, stubs), root


SIZE_ONE = textwrap.dedent(f"""
    import json, sys
    import rvod
    after_rvod = sorted(m for m in {FRAMEWORKS!r} if m in sys.modules)
    import numpy as np
    import rvod.numpy as hvd
    after_numpy = sorted(m for m in {FRAMEWORKS!r} if m in sys.modules)
    hvd.init()
    out = hvd.allreduce(np.arange(4, dtype=np.float32), op=hvd.Sum)
    report = dict(rvod=rvod.__file__, native=rvod._rvod.__file__, size=hvd.size(), rank=hvd.rank(),
                  result=out.tolist(), dtype=str(out.dtype), after_rvod=after_rvod, after_numpy=after_numpy)
    hvd.shutdown()
    print(json.dumps(report))
""")

TWO_RANKS = textwrap.dedent("""
    import numpy as np, rvod.numpy as hvd
    hvd.init()
    out = hvd.allreduce(np.full(3, hvd.rank() + 1, dtype=np.float64), op=hvd.Sum)
    print("rank", hvd.rank(), "of", hvd.size(), "sum", out.tolist())
    hvd.shutdown()
""")


@pytest.mark.timeout(420)
def test_size_one_script_runs_from_the_wheel(installed):
    venv, env, root = installed
    result = subprocess.run(["python", "-c", SIZE_ONE], env=env, cwd=root, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert Path(report["rvod"]).resolve().is_relative_to(venv.resolve()), report
    assert Path(report["native"]).resolve().is_relative_to(venv.resolve()), report
    assert (report["size"], report["rank"]) == (1, 0)
    assert report["result"] == [0.0, 1.0, 2.0, 3.0] and report["dtype"] == "float32", report
    assert report["after_rvod"] == [] and report["after_numpy"] == [], report


@pytest.mark.timeout(420)
def test_rvodrun_from_the_wheel(installed):
    venv, env, root = installed
    assert shutil.which("rvodrun", path=env["PATH"]) == str(venv / "bin" / "rvodrun")
    result = subprocess.run(["rvodrun", "-np", "2", "python", "-c", TWO_RANKS], env=env, cwd=root,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    for rank in (0, 1):
        assert re.search(rf"^\[{rank}\]<stdout>:rank {rank} of 2 sum \[3\.0, 3\.0, 3\.0\]$", result.stdout,
                         re.MULTILINE), result.stdout
    check = subprocess.run(["rvodrun", "--check-build"], env=env, cwd=root, capture_output=True, text=True,
                           timeout=60)
    assert check.returncode == 0, check.stderr
    assert "tcp" in check.stdout.lower(), check.stdout


def test_the_wheel_is_the_manylinux2014_abi3_one():
    """CI tests the wheel users get: abi3 from CPython 3.10, manylinux2014 (glibc 2.17)."""
    name = Path(WHEEL).name
    assert re.fullmatch(r"rvod-[^-]+-cp310-abi3-manylinux2014_(x86_64|aarch64)\.manylinux_2_17_\1\.whl", name), (
        f"{name} is not the manylinux2014 abi3 wheel scripts/build-wheels.sh makes")


def install_and_run_size_one(python: str, wheel: Path, root: Path, stubs: Path) -> str:
    """Install the wheel (and its dependencies) into a fresh venv of `python`; run SIZE_ONE there.
    Returns "" when it worked, else what went wrong."""
    venv = root / "venv"
    made = subprocess.run([python, "-m", "venv", "--without-pip", str(venv)], capture_output=True, text=True,
                          timeout=120)
    if made.returncode != 0:
        return f"venv failed: {made.stderr}"
    # This environment's pip installs into the other interpreter's venv (pip --python): no ensurepip needed.
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
                              "--quiet", str(wheel)], capture_output=True, text=True, timeout=300)
    if install.returncode != 0:
        return f"pip install failed:\n{install.stdout}\n{install.stderr}"
    result = subprocess.run([str(venv / "bin" / "python"), "-c", SIZE_ONE], env=clean_env(venv, stubs), cwd=root,
                            capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        return f"the size-1 job failed:\n{result.stderr}"
    report = json.loads(result.stdout.strip().splitlines()[-1])
    if not Path(report["native"]).resolve().is_relative_to(venv.resolve()) or report["result"] != [0, 1, 2, 3]:
        return f"wrong report: {report}"
    return ""


@pytest.mark.timeout(600)
def test_the_wheel_runs_under_every_cpython_from_3_10(installed, tmp_path):
    """One fresh environment per CPython >= 3.10 found on this machine (named in the run's header)."""
    from concurrent.futures import ThreadPoolExecutor

    pythons = supported_cpythons()
    running = ".".join(map(str, sys.version_info[:3]))
    assert running in pythons, f"this interpreter ({running}) was not found among {pythons}"
    _, _, root = installed
    wheel = Path(WHEEL).resolve()
    with ThreadPoolExecutor(max_workers=3) as pool:
        outcomes = dict(zip(pythons, pool.map(
            lambda item: install_and_run_size_one(item[1], wheel, tmp_path / item[0], root / "stubs"),
            pythons.items())))
    failed = {version: problem for version, problem in outcomes.items() if problem}
    assert not failed, f"found CPython {', '.join(pythons)}; failed under {sorted(failed)}:\n" + "\n".join(
        f"--- {version}: {problem}" for version, problem in failed.items())
