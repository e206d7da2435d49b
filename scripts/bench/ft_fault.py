#!/usr/bin/env python3
"""A torchft run that loses a replica group and gets it back, against the same run
without the fault.

Two replica groups of ``torchrun -m tagc.train --ft_lighthouse`` (one rank each, tiny
GPT-2 on the built-in corpus, ``--preset`` between them; tagc/train/ft.py) under
torchft's Lighthouse CLI, twice:

1. no fault: both train ``--steps`` steps;
2. fault: group 1 is SIGKILLed (torchrun's agent and its worker) once it logs step
   ``--kill-at``, started again at once with the same command (torch's import
   included), heals from group 0 and rejoins.

Prints and writes (``--out``: report.md, results.json) per run: the steps each group
committed by quorum size, the steps healed over, bytes group 0 sent to the other group
and the fp32 ring all-reduce's figure, both groups' final validation loss, the wall
time; for the fault run the cycle: seconds from the kill to the heal, and the steps the
survivor took alone.

    python3 scripts/bench/ft_fault.py
    python3 scripts/bench/ft_fault.py --steps 40 --kill-at 10 -- --n_layer=2 --n_embd=64
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from tagc.train.runs import free_port, kill_tree


def start_group(rid: int, tag: str, port: int, args: argparse.Namespace,
                run_dir: Path) -> "tuple[subprocess.Popen, Path]":
    """One replica group (torchrun, one rank), its output in ``run_dir``."""
    log = run_dir / f"replica{rid}-{tag}.log"
    cmd = ["torchrun", "--standalone", "--nproc_per_node=1", "-m", "tagc.train",
           "--fsdp=2", f"--max_iters={args.steps}", f"--ft_lighthouse=http://localhost:{port}",
           f"--ft_replica={rid}", f"--out_dir={run_dir / 'out'}", f"--cache_dir={args.cache}",
           "--progress=false", "--tensorboard=false", "--save_checkpoint=false",
           f"--eval_interval={args.steps}", "--log_interval=10", "--timeout=60",
           f"--threads={args.threads}"]
    if args.preset != "plain":
        cmd.append(f"--tagc={args.preset}")
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd + args.train_args, stdout=f, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
    return proc, log


def wait_for(pattern: str, log: Path, procs: List[subprocess.Popen],
             seconds: float) -> "re.Match[str]":
    """The first match of ``pattern`` in ``log``; raises if a process exits first or
    ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    while True:
        m = re.search(pattern, log.read_text(errors="replace"), re.M)
        if m:
            return m
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            raise RuntimeError(f"no {pattern!r} in {log}:\n"
                               + log.read_text(errors="replace")[-3000:])
        time.sleep(0.1)


def one_run(fault: bool, args: argparse.Namespace) -> Dict[str, Any]:
    """Both groups to ``--steps``, with or without the kill; their summaries."""
    run_dir = args.out / ("fault" if fault else "no-fault")
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    port = free_port()
    lh = subprocess.Popen(["torchft_lighthouse", "--min_replicas", "1", "--bind",
                           f"[::]:{port}", "--join_timeout_ms", "10000",
                           "--heartbeat_timeout_ms", "2000"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs: List[subprocess.Popen] = []
    out: Dict[str, Any] = {"fault": fault}
    t0 = time.monotonic()
    try:
        time.sleep(1)
        for rid in (0, 1):
            procs.append(start_group(rid, "first", port, args, run_dir)[0])
        logs = [run_dir / f"replica{r}-first.log" for r in (0, 1)]
        if fault:
            wait_for(rf"^iter {args.kill_at}: ", logs[1], procs, 3600)
            kill_tree(procs[1].pid)
            procs[1].wait(30)
            t_kill = time.monotonic()
            procs[1], log1 = start_group(1, "restarted", port, args, run_dir)
            healed = wait_for(r"healed from a peer: step (\d+) -> (\d+)", log1, procs, 600)
            out["kill_to_heal_s"] = time.monotonic() - t_kill
            out["healed_at"] = int(healed.group(2))
        for p in procs:
            if p.wait(7200) != 0:
                raise RuntimeError(f"a group failed, see {run_dir}")
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)
        lh.terminate()
        lh.wait(30)
    out["wall_s"] = time.monotonic() - t0
    out["groups"] = [json.loads((run_dir / "out" / f"replica-{r}" / "summary.json").read_text())
                     for r in (0, 1)]
    return out


def row(r: Dict[str, Any]) -> str:
    """One report row."""
    a, b = r["groups"]
    cycle = (f"{r['kill_to_heal_s']:.1f} s, survivor alone "
             f"{a['ft_committed_by_replicas'].get('1', 0)} steps" if r["fault"] else "-")
    return (f"| {'fault' if r['fault'] else 'no fault'} | {a['ft_committed_by_replicas']} | "
            f"{b['ft_committed_by_replicas']} | {a['ft_healed_steps']} / "
            f"{b['ft_healed_steps']} | {a['ft_bytes_between'] / 1e6:.1f} MB "
            f"({a['ft_bytes_between'] / max(a['ft_bytes_between_fp32'], 1):.3f} of fp32) | "
            f"{a['final_val_loss']:.4f} / {b['final_val_loss']:.4f} | {r['wall_s']:.0f} s | "
            f"{cycle} |")


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000, help="steps of each run")
    ap.add_argument("--kill-at", type=int, default=300,
                    help="group 1 is killed once it logs this step (a multiple of 10)")
    ap.add_argument("--preset", default="tagc-balanced",
                    help="--tagc between the groups; plain: torchft's fp32 all-reduce")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per group")
    ap.add_argument("--cache", type=Path, default=Path("data_cache"), help="token cache")
    ap.add_argument("--out", type=Path, default=Path("out/ft-fault"), help="output folder")
    ap.add_argument("train_args", nargs="*", help="after --: more tagc.train options")
    args = ap.parse_args(argv)
    if args.kill_at % 10 or not 0 < args.kill_at < args.steps:
        ap.error("--kill-at must be a multiple of 10 (the log interval) below --steps")
    if shutil.which("torchft_lighthouse") is None:
        sys.exit("torchft_lighthouse not found: pip install 'tagc[ft]'")
    args.out.mkdir(parents=True, exist_ok=True)
    results = [one_run(False, args), one_run(True, args)]
    base = results[0]["groups"][0]["final_val_loss"]
    gap = 100 * (results[1]["groups"][0]["final_val_loss"] / base - 1)
    lines = [f"torchft, 2 replica groups x 1 rank, `--tagc {args.preset}`, {args.steps} steps, "
             f"group 1 killed at step {args.kill_at} and restarted "
             f"(extra options: {' '.join(args.train_args) or 'none'})", "",
             "| run | group 0 committed (by quorum size) | group 1 (restarted) | healed "
             "over (0 / 1) | group 0 sent to group 1 | final val loss (0 / 1) | wall | "
             "kill -> heal |", "|---|---|---|---|---|---|---|---|",
             *map(row, results), "", f"fault run's final loss against no fault: {gap:+.2f}%"]
    text = "\n".join(lines)
    print(text)
    (args.out / "report.md").write_text(text + "\n")
    (args.out / "results.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "runs": results,
         "gap_pct": gap}, indent=1))


if __name__ == "__main__":
    main()
