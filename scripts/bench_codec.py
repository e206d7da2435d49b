#!/usr/bin/env python3
"""Codec throughput on this machine, against memcpy, timed alternately on the same buffers.

Per shard size S and sparsity theta (k = ceil((1-theta)*S)), each op is timed in
turn with a memcpy of the shard (``dst.copy_(grad)``, S fp32), so both see the same
machine load; the ratio is median memcpy time / median op time (per shard: >= 1/4
means the op runs at a quarter of memory-copy speed or better).  Ops:
  - select+sparsify: ``_tagc.sparsify`` with an fp32 residual (error feedback), on
    a residual left by the previous calls and three alternating gradients, as in
    training;
  - auto pack / auto decode: one rank's k pairs in the coding ``auto`` picks for
    (S, k, fp32) (``_tagc.pairs_pack``), and the owner's ``pairs_unpack_add`` of
    one such message (it decodes N-1 of them per shard and step);
  - sparse pack / unpack: the int32-offset pairs of mode ``sparse``;
  - sketch encode / peel decode: mode ``exact`` (decode of N ranks' summed sketch);
  - quant encode / decode (int4, ternary by default, ``--formats``; every entry,
    no theta), fp32 grad and residual by default (``--dtypes``);
  - wq encode / decode (int8, fp32 and bf16 weights, blocks of 256, the shard cut
    into 1000 parameter segments; every entry, no theta): the weight all-gather's
    message of one rank, and one rank's decode of it (into out of the weights'
    dtype); memcpy is the same fp32 copy as everywhere, so "+" row = encode and
    decode together.
The codec is single-threaded; torch is set to the same thread count (``--threads``,
default 1) so memcpy is comparable.  Prints a markdown table and the load average.

``--only quant`` (a substring of op names, repeatable) runs only the matching ops.

Usage: python scripts/bench_codec.py [--quick] [--reps R] [--threads T] [--only OP]
"""
import argparse
import logging
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import torch

# the repository's in-place build of _tagc, also when the editable install points elsewhere
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import _tagc  # noqa: E402
from tagc.config import keep_count  # noqa: E402

logger = logging.getLogger(__name__)


CLOCK = time.perf_counter
ONLY: List[str] = []  # --only: substrings of the op names to run (empty: all)
TOPK_OPS = ("select+sparsify", "auto pack", "auto decode", "sparse pack", "sparse unpack",
            "sketch encode", "peel decode")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def wanted(op: str) -> bool:
    """Whether --only selects the op named op."""
    return not ONLY or any(o in op for o in ONLY)


def alternating(fn: Callable[[], object], copy: Callable[[], object],
                reps: int) -> Tuple[float, float]:
    """Median times of fn() and of copy(), run in turn reps times after a warm-up.

    Args:
        fn: the op to time.
        copy: the memcpy it is compared with.
        reps: timed repetitions of each.
    Returns:
        (median seconds of fn, median seconds of copy), on the --clock clock.
    """
    fn()
    copy()
    t_fn, t_copy = [], []
    for _ in range(reps):
        for f, out in ((copy, t_copy), (fn, t_fn)):
            t0 = CLOCK()
            f()
            out.append(CLOCK() - t0)
    return statistics.median(t_fn), statistics.median(t_copy)


def row(op: str, S: int, theta: Any, k: int, sec: float, t_copy: float) -> Dict:
    """One table row: the op's median time and its per-shard ratio to memcpy."""
    return dict(op=op, S=S, theta=theta, k=k, sec=sec, copy=t_copy,
                gbs=S * 4 / sec / 1e9, per_shard=t_copy / sec)


