#!/usr/bin/env python3
"""torchft runs of the training script (tagc/train/ft.py): two replica groups of one
rank each, tiny GPT-2 on the built-in corpus, under torchft's Lighthouse CLI.

``fault``: a run that loses a group and gets it back, against the same run without the
fault.  Twice, each group started by torchrun: (1) both train ``--steps`` steps; (2)
group 1 is SIGKILLed (torchrun's agent and its worker) once it logs step ``--kill-at``,
started again at once with the same command (torch's import included), heals from
group 0 and rejoins.  Per run: the steps each group committed by quorum size, the steps
healed over, the bytes group 0 sent to the other group and the fp32 ring all-reduce's
figure, both groups' final validation loss, the wall time; for the fault run the
seconds from the kill to the heal.

``compare``: torchft's own DiLoCo (``--ft_allreduce torchft``: fp32) against the same
run with TAGC's local steps over the quorum (``FTLocalSteps``: its codes, one fragment),
local steps at each ``--H`` (``tagc-local``'s outer optimizer in both), on each ``--rate``: an emulated link between the groups (network
namespaces, tagc/train/netem.sh; needs root) or ``none`` (loopback).  Per run: the
mean step, the mean sync (its first all-reduce call to its vote), the bytes per sync
at the call, the final validation loss.

Each writes report.md and results.json to ``--out``.

    python3 scripts/bench/ft_runs.py fault
    python3 scripts/bench/ft_runs.py fault --steps 300 --kill-at 10 -- --n_layer=2 --n_embd=64
    sudo python3 scripts/bench/ft_runs.py compare --rate 20mbit 200mbit --H 8 --steps 64
    python3 scripts/bench/ft_runs.py compare --rate none --H 8 --steps 1000
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

from tagc.train.runs import free_port, kill_tree, netem, split_passthrough

# tagc/train/netem.sh's addresses: host i is SUBNET.(i + 1) on IFNAME
SUBNET, IFNAME = "10.77.0", "tagc0"


def start_group(rid: int, tag: str, lighthouse: str, args: argparse.Namespace,
                run_dir: Path, preset: List[str],
                netns: Optional[str] = None) -> "tuple[subprocess.Popen, Path]":
    """One replica group of one rank, its output in ``run_dir``: under torchrun on
    loopback, or (``netns``) one process in that network namespace, reached by the
    other group at the namespace's address."""
    log = run_dir / f"replica{rid}-{tag}.log"
    train = ["--fsdp=2", f"--max_iters={args.steps}", f"--ft_lighthouse={lighthouse}",
             f"--ft_replica={rid}", f"--out_dir={run_dir / 'out'}",
             f"--cache_dir={args.cache.resolve()}", "--progress=false",
             "--tensorboard=false", "--save_checkpoint=false",
             f"--eval_interval={args.steps}", "--log_interval=10", "--timeout=300",
             f"--threads={args.threads}", *preset, *args.train_args]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if netns is None:
        cmd = ["torchrun", "--standalone", "--nproc_per_node=1", "-m", "tagc.train", *train]
    else:
        addr = f"{SUBNET}.{rid + 1}"
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR=addr, MASTER_PORT=str(free_port()), GLOO_SOCKET_IFNAME=IFNAME)
        cmd = ["ip", "netns", "exec", netns, sys.executable, "-m", "tagc.train", *train,
               f"--ft_hostname={addr}"]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
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


