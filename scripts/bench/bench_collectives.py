#!/usr/bin/env python3
"""gloo collective rates on the emulated slow network: the link as the cost model needs it.

A raw TCP transfer (``netem.sh measure``) gives the link's rate; gloo's collectives do
not all reach it (on the 200 Mbit veth its all-gather and all-to-all run well below
its all-reduce). This is the nccl-tests of the emulation: it times ``all_reduce``,
``all_gather_into_tensor``, ``all_to_all_single`` and point-to-point ``isend``/``irecv``
to every peer, all posted at once (``p2p``) or in ring steps (``p2p_ring``, TAGC's
exchange from three ranks, ``tagc/comm.py``), of several sizes, each call after an idle
gap (collectives in a training step are separated by compute), and prints the bytes
per second a host's link carried for each. ``scripts/bench/cost_model.py`` reads the
output as a setup's ``collectives`` table (``--check``) or ``--collectives FILE``.
``--out`` defaults to ``docs/runs/collectives-<UTC date-time>/collectives.json`` of this
checkout, a folder to commit with the figures quoted from it (``scripts/bench/tagc_bench/outputs.py``).

Groups measured: the ``world`` (every rank, FULL_SHARD's collectives; with one rank
per host all of them on the shaped link) and, with ``--per-node N > 1``, the ``node``
group (a host's ranks on its unshaped loopback, the fast link inside a node) and the
``replica`` groups (one rank per host, the N of them at once, as HSDP's all-reduce
across nodes).

Rate = the bytes the cost model counts on that link for the call (ring formulas per
rank: all-reduce 2(g-1)/g x size, the others (g-1)/g x size; times the N ranks of a
host for the replica groups), over the call's time, the slowest rank's; size = the full
tensor (all-reduce input, all-gather output, all-to-all and p2p input), as nccl-tests
counts it. Median over ``--reps`` calls.

Usage:
    sudo python3 scripts/bench/bench_collectives.py --nodes 2
    sudo python3 scripts/bench/bench_collectives.py --nodes 2 --per-node 2 --out links-2x2.json
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

from tagc_bench.outputs import run_dir
from tagc.train.runs import NETEM, free_port, netem

# the checkout this script sits in (scripts/bench/): where --out's default folder goes
ROOT = Path(__file__).resolve().parents[2]

logger = logging.getLogger(__name__)

OPS = ("all_reduce", "all_gather", "all_to_all", "p2p", "p2p_ring")


def link_bytes(op: str, size: int, g: int) -> float:
    """Bytes one rank puts on the link for one call on ``g`` ranks (ideal ring).

    Args:
        op: one of :data:`OPS`.
        size: bytes of the full tensor (all-reduce input, all-gather output,
            all-to-all input, the p2p pieces together).
        g: ranks in the group.
    Returns:
        bytes.
    """
    if op == "all_reduce":
        return 2 * (g - 1) / g * size
    if op in ("all_gather", "all_to_all", "p2p", "p2p_ring"):
        return (g - 1) / g * size
    raise ValueError(f"unknown collective {op!r}; one of {OPS}")


def _call(op: str, size: int, g: int, group) -> Callable[[], None]:
    """A closure running one collective of ``size`` bytes (fp32) over ``group``."""
    import torch
    import torch.distributed as dist

    n = max(g, size // 4 // g * g)  # divisible by g: every rank the same piece
    if op == "all_reduce":
        t = torch.ones(n)
        return lambda: dist.all_reduce(t, group=group)
    if op == "all_gather":
        inp, out = torch.ones(n // g), torch.empty(n)
        return lambda: dist.all_gather_into_tensor(out, inp, group=group)
    inp, out = torch.ones(n), torch.empty(n)
    if op == "all_to_all":
        return lambda: dist.all_to_all_single(out, inp, group=group)
    me, send, recv = dist.get_rank(group), inp.view(g, -1), out.view(g, -1)
    peers = [(me + 1 + i) % g for i in range(g - 1)]

    def p2p() -> None:
        """Every receive posted, then a send to each peer in ring order, then wait
        for all (tagc/comm.py before its ring steps, and with two ranks)."""
        works = [dist.irecv(recv[r], group=group, group_src=r) for r in peers]
        works += [dist.isend(send[r], group=group, group_dst=r) for r in peers]
        for w in works:
            w.wait()

    def p2p_ring() -> None:
        """Ring steps: at step i send to rank + i, receive from rank - i, both done
        before step i + 1 (tagc/comm.py Comm.stepped, from three ranks)."""
        for r in peers:
            src = (2 * me - r) % g
            works = [dist.irecv(recv[src], group=group, group_src=src),
                     dist.isend(send[r], group=group, group_dst=r)]
            for w in works:
                w.wait()
    return p2p if op == "p2p" else p2p_ring


def _worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    n = args.per_node
    hosts = world // n
    groups: Dict[str, tuple] = {"world": (None, world, 1)}
    if n > 1:
        # every rank creates every group, in the same order (torch.distributed's rule)
        for h in range(hosts):
            pg = dist.new_group(list(range(h * n, (h + 1) * n)))
            if rank // n == h:
                groups["node"] = (pg, n, 1)
        for j in range(n):
            pg = dist.new_group(list(range(j, world, n)))
            if rank % n == j:
                groups["replica"] = (pg, hosts, n)  # the host's N rings share its link
    table: Dict[str, Dict[str, List[List[float]]]] = {}
    for gname, (pg, g, share) in groups.items():
        for op in args.ops:
            rows = []
            for mib in args.sizes:
                size = int(mib * 2**20)
                f = _call(op, size, g, pg)
                f()  # connections and buffers set up outside the timing
                times = []
                for _ in range(args.reps):
                    dist.barrier()
                    time.sleep(args.gap_ms / 1e3)
                    t0 = time.perf_counter()
                    f()
                    times.append(time.perf_counter() - t0)
                # the slowest rank's time per call: a collective ends when its last rank does
                tt = torch.tensor(times, dtype=torch.float64)
                dist.all_reduce(tt, op=dist.ReduceOp.MAX)
                med = statistics.median(tt.tolist())
                rate = link_bytes(op, size, g) * share / med
                rows.append([size, rate])
                if rank == 0:
                    logger.info("%-7s %-10s %7.2f MiB: %8.1f Mbit/s", gname, op, mib, rate * 8 / 1e6)
            table.setdefault(gname, {})[op] = rows
    if rank == 0:
        Path(args.result).write_text(json.dumps(table))
    dist.destroy_process_group()
    return 0


def _driver(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        sys.exit("bench_collectives.py: needs root to build the emulated network "
                 "(tagc/train/netem.sh); run with sudo")
    out = Path(args.out) if args.out else run_dir(ROOT, "collectives") / "collectives.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result = out.with_suffix(".raw.json")
    prefix = f"tagcc{os.getpid() % 1000}"
    net = ["--prefix", prefix, "-n", str(args.nodes), "--rate", args.rate, "--delay", "0"]
    report = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
              "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
              "loadavg_start": os.getloadavg(), "nodes": args.nodes, "per_node": args.per_node,
              "rate": args.rate, "gap_ms": args.gap_ms, "reps": args.reps,
              "rate_unit": "bytes per second a host's link carries (see the module doc)"}
    try:
        netem(net, "up")
        report["link_measured"] = netem(net, "measure", "10", timeout=600).strip()
        cmd = ["bash", str(NETEM), *net, "torchrun", "--port", str(free_port()), "--timeout",
               str(int(args.timeout)), "--nproc-per-node", str(args.per_node), "--",
               str(Path(__file__).resolve()), "--worker", "--per-node", str(args.per_node),
               "--result", str(result), "--reps", str(args.reps), "--gap-ms", str(args.gap_ms),
               "--sizes", *map(str, args.sizes), "--ops", *args.ops]
        env = dict(os.environ, OMP_NUM_THREADS="1", TAGC_PYTHON=sys.executable)
        r = subprocess.run(cmd, timeout=args.timeout + 60, env=env)
        if r.returncode != 0 or not result.exists():
            raise RuntimeError(f"workers failed (exit {r.returncode}); see the log above")
    finally:
        netem(net, "down", check=False)
    report["loadavg_end"] = os.getloadavg()
    report["collectives"] = json.loads(result.read_text())
    result.unlink()
    out.write_text(json.dumps(report, indent=1))
    print(render(report))
    print(f"wrote {out}")
    return 0


def render(report: dict) -> str:
    """Markdown table of a report: Mbit/s per group, op and size."""
    lines = [f"`{report['command']}` ({report['started_utc']} UTC, load "
             f"{report['loadavg_start'][0]:.1f} -> {report['loadavg_end'][0]:.1f}); "
             f"{report['link_measured']}", "",
             "| group | collective | " + " | ".join(
                 f"{s / 2**20:g} MiB" for s, _ in
                 next(iter(next(iter(report["collectives"].values())).values()))) + " |"]
    lines.append("|---|---|" + "---|" * (lines[-1].count("|") - 3))
    for g, ops in report["collectives"].items():
        for op, rows in ops.items():
            lines.append(f"| {g} | {op} | " + " | ".join(f"{r * 8 / 1e6:.0f}" for _, r in rows)
                         + " |")
    return "\n".join(lines)


def main(argv: List[str] | None = None) -> int:
    """Parse arguments; run the driver or, with --worker, one rank.

    Args:
        argv: command line (default sys.argv[1:]).
    Returns:
        exit code.
    """
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=2, help="emulated hosts (default 2)")
    p.add_argument("--per-node", type=int, default=1, help="ranks per host (default 1)")
    p.add_argument("--rate", default="200mbit", help="tc rate per link (default 200mbit)")
    p.add_argument("--sizes", type=float, nargs="+", default=[0.25, 1, 4, 16],
                   help="tensor sizes in MiB (default 0.25 1 4 16)")
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    p.add_argument("--reps", type=int, default=6, help="timed calls per size (default 6)")
    p.add_argument("--gap-ms", type=float, default=50.0,
                   help="idle time before each call, as compute between a step's "
                        "collectives (default 50)")
    p.add_argument("--out", default=None,
                   help="the output JSON (default: docs/runs/collectives-<UTC date-time>/"
                        "collectives.json of this checkout)")
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.nodes < 2 or args.per_node < 1 or args.reps < 1 or args.gap_ms < 0:
        p.error("--nodes >= 2, --per-node >= 1, --reps >= 1, --gap-ms >= 0")
    if any(s <= 0 for s in args.sizes):
        p.error("--sizes must be > 0 MiB")
    return _worker(args) if args.worker else _driver(args)


if __name__ == "__main__":
    sys.exit(main())
