#!/usr/bin/env python3
"""Quality of local steps between nodes: each outer setting against native HSDP (issue 41).

Every (task, run) trains ``-m tagc.train configs/train-tiny.yaml --fsdp=2 --replicas=R``
(R gloo ranks, one per replica: FSDP2's 2-D mesh, nothing sharded inside a replica) on
the built-in corpus with the same seed and batches: ``native`` is native HSDP (an fp32
all-reduce between the replicas every step), every other run is ``configs/tagc-local.yaml``
with its outer settings (H = ``outer_every``, the outer learning rate and momentum)
replaced.  The table gives the validation loss along training (replica 0's parameters at
that step), the change against native HSDP at the end, and the bytes each rank sent
between the replicas per step (the training script's count at the call); the curves plot
each run's loss against native HSDP's along training.

Usage:
    python3 scripts/bench/local_quality.py                           # every task and run
    python3 scripts/bench/local_quality.py --tasks tiny-r4 --runs preset
    python3 scripts/bench/local_quality.py --report-only             # the finished runs

Runs go to ``--out_dir`` (default ``out/local-quality``, one folder per task and run,
reused when the code and configs are unchanged, ``--no-reuse`` to force), the table to
``--doc`` (default ``docs/RESULTS.md``, the part between the markers) and the curves to
``--curves`` (default ``docs/local-quality.png``).  Native HSDP always runs (the
reference of its task).
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml

from tagc_bench.outputs import publish_comparison, save_figure
from tagc.train.runs import (TRAIN_GPT2, add_comparison_args, code_id, finished_run,
                             run_meta)

logger = logging.getLogger("local_quality")
ROOT = Path(__file__).resolve().parents[2]

# task -> (steps, replicas, trainer options beyond train-tiny.yaml's)
TASKS: Dict[str, Tuple[int, int, Tuple[str, ...]]] = {
    "tiny-r2": (1000, 2, ()),
    "tiny-r4": (1000, 4, ()),
    # long enough for H = 128 (issue 41: each run at least 20 H steps)
    "tiny-r2-long": (2560, 2, ()),
    "tiny-r4-long": (2560, 4, ()),
    # the suite's widest GPT-2 (4 x 512, 12.8M), 20 H steps of the preset's H = 32
    "wide-r2": (640, 2, ("--n_layer=4", "--n_head=8", "--n_embd=512")),
}
# run -> (outer_every H, outer_lr, outer_momentum[, {streaming knob: value}]); None:
# native HSDP, "preset": the preset's own settings
RUNS: Dict[str, Any] = {
    "native": None,
    "preset": "preset",
    # where H breaks at R = 4: syncing every 2 and 4 steps
    "h2-m0.5": (2, 1.0, 0.5),
    "h4-m0.5": (4, 1.0, 0.5),
    "h8-diloco": (8, 0.7, 0.9),     # DiLoCo's outer lr and momentum
    "h8-avg": (8, 1.0, 0.0),        # plain averaging of the replicas
    "h8-m0.5": (8, 1.0, 0.5),
    "h16-avg": (16, 1.0, 0.0),
    "h32-diloco": (32, 0.7, 0.9),
    "h32-avg": (32, 1.0, 0.0),
    # a longer outer step: the average of R replicas' changes is less noisy than one
    "h32-lr2": (32, 2.0, 0.5),
    # the outer step twice the replicas' mean change without momentum's lag: does R = 4
    # lose because averaging R AdamW updates shrinks the step?
    "h8-lr2-avg": (8, 2.0, 0.0),
    "h128-m0.5": (128, 1.0, 0.5),
    # Streaming DiLoCo (arXiv 2501.18512) at the preset's H: the model in 4 fragments (at
    # most one per FSDP2 unit), one synced every 8 steps, first at once (what fragmenting alone costs), then each sync
    # overlapped with 2 inner steps, taking the global result (alpha 0) or merging half
    # local, half global (their alpha 0.5)
    "h32-p4": (32, 1.0, 0.5, {"outer_fragments": 4}),
    "h32-p4-t2": (32, 1.0, 0.5, {"outer_fragments": 4, "outer_overlap": 2}),
    "h32-p4-t2-a0.5": (32, 1.0, 0.5, {"outer_fragments": 4, "outer_overlap": 2,
                                      "outer_mix": 0.5}),
}
# the streaming knobs' names in the table
STREAM = {"outer_fragments": "P", "outer_overlap": "tau", "outer_mix": "alpha"}


def knobs(outer: Sequence[Any]) -> Dict[str, Any]:
    """A run's TAGCConfig fields from its RUNS entry (H, lr, mu[, streaming knobs])."""
    h, lr, mu, *stream = outer
    return {"outer_every": h, "outer_lr": lr, "outer_momentum": mu,
            **(stream[0] if stream else {})}
MARK = ("<!-- local-quality:start -->", "<!-- local-quality:end -->")
EVAL_EVERY = 50


