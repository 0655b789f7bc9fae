"""The distributed optimizers of every shim refuse the same bad options with the same messages, because one
module checks them (rvod.common.gradients). workers/optimizer_options.py hands each bad option to
torch's DistributedOptimizer, TensorFlow's DistributedGradientTape and DistributedOptimizer (Keras and
tf.compat.v1 optimizers) and MXNet's DistributedOptimizer and DistributedTrainer, in a job of one rank;
each framework runs where it imports."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from jobs import WORKERS

UNREGISTERED = ("ProcessSet(process_set_id=None, ranks=[0], mpi_comm=None): Process set provided does not exist, "
                "or has not been registered; register the process set with init(process_sets=[...]) or "
                "add_process_set().")
# What each case raises; {variable} and {kind} are the entry's (the variable put in two groups, and what
# groups' lists hold), {what}/{wrapper} what it wraps and is.
MESSAGES = {
    "op=Sum, gradient_predivide_factor=2": "ValueError: gradient_predivide_factor not supported with op != Average",
    "op=Min": "ValueError: op must be Average or Sum (or Adasum), got Min",
    "groups=-1": "ValueError: groups should be a non-negative integer or a list of list of {kind}, got -1",
    "groups=[[1]]": "ValueError: groups should be a non-negative integer or a list of list of {kind}, got [[1]]",
    "groups=[[w], [w]]": "ValueError: parameter {variable} is in more than one group",
    "gradient_predivide_factor=0": "ValueError: gradient_predivide_factor must be > 0 (and finite), got 0",
    "gradient_predivide_factor=-1.0": "ValueError: gradient_predivide_factor must be > 0 (and finite), got -1.0",
    "gradient_predivide_factor=inf": "ValueError: gradient_predivide_factor must be > 0 (and finite), got inf",
    "num_groups=-1": "ValueError: num_groups must be a non-negative integer, got -1",
    "backward_passes_per_step=0": "ValueError: backward_passes_per_step must be an int >= 1, got 0",
    "backward_passes_per_step=1.5": "ValueError: backward_passes_per_step must be an int >= 1, got 1.5",
    "already wrapped": "ValueError: this {what} is already a {wrapper}; wrap the plain {what} once",
    "unregistered process set": f"ValueError: {UNREGISTERED}",
}
FACTORS = ["gradient_predivide_factor=0", "gradient_predivide_factor=-1.0", "gradient_predivide_factor=inf",
           "num_groups=-1"]
COMMON = ["op=Sum, gradient_predivide_factor=2", "op=Min", "groups=-1", "groups=[[w], [w]]", *FACTORS,
          "already wrapped", "unregistered process set"]
OPTIMIZER = {"what": "optimizer", "wrapper": "DistributedOptimizer"}
# entry -> (the cases it gets, the values of the placeholders in their messages)
ENTRIES = {
    "torch": {
        "torch.DistributedOptimizer": (
            [*COMMON, "backward_passes_per_step=0", "backward_passes_per_step=1.5", "groups=[[1]]"],
            {"variable": "w", "kind": "torch.Tensor", **OPTIMIZER}),
    },
    "tensorflow": {
        "tensorflow.DistributedGradientTape": (
            COMMON, {"variable": "w:0", "kind": "variables", "what": "tape", "wrapper": "DistributedGradientTape"}),
        "tensorflow.DistributedOptimizer(keras)": (
            [*COMMON, "backward_passes_per_step=0"], {"variable": "w", "kind": "variables", **OPTIMIZER}),
        "tensorflow.DistributedOptimizer(tf.compat.v1)": (
            [case for case in COMMON if case != "already wrapped"] + ["backward_passes_per_step=0"],
            {"variable": "w:0", "kind": "variables"}),
    },
    "mxnet": {
        "mxnet.DistributedOptimizer": ([*FACTORS, "already wrapped", "unregistered process set"], OPTIMIZER),
        "mxnet.DistributedTrainer": ([*FACTORS, "unregistered process set"], {}),
    },
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("framework", sorted(ENTRIES))
def test_every_shim_refuses_the_same_bad_options_with_the_same_message(job_env, framework):
    pytest.importorskip(framework)
    env = {k: v for k, v in job_env.items() if not k.startswith(("RVOD_", "HOROVOD_")) or k == "RVOD_TEST_JOB_TAG"}
    result = subprocess.run([sys.executable, str(WORKERS / "optimizer_options.py"), framework], env=env,
                            capture_output=True, text=True, timeout=150)
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    outcomes = json.loads(result.stdout.strip().splitlines()[-1])
    expected = {f"{entry}|{case}": MESSAGES[case].format(**values)
                for entry, (cases, values) in ENTRIES[framework].items() for case in cases}
    assert outcomes == expected
