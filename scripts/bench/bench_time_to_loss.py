#!/usr/bin/env python3
"""Time to plain FSDP's loss on an emulated slow link, and the loss at equal time.

Needs root (``tagc/train/netem.sh``): two emulated hosts (network namespaces) joined by
a veth shaped by ``tc`` (default 200 Mbit/s), one ``torchrun`` node per host, each
training the shipped ``train-tiny`` preset with ``torchrun ... -m tagc.train``.  Direct
runs, no model of the step time:

1. plain FSDP, ``--max_iters`` steps: its training time T and final validation loss L;
2. each preset, the same steps: the time it takes to reach L (linear between two
   evaluations of its curve) and its own training time;
3. each preset again, with as many steps as fit in T at its measured step time (its LR
   schedule stretched to them): the loss it reaches in plain FSDP's time.

Times are the training steps' wall time (``train_s`` in metrics.csv); evaluations are
left out (the same forward passes for everyone).  Writes ``<out>/time_to_loss.md`` and
``<out>/time_to_loss.png`` (validation loss against training time).

    sudo python3 scripts/bench/bench_time_to_loss.py
    sudo python3 scripts/bench/bench_time_to_loss.py --presets tagc-balanced --rate 100mbit

Arguments after ``--`` go to every training run.
"""
from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from tagc import presets as tagc_presets
from tagc.train.runs import NETEM, TRAIN_GPT2, code_id, free_port, netem, split_passthrough

logger = logging.getLogger("bench_time_to_loss")
# the checkout this script sits in (scripts/bench/): where --out's default folder goes
ROOT = Path(__file__).resolve().parents[2]

Curve = List[Tuple[float, float]]  # (training seconds, validation loss)


def train(net: List[str], name: str, out: Path, preset: Optional[Path],
          extra: Sequence[str], timeout: float) -> Curve:
    """One training run across the emulated hosts; returns rank 0's validation curve."""
    run_dir = out / name
    if run_dir.exists():
        shutil.rmtree(run_dir)
    cmd = ["bash", str(NETEM), *net, "torchrun", "--port", str(free_port()), "--timeout",
           str(int(timeout)), "--", *TRAIN_GPT2, str(tagc_presets.resolve("train-tiny")),
           f"--out_dir={run_dir}",
           "--progress=false", "--threads=1", "--save_checkpoint=false", "--tensorboard=false",
           *([f"--tagc={preset}"] if preset else []), *extra]
    logger.info("%s: %s", name, " ".join(cmd))
    env = dict(os.environ, OMP_NUM_THREADS="1", TAGC_PYTHON=sys.executable)
    with open(out / f"{name}.log", "w") as log:
        r = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout + 60,
                           env=env)
    if r.returncode != 0:
        tail = (out / f"{name}.log").read_text()[-3000:]
        raise RuntimeError(f"{name} failed (exit {r.returncode}):\n{tail}")
    with open(run_dir / "metrics.csv", newline="") as f:
        curve = [(float(row["train_s"]), float(row["loss"]))
                 for row in csv.DictReader(f) if row["kind"] == "val"]
    logger.info("%s: final loss %.4f after %.1f s of training", name, curve[-1][1], curve[-1][0])
    return curve


def time_to(curve: Curve, target: float) -> Optional[float]:
    """First training time at which the curve reaches ``target`` (None: never)."""
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if l1 <= target:
            if l0 <= target or l1 == l0:
                return t0 if l0 <= target else t1
            return t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
    return None


