"""Allreduce across two hosts: two network namespaces joined by a veth pair shaped with tc (tbf) to a fixed
rate, two ranks in each, rvod hierarchical vs rvod flat vs torch.distributed gloo (issue 12, item 7).

    python benches/hosts_allreduce.py --out bench-hosts/ [--rates 2gbit,10gbit] [--rounds 5] [--quick]

Needs root (it makes namespaces; it deletes them whatever happens). Addresses come from 198.51.100.0/24,
used only inside the namespaces. Each "host" is a namespace: ranks 0-1 in the first (198.51.100.1), 2-3 in
the second (198.51.100.2), with RVOD_HOSTNAME hosta / hostb, so each host's ranks share memory and the hosts
talk TCP over the shaped link. rvod ranks get the environment rvodrun would give them (rvod.runner's
slots and worker_env) and meet at a rendezvous store served in the first namespace; their data listeners
pick their address themselves (the one that routes to the store). gloo ranks use env:// with MASTER_ADDR
in the first namespace and GLOO_SOCKET_IFNAME set to the namespace's veth.

Every round runs one job per implementation, in turn (A B C A B C ...). Each job times, per size from 4 B
to 256 MiB, in-place float32 allreduces after one warm-up (rank 0's mean per call). Reported per size:
algbw = bytes / time and busbw = algbw * 2 (n - 1) / n, median [min-max] over rounds, and the ratios of
per-round figures. The physical limit for two hosts is algbw = the link's rate (each host must send and
receive all S bytes). Writes hosts_allreduce.csv, .json, .txt and, where matplotlib is importable, .png.
"""

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = HERE / "hosts_allreduce_worker.py"
ADDRS = ["198.51.100.1", "198.51.100.2"]
N, PER_HOST = 4, 2
IMPLS = ["rvod-hier", "rvod-flat", "gloo"]
# The settings of each rvod implementation (benches/hosts_ucx.py adds its own).
RVOD_SETTINGS = {"rvod-hier": {"RVOD_HIERARCHICAL_ALLREDUCE": "1"}, "rvod-flat": {"RVOD_HIERARCHICAL_ALLREDUCE": "0"}}
KiB, MiB = 1 << 10, 1 << 20


def run(*cmd, check=True):
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


class Hosts:
    """Two namespaces and a veth pair between them, shaped to `rate` each way; removed on exit."""

    def __init__(self, rate):
        tag = f"{os.getpid() % 100000}"
        self.ns = [f"rvodb{tag}a", f"rvodb{tag}b"]
        self.veth = [f"rvb{tag}a", f"rvb{tag}b"]
        self.rate = rate

    def __enter__(self):
        try:
            for ns in self.ns:
                run("ip", "netns", "add", ns)
                run("ip", "-n", ns, "link", "set", "lo", "up")
            run("ip", "link", "add", self.veth[0], "netns", self.ns[0], "type", "veth", "peer", "name", self.veth[1],
                "netns", self.ns[1])
            for ns, veth, addr in zip(self.ns, self.veth, ADDRS):
                run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
                run("ip", "-n", ns, "link", "set", veth, "up")
                # tbf needs a bucket of at least rate / HZ; 4 MB covers 10 Gbit/s at HZ=250 with room.
                run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", veth, "root", "tbf", "rate", self.rate,
                    "burst", "4mb", "latency", "50ms")
            self.wait_until_up()
        except BaseException:
            self.__exit__()
            raise
        return self

    def wait_until_up(self, timeout=10.0):
        """Wait until both ends of the veth pair are operational: a device that is not yet (the kernel reports
        the carrier a moment after `link set up`) is left out by UCX's TCP transport, whose endpoints then find the
        other host unreachable."""
        deadline = time.monotonic() + timeout
        while True:
            states = [run("ip", "netns", "exec", ns, "cat", f"/sys/class/net/{veth}/operstate").stdout.strip()
                      for ns, veth in zip(self.ns, self.veth)]
            if all(state == "up" for state in states):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the veth pair {self.veth} is not up after {timeout} s: {states}")
            time.sleep(0.05)

    def __exit__(self, *exc):
        for ns in self.ns:
            run("ip", "netns", "del", ns, check=False)

    def exec_prefix(self, host):
        return ["ip", "netns", "exec", self.ns[host]]


