"""The wheel users install works without a Rust toolchain.

Given RVOD_TEST_WHEEL (a wheel built by `maturin build --release`), install it with NumPy into a fresh
virtual environment, then, with a PATH holding no cargo or rustc and outside the source tree, run a job
of size 1 with plain `python` and a 2-rank job with the installed `rvodrun`.
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

WHEEL = os.environ.get("RVOD_TEST_WHEEL")
FRAMEWORKS = ("torch", "tensorflow", "jax", "mxnet", "keras")

pytestmark = pytest.mark.skipif(
    not WHEEL, reason="RVOD_TEST_WHEEL is not set: build a wheel with `maturin build --release` and point "
                      "RVOD_TEST_WHEEL at the .whl file to test installing it")


def toolchain_free_path(venv: Path) -> str:
    """The venv's bin directory, then every directory of PATH that has no Rust tool in it."""
    tools = ("cargo", "rustc", "rustup", "maturin")
    kept = [d for d in os.environ.get("PATH", "").split(os.pathsep)
            if d and not any(os.access(os.path.join(d, tool), os.X_OK) for tool in tools)]
    path = os.pathsep.join([str(venv / "bin"), *kept])
    for tool in tools:
        assert shutil.which(tool, path=path) is None, f"{tool} is still reachable on {path}"
    return path


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
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RVOD_", "HOROVOD_", "PYTHON", "VIRTUAL_ENV", "CARGO", "RUSTUP"))}
    env.update({"PATH": toolchain_free_path(venv), "PYTHONPATH": str(stubs), "VIRTUAL_ENV": str(venv)})
    tag = os.environ.get("RVOD_TEST_JOB_TAG")
    if tag:
        env["RVOD_TEST_JOB_TAG"] = tag
    return venv, env, root


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
