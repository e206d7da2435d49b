#!/usr/bin/env python3
"""Time to plain FSDP's loss on an emulated slow link, and the loss at equal time.

Needs root (``tagc/train/netem.sh``): two emulated hosts (network namespaces) joined by
a veth shaped by ``tc`` (default 200 Mbit/s), one ``torchrun`` node per host, each
training the shipped ``train-tiny`` preset with ``torchrun ... -m tagc.train``.  Direct
runs, no model of the step time:

1. plain FSDP, ``--max_iters`` steps: its training time T and final validation loss L;
   (``--baseline-name``: what that run is when the arguments after ``--`` make it
   something else, e.g. native HSDP with ``-- --fsdp=2 --replicas=2``);
2. each preset, the same steps: its own training time and curve;
3. each preset again, with as many steps as fit in T at its measured step time (its LR
   schedule stretched to them): the loss it reaches in plain FSDP's time.

The time to plain FSDP's final loss L is computed here, from the evaluation points:
for each of the preset's two runs the first training time at which its validation
curve reaches L, linear between the two evaluations around it; the report takes the
earlier of the two and names the run (the same-steps run of a preset that ends just
above L never reaches it, while its equal-time run, trained longer, passes it).

Times are the training steps' wall time (``train_s`` in metrics.csv); evaluations are
left out (the same forward passes for everyone).  Writes ``results.json``,
``time_to_loss.md`` and ``time_to_loss.png`` (validation loss against training time)
to ``--out``, by default a new ``docs/runs/time-to-loss-<UTC date-time>/`` of this
checkout: commit it with the figures a document quotes from it
(``scripts/bench/tagc_bench/outputs.py``); the runs' own folders (logs, metrics.csv) sit beside them.
``--report-only DIR`` recomputes the table and the plot from ``DIR/results.json``
without training (no root needed).

    sudo python3 scripts/bench/bench_time_to_loss.py
    sudo python3 scripts/bench/bench_time_to_loss.py --presets tagc-balanced --rate 100mbit
    python3 scripts/bench/bench_time_to_loss.py --report-only docs/runs/time-to-loss-DATE

Arguments after ``--`` go to every training run.
"""
from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from tagc import presets as tagc_presets
from tagc.train.runs import (NETEM, TRAIN_GPT2, code_id, free_port, netem, shown,
                             split_passthrough)
from tagc_bench.outputs import run_dir

logger = logging.getLogger("bench_time_to_loss")
# the checkout this script sits in (scripts/bench/): where --out's default folder goes
ROOT = Path(__file__).resolve().parents[2]

Curve = List[Tuple[float, float]]  # (training seconds, validation loss)


def train(net: List[str], name: str, out: Path, preset: Union[str, Path, None],
          extra: Sequence[str], timeout: float) -> Curve:
    """One training run across the emulated hosts; returns rank 0's validation curve."""
    run_folder = out / name
    if run_folder.exists():
        shutil.rmtree(run_folder)
    cmd = ["bash", str(NETEM), *net, "torchrun", "--port", str(free_port()), "--timeout",
           str(int(timeout)), "--", *TRAIN_GPT2, "train-tiny.yaml",
           f"--out_dir={shown(run_folder)}", "--progress=false", "--threads=1",
           "--save_checkpoint=false", "--tensorboard=false",
           *([f"--tagc={preset}"] if preset else []), *extra]
    logger.info("%s: %s", name, " ".join(cmd))
    env = dict(os.environ, OMP_NUM_THREADS="1", TAGC_PYTHON=sys.executable)
    with open(out / f"{name}.log", "w") as log:
        r = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout + 60,
                           env=env)
    if r.returncode != 0:
        tail = (out / f"{name}.log").read_text()[-3000:]
        raise RuntimeError(f"{name} failed (exit {r.returncode}):\n{tail}")
    with open(run_folder / "metrics.csv", newline="") as f:
        curve = [(float(row["train_s"]), float(row["loss"]))
                 for row in csv.DictReader(f) if row["kind"] == "val"]
    logger.info("%s: final loss %.4f after %.1f s of training", name, curve[-1][1], curve[-1][0])
    return curve


