#!/usr/bin/env python3
"""Resume on another cluster shape: the final loss against an unbroken run of the new one.

For each case, two runs of ``python -m tagc.train`` (tiny GPT-2, built-in corpus,
``--tagc`` preset, the same global batch on every shape: ``--global-batch`` / ranks
sequences per rank):

1. unbroken: ``--steps`` steps on the new shape;
2. broken: ``--at`` steps on the old shape, then ``--init_from=resume`` on the new
   shape up to ``--steps`` (DCP reshards model and optimizer, TAGC maps its feedback
   state by parameter name: tagc/checkpoint.py).

Prints one row per case: both final validation losses and the broken run's excess in
percent; writes ``results.json`` to ``--out``.  A shape is ``fsdp2:N`` (FSDP2 on N
ranks), ``fsdp1:N`` or ``hsdp:RxS`` (TAGC's HSDP route, R replicas of S ranks).

    python3 scripts/bench/reshape_quality.py
    python3 scripts/bench/reshape_quality.py --cases fsdp2:2-fsdp2:1 --steps 40 --at 20
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

from tagc.train.runs import free_port

CASES = ["fsdp2:2-fsdp2:1", "fsdp2:1-fsdp2:2", "fsdp2:4-fsdp2:2", "fsdp1:2-fsdp2:2",
         "hsdp:2x2-hsdp:2x1", "hsdp:2x1-hsdp:2x2"]


def shape_args(shape: str, global_batch: int) -> Tuple[int, List[str]]:
    """(ranks, training arguments) of a shape."""
    kind, _, size = shape.partition(":")
    if kind == "hsdp":
        r, s = (int(x) for x in size.split("x"))
        ranks, extra = r * s, ["--fsdp=2", f"--replicas={r}"]
    elif kind in ("fsdp1", "fsdp2"):
        ranks, extra = int(size), [f"--fsdp={kind[-1]}"]
    else:
        raise ValueError(f"unknown shape {shape!r} (fsdp1:N, fsdp2:N or hsdp:RxS)")
    if global_batch % ranks:
        raise ValueError(f"--global-batch {global_batch} does not split over {ranks} ranks")
    return ranks, extra + [f"--batch_size={global_batch // ranks}"]


def train(shape: str, out: Path, steps: int, common: List[str], global_batch: int,
          resume: bool) -> Dict[str, Any]:
    """One torchrun of tagc.train; its summary.json."""
    ranks, extra = shape_args(shape, global_batch)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
           f"--nproc_per_node={ranks}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "tagc.train", *common, *extra,
           f"--out_dir={out}", f"--max_iters={steps}",
           f"--init_from={'resume' if resume else 'scratch'}"]
    log = out.with_suffix(f".{'resume' if resume else 'first'}.log")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc:
        raise RuntimeError(f"{' '.join(cmd)} failed ({rc}); see {log}")
    return json.loads((out / "summary.json").read_text())


def main(argv: List[str] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", default=CASES, help="OLD-NEW shape pairs")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--at", type=int, default=100, help="the step the shape changes at")
    p.add_argument("--tagc", default="tagc-balanced")
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--out", type=Path, default=None, help="default: a new temporary folder")
    args = p.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="reshape-"))
    common = ["--progress=false", "--tensorboard=false", f"--tagc={args.tagc}",
              "--eval_interval=50", "--eval_iters=8", f"--ckpt_interval={args.at}",
              "--keep_checkpoints=1", "--threads=1", f"--lr_decay_iters={args.steps}"]
    results = []
    print(f"| case | unbroken {args.steps} steps | {args.at} old + {args.steps - args.at} new "
          "| broken vs unbroken |\n|---|---|---|---|", flush=True)
    for case in args.cases:
        old, new = case.split("-")
        t0 = time.time()
        base = train(new, out / f"{case}-unbroken", args.steps, common, args.global_batch, False)
        train(old, out / f"{case}-broken", args.at, common, args.global_batch, False)
        broken = train(new, out / f"{case}-broken", args.steps, common, args.global_batch, True)
        a, b = base["final_val_loss"], broken["final_val_loss"]
        results.append({"case": case, "unbroken": a, "broken": b,
                        "excess_pct": 100 * (b / a - 1), "seconds": time.time() - t0})
        print(f"| {old} -> {new} | {a:.4f} | {b:.4f} | {100 * (b / a - 1):+.2f}% |",
              flush=True)
    (out / "results.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1))
    print(f"results: {out / 'results.json'}")


if __name__ == "__main__":
    main()