def rank_envs(impl, store_port, secret, hosts, per_host=PER_HOST, gloo_port=None):
    """(host, environment) of each rank, `per_host` ranks on each of the two hosts: gloo's env:// variables
    for "gloo", else what rvodrun would give an rvod rank with RVOD_SETTINGS[impl] (and gloo's variables
    too where `gloo_port` is given, for ranks that hold both)."""
    from rvod.runner.hosts import assign_slots, parse_hosts
    from rvod.runner.worker_env import worker_env

    n = 2 * per_host
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RVOD_", "HOROVOD_"))}
    envs = []
    for slot in assign_slots(parse_hosts(f"hosta:{per_host},hostb:{per_host}"), n):
        host = slot.rank // per_host
        gloo = dict(RANK=str(slot.rank), WORLD_SIZE=str(n), LOCAL_RANK=str(slot.local_rank), MASTER_ADDR=ADDRS[0],
                    MASTER_PORT=str(store_port if impl == "gloo" else gloo_port), GLOO_SOCKET_IFNAME=hosts.veth[host])
        if impl == "gloo":
            env = dict(base, **gloo)
        else:
            env = worker_env(base, slot, rendezvous_addr=ADDRS[0], rendezvous_port=store_port, secret=secret,
                             settings=RVOD_SETTINGS[impl])
            if gloo_port is not None:
                env.update(gloo)
        env["OMP_NUM_THREADS"] = "1"
        if env.get("UCX_NET_DEVICES") == "{veth}":
            env["UCX_NET_DEVICES"] = hosts.veth[host]
        envs.append((host, env))
    return envs


STORE = """import sys, time
from rvod._rvod import RendezvousServer
server = RendezvousServer(sys.argv[1], 0, bytes.fromhex(sys.stdin.readline().strip()))
print(server.port, flush=True)
sys.stdin.read()
"""


