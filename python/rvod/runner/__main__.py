"""`python -m rvod.runner`: the same as the `rvodrun` command."""

from rvod.runner.launch import run_commandline

run_commandline()