def run_one(task: str, run: str, args: argparse.Namespace, cid: Dict[str, str]
            ) -> Optional[Dict[str, Any]]:
    """Train one (task, run), or reuse its finished run; returns its record (None:
    ``--report-only`` and the run never finished)."""
    steps, reps, extra = TASKS[task]
    folder = Path(args.out_dir) / task / run
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={reps}", *TRAIN_GPT2, str(ROOT / "configs" / "train-tiny.yaml"),
           f"--out_dir={folder}", "--progress=false", "--fsdp=2", f"--replicas={reps}",
           f"--max_iters={steps}", f"--eval_interval={EVAL_EVERY}", "--seed=1337", *extra]
    outer = RUNS[run]
    if outer is not None:
        cmd.append("--tagc=tagc-local")
        if outer != "preset":
            cmd.append("--tagc_set=" + ",".join(f"{k}={v}" for k, v in knobs(outer).items()))
    meta = run_meta(cmd, {"outer": outer, "steps": steps, "replicas": reps,
                          "args": list(extra)}, cid)
    got = finished_run(cmd, folder, meta, report_only=args.report_only, reuse=args.reuse)
    if got is None:
        return None
    s, curve, rec = got["summary"], got["curve"], got["record"]
    return {"task": task, "run": run, "final": s["final_val_loss"], "curve": curve,
            "bytes_per_step": s["bytes_sent"] / max(1, s["iters"]), "outer": outer,
            "seconds": rec["seconds"], "commit": rec["code"]["commit"]}


def _label(r: Dict[str, Any]) -> str:
    if r["outer"] is None:
        return "native HSDP"
    if r["outer"] == "preset":
        t = yaml.safe_load((ROOT / "configs" / "tagc-local.yaml").read_text())
        return (f"**the preset** (H = {t['outer_every']}, lr {t['outer_lr']}, "
                f"mu {t['outer_momentum']})")
    k = knobs(r["outer"])
    streamed = "".join(f", {STREAM[n]} = {k[n]}" for n in STREAM if n in k)
    return f"H = {k['outer_every']}, lr {k['outer_lr']}, mu {k['outer_momentum']}{streamed}"


def table(runs: Sequence[Dict[str, Any]]) -> str:
    """The markdown table: per task, every run against its native HSDP run."""
    lines = ["| task | run | bytes between replicas per step and rank | val loss at 20% / 40% "
             "/ 60% / 80% / 100% of the steps (the evaluation at or before) | vs native at "
             "the end | run |",
             "|---|---|---|---|---|---|"]
    base = {r["task"]: r for r in runs if r["run"] == "native"}
    for r in runs:
        b = base.get(r["task"])
        steps = TASKS[r["task"]][0]
        # the last evaluation at or before each fifth of the run (every EVAL_EVERY steps)
        pts = " / ".join(next((f"{v:.4f}" for i, v in reversed(r["curve"]) if i <= s), "-")
                         for s in (steps * q // 5 for q in range(1, 6)))
        if b is None:
            vs, frac = "no native run", ""
        else:
            vs = f"{100 * (r['final'] / b['final'] - 1):+.2f}%"
            frac = "" if r is b else f" (1/{b['bytes_per_step'] / r['bytes_per_step']:.0f})"
        lines.append(f"| {r['task']} | {_label(r)} | {r['bytes_per_step'] / 1e3:.0f} KB{frac} "
                     f"| {pts} | {vs} | {r['seconds'] / 60:.0f} min ({r['commit']}) |")
    return "\n".join(lines)


def plot(runs: Sequence[Dict[str, Any]], path: Path) -> None:
    """Per task: each run's validation loss against native HSDP's along training."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r["task"] for r in runs))
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.2 * len(tasks), 3.6), dpi=100,
                             squeeze=False)
    for ax, t in zip(axes.flat, tasks):
        base = dict(next((r["curve"] for r in runs if r["task"] == t and r["run"] == "native"),
                         []))
        for r in runs:
            if r["task"] == t and r["run"] != "native":
                pts = [(i, 100 * (v / base[i] - 1)) for i, v in r["curve"] if i in base and i]
                n = list(RUNS).index(r["run"])  # one colour per run, the same in every panel
                if pts:
                    ax.plot(*zip(*pts), label=_label(r).replace("**", ""),
                            lw=1.4 if r["run"] == "preset" else 1, color=f"C{n % 10}")
        ax.axhline(0, color="black", lw=1)
        ax.set_title(f"{t}: validation loss against native HSDP", fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel("% above native HSDP", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    save_figure(fig, path)


def main(argv: Optional[Sequence[str]] = None) -> List[Dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS),
                   help="native (the reference) always runs")
    add_comparison_args(p, TASKS, "out/local-quality", ROOT / "docs" / "RESULTS.md",
                        ROOT / "docs" / "local-quality.png")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s",
                        datefmt="%H:%M:%S")
    cid = code_id()
    names = ["native", *[r for r in args.runs if r != "native"]]
    runs = [r for r in (run_one(t, n, args, cid) for t in args.tasks for n in names)
            if r is not None]
    publish_comparison(table(runs), Path(args.doc), MARK, lambda: plot(runs, Path(args.curves)))
    return runs


if __name__ == "__main__":
    main()