def start_store(hosts, secret):
    """rvod's rendezvous store, served in the first namespace: (its process, its port)."""
    store = subprocess.Popen(hosts.exec_prefix(0) + [sys.executable, "-c", STORE, ADDRS[0]], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    store.stdin.write(secret.hex() + "\n")
    store.stdin.flush()
    return store, int(store.stdout.readline())


def launch(hosts, envs, argv, logs, name, timeout):
    """Run `argv` once per (host, env) of `envs` in its host's namespace; rank 0's stdout (the others' output
    goes to logs/name.rankN.log), once every rank has exited 0."""
    procs = []
    try:
        for rank, (host, env) in enumerate(envs):
            log = open(logs / f"{name}.rank{rank}.log", "w")
            procs.append(subprocess.Popen(hosts.exec_prefix(host) + [sys.executable] + argv, env=env,
                                          stdout=subprocess.PIPE if rank == 0 else log, stderr=log, text=True))
        out, _ = procs[0].communicate(timeout=timeout)
        if procs[0].returncode:
            raise RuntimeError(f"{name} job failed on rank 0; see {logs}")
        for p in procs[1:]:
            p.wait(timeout=30)
        if any(p.returncode for p in procs):
            raise RuntimeError(f"{name} job failed; see {logs}")
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def gloo_store_port():
    """A port for gloo's store, below Linux's ephemeral range (32768 and up), where the sockets of earlier jobs
    in the namespace (rvod's, UCX's) may still hold the one picked."""
    return 20000 + secrets.randbelow(12000)


def run_job(impl, plan, hosts, logs, timeout):
    secret = secrets.token_bytes(16)
    store = None
    if impl == "gloo":
        port = gloo_store_port()
    else:
        store, port = start_store(hosts, secret)
    try:
        argv = [str(WORKER), "gloo" if impl == "gloo" else "rvod", json.dumps(plan)]
        out = launch(hosts, rank_envs(impl, port, secret, hosts), argv, logs, impl, timeout)
        line = [ln for ln in out.splitlines() if ln.startswith("{")][-1]
        return {int(k): v for k, v in json.loads(line)["seconds"].items()}
    finally:
        if store is not None:
            store.kill()
            store.wait()


def spread(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def human(size):
    for unit, scale in (("MiB", MiB), ("KiB", KiB)):
        if size >= scale:
            return f"{size // scale} {unit}"
    return f"{size} B"


def report(rate, sizes, times, rounds):
    """Lines of the table for one rate: per size, each impl's algbw (and latency for small sizes), and ratios."""
    link = float(rate.lower().replace("gbit", "e9").replace("mbit", "e6")) / 8
    lines = [f"link {rate} each way ({link / 1e9:.3f} GB/s), {N} ranks on 2 hosts, {rounds} rounds; "
             "algbw GB/s and time per call, median [min-max] over rounds"]
    summary = {}
    for size in sizes:
        row = [f"{human(size):>8}"]
        for impl in IMPLS:
            per_round = times[impl][size]
            algbw = spread([size / t / 1e9 for t in per_round])
            us = spread([t * 1e6 for t in per_round])
            summary[(impl, size)] = {"algbw_GBps": algbw, "busbw_GBps": {k: v * 2 * (N - 1) / N for k, v in algbw.items()},
                                     "us": us}
            row.append(f"{impl} {algbw['median']:.3f} [{algbw['min']:.3f}-{algbw['max']:.3f}] "
                       f"{us['median']:.0f} us")
        ratios = []
        for a, b in (("rvod-hier", "rvod-flat"), ("rvod-hier", "gloo"), ("rvod-flat", "gloo")):
            r = [tb / ta for ta, tb in zip(times[a][size], times[b][size])]
            ratios.append(f"{a}/{b} {statistics.median(r):.2f}x")
        lines.append(" | ".join(row + ratios))
    big = 64 * MiB
    if big in sizes:
        hier = summary[("rvod-hier", big)]["algbw_GBps"]["median"]
        flat = [tf / th for th, tf in zip(times["rvod-hier"][big], times["rvod-flat"][big])]
        gloo = [tg / th for th, tg in zip(times["rvod-hier"][big], times["gloo"][big])]
        lines.append(f"64 MiB: rvod-hier algbw {hier * 1e9 / link:.0%} of the link's rate (target >= 80%), "
                     f"{statistics.median(flat):.2f}x flat (target >= 1.3x), {statistics.median(gloo):.2f}x gloo "
                     "(target >= 1.3x); medians over rounds")
    small = sizes[0]
    lat = {impl: summary[(impl, small)]["us"]["median"] for impl in IMPLS}
    lines.append(f"{human(small)} latency: rvod-hier {lat['rvod-hier']:.0f} us, rvod-flat {lat['rvod-flat']:.0f} us, "
                 f"gloo {lat['gloo']:.0f} us (target: rvod <= 1/3 of gloo)")
    return lines, summary, link


def plot(path, results):
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not importable: no plot", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 5), squeeze=False)
    for ax, (rate, (sizes, summary, link)) in zip(axes[0], results.items()):
        for impl in IMPLS:
            med = [summary[(impl, s)]["algbw_GBps"]["median"] for s in sizes]
            ax.plot(sizes, med, marker="o", label=impl)
        ax.axhline(link / 1e9, color="grey", linestyle="--", label="link rate")
        ax.set(xscale="log", yscale="log", xlabel="bytes per rank", ylabel="algbw, GB/s",
               title=f"allreduce, 2 hosts x 2 ranks, {rate}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rates", default="2gbit,10gbit")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="4 B .. 64 MiB, small budgets, 2 rounds")
    parser.add_argument("--min-size", type=int, default=4, help="smallest size in bytes (a power of 4)")
    parser.add_argument("--report-only", action="store_true", help="rebuild the outputs from --out's CSV")
    args = parser.parse_args()
    if args.report_only:
        return write_outputs(args.out, *read_csv(args.out / "hosts_allreduce.csv"))
    top = 64 * MiB if args.quick else 256 * MiB
    sizes = [4 * 4 ** i for i in range(14) if args.min_size <= 4 * 4 ** i <= top]
    plan = {"sizes": sizes, "budget": (128 if args.quick else 512) * MiB, "min": 3, "max": 50 if args.quick else 200}
    rounds = 2 if args.quick else args.rounds
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for rate in args.rates.split(","):
        times = {impl: {size: [] for size in sizes} for impl in IMPLS}
        with Hosts(rate) as hosts:
            for r in range(rounds):
                for impl in IMPLS:
                    started = time.monotonic()
                    got = run_job(impl, plan, hosts, args.out, timeout=900)
                    print(f"{rate} round {r + 1}/{rounds} {impl}: {time.monotonic() - started:.0f} s", flush=True)
                    for size in sizes:
                        times[impl][size].append(got[size])
                        rows.append((rate, impl, size, r, got[size]))
    with open(args.out / "hosts_allreduce.csv", "w") as f:
        f.write("rate,impl,size_bytes,round,seconds_per_call\n")
        f.writelines(f"{a},{b},{c},{d},{e}\n" for a, b, c, d, e in rows)
    write_outputs(args.out, *read_csv(args.out / "hosts_allreduce.csv"))
    return None


def read_csv(path):
    """The raw per-round times in the CSV, as (rate -> impl -> size -> [seconds per call by round],)."""
    by_rate = {}
    with open(path) as f:
        next(f)
        for line in f:
            rate, impl, size, _, seconds = line.strip().split(",")
            by_rate.setdefault(rate, {}).setdefault(impl, {}).setdefault(int(size), []).append(float(seconds))
    return (by_rate,)


def write_outputs(out, by_rate):
    results, text = {}, []
    for rate, times in by_rate.items():
        sizes = sorted(times[IMPLS[0]])
        rounds = len(times[IMPLS[0]][sizes[0]])
        lines, summary, link = report(rate, sizes, times, rounds)
        print("\n".join(lines), flush=True)
        text += lines + [""]
        results[rate] = (sizes, summary, link)
    (out / "hosts_allreduce.txt").write_text("\n".join(text))
    json_summary = {rate: {f"{impl} {size}": v for (impl, size), v in summary.items()}
                    for rate, (_, summary, _) in results.items()}
    (out / "hosts_allreduce.json").write_text(json.dumps({"summary": json_summary}, indent=1))
    plot(out / "hosts_allreduce.png", results)


if __name__ == "__main__":
    main()
