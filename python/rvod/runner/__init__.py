"""rvod's job launcher, `rvodrun`: places ranks on hosts, gives each its environment, supervises the job.

`main(argv)` returns rvodrun's exit status; `run_commandline()` runs it on `sys.argv` and exits.
"""

from rvod.runner.launch import main, run_commandline

__all__ = ["main", "run_commandline"]
