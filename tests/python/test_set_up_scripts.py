"""The set-up scripts refuse what they cannot do with a sentence, before they change anything.

scripts/setup-mxnet-env.sh on a CPython MXNet 1.9.1 cannot run on, scripts/install-torch.sh with an unknown
RVOD_TORCH or with a torch already installed, scripts/build-wheels.sh with an architecture it does not build
and scripts/check_wheels.py on a wheel that is not the manylinux2014 abi3 one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from interpreters import supported_cpythons

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"


def run_script(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})}, cwd=REPO)


def test_mxnet_environment_refuses_a_python_newer_than_3_11_in_a_sentence(tmp_path):
    newer = {version: path for version, path in supported_cpythons().items()
             if tuple(map(int, version.split(".")[:2])) >= (3, 12)}
    if not newer:
        pytest.skip("no CPython 3.12 or later on this machine to be refused")
    version, python = next(iter(newer.items()))
    venv = tmp_path / "mxnet-venv"
    result = run_script(str(SCRIPTS / "setup-mxnet-env.sh"),
                        env={"RVOD_MXNET_PYTHON": python, "RVOD_MXNET_VENV": str(venv)})
    assert result.returncode == 1
    short = ".".join(version.split(".")[:2])
    assert (f"MXNet 1.9.1 runs on CPython 3.8 to 3.11 (its numpy 1.23 has no wheels for later ones), and {python} "
            f"is {short}; set RVOD_MXNET_PYTHON to a CPython 3.8-3.11") in result.stderr
    assert not venv.exists()


def test_install_torch_names_its_choices_and_keeps_an_installed_torch():
    bad = run_script(str(SCRIPTS / "install-torch.sh"), "/nonexistent/python", env={"RVOD_TORCH": "rocm"})
    assert bad.returncode == 2
    assert "RVOD_TORCH is 'rocm'; it takes cpu (the default) or cuda" in bad.stderr
    pytest.importorskip("torch")
    kept = run_script(str(SCRIPTS / "install-torch.sh"), sys.executable)
    assert kept.returncode == 0
    import torch

    assert f"keeping the torch already installed ({torch.__version__})" in kept.stderr


def test_build_wheels_refuses_an_architecture_it_does_not_build():
    result = run_script(str(SCRIPTS / "build-wheels.sh"), "--arch", "riscv64")
    assert result.returncode == 2
    assert "--arch takes x86_64, aarch64, native or all (got 'riscv64')" in result.stderr


def test_check_wheels_names_a_wheel_with_the_wrong_tags(tmp_path):
    wheel = tmp_path / "rvod-0.1.0-cp310-abi3-manylinux_2_34_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("rvod-0.1.0.dist-info/WHEEL",
                         "Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: cp310-abi3-manylinux_2_34_x86_64\n")
        archive.writestr("rvod/_rvod.abi3.so", b"\x7fELF" + bytes(14) + (0x3E).to_bytes(2, "little"))
    env = {"PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
    result = subprocess.run([sys.executable, str(SCRIPTS / "check_wheels.py"), str(wheel)], capture_output=True,
                            text=True, timeout=120, env={**os.environ, **env})
    assert result.returncode == 1
    assert f"check_wheels: {wheel.name}: FAILED" in result.stdout
    assert ("WHEEL tags ['cp310-abi3-manylinux_2_34_x86_64'], expected ['cp310-abi3-manylinux2014_x86_64', "
            "'cp310-abi3-manylinux_2_17_x86_64']") in result.stderr
