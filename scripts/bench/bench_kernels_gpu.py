#!/usr/bin/env python3
"""GPU throughput of every CUDA codec op of ``_tagc``, against a device-to-device copy.

For each op the script times ``--iters`` back-to-back calls on the current
stream with CUDA events (after ``--warmup`` calls) and reports the time per
call and an effective bandwidth: the bytes the op must at least read and
write (its inputs and outputs, once each) divided by that time.  The
reference is ``dst.copy_(src)`` of the shard's fp32 gradient, counted the
same way (read + write).  ``% copy`` is the ratio of the two bandwidths,
so 50% means the op moves its minimal traffic at half the speed of a copy.
Multi-pass kernels (the radix select reads its input once per digit) move
more than the minimal traffic, which is exactly what the ratio shows.

The goals: select+sparsify (the ``sparsify`` row, which includes the select) and
quant encode (``quant_encode int4``) at >= 50% of the copy (issue 39); the newer codes'
encoders at >= 40% (issue 56: ``tls`` as ``tagc-lean`` runs it, without a residual;
``fp4`` as ``gather: fp4`` runs it, plain and rotated; ``wq_delta``, ``tagc-full4``'s
gathers); ``--json`` records each goal and whether it was met.

Usage (needs a CUDA GPU and a CUDA build of ``_tagc``: ``TAGC_BUILD_CUDA=1 pip install
-e .``, or ``scripts/gpu_check.sh``, which builds one in a scratch folder)::

    python3 scripts/bench/bench_kernels_gpu.py --n 16777216 --theta 0.9875 --json out/gpu.json

``--emu-lib LIB`` runs the same calls on the CPU through the CUDA emulation
(``tagc_bench.cuda_emu``; ``--n`` a few thousand): a check of this script's calls, never a
measurement (the figures are CPU thread timings).  Exits with status 2 and a message when
no GPU or no CUDA build is present.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from typing import Any, Callable, Dict, List, Tuple

logger = logging.getLogger(__name__)

COPY = "copy (torch copy_, device to device)"
# (row, goal in % of the copy's bandwidth): issue 39's, then issue 56's
GOALS = (("sparsify (select+EF+bitmap+compact)", 50.0), ("quant_encode int4", 50.0),
         ("tls_encode (no residual)", 40.0), ("fp4_encode block 32 (no residual)", 40.0),
         ("fp4_encode block 32 rotated (no residual)", 40.0), ("wq_delta_encode int4", 40.0))


def _fail(msg: str) -> None:
    print(f"bench_kernels_gpu: {msg}", file=sys.stderr)
    sys.exit(2)


def time_op(fn: Callable[[], None], iters: int, warmup: int, cuda: bool = True) -> float:
    """Mean milliseconds per call of fn on the current stream.

    Args:
        fn: enqueues one call (no host sync inside).
        iters: timed calls.
        warmup: untimed calls first (allocator, caches, lazy module loading).
        cuda: time with CUDA events (else the host clock: the emulation).

    Returns:
        Milliseconds per call.
    """
    import torch

    for _ in range(warmup):
        fn()
    if not cuda:
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) * 1e3 / iters
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def _require_gpu() -> Tuple[Any, Any]:
    """torch and a CUDA build of _tagc with a visible device, or a clear exit."""
    try:
        import torch
    except ImportError:
        _fail("torch is not installed")
    if not torch.cuda.is_available():
        _fail("no CUDA device visible to torch: this benchmark needs a GPU "
              "(nothing was measured)")
    try:
        import _tagc
    except ImportError as exc:
        _fail(f"cannot import _tagc ({exc}); build it with TAGC_BUILD_CUDA=1 pip install -e .")
    if not getattr(_tagc, "cuda_available", lambda: False)():
        _fail("_tagc was built without CUDA kernels or sees no device; "
              "rebuild with TAGC_BUILD_CUDA=1 pip install -e .")
    return torch, _tagc


def _ops(torch: Any, ops: Any, dev: Any, s: int, n: int, k: int, N: int, u: int, t: int
         ) -> Tuple[Dict[str, tuple], Any]:
    """Every op as (callable, bytes it moves) on the same buffers, the copy first; and
    the device counter the last peel_decode writes.

    Args:
        torch: the torch module.
        ops: ``_tagc`` (CUDA tensors) or a ``tagc_bench.cuda_emu.EmuOps`` (CPU tensors).
        dev: the tensors' device.
        s: the stream handle every call gets.
        n, k, N, u, t: shard length, kept entries, ranks, union size, sketch rows.
    """
    nb = (n + 7) // 8
    gen = torch.Generator(device=dev).manual_seed(0)
    grad = torch.randn(n, device=dev, generator=gen)
    res = torch.randn(n, device=dev, generator=gen) * 0.01
    src = torch.randn(n, device=dev, generator=gen)
    dst = torch.empty_like(src)
    idx = torch.empty(k, dtype=torch.int32, device=dev)
    val = torch.empty(k, device=dev)
    bm = torch.empty(nb, dtype=torch.uint8, device=dev)
    tau = torch.empty(1, device=dev)
    cnt = torch.empty(1, dtype=torch.int64, device=dev)
    ops.sparsify(idx, val, bm, res, grad, k, out=tau, stream=s)

    # The owner's inputs: a union of u positions and a sketch that peels.
    upos = torch.randperm(n, device=dev, generator=gen)[:u].sort().values.to(torch.int32)
    uval = torch.randn(u, device=dev, generator=gen)
    sk = torch.empty(3 * t, device=dev)
    ops.sketch_encode(sk, upos, uval, n, t, 12345, stream=s)
    ubits = torch.zeros(nb * 8, dtype=torch.uint8, device=dev)
    ubits[upos.long()] = 1
    union = (ubits.view(-1, 8).int() << torch.arange(8, device=dev, dtype=torch.int32)
             ).sum(1).to(torch.uint8)
    bms = torch.randint(0, 256, (N * nb,), dtype=torch.uint8, device=dev, generator=gen)
    lanes4 = torch.empty((n * 4 + 7) // 8, dtype=torch.uint8, device=dev)
    lanes1 = torch.empty(nb, dtype=torch.uint8, device=dev)
    out = torch.empty(n, device=dev)
    unp = torch.empty(u, dtype=torch.int32, device=dev)
    pairs = torch.empty(k * 8, dtype=torch.uint8, device=dev)
    ops.sparse_pack(pairs, idx, val, stream=s)
    ef = torch.empty(ops.pairs_bytes(n, k, torch.float32, "ef"), dtype=torch.uint8, device=dev)
    ops.pairs_pack(ef, idx, val, n, "ef", stream=s)
    acc = torch.zeros(n, device=dev)
    qbufs = {fmt: torch.empty(ops.quant_bytes(n, fmt, 256), dtype=torch.uint8, device=dev)
             for fmt in ("int4", "ternary", "sign", "int8")}
    for fmt, qb in qbufs.items():
        ops.quant_encode(qb, res, grad, fmt, 256, stream=s)
    # a unit's parameter shard: 12 segments (parameters) of unequal length
    seg_cpu = torch.full((12,), n // 12, dtype=torch.int64)
    seg_cpu[-1] += n - int(seg_cpu.sum())
    segs = seg_cpu.to(dev)
    wq8 = torch.empty(ops.wq_bytes(seg_cpu, "int8", 256), dtype=torch.uint8, device=dev)
    ops.wq_encode(wq8, src, segs, "int8", 256, stream=s)
    wout = torch.empty(n, dtype=torch.bfloat16, device=dev)
    wq4d = torch.empty(ops.wq_delta_bytes(seg_cpu, "int4", 256), dtype=torch.uint8, device=dev)
    sent, held = torch.zeros_like(src), src + 1e-3 * grad
    tls = torch.empty(ops.tls_bytes(n), dtype=torch.uint8, device=dev)
    fp4 = torch.empty(ops.fp4_bytes(n, 32), dtype=torch.uint8, device=dev)
    ops.tls_encode(tls, None, grad, stream=s)

    f4 = 4
    table: Dict[str, tuple] = {
        COPY: (lambda: dst.copy_(src), 2 * n * f4),
        "select_kth": (lambda: ops.select_kth(grad, k, out=tau, stream=s), n * f4),
        "sparsify (select+EF+bitmap+compact)": (
            lambda: ops.sparsify(idx, val, bm, res, grad, k, out=tau, stream=s),
            3 * n * f4 + nb + 8 * k),
        "lanes_pack 1-bit": (lambda: ops.lanes_pack(lanes1, bm, n, 1, stream=s), 2 * nb),
        "lanes_pack 4-bit": (lambda: ops.lanes_pack(lanes4, bm, n, 4, stream=s),
                             nb + lanes4.numel()),
        "lanes_unpack 4-bit": (lambda: ops.lanes_unpack(bm, lanes4, n, 4, stream=s),
                               nb + lanes4.numel()),
        f"bitmap_or x{N}": (lambda: ops.bitmap_or(bm, bms, N, stream=s), (N + 1) * nb),
        "popcount": (lambda: ops.popcount(union, n, out=cnt, stream=s), nb),
        "sketch_encode": (lambda: ops.sketch_encode(sk, idx, val, n, t, 7, stream=s),
                          8 * k + 3 * t * f4),
        "peel_decode": (lambda: ops.peel_decode(out, sk, union, n, t, 12345, unpeeled=unp,
                                                estimate=True, count_out=cnt, stream=s),
                        nb + 3 * t * f4 + n * f4),
        "sparse_pack": (lambda: ops.sparse_pack(pairs, idx, val, stream=s), 16 * k),
        "sparse_unpack": (lambda: ops.sparse_unpack(acc, pairs, k, torch.float32, stream=s),
                          16 * k),
        "pairs_pack ef": (lambda: ops.pairs_pack(ef, idx, val, n, "ef", stream=s),
                          8 * k + ef.numel()),
        "pairs_unpack_add ef": (lambda: ops.pairs_unpack_add(acc, ef, k, torch.float32, "ef",
                                                             stream=s), ef.numel() + 8 * k),
    }
    for fmt, qb in qbufs.items():  # quant mode: every entry, fused error feedback
        table[f"quant_encode {fmt}"] = (
            lambda qb=qb, fmt=fmt: ops.quant_encode(qb, res, grad, fmt, 256, stream=s),
            3 * n * f4 + qb.numel())
        table[f"quant_decode_add {fmt}"] = (
            lambda qb=qb, fmt=fmt: ops.quant_decode_add(acc, qb, fmt, 256, stream=s),
            2 * n * f4 + qb.numel())
    # the parameter gather (tagc-full): fp32 masters to int8 codes, codes to bf16 weights
    table["wq_encode int8"] = (lambda: ops.wq_encode(wq8, src, segs, "int8", 256, stream=s),
                               n * f4 + wq8.numel())
    table["wq_decode int8 (to bf16)"] = (
        lambda: ops.wq_decode(wout, wq8, segs, "int8", 256, stream=s), wq8.numel() + 2 * n)

    def delta_encode() -> None:
        # a changed shard (as every step's first gather): compare, code, remember
        sent[:1].add_(1.0)
        ops.wq_delta_encode(wq4d, src, sent, held, segs, "int4", 256, stream=s)

    # tagc-full4's gathers: the change of the weights, int4 (the compare reads two arrays
    # and the copy writes one beside the codes)
    table["wq_delta_encode int4"] = (delta_encode, 3 * n * f4 + n * f4 + wq4d.numel())
    table["wq_delta_decode int4"] = (
        lambda: ops.wq_delta_decode(dst, held, wq4d, segs, "int4", 256, stream=s),
        wq4d.numel() + 3 * n * f4)
    # tagc-lean's code (no feedback) and the 4-bit gather codes (weights: no residual)
    table["tls_encode (no residual)"] = (lambda: ops.tls_encode(tls, None, grad, stream=s),
                                         n * f4 + tls.numel())
    table["tls_decode_add"] = (lambda: ops.tls_decode_add(acc, tls, stream=s),
                               2 * n * f4 + tls.numel())
    for rot in (False, True):
        tag = " rotated" if rot else ""
        table[f"fp4_encode block 32{tag} (no residual)"] = (
            lambda rot=rot: ops.fp4_encode(fp4, None, src, 32, seed=3, rotate=rot, stream=s),
            n * f4 + fp4.numel())
        table[f"fp4_decode_add block 32{tag}"] = (
            lambda rot=rot: ops.fp4_decode_add(acc, fp4, 32, seed=3, rotate=rot, stream=s),
            2 * n * f4 + fp4.numel())
    # the hook's unit path (tagc-balanced, tagc-full at two ranks): one call per side, the
    # residual kept as int4 codes over the whole unit; encode reads the sent shard and the
    # codes, writes the message and the codes back, decode reads a message and the own
    # shard and writes the sum
    ushard = n // 128 * 64
    ugrad = grad[:2 * ushard]
    urc = torch.empty(ops.quant_bytes(2 * ushard, "int4", 64), dtype=torch.uint8, device=dev)
    ops.quant_encode(urc, None, res[:2 * ushard], "int4", 64, stream=s)
    ubuf = torch.empty(2, ops.quant_bytes(ushard, "int4", 64), dtype=torch.uint8, device=dev)
    ucounts = torch.zeros(5, dtype=torch.int64, device=dev)
    uflags = torch.zeros(2, dtype=torch.int32, device=dev)
    uout = torch.empty(ushard, device=dev)
    table["quant_unit_encode int4 (2 ranks)"] = (
        lambda: ops.quant_unit_encode(ubuf, urc, ugrad, 2, 0, "int4", "int4", 64, 0.5,
                                      counts=ucounts, flags=uflags, stream=s),
        ushard * f4 + 2 * urc.numel() + ubuf[1].numel())
    table["quant_unit_decode int4 (2 ranks)"] = (
        lambda: ops.quant_unit_decode(uout, ubuf, ugrad[:ushard], 2, 0, "int4", 64, 2.0,
                                      stream=s),
        ubuf[1].numel() + 2 * ushard * f4)
    return table, cnt


def goals(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Each goal of :data:`GOALS`: its row's share of the copy and whether it is met."""
    by_op = {r["op"]: r for r in rows}
    return [{"op": op, "goal_pct_copy": goal,
             "pct_copy": by_op[op]["pct_copy"] if op in by_op else None,
             "met": op in by_op and by_op[op]["pct_copy"] >= goal} for op, goal in GOALS]


