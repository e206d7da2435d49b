#!/usr/bin/env python3
"""Codec throughput on this machine, against memcpy, on the same buffers.

Measures, per shard size S and sparsity theta (k = ceil((1-theta)*S)):
  - memcpy: ``dst.copy_(grad)`` of the S fp32 gradient (GB/s of gradient);
  - select+sparsify: ``_tagc.sparsify`` with error feedback (GB/s of gradient);
  - sketch encode: ``_tagc.sketch_encode`` of the k kept entries (entries/s);
  - peel decode: ``_tagc.peel_decode`` of the sum of N ranks' sketches sized as
    docs/DESIGN.md section 4 `exact` (entries/s of the union);
  - quant encode/decode (int4, ternary; no theta: every entry): ``_tagc.quant_encode``
    with error feedback and ``_tagc.quant_decode_add`` (GB/s of gradient);
and prints a markdown table with each op's ratio to memcpy, both per item
(entries/s over fp32 elements copied per second) and per shard (time to copy
the shard over the op's time).  The codec is single-threaded; torch is set
to the same thread count (``--threads``, default 1) so memcpy is comparable.

Usage: python scripts/bench_codec.py [--quick] [--reps R] [--threads T]
"""
import argparse
import logging
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch

# the repository's in-place build of _tagc, also when the editable install points elsewhere
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import _tagc  # noqa: E402

logger = logging.getLogger(__name__)


CLOCK = time.perf_counter


def timed(fn: Callable[[], object], reps: int) -> float:
    """Median time of fn() over reps runs after one warm-up, in seconds.

    Args:
        fn: the call to time.
        reps: number of timed runs.
    Returns:
        median seconds per call, on the clock chosen by --clock.
    """
    fn()
    times = []
    for _ in range(reps):
        t0 = CLOCK()
        fn()
        times.append(CLOCK() - t0)
    return statistics.median(times)


