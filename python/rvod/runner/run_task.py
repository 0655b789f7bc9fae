"""`python -m rvod.runner.run_task`: one rank of an `rvod.run` job.

Fetches the cloudpickled `(func, args, kwargs)` from the job's rendezvous store, runs it, and puts back
`(True, result)` or, when it raises, `(False, traceback text)` and exits with status 1, so rvodrun stops the
job and `rvod.run` can name this rank. The result goes under the rank the worker has when the function
returns (in an elastic job, its rank in the last world).
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback

from rvod.runner.run_func import FUNCTION_KEY, RESULT_KEY


def main() -> int:
    import cloudpickle

    from rvod._rvod import StoreClient

    timeout = float(os.environ.get("RVOD_START_TIMEOUT", "60"))
    client = StoreClient(os.environ["RVOD_RENDEZVOUS_ADDR"], int(os.environ["RVOD_RENDEZVOUS_PORT"]),
                         bytes.fromhex(os.environ["RVOD_SECRET"]), timeout)
    func, args, kwargs = pickle.loads(client.get(FUNCTION_KEY, timeout))
    try:
        outcome = (True, func(*args, **kwargs))
        status = 0
    except BaseException:  # noqa: BLE001 - whatever the function raised goes back to the caller
        outcome = (False, traceback.format_exc())
        status = 1
    # Read now: in an elastic job, init() sets the rank of each world this worker joins.
    rank = int(os.environ["RVOD_RANK"])
    try:
        payload = cloudpickle.dumps(outcome)
    except Exception:  # noqa: BLE001 - a result that cannot be pickled is this rank's failure
        payload = cloudpickle.dumps((False, f"the result of rank {rank} cannot be pickled:\n{traceback.format_exc()}"))
        status = 1
    client.set(RESULT_KEY.format(rank=rank), payload)
    client.close()
    return status


if __name__ == "__main__":
    sys.exit(main())
