#!/usr/bin/env python3
"""Codec throughput against memcpy: runs the pytest benchmarks, prints the markdown table.

The benchmarks are ``tests/test_bench_codec.py`` (pytest-benchmark; every op checked
against a torch reference after it is timed).  This script runs them with
``--benchmark-enable`` on each shard size, keeps pytest-benchmark's JSON
(``--json``), and prints one row per op: median time, GB/s of gradient (4 bytes per
entry of the shard) and the ratio memcpy time / op time, memcpy being the mean of
the medians timed first and last in the same run (both printed: their gap is how
far the machine's load moved meanwhile).  The codec is single-threaded and the
benchmarks run torch on one thread.

Usage: python3 scripts/bench/bench_codec.py [--quick] [--sizes 4194304,16777216] [--only quant]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence

# the checkout this script sits in (scripts/bench/): its tests/ hold the benchmarks
ROOT = Path(__file__).resolve().parents[2]
BENCH = "tests/test_bench_codec.py"


def run_size(size: int, only: Sequence[str], min_rounds: int, json_path: Path) -> Dict:
    """pytest-benchmark's JSON for one shard size.

    Args:
        size: shard length (fp32 entries).
        only: substrings of test ids to keep (pytest ``-k``, or-ed); memcpy always runs.
        min_rounds: pytest-benchmark's ``--benchmark-min-rounds``.
        json_path: where pytest-benchmark writes its JSON.
    Returns:
        the parsed JSON.
    Raises:
        SystemExit: when pytest fails (a benchmark whose output is wrong fails too).
    """
    cmd = [sys.executable, "-m", "pytest", "-q", BENCH, "--benchmark-enable",
           f"--bench-size={size}", f"--benchmark-min-rounds={min_rounds}",
           f"--benchmark-json={json_path}", "--benchmark-columns=median"]
    if only:
        cmd += ["-k", " or ".join(["memcpy", *only])]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"bench_codec.py: pytest failed (exit {r.returncode}):\n{r.stdout[-4000:]}"
                 f"\n{r.stderr[-2000:]}")
    return json.loads(json_path.read_text())


def rows(data: Dict, size: int) -> List[str]:
    """Markdown rows of one size's results.

    Args:
        data: pytest-benchmark's JSON of one run.
        size: its shard length.
    Returns:
        one row per op, and a last line with the two memcpy medians.
    """
    med = {b["name"]: b["stats"]["median"] for b in data["benchmarks"]}
    first, last = med.pop("test_memcpy"), med.pop("test_memcpy_end")
    copy = (first + last) / 2
    out = []
    for name, sec in med.items():
        op = name.removeprefix("test_").replace("[", " [")
        out.append(f"| 2^{size.bit_length() - 1} | {op} | {sec * 1e3:.3f} | "
                   f"{size * 4 / sec / 1e9:.2f} | {copy / sec:.2f} |")
    out.append(f"| 2^{size.bit_length() - 1} | memcpy (first / last) | "
               f"{first * 1e3:.3f} / {last * 1e3:.3f} | {size * 4 / copy / 1e9:.2f} | 1 |")
    return out


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Parses arguments, runs the benchmarks per size, prints the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one size, 2^20, few rounds")
    ap.add_argument("--sizes", default=f"{1 << 22},{1 << 24}",
                    help="shard lengths (fp32 entries), comma-separated")
    ap.add_argument("--only", action="append", default=[], metavar="OP",
                    help="run only the tests whose id contains OP (repeatable), "
                         "e.g. --only quant --only wq")
    ap.add_argument("--rounds", type=int, default=0,
                    help="minimum timed rounds per op (0: 3 with --quick, else 7)")
    ap.add_argument("--json", default="", help="directory for pytest-benchmark's JSON "
                                               "(one file per size; default: a temporary one)")
    args = ap.parse_args(argv)
    try:
        sizes = [1 << 20] if args.quick else [int(s) for s in args.sizes.split(",") if s]
    except ValueError:
        ap.error(f"--sizes: integers, got {args.sizes!r}")
    if not sizes or min(sizes) < 256:
        ap.error("--sizes: at least one size, each >= 256")
    rounds = args.rounds or (3 if args.quick else 7)
    load = os.getloadavg()[0]
    lines = ["| S | op [params] | median ms | GB/s of gradient | ratio to memcpy |",
             "|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(args.json or tmp)
        out_dir.mkdir(parents=True, exist_ok=True)
        for size in sizes:
            data = run_size(size, args.only, rounds, out_dir / f"bench_codec_{size}.json")
            lines += rows(data, size)
    print("\n".join(lines))
    print(f"\nmedian of >= {rounds} rounds per op (pytest-benchmark); codec and torch on one "
          f"thread; 1-min load average {load:.2f} before, {os.getloadavg()[0]:.2f} after, "
          f"on {os.cpu_count()} CPUs." + (f" JSON: {args.json}" if args.json else ""))


if __name__ == "__main__":
    main()