def report(res: Dict[str, Any], path: Path, command: str) -> str:
    """Markdown table of the three measurements per preset."""
    base_t, base_l = res["baseline"]["curve"][-1]
    code = res.get("code") or {}
    lines = [f"Command: `{command}` (commit {code.get('commit', '?')}"
             + (f" + uncommitted changes {code['dirty']}" if code.get("dirty") else "")
             + f", {time.strftime('%Y-%m-%d %H:%M %Z')}, load average "
             f"{res['loadavg'][0]:.2f} at start, {res['loadavg_end'][0]:.2f} at end; link "
             f"{res['link']})", "",
             "| run | steps | training time | final val loss | time to plain FSDP's final "
             "loss | speed-up to that loss | steps in plain FSDP's time | val loss at plain "
             "FSDP's time | vs plain FSDP |",
             "|---|---|---|---|---|---|---|---|---|",
             f"| plain FSDP | {res['steps']} | {base_t:.1f} s | {base_l:.4f} | {base_t:.1f} s | "
             f"1.00x | {res['steps']} | {base_l:.4f} | — |"]
    for name, r in res["presets"].items():
        t, loss = r["curve"][-1]
        reach = time_to(r["curve"], base_l)
        eq_t, eq_l = r["equal_time_curve"][-1]
        lines.append(
            f"| {name} | {res['steps']} | {t:.1f} s | {loss:.4f} | "
            + (f"{reach:.1f} s | {base_t / reach:.2f}x" if reach else "not reached | —")
            + f" | {r['equal_time_steps']} ({eq_t:.1f} s) | {eq_l:.4f} | "
            f"{100 * (eq_l / base_l - 1):+.2f}% |")
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def plot(res: Dict[str, Any], path: Path) -> None:
    """Validation loss against training time, every run."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    ax.plot(*zip(*res["baseline"]["curve"]), color="black", lw=2.2, label="plain FSDP")
    for i, (name, r) in enumerate(res["presets"].items()):
        c = f"C{i}"
        ax.plot(*zip(*r["curve"]), color=c, lw=1.4, label=f"{name} ({res['steps']} steps)")
        ax.plot(*zip(*r["equal_time_curve"]), color=c, lw=1.4, ls="--",
                label=f"{name} ({r['equal_time_steps']} steps)")
    curves = [res["baseline"]["curve"], *(c for r in res["presets"].values()
                                          for c in (r["curve"], r["equal_time_curve"]))]
    tail = [loss for c in curves for _, loss in c[len(c) // 3:]]
    ax.set_ylim(min(tail) - 0.05, max(tail) + 0.1)
    ax.set_title(res["link"], fontsize=7)
    ax.set_xlabel("training time on the emulated link (s)")
    ax.set_ylabel("validation loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Bring the link up, run everything, tear it down, write the report."""
    argv, extra = split_passthrough(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default="tagc-balanced,tagc-lean",
                   help="comma-separated shipped preset names (tagc-balanced or balanced) "
                        "or paths to TAGC YAML files")
    p.add_argument("--max_iters", type=int, default=300, help="steps of the first runs")
    p.add_argument("--rate", default="200mbit", help="tc rate of the link")
    p.add_argument("--out", default=str(ROOT / "bench_out" / "time_to_loss"))
    p.add_argument("--timeout", type=float, default=3600, help="seconds per training run")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if os.geteuid() != 0:
        sys.exit("bench_time_to_loss.py: needs root for tagc/train/netem.sh (run with sudo)")
    presets = {}
    for n in (x.strip() for x in args.presets.split(",") if x.strip()):
        try:
            path = tagc_presets.resolve(n)
        except ValueError as e:
            p.error(f"--presets: {e}")
        presets[path.stem] = path.resolve()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    net = ["--prefix", f"tagct{os.getpid() % 1000}", "-n", "2", "--rate", args.rate,
           "--delay", "0"]
    res: Dict[str, Any] = {"steps": args.max_iters, "code": code_id(), "loadavg": os.getloadavg(),
                           "presets": {}}
    steps = [f"--max_iters={args.max_iters}", *extra]
    try:
        netem(net, "up")
        res["link"] = netem(net, "measure", "20", timeout=600).strip().splitlines()[-1]
        res["baseline"] = {"curve": train(net, "baseline", out, None, steps, args.timeout)}
        base_t = res["baseline"]["curve"][-1][0]
        for name, path in presets.items():
            curve = train(net, name, out, path, steps, args.timeout)
            fit = int(args.max_iters * base_t / curve[-1][0])
            eq = train(net, f"{name}-equal-time", out, path, [f"--max_iters={fit}", *extra],
                       args.timeout)
            res["presets"][name] = {"curve": curve, "equal_time_steps": fit,
                                    "equal_time_curve": eq}
    finally:
        netem(net, "down", check=False)
    res["loadavg_end"] = os.getloadavg()
    (out / "results.json").write_text(json.dumps(res, indent=1))
    command = "sudo python3 scripts/bench/bench_time_to_loss.py " + " ".join(
        argv + (["--", *extra] if extra else []))
    print(report(res, out / "time_to_loss.md", command.strip()))
    plot(res, out / "time_to_loss.png")
    print(f"wrote {out / 'time_to_loss.md'} and {out / 'time_to_loss.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
