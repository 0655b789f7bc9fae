"""Allreduce across two shaped hosts over UCX against rvod's TCP and torch.distributed gloo, in the same run
(issue 31, item 5): the namespaces, link shaping, ranks and timing of benches/hosts_allreduce.py, with three
implementations: rvod-tcp (hierarchical allreduce, rvod's TCP between the hosts), rvod-ucx (the same over
UCX, RVOD_TRANSPORT=ucx with UCX_TLS=tcp,self: UCX's own TCP transport, as no RDMA hardware is here) and
gloo. UCX_NET_DEVICES names each host's end of the link: the two namespaces share one kernel, so UCX would
otherwise also take loopback for a route to the other host and split large messages across both (on real
machines loopback never reaches another one); its shared memory is left out for the same reason (see
tests/python/ucx_env.py).

    python benches/hosts_ucx.py --out bench-ucx/ [--rates 10gbit] [--rounds 3]

Needs root and libucp (scripts/setup-system.sh). Reports per size the algbw (median [min-max] over rounds)
and time per call, the ratios rvod-ucx/rvod-tcp and rvod-ucx/gloo of per-round times, and the two figures
the issue asks for: 64 MiB algbw of UCX against rvod's TCP (target >= 0.9x) and 4 B latency. Writes
hosts_ucx.csv and hosts_ucx.txt.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hosts_allreduce as shaped  # noqa: E402

IMPLS = ["rvod-tcp", "rvod-ucx", "gloo"]
MiB = 1 << 20
SIZES = [4, 4 << 10, 64 << 10, 1 * MiB, 16 * MiB, 64 * MiB]
shaped.RVOD_SETTINGS.update({
    "rvod-tcp": {"RVOD_HIERARCHICAL_ALLREDUCE": "1", "RVOD_TRANSPORT": "tcp"},
    "rvod-ucx": {"RVOD_HIERARCHICAL_ALLREDUCE": "1", "RVOD_TRANSPORT": "ucx", "UCX_TLS": "tcp,self",
                 "UCX_NET_DEVICES": "{veth}"},
})


def report(rate, times, rounds):
    lines = [f"link {rate} each way, {shaped.N} ranks on 2 hosts, {rounds} rounds; algbw GB/s and time per call, "
             "median [min-max] over rounds; ratios of per-round times (> 1: the first is faster)"]
    for size in SIZES:
        row = [f"{shaped.human(size):>8}"]
        for impl in IMPLS:
            algbw = shaped.spread([size / t / 1e9 for t in times[impl][size]])
            us = statistics.median(times[impl][size]) * 1e6
            row.append(f"{impl} {algbw['median']:.3f} [{algbw['min']:.3f}-{algbw['max']:.3f}] {us:.0f} us")
        for a, b in (("rvod-ucx", "rvod-tcp"), ("rvod-ucx", "gloo")):
            ratio = statistics.median(tb / ta for ta, tb in zip(times[a][size], times[b][size]))
            row.append(f"{a}/{b} {ratio:.2f}x")
        lines.append(" | ".join(row))
    big = 64 * MiB
    ucx_vs_tcp = statistics.median(tt / tu for tu, tt in zip(times["rvod-ucx"][big], times["rvod-tcp"][big]))
    lines.append(f"64 MiB: rvod-ucx algbw {ucx_vs_tcp:.2f}x rvod-tcp's (target >= 0.9x)")
    lat = {impl: statistics.median(times[impl][4]) * 1e6 for impl in IMPLS}
    lines.append("4 B latency: " + ", ".join(f"{impl} {us:.0f} us" for impl, us in lat.items()))
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rates", default="10gbit")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--impls", default=",".join(IMPLS), help="which to run (the report needs all three)")
    args = parser.parse_args()
    impls = args.impls.split(",")
    plan = {"sizes": SIZES, "budget": 1024 * MiB, "min": 3, "max": 100}
    args.out.mkdir(parents=True, exist_ok=True)
    rows, text = [], []
    for rate in args.rates.split(","):
        times = {impl: {size: [] for size in SIZES} for impl in IMPLS}
        with shaped.Hosts(rate) as hosts:
            for r in range(args.rounds):
                for impl in impls:
                    started = time.monotonic()
                    got = shaped.run_job(impl, plan, hosts, args.out, timeout=900)
                    print(f"{rate} round {r + 1}/{args.rounds} {impl}: {time.monotonic() - started:.0f} s", flush=True)
                    for size in SIZES:
                        times[impl][size].append(got[size])
                        rows.append(f"{rate},{impl},{size},{r},{got[size]}\n")
        if impls == IMPLS:
            lines = report(rate, times, args.rounds)
            print("\n".join(lines), flush=True)
            text += lines + [""]
    (args.out / "hosts_ucx.csv").write_text("rate,impl,size_bytes,round,seconds_per_call\n" + "".join(rows))
    (args.out / "hosts_ucx.txt").write_text("\n".join(text))


if __name__ == "__main__":
    main()