def time_to(curve: Curve, target: float) -> Optional[float]:
    """First training time at which the curve reaches ``target`` (None: never), linear
    between the two evaluation points around it.

    Args:
        curve: (training seconds, validation loss) at each evaluation, in order.
        target: the loss to reach.
    Returns:
        seconds; the first point's time when it is already at or below ``target``.
    """
    if curve and curve[0][1] <= target:
        return curve[0][0]
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if l1 <= target:
            if l1 == l0:
                return t1
            return t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
    return None


def time_to_baseline(res: Dict[str, Any]) -> Dict[str, Tuple[Optional[float], str]]:
    """Each preset's time to plain FSDP's final loss: the earlier of its two runs.

    Args:
        res: the results (``baseline`` and ``presets`` with ``curve`` and
            ``equal_time_curve``).
    Returns:
        ``{preset: (seconds or None, the run that reached it first: "same steps",
        "equal time" or "")}``.
    """
    target = res["baseline"]["curve"][-1][1]
    out: Dict[str, Tuple[Optional[float], str]] = {}
    for name, r in res["presets"].items():
        reached = [(t, run) for t, run in ((time_to(r["curve"], target), "same steps"),
                                           (time_to(r["equal_time_curve"], target), "equal time"))
                   if t is not None]
        out[name] = min(reached) if reached else (None, "")
    return out