def bench_case(S: int, theta: float, ranks: int, reps: int) -> List[Dict]:
    """All ops on one shard size and sparsity.

    Args:
        S: shard length (fp32 elements).
        theta: sparsity; k = ceil((1-theta)*S).
        ranks: ranks whose sketches are summed for the decode.
        reps: timed repetitions per op.
    Returns:
        one row dict per op.
    """
    k = math.ceil(round((1 - theta) * S, 9))
    gen = torch.Generator().manual_seed(S)
    grad = torch.randn(S, generator=gen)
    residual = torch.randn(S, generator=gen) * 0.01
    dst = torch.empty_like(grad)
    idx = torch.empty(k, dtype=torch.int32)
    val = torch.empty(k)
    bitmaps = torch.empty(ranks, (S + 7) // 8, dtype=torch.uint8)
    t = math.ceil(1.3 * min(S, ranks * k) / 3)
    seed = _tagc.seed_derive(0, 1, 2)

    t_copy = timed(lambda: dst.copy_(grad), reps)
    t_sel = timed(lambda: _tagc.select_kth(grad, k), reps)
    t_sp = timed(lambda: _tagc.sparsify(idx, val, bitmaps[0], residual, grad, k), reps)

    # N ranks' sketches of different gradients, summed: the owner's decode input.
    total = torch.zeros(3 * t)
    sk = torch.empty(3 * t)
    for r in range(ranks):
        g = torch.randn(S, generator=gen)
        _tagc.sparsify(idx, val, bitmaps[r], None, g, k)
        _tagc.sketch_encode(sk, idx, val, S, t, seed)
        total += sk
    t_enc = timed(lambda: _tagc.sketch_encode(sk, idx, val, S, t, seed), reps)
    union = torch.empty((S + 7) // 8, dtype=torch.uint8)
    _tagc.bitmap_or(union, bitmaps, ranks)
    u = _tagc.popcount(union, S)
    out = torch.empty(S)
    left = _tagc.peel_decode(out, total, union, S, t, seed)
    t_dec = timed(lambda: _tagc.peel_decode(out, total, union, S, t, seed), reps)

    copy_gbs = S * 4 / t_copy / 1e9
    copy_eps = S / t_copy  # fp32 elements copied per second
    rows = [dict(op="memcpy (copy_)", items=S, sec=t_copy, rate=copy_gbs, unit="GB/s",
                 per_item=1.0, per_shard=1.0)]
    for name, sec in (("select_kth", t_sel), ("select+sparsify", t_sp)):
        gbs = S * 4 / sec / 1e9
        rows.append(dict(op=name, items=S, sec=sec, rate=gbs, unit="GB/s",
                         per_item=gbs / copy_gbs, per_shard=t_copy / sec))
    rows.append(dict(op="sketch encode", items=k, sec=t_enc, rate=k / t_enc, unit="entries/s",
                     per_item=(k / t_enc) / copy_eps, per_shard=t_copy / t_enc))
    rows.append(dict(op="peel decode (N=%d, u=%d, left=%d)" % (ranks, u, left), items=u,
                     sec=t_dec, rate=u / t_dec, unit="entries/s",
                     per_item=(u / t_dec) / copy_eps, per_shard=t_copy / t_dec))
    for r in rows:
        r.update(S=S, theta=theta, k=k)
    return rows


def bench_quant(S: int, reps: int) -> List[Dict]:
    """quant mode's encode (fused error feedback) and decode, per format, one shard.

    Args:
        S: shard length (fp32 elements).
        reps: timed repetitions per op.
    Returns:
        one row dict per op (ratios against a memcpy timed here too).
    """
    gen = torch.Generator().manual_seed(S)
    grad = torch.randn(S, generator=gen)
    residual = torch.randn(S, generator=gen) * 0.01
    dst = torch.empty_like(grad)
    out = torch.zeros(S)
    t_copy = timed(lambda: dst.copy_(grad), reps)
    copy_gbs = S * 4 / t_copy / 1e9
    rows = []
    for fmt in ("int4", "ternary"):
        buf = torch.empty(_tagc.quant_bytes(S, fmt, 256), dtype=torch.uint8)
        for name, fn in ((f"quant encode {fmt}",
                          lambda: _tagc.quant_encode(buf, residual, grad, fmt, 256)),
                         (f"quant decode {fmt}",
                          lambda: _tagc.quant_decode_add(out, buf, fmt, 256))):
            sec = timed(fn, reps)
            gbs = S * 4 / sec / 1e9
            rows.append(dict(op=name, items=S, sec=sec, rate=gbs, unit="GB/s",
                             per_item=gbs / copy_gbs, per_shard=t_copy / sec,
                             S=S, theta="-", k=S))
    return rows


def main() -> None:
    """Parses arguments, runs the cases, prints the markdown table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI-sized run (S = 2^20, few reps)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per op")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for memcpy")
    ap.add_argument("--ranks", type=int, default=2, help="ranks summed for the decode")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="wall: perf_counter; cpu: this process's CPU time (less "
                         "sensitive to other processes sharing the cores)")
    args = ap.parse_args()
    global CLOCK
    CLOCK = time.perf_counter if args.clock == "wall" else time.process_time
    load_before = os.getloadavg()[0]
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    sizes = [1 << 20] if args.quick else [1 << 22, 1 << 24]
    thetas = [0.9875] if args.quick else [0.9875, 0.9]
    reps = args.reps or (3 if args.quick else 7)
    rows = []
    for S in sizes:
        for theta in thetas:
            logger.info("S=2^%d theta=%s ...", S.bit_length() - 1, theta)
            rows += bench_case(S, theta, args.ranks, reps)
        rows += bench_quant(S, reps)
    print("| S | theta | k | op | median ms | throughput | ratio to memcpy (per item) "
          "| ratio (per shard) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        rate = ("%.2f GB/s" % r["rate"]) if r["unit"] == "GB/s" else ("%.3g entries/s" % r["rate"])
        print("| 2^%d | %s | %d | %s | %.3f | %s | %.2f | %.2f |" % (
            r["S"].bit_length() - 1, r["theta"], r["k"], r["op"], r["sec"] * 1e3, rate,
            r["per_item"], r["per_shard"]))
    print("\ntorch threads: %d; codec: 1 thread; median of %d runs; %s clock; "
          "1-min load average %.1f before, %.1f after, on %d CPUs." % (
              args.threads, reps, args.clock, load_before, os.getloadavg()[0], os.cpu_count()))


if __name__ == "__main__":
    main()
