"""The documentation site (issue 36 item 4): `mkdocs build --strict` passes (no broken link or reference), and
the guides' examples run and print what the guides say they print.

What runs is marked in the Markdown, invisibly to a reader:

- `<!-- run -->` before a ```python block: an example that runs. A page's marked blocks run in order, as one
  script (a page reads top to bottom), on 2 ranks with rvodrun (`np=N` says otherwise). The marker may say
  `job=NAME` (the pages of one job run in one rvodrun job, each page in a namespace of its own, so one
  framework is imported once), `needs=MODULE` (the job is skipped, saying so, where MODULE is not
  importable: MXNet lives in an environment of its own), `rvodrun="ARGS"` (flags for rvodrun), and
  `launcher=python` (the job runs with plain Python: for examples that start ranks themselves, `rvod.run`).
- `<!-- run after -->` before a ```python block: runs with plain Python once the page's job has ended, in
  the same folder (to read what the job wrote, a timeline say).
- `<!-- output -->` before a ```text block: lines the page's job (or its after-blocks) must print, each
  exactly as rvodrun prints it (`[1]<stdout>:...`), in any order.

Blocks that need GPUs, other hosts, or Spark or Ray clusters are not marked. The jobs run in a temporary
folder with a timeout. The file costs about a minute of CPU time in all, most of it TensorFlow, PyTorch and
JAX imported on 2 ranks each and mkdocstrings reading python/rvod.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import run_job

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
MARKER = re.compile(r"<!--\s*(run|output)\b([^<>]*)-->\s*\n\s*$")
ATTRIBUTE = re.compile(r"""(\w+)(?:=("[^"]*"|\S+))?""")
JOB_TIMEOUT = 150


@dataclass
class Page:
    path: Path
    code: list[str] = field(default_factory=list)
    after: list[str] = field(default_factory=list)
    expected: list[str] = field(default_factory=list)
    attributes: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.path.relative_to(DOCS).as_posix()


def _attributes(text: str) -> dict[str, str]:
    return {key: value.strip('"') for key, value in ATTRIBUTE.findall(text)}


def read_page(path: Path) -> Page:
    """The marked blocks of one Markdown page; a marker must sit right above a block of the right language."""
    text = path.read_text()
    page = Page(path)
    for fence in FENCE.finditer(text):
        before = text[: fence.start()]
        marker = MARKER.search(before[-300:])
        if marker is None:
            continue
        kind, attributes = marker.group(1), _attributes(marker.group(2))
        language, body = fence.group(1), fence.group(2)
        where = f"{page.name}, block at line {text.count(chr(10), 0, fence.start()) + 1}"
        if kind == "output":
            assert language == "text", f"{where}: <!-- output --> marks a ```text block"
            page.expected += [line for line in body.splitlines() if line.strip()]
            continue
        assert language == "python", f"{where}: <!-- run --> marks a ```python block"
        if "after" in attributes:
            page.after.append(body)
            continue
        for key, value in attributes.items():
            assert page.attributes.get(key, value) == value, f"{where}: {key}= differs from the page's earlier marker"
        page.attributes.update(attributes)
        page.code.append(body)
    return page


def marked_pages() -> list[Page]:
    pages = [read_page(path) for path in sorted(DOCS.rglob("*.md"))]
    return [page for page in pages if page.code or page.after or page.expected]


@dataclass
class Job:
    name: str
    pages: list[Page]

    def setting(self, key: str, default: str) -> str:
        values = {page.attributes.get(key, default) for page in self.pages}
        assert len(values) == 1, f"the pages of job {self.name} disagree about {key}: {values}"
        return values.pop()


def jobs() -> list[Job]:
    grouped: dict[str, list[Page]] = {}
    for page in marked_pages():
        grouped.setdefault(page.attributes.get("job", page.name), []).append(page)
    return [Job(name, pages) for name, pages in grouped.items()]


def test_the_markers_are_found():
    """The examples this file runs: a guide whose markers were mistyped would otherwise be skipped unseen."""
    pages = {page.name: page for page in marked_pages()}
    for name in ("getting-started.md", "guides/numpy.md", "guides/torch.md", "guides/tensorflow.md",
                 "guides/keras.md", "guides/jax.md", "guides/mxnet.md", "migrating.md", "timeline.md"):
        assert name in pages and pages[name].code, f"docs/{name} has no <!-- run --> block"
    for page in pages.values():
        assert page.code or not page.expected, f"docs/{page.name} expects output but runs nothing"


def test_mkdocs_build_strict(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        if os.environ.get("CI"):
            pytest.fail("mkdocs is not installed (scripts/run-tests.sh installs mkdocs, mkdocs-material and "
                        "mkdocstrings[python])")
        pytest.skip("mkdocs is not installed: pip install mkdocs mkdocs-material 'mkdocstrings[python]'")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert (tmp_path / "site" / "reference" / "native" / "index.html").is_file()
    assert (tmp_path / "site" / "timeline" / "index.html").is_file()


def _driver(pages: list[Page], folder: Path) -> Path:
    """One script that runs each page's blocks in a namespace of its own, in order."""
    scripts = []
    for page in pages:
        script = folder / (page.name.replace("/", "_").removesuffix(".md") + ".py")
        script.write_text("\n".join(page.code))
        scripts.append(str(script))
    driver = folder / "docs_job.py"
    driver.write_text("import runpy\n" + "".join(f"runpy.run_path({path!r}, run_name='__main__')\n" for path in scripts))
    return driver


@pytest.mark.timeout(JOB_TIMEOUT * 2 + 30)
@pytest.mark.parametrize("job", jobs(), ids=lambda job: job.name)
def test_the_examples_run_and_print_what_the_guides_say(job, job_env, tmp_path):
    needs = job.setting("needs", "")
    if needs and importlib.util.find_spec(needs) is None:
        pytest.skip(f"could not import '{needs}', which {', '.join(p.name for p in job.pages)} needs")
    np = job.setting("np", "2")
    rvodrun_args = shlex.split(job.setting("rvodrun", ""))
    driver = _driver(job.pages, tmp_path)
    launcher = [] if job.setting("launcher", "rvodrun") == "python" else \
        [sys.executable, "-m", "rvod.runner", "-np", np, *rvodrun_args]
    result = run_job([*launcher, sys.executable, str(driver)], job_env, JOB_TIMEOUT, tmp_path)
    assert result.returncode == 0, f"job {job.name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    printed = result.stdout.splitlines()
    for page in job.pages:
        for index, code in enumerate(page.after):
            script = tmp_path / f"after_{index}.py"
            script.write_text(code)
            after = run_job([sys.executable, str(script)], job_env, JOB_TIMEOUT, tmp_path)
            assert after.returncode == 0, f"{page.name}: an after-block failed:\n{after.stdout}\n{after.stderr[-5000:]}"
            printed += after.stdout.splitlines()
    for page in job.pages:
        missing = [line for line in page.expected if line not in printed]
        assert not missing, f"docs/{page.name} says these lines are printed, but they were not: {missing}\n" \
                            f"printed:\n" + "\n".join(printed)[-3000:]