def report(res: Dict[str, Any], path: Path, command: str) -> str:
    """Markdown table of the three measurements per preset (written to ``path``)."""
    base_t, base_l = res["baseline"]["curve"][-1]
    b = res.get("baseline_name", "plain FSDP")
    code = res.get("code") or {}
    started = res.get("started_utc")
    lines = [f"Command: `{command}` (commit {code.get('commit', '?')}"
             + (f" + uncommitted changes {code['dirty']}" if code.get("dirty") else "")
             + (f", started {started} UTC" if started else "")
             + f", load average {res['loadavg'][0]:.2f} at start, "
             f"{res['loadavg_end'][0]:.2f} at end; link {res['link']})", "",
             f"| run | steps | training time | final val loss | time to {b}'s final "
             f"loss | speed-up to that loss | steps in {b}'s time | val loss at {b}'s time "
             f"| vs {b} |",
             "|---|---|---|---|---|---|---|---|---|",
             f"| {b} | {res['steps']} | {base_t:.1f} s | {base_l:.4f} | {base_t:.1f} s | "
             f"1.00x | {res['steps']} | {base_l:.4f} | — |"]
    reach = time_to_baseline(res)
    for name, r in res["presets"].items():
        t, loss = r["curve"][-1]
        when, run = reach[name]
        eq_t, eq_l = r["equal_time_curve"][-1]
        lines.append(
            f"| {name} | {res['steps']} | {t:.1f} s | {loss:.4f} | "
            + (f"{when:.1f} s ({run} run) | {base_t / when:.2f}x" if when else "not reached | —")
            + f" | {r['equal_time_steps']} ({eq_t:.1f} s) | {eq_l:.4f} | "
            f"{100 * (eq_l / base_l - 1):+.2f}% |")
    lines += ["", f"Time to {b}'s final loss: the first training time at which a "
              "preset's validation curve reaches it, linear between two evaluations, in the "
              f"earlier of its two runs (the run named); speed-up = {b}'s training "
              "time / that time."]
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def plot(res: Dict[str, Any], path: Path) -> None:
    """Validation loss against training time, every run."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    ax.plot(*zip(*res["baseline"]["curve"]), color="black", lw=2.2,
            label=res.get("baseline_name", "plain FSDP"))
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


def write_outputs(res: Dict[str, Any], out: Path, command: str) -> None:
    """time_to_loss.md (printed) and time_to_loss.png of the results in ``out``."""
    print(report(res, out / "time_to_loss.md", command))
    plot(res, out / "time_to_loss.png")
    print(f"wrote {out / 'time_to_loss.md'} and {out / 'time_to_loss.png'}")


def report_only(folder: Path) -> int:
    """Recompute the table and the plot of a finished run from ``folder/results.json``.

    Args:
        folder: the run's ``--out``.
    Returns:
        the exit code.
    """
    res = json.loads((folder / "results.json").read_text())
    write_outputs(res, folder, res.get("command", "(command not recorded in results.json)"))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Bring the link up, run everything, tear it down, write the report (or, with
    ``--report-only``, only the report of an earlier run)."""
    argv, extra = split_passthrough(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default="tagc-balanced,tagc-lean",
                   help="comma-separated shipped preset names (tagc-balanced or balanced) "
                        "or paths to TAGC YAML files")
    p.add_argument("--max_iters", type=int, default=300, help="steps of the first runs")
    p.add_argument("--rate", default="200mbit", help="tc rate of the link")
    p.add_argument("--out", default=None,
                   help="the run's folder (default: a new docs/runs/time-to-loss-<UTC "
                        "date-time>/ of this checkout)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per training run")
    p.add_argument("--baseline-name", default="plain FSDP",
                   help="what the run without --tagc is, for the report (e.g. 'native HSDP' "
                        "with -- --fsdp=2 --replicas=2)")
    p.add_argument("--report-only", metavar="DIR", type=Path,
                   help="recompute time_to_loss.md and .png from DIR/results.json of an "
                        "earlier run, training nothing")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.report_only:
        if not (args.report_only / "results.json").is_file():
            p.error(f"--report-only: no {args.report_only / 'results.json'}")
        return report_only(args.report_only)
    if os.geteuid() != 0:
        sys.exit("bench_time_to_loss.py: needs root for tagc/train/netem.sh (run with sudo)")
    presets = {}
    for n in (x.strip() for x in args.presets.split(",") if x.strip()):
        try:
            path = tagc_presets.resolve(n)
        except ValueError as e:
            p.error(f"--presets: {e}")
        # a shipped preset travels by name, another file by its path
        shipped = path.resolve().parent == tagc_presets.config_dir().resolve()
        presets[path.stem] = path.stem if shipped else path.resolve()
    started = time.time()
    out = Path(args.out) if args.out else run_dir(ROOT, "time-to-loss", started)
    out.mkdir(parents=True, exist_ok=True)
    net = ["--prefix", f"tagct{os.getpid() % 1000}", "-n", "2", "--rate", args.rate,
           "--delay", "0"]
    command = "sudo python3 scripts/bench/bench_time_to_loss.py " + " ".join(
        shlex.quote(a) for a in argv + (["--", *extra] if extra else []))
    res: Dict[str, Any] = {"steps": args.max_iters, "code": code_id(), "loadavg": os.getloadavg(),
                           "command": command.strip(), "baseline_name": args.baseline_name,
                           "started_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime(started)),
                           "presets": {}}
    steps = [f"--max_iters={args.max_iters}", *extra]
    try:
        netem(net, "up")
        res["link"] = netem(net, "measure", "20", timeout=600).strip().splitlines()[-1]
        res["baseline"] = {"curve": train(net, "baseline", out, None, steps, args.timeout)}
        base_t = res["baseline"]["curve"][-1][0]
        for name, preset in presets.items():
            curve = train(net, name, out, preset, steps, args.timeout)
            fit = int(args.max_iters * base_t / curve[-1][0])
            eq = train(net, f"{name}-equal-time", out, preset, [f"--max_iters={fit}", *extra],
                       args.timeout)
            res["presets"][name] = {"curve": curve, "equal_time_steps": fit,
                                    "equal_time_curve": eq}
    finally:
        netem(net, "down", check=False)
    res["loadavg_end"] = os.getloadavg()
    (out / "results.json").write_text(json.dumps(res, indent=1))
    write_outputs(res, out, res["command"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