def bench_case(S: int, theta: float, ranks: int, reps: int) -> List[Dict]:
    """All top-k ops on one shard size and sparsity.

    Args:
        S: shard length (fp32 elements).
        theta: sparsity; k = ceil((1-theta)*S).
        ranks: ranks whose sketches are summed for the peel decode.
        reps: timed repetitions per op.
    Returns:
        one row dict per op.
    """
    k = keep_count(theta, S)
    if not any(wanted(op) for op in TOPK_OPS):
        return []
    gen = torch.Generator().manual_seed(S)
    grads = [torch.randn(S, generator=gen) for _ in range(3)]
    residual = torch.zeros(S)
    dst = torch.empty(S)
    idx = torch.empty(k, dtype=torch.int32)
    val = torch.empty(k)
    bitmaps = torch.empty(ranks, (S + 7) // 8, dtype=torch.uint8)
    turn = iter(range(10 ** 9))

    def copy() -> None:
        dst.copy_(grads[0])

    def sparsify() -> None:
        _tagc.sparsify(idx, val, bitmaps[0], residual, grads[next(turn) % 3], k)

    rows = []
    if wanted("select+sparsify"):
        rows.append(row("select+sparsify", S, theta, k, *alternating(sparsify, copy, reps)))
    else:
        sparsify()  # idx, val: the input of the ops below
    coding = _tagc.pairs_cheapest(S, k, torch.float32)
    msg = torch.empty(_tagc.pairs_bytes(S, k, torch.float32, coding), dtype=torch.uint8)
    pairs = torch.empty(_tagc.sparse_bytes(k, torch.float32), dtype=torch.uint8)
    out = torch.zeros(S)
    for name, fn in ((f"auto pack ({coding})",
                      lambda: _tagc.pairs_pack(msg, idx, val, S, coding)),
                     (f"auto decode ({coding})",
                      lambda: _tagc.pairs_unpack_add(out, msg, k, torch.float32, coding)),
                     ("sparse pack", lambda: _tagc.sparse_pack(pairs, idx, val)),
                     ("sparse unpack", lambda: _tagc.sparse_unpack(out, pairs, k,
                                                                   torch.float32))):
        if wanted(name):
            rows.append(row(name, S, theta, k, *alternating(fn, copy, reps)))

    # N ranks' sketches of different gradients, summed: the owner's decode input.
    t = math.ceil(1.3 * min(S, ranks * k) / 3)
    seed = _tagc.seed_derive(0, 1, 2)
    total, sk = torch.zeros(3 * t), torch.empty(3 * t)
    for r in range(ranks):
        _tagc.sparsify(idx, val, bitmaps[r], None, torch.randn(S, generator=gen), k)
        _tagc.sketch_encode(sk, idx, val, S, t, seed)
        total += sk
    union = torch.empty((S + 7) // 8, dtype=torch.uint8)
    _tagc.bitmap_or(union, bitmaps, ranks)
    u = _tagc.popcount(union, S)
    if wanted("sketch encode"):
        rows.append(row("sketch encode", S, theta, k, *alternating(
            lambda: _tagc.sketch_encode(sk, idx, val, S, t, seed), copy, reps)))
    name = f"peel decode (N={ranks}, union {u})"
    if wanted(name):
        rows.append(row(name, S, theta, k, *alternating(
            lambda: _tagc.peel_decode(out, total, union, S, t, seed), copy, reps)))
    return rows


def bench_quant(S: int, reps: int, formats: List[str], grad_dtype: str,
                residual_dtype: str) -> List[Dict]:
    """quant mode's encode (fused error feedback) and decode, per format, one shard.

    Args:
        S: shard length (elements).
        reps: timed repetitions per op.
        formats: quant formats to time.
        grad_dtype, residual_dtype: keys of DTYPES (memcpy stays S fp32).
    Returns:
        one row dict per op.
    """
    gen = torch.Generator().manual_seed(S)
    grad32 = torch.randn(S, generator=gen)
    residual = (torch.randn(S, generator=gen) * 0.01).to(DTYPES[residual_dtype])
    dst = torch.empty_like(grad32)
    grad = grad32.to(DTYPES[grad_dtype])
    out = torch.zeros(S)
    tag = "" if (grad_dtype, residual_dtype) == ("fp32", "fp32") else \
        f" ({grad_dtype} grad, {residual_dtype} residual)"
    rows = []
    for fmt in formats:
        buf = torch.empty(_tagc.quant_bytes(S, fmt, 256), dtype=torch.uint8)
        for name, fn in ((f"quant encode {fmt}{tag}",
                          lambda: _tagc.quant_encode(buf, residual, grad, fmt, 256)),
                         (f"quant decode {fmt}{tag}",
                          lambda: _tagc.quant_decode_add(out, buf, fmt, 256))):
            if wanted(name):
                rows.append(row(name, S, "-", S, *alternating(
                    fn, lambda: dst.copy_(grad32), reps)))
    return rows


def bench_wq(S: int, reps: int) -> List[Dict]:
    """The weight gather's encode and decode (int8), fp32 and bf16 weights, one shard.

    Args:
        S: shard length (elements).
        reps: timed repetitions per op.
    Returns:
        one row dict per op, and one for encode + decode.
    """
    gen = torch.Generator().manual_seed(S)
    grad = torch.randn(S, generator=gen)
    dst = torch.empty_like(grad)
    cuts = sorted(torch.randint(0, S + 1, (999,), generator=gen).tolist())
    segs = torch.tensor([b - a for a, b in zip([0] + cuts, cuts + [S])], dtype=torch.int64)
    buf = torch.empty(_tagc.wq_bytes(segs, "int8", 256), dtype=torch.uint8)
    rows = []
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        w = grad.to(dtype)
        out = torch.empty(S, dtype=dtype)
        enc = alternating(lambda: _tagc.wq_encode(buf, w, segs, "int8", 256),
                          lambda: dst.copy_(grad), reps)
        dec = alternating(lambda: _tagc.wq_decode(out, buf, segs, "int8", 256),
                          lambda: dst.copy_(grad), reps)
        rows.append(row(f"wq encode int8 {name}", S, "-", S, *enc))
        rows.append(row(f"wq decode int8 {name}", S, "-", S, *dec))
        rows.append(row(f"wq encode+decode int8 {name}", S, "-", S, enc[0] + dec[0],
                        (enc[1] + dec[1]) / 2))
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
    ap.add_argument("--only", action="append", default=[], metavar="OP",
                    help="run only the ops whose name contains OP (repeatable), "
                         "e.g. --only 'quant encode'")
    ap.add_argument("--formats", default="int4,ternary",
                    help="quant formats, comma-separated (int4, ternary, int8, sign)")
    ap.add_argument("--dtypes", default="fp32:fp32",
                    help="quant (grad:residual) dtype pairs, comma-separated, "
                         "e.g. fp32:fp32,bf16:bf16")
    args = ap.parse_args()
    global CLOCK
    ONLY.extend(args.only)
    formats = [f for f in args.formats.split(",") if f]
    dtypes = [tuple(p.split(":")) for p in args.dtypes.split(",") if p]
    if not all(len(p) == 2 and set(p) <= set(DTYPES) for p in dtypes):
        ap.error(f"--dtypes: grad:residual pairs of {sorted(DTYPES)}, got {args.dtypes!r}")
    CLOCK = time.perf_counter if args.clock == "wall" else time.process_time
    load_before = os.getloadavg()[0]
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    sizes = [1 << 20] if args.quick else [1 << 22, 1 << 24]
    thetas = [0.9875] if args.quick else [0.9875, 0.95, 0.9]
    reps = args.reps or (3 if args.quick else 7)
    rows = []
    for S in sizes:
        for theta in thetas:
            logger.info("S=2^%d theta=%s ...", S.bit_length() - 1, theta)
            rows += bench_case(S, theta, args.ranks, reps)
        for gd, rd in dtypes:
            rows += bench_quant(S, reps, formats, gd, rd)
        if wanted("wq encode") or wanted("wq decode"):
            rows += bench_wq(S, reps)
    print("| S | theta | k | op | median ms | memcpy ms (alternating) | GB/s of gradient "
          "| ratio to memcpy (per shard) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| 2^%d | %s | %d | %s | %.3f | %.3f | %.2f | %.2f |" % (
            r["S"].bit_length() - 1, r["theta"], r["k"], r["op"], r["sec"] * 1e3,
            r["copy"] * 1e3, r["gbs"], r["per_shard"]))
    print("\ntorch threads: %d; codec: 1 thread; median of %d alternating runs; %s clock; "
          "1-min load average %.2f before, %.2f after, on %d CPUs." % (
              args.threads, reps, args.clock, load_before, os.getloadavg()[0], os.cpu_count()))


if __name__ == "__main__":
    main()