def main(argv: List[str]) -> int:
    """Run the benchmark.

    Args:
        argv: command-line arguments (see --help).

    Returns:
        Process exit status.
    """
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1 << 24, help="shard length (elements)")
    ap.add_argument("--theta", type=float, default=0.9875, help="sparsity (k = ceil((1-theta) n))")
    ap.add_argument("--ranks", type=int, default=8, help="bitmaps ORed / ranks summed")
    ap.add_argument("--sketch-factor", type=float, default=1.3, help="m = factor * ranks * k")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the rows and goals to this file")
    ap.add_argument("--emu-lib", default=None,
                    help="run on the CPU through this emulated build of the kernels "
                         "(tagc_bench.cuda_emu): a check of the calls, not a measurement")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.emu_lib:
        import torch

        from tagc_bench.cuda_emu import EmuOps

        ops, dev, stream, name = EmuOps(args.emu_lib), torch.device("cpu"), 0, \
            "CPU (CUDA emulation: not a measurement)"
    else:
        torch, ops = _require_gpu()
        dev = torch.device("cuda")
        stream = torch.cuda.current_stream().cuda_stream
        name = torch.cuda.get_device_name(dev)
    cuda = dev.type == "cuda"
    n, N = args.n, args.ranks
    k = max(1, math.ceil((1.0 - args.theta) * n))
    u = min(n, N * k)
    t = max(1, math.ceil(args.sketch_factor * u / 3))
    table, cnt = _ops(torch, ops, dev, stream, n, k, N, u, t)
    logger.info("device: %s; n=%d k=%d (theta=%g) union=%d t=%d ranks=%d iters=%d",
                name, n, k, args.theta, u, t, N, args.iters)
    rows = []
    ref_gbs = None
    for op, (fn, nbytes) in table.items():
        ms = time_op(fn, args.iters, args.warmup, cuda)
        gbs = nbytes / (ms * 1e-3) / 1e9
        if ref_gbs is None:
            ref_gbs = gbs
        rows.append({"op": op, "bytes": nbytes, "ms": ms, "GB/s": gbs,
                     "pct_copy": 100.0 * gbs / ref_gbs})
    logger.info("%-44s %12s %10s %10s %9s", "op", "bytes", "ms", "GB/s", "% copy")
    for r in rows:
        logger.info("%-44s %12d %10.4f %10.1f %8.1f%%", r["op"], r["bytes"], r["ms"],
                    r["GB/s"], r["pct_copy"])
    peeled = int(cnt.item())  # after timing: the last decode's unpeeled count
    logger.info("last peel_decode left %d of %d union positions unpeeled", peeled, u)
    met = goals(rows)
    for g in met:
        logger.info("goal: %s >= %.0f%% of the copy: %s (%.1f%%)", g["op"], g["goal_pct_copy"],
                    "met" if g["met"] else "MISSED", g["pct_copy"] or 0.0)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "emulated": not cuda, "n": n, "k": k,
                       "theta": args.theta, "union": u, "t": t, "ranks": N,
                       "iters": args.iters, "unpeeled": peeled, "rows": rows, "goals": met},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
