"""Validation quality of TAGC presets against plain FSDP (the paper's Figure 4 / section 5).

Runs scripts/train_gpt2.py once per setting, same seed, data and steps (torchrun, 2 ranks,
gloo on CPU by default), then writes ``<out_dir>/quality.md`` (final validation loss, ratio
to the baseline, gradient bits per parameter on the wire, step time) and
``<out_dir>/val_curves.png``.

    python scripts/compare_quality.py                       # tiny model, 300 steps
    python scripts/compare_quality.py --presets tagc-exact,tagc-sparse -- --max_iters=50

Arguments after ``--`` are passed to every training run (``--key=value`` overrides).
"""
from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

logger = logging.getLogger("compare_quality")

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PRESETS = ("tagc-10x-1bit,tagc-10x-4bit,tagc-exact,tagc-sparse,"
                   "tagc-10x-1bit-warmup,tagc-exact-warmup,tagc-sparse-warmup,"
                   "tagc-sparse-t90-warmup")
# Goals (README): the paper reports a 3.6% loss increase for 10x 1-bit; ours must stay
# within these relative increases of the baseline.
GOALS = {"tagc-exact": 1.0, "tagc-sparse": 2.0,
         "tagc-exact-warmup": 1.0, "tagc-sparse-warmup": 2.0, "tagc-sparse-t90-warmup": 2.0}
PAPER_10X_1BIT_LOSS_PCT = 3.6


def run_one(name: str, preset: Optional[Path], args: argparse.Namespace,
            extra: Sequence[str]) -> Dict[str, Any]:
    """Train one setting; returns its summary.json plus its validation curve.

    Args:
        name: run name (output sub-folder).
        preset: TAGC YAML preset, or None for plain FSDP.
        args: this script's arguments.
        extra: overrides passed through to train_gpt2.py.

    Returns:
        The summary dict with "val_curve": [(iter, loss), ...] and "wall_s".

    Raises:
        RuntimeError: the training run failed (its log tail is in the message).
    """
    out = Path(args.out_dir) / name
    summary_path = out / "summary.json"
    if args.reuse and summary_path.exists():
        logger.info("%s: reusing %s", name, summary_path)
        wall = float("nan")
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={args.nproc}", str(REPO / "scripts" / "train_gpt2.py"),
               args.train_config, f"--out_dir={out}", "--progress=false",
               f"--fsdp={args.fsdp}", *([f"--tagc={preset}"] if preset else []), *extra]
        logger.info("%s: %s", name, " ".join(shlex.quote(c) for c in cmd))
        out.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with open(out / "train.log", "w") as log:
            p = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        wall = time.perf_counter() - t0
        if p.returncode != 0:
            tail = (out / "train.log").read_text()[-3000:]
            raise RuntimeError(f"{name} failed (exit {p.returncode}):\n{tail}")
        final = [ln for ln in (out / "train.log").read_text().splitlines()
                 if ln.startswith("final:")]
        logger.info("%s: %s (%.0f s)", name, final[-1] if final else "no summary", wall)
    summary = json.loads(summary_path.read_text())
    with open(out / "metrics.csv", newline="") as f:
        summary["val_curve"] = [(int(r["iter"]), float(r["loss"]))
                                for r in csv.DictReader(f) if r["kind"] == "val"]
    summary["wall_s"] = wall
    return summary


