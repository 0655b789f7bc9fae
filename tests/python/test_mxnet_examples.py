"""The MXNet example runs under rvodrun with 2 ranks: the Gluon digits CNN (sharded data, deferred
parameters broadcast from rank 0, DistributedTrainer) reaches its accuracy, with and without fp16
compression and a gradient predivide factor."""

from __future__ import annotations

import re
import sys

import pytest
from jobs import EXAMPLES, assert_digits_example_succeeded, example_report

pytest.importorskip("mxnet", reason="rvod.mxnet needs MXNet 1.9 (make its environment with scripts/setup-mxnet-env.sh)")
pytest.importorskip("sklearn", reason="the digits example needs scikit-learn")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("flags", [[], ["--fp16-allreduce", "--gradient-predivide-factor", "2"]],
                         ids=["plain", "fp16-predivide"])
def test_digits_example_trains_to_high_accuracy(run_rvodrun, flags):
    result = run_rvodrun(["-np", "2", sys.executable, str(EXAMPLES / "mxnet_digits.py"), *flags], timeout=120)
    assert_digits_example_succeeded(result)
    epochs = re.findall(r"^\[0\]<stdout>:epoch +\d+/12: loss [\d.]+ \(mean over ranks\), test accuracy [\d.]+$",
                        result.stdout, re.MULTILINE)
    assert len(epochs) == 12, example_report(result)
