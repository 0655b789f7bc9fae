"""rvod's job launcher, `rvodrun`: places ranks on hosts, gives each its environment, supervises the job.

`main(argv)` returns rvodrun's exit status; `run_commandline()` runs it on `sys.argv` and exits. Both import
the launcher when called, so `python -m rvod.runner.<module>` (the remote bootstrap, a rank of rvod.run)
does not load it.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    from rvod.runner.launch import main as launch_main

    return launch_main(argv)


def run_commandline() -> None:
    from rvod.runner.launch import run_commandline as launch_run_commandline

    launch_run_commandline()


__all__ = ["main", "run_commandline"]