def one_run(run_dir: Path, args: argparse.Namespace, preset: List[str], fault: bool = False,
            netns: Optional[List[str]] = None) -> Dict[str, Any]:
    """Both groups to ``--steps`` (with the kill when ``fault``; in the namespaces
    ``netns`` when given); their summaries."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    port = free_port()
    host = "localhost" if netns is None else f"{SUBNET}.1"
    # with a fault, one group may go on alone; without, both start in one quorum
    lh = subprocess.Popen([*(["ip", "netns", "exec", netns[0]] if netns else []),
                           "torchft_lighthouse", "--min_replicas", "1" if fault else "2",
                           "--bind", f"{'[::]' if netns is None else host}:{port}",
                           "--join_timeout_ms", "10000", "--heartbeat_timeout_ms", "2000"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    lighthouse = f"http://{host}:{port}"
    procs: List[subprocess.Popen] = []
    out: Dict[str, Any] = {"fault": fault}
    t0 = time.monotonic()
    try:
        time.sleep(1)
        for rid in (0, 1):
            procs.append(start_group(rid, "first", lighthouse, args, run_dir, preset,
                                     netns[rid] if netns else None)[0])
        logs = [run_dir / f"replica{r}-first.log" for r in (0, 1)]
        if fault:
            wait_for(rf"^iter {args.kill_at}: ", logs[1], procs, 3600)
            kill_tree(procs[1].pid)
            procs[1].wait(30)
            t_kill = time.monotonic()
            procs[1], log1 = start_group(1, "restarted", lighthouse, args, run_dir, preset)
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


def fault_row(r: Dict[str, Any]) -> str:
    """One row of the fault report."""
    a, b = r["groups"]
    cycle = (f"{r['kill_to_heal_s']:.1f} s, survivor alone "
             f"{a['ft_committed_by_replicas'].get('1', 0)} steps" if r["fault"] else "-")
    return (f"| {'fault' if r['fault'] else 'no fault'} | {a['ft_committed_by_replicas']} | "
            f"{b['ft_committed_by_replicas']} | {a['ft_healed_steps']} / "
            f"{b['ft_healed_steps']} | {a['ft_bytes_between'] / 1e6:.1f} MB "
            f"({a['ft_bytes_between'] / max(a['ft_bytes_between_fp32'], 1):.3f} of fp32) | "
            f"{a['final_val_loss']:.4f} / {b['final_val_loss']:.4f} | {r['wall_s']:.0f} s | "
            f"{cycle} |")


def fault(args: argparse.Namespace) -> str:
    """The ``fault`` command: both runs; the report."""
    if args.kill_at % 10 or not 0 < args.kill_at < args.steps:
        sys.exit("--kill-at must be a multiple of 10 (the log interval) below --steps")
    preset = [] if args.preset == "plain" else [f"--tagc={args.preset}"]
    results = [one_run(args.out / "no-fault", args, preset),
               one_run(args.out / "fault", args, preset, fault=True)]
    base = results[0]["groups"][0]["final_val_loss"]
    gap = 100 * (results[1]["groups"][0]["final_val_loss"] / base - 1)
    (args.out / "results.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "runs": results,
         "gap_pct": gap}, indent=1))
    return "\n".join([
        f"torchft, 2 replica groups x 1 rank, `--tagc {args.preset}`, {args.steps} steps, "
        f"group 1 killed at step {args.kill_at} and restarted (extra options: "
        f"{' '.join(args.train_args) or 'none'})", "",
        "| run | group 0 committed (by quorum size) | group 1 (restarted) | healed "
        "over (0 / 1) | group 0 sent to group 1 | final val loss (0 / 1) | wall | "
        "kill -> heal |", "|---|---|---|---|---|---|---|---|",
        *map(fault_row, results), "",
        f"fault run's final loss against no fault: {gap:+.2f}%"])


def compare(args: argparse.Namespace) -> str:
    """The ``compare`` command: torchft's fp32 DiLoCo and TAGC's local steps at each
    rate and H."""
    shaped = [r for r in args.rate if r != "none"]
    if shaped and os.geteuid() != 0:
        sys.exit("ft_runs.py compare: an emulated --rate needs root (network namespaces)")
    prefix = f"tagcf{os.getpid() % 1000}"
    rows: List[Dict[str, Any]] = []
    for rate in args.rate:
        net = ["--prefix", prefix, "-n", "2", "--rate", rate, "--delay", "0"]
        if rate != "none":
            netem(net, "up")
        try:
            for h in args.H:
                for allreduce in ("torchft", "tagc"):
                    preset = ["--tagc=tagc-local", f"--tagc_set=outer_every={h}",
                              f"--ft_allreduce={allreduce}"]
                    r = one_run(args.out / f"{rate}-h{h}-{allreduce}", args, preset,
                                netns=None if rate == "none" else
                                [f"{prefix}-h0", f"{prefix}-h1"])
                    rows.append({"rate": rate, "H": h, "allreduce": allreduce, **r})
        finally:
            if rate != "none":
                netem(net, "down", check=False)
    (args.out / "results.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "runs": rows}, indent=1))
    lines = [f"torchft's DiLoCo (fp32) and TAGC's local steps (FTLocalSteps; `tagc-local`'s "
             f"outer optimizer in both), 2 replica groups x 1 rank, {args.steps} steps (extra options: "
             f"{' '.join(args.train_args) or 'none'})", "",
             "| link | H | all-reduce | mean step | mean sync | sent per sync (group 0) | "
             "final val loss (0 / 1) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        a, b = r["groups"]
        syncs = max(sum(a["ft_committed_by_replicas"].values()) + a["ft_failed"], 1)
        lines.append(f"| {r['rate']} | {r['H']} | {r['allreduce']} | "
                     f"{a['mean_step_ms'] / 1e3:.3f} s | {a['ft_sync_s_mean']:.3f} s | "
                     f"{a['ft_bytes_between'] / syncs / 1e6:.3f} MB | "
                     f"{a['final_val_loss']:.4f} / {b['final_val_loss']:.4f} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 usage="%(prog)s {fault,compare} [options] [-- tagc.train "
                                       "options]",
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=("fault", "compare"), help="what to run")
    ap.add_argument("--steps", type=int, default=1000, help="steps of each run")
    ap.add_argument("--kill-at", type=int, default=300,
                    help="fault: group 1 is killed once it logs this step (a multiple of 10)")
    ap.add_argument("--preset", default="tagc-balanced",
                    help="fault: --tagc between the groups; plain: torchft's fp32 all-reduce")
    ap.add_argument("--rate", nargs="+", default=["20mbit", "200mbit"],
                    help="compare: link rates between the groups (none: loopback)")
    ap.add_argument("--H", type=int, nargs="+", default=[8], help="compare: outer_every")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per group")
    ap.add_argument("--cache", type=Path, default=Path("data_cache"), help="token cache")
    ap.add_argument("--out", type=Path, default=Path("out/ft-runs"), help="output folder")
    own, passed = split_passthrough(argv)
    args = ap.parse_args(own)
    args.train_args = passed  # after --: more tagc.train options
    if shutil.which("torchft_lighthouse") is None:
        sys.exit("torchft_lighthouse not found: pip install 'tagc[ft]'")
    args.out.mkdir(parents=True, exist_ok=True)
    text = fault(args) if args.command == "fault" else compare(args)
    print(text)
    (args.out / "report.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