def write_table(results: Dict[str, Dict[str, Any]], path: Path, command: str) -> str:
    """Markdown table of the runs against the baseline; returns the text it wrote."""
    base = results["baseline"]["final_val_loss"]
    b0 = results["baseline"]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                capture_output=True, text=True).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    lines = [
        f"Command: `{command}` (commit {commit}, {time.strftime('%Y-%m-%d %H:%M %Z')})",
        "",
        f"GPT-2 `{json.loads(Path(b0['_config']).read_text())['model']}` "
        f"({b0['n_params'] / 1e6:.2f}M params), {b0['iters']} steps, {b0['world_size']} ranks, "
        f"FSDP{b0['fsdp']} {b0['sharding']}, tokenizer {b0['tokenizer']}, same seed and data "
        "for every run. Bits/param: bits this rank sends per gradient element per step on an "
        "ideal network (plain fp32 reduce-scatter: 32 (N-1)/N), over all parameters and over "
        "the compressed units only. Step time: mean wall time of a training step on this "
        "machine (shared CPU cores, noisy).",
        "",
        "| run | final val loss | ratio to baseline | loss change | bits/param (all) "
        "| bits/param (compressed units) | step ms | unpeeled (recovered) | goal |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in results.items():
        loss = s["final_val_loss"]
        ratio = loss / base
        goal = ""
        if name in GOALS:
            ok = (ratio - 1) * 100 <= GOALS[name]
            goal = f"within {GOALS[name]:g}%: {'met' if ok else 'NOT met'}"
        elif name == "tagc-10x-1bit":
            goal = f"paper: +{PAPER_10X_1BIT_LOSS_PCT}%"
        cbits = s.get("compressed_bits_per_param")
        cbits_s = "-" if cbits is None or (isinstance(cbits, float) and math.isnan(cbits)) \
            else f"{cbits:.2f}"
        unpeeled = "-" if name == "baseline" else \
            f"{int(s.get('unpeeled', 0))} ({int(s.get('recovered', 0))})"
        lines.append(f"| {name} | {loss:.4f} | {ratio:.4f} | {100 * (ratio - 1):+.2f}% | "
                     f"{s['bits_per_param']:.2f} | {cbits_s} | {s['mean_step_ms']:.0f} | "
                     f"{unpeeled} | {goal} |")
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def plot_curves(results: Dict[str, Dict[str, Any]], path: Path) -> None:
    """PNG of validation loss against iteration, one line per run (matplotlib, Agg)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for name, s in results.items():
        its, losses = zip(*s["val_curve"]) if s["val_curve"] else ((), ())
        ax.plot(its, losses, label=name, lw=2.2 if name == "baseline" else 1.4,
                color="black" if name == "baseline" else None)
    tail = [loss for s in results.values() for it, loss in s["val_curve"]
            if it >= 0.3 * max(1, s["iters"])]
    if tail:  # zoom on the part where the runs differ; the first evals are far above
        lo, hi = min(tail), max(tail)
        ax.set_ylim(lo - 0.05 * (hi - lo + 1e-3), hi + 0.5 * (hi - lo + 1e-3))
    ax.set_xlabel("iteration")
    ax.set_ylabel("validation loss")
    ax.set_title("Validation loss: plain FSDP vs TAGC presets")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Dict[str, Any]]:
    """Run the comparison; returns {run name: summary}."""
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: List[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default=DEFAULT_PRESETS,
                   help="comma-separated names of configs/<name>.yaml or paths to TAGC YAML "
                        "files (the baseline always runs)")
    p.add_argument("--train_config", default=str(REPO / "configs" / "train-tiny.yaml"))
    p.add_argument("--nproc", type=int, default=2, help="ranks (torchrun --nproc_per_node)")
    p.add_argument("--fsdp", type=int, choices=(1, 2), default=1)
    p.add_argument("--out_dir", default="out/compare")
    p.add_argument("--reuse", action="store_true",
                   help="reuse runs whose summary.json already exists in out_dir")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    names = [n.strip() for n in args.presets.split(",") if n.strip()]
    presets: List[Tuple[str, Optional[Path]]] = [("baseline", None)]
    for n in names:
        path = Path(n) if n.endswith((".yaml", ".yml")) else REPO / "configs" / f"{n}.yaml"
        if not path.is_file():
            raise SystemExit(f"no preset {path}")
        presets.append((path.stem, path.resolve()))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results: Dict[str, Dict[str, Any]] = {}
    for name, preset in presets:
        results[name] = run_one(name, preset, args, extra)
        results[name]["_config"] = str(out / name / "config.json")
    command = "python scripts/compare_quality.py " + " ".join(
        shlex.quote(a) for a in (argv + (["--", *extra] if extra else [])))
    text = write_table(results, out / "quality.md", command.strip())
    plot_curves(results, out / "val_curves.png")
    print(text)
    print(f"wrote {out / 'quality.md'} and {out / 'val_curves.png'}")
    return results


if __name__ == "__main__":
    main()
