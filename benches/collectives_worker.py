"""One rank of one benchmark job: `python benches/collectives_worker.py --impl IMPL --plan P --out DIR --round R`.

IMPL is one of `collectives_backends.IMPLS` (rvod-shm, rvod-tcp, gloo, horovod, mpi). Started by
`benches/collectives.py` (under `rvodrun` for rvod, `horovodrun` for Horovod, `mpirun` for MPI, with
torch.distributed's env:// variables for gloo). Runs the phases the plan names and writes this rank's raw
records, with the transport the job really used, to `DIR/round<R>.<impl>.rank<k>.json`. One compute thread
per rank.
"""

import os

os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"
os.environ["OPENBLAS_NUM_THREADS"] = "1"

import argparse
import json
import time

import collectives_phases as phases
from collectives_backends import IMPLS, make_backend

F32 = 4


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=sorted(IMPLS), required=True)
    parser.add_argument("--plan", required=True, help="JSON file with the measurement plan")
    parser.add_argument("--out", required=True)
    parser.add_argument("--round", type=int, required=True)
    args = parser.parse_args()
    with open(args.plan) as f:
        plan = json.load(f)

    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        if IMPLS[args.impl][0] != "rvod" or plan.get("rvod_torch_input_sizes"):
            raise

    started = time.perf_counter()
    backend = make_backend(args.impl)
    phases.check_values(backend)
    records = []
    timings = {"init_s": time.perf_counter() - started}
    for phase in plan["phases"]:
        t0 = time.perf_counter()
        if phase == "latency":
            records += phases.latency(backend, plan)
        elif phase == "bandwidth":
            largest = max(plan["bw_sizes"] + plan["allgather_sizes"] + plan["broadcast_sizes"]
                          + plan.get("out_of_place_sizes", []))
            arena_bytes = max(2 * largest, plan["working_set_bytes"])
            arena = backend.new_buffer(arena_bytes // F32)
            records += phases.bandwidth(backend, plan, arena)
            del arena
        elif phase == "fusion":
            records += phases.fusion(backend, plan)
        else:
            raise SystemExit(f"unknown phase {phase!r}")
        timings[f"{phase}_s"] = time.perf_counter() - t0
    backend.barrier()
    rank, size = backend.rank, backend.size
    backend.shutdown()

    path = os.path.join(args.out, f"round{args.round}.{args.impl}.rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"impl": args.impl, "round": args.round, "rank": rank, "size": size, "timings": timings,
                   "transport": backend.transport, "tensors": backend.tensors, "records": records}, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
