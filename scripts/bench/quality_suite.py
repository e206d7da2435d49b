"""The quality suite: every task x every method against plain FSDP of the same task and seed.

"The same model" has to hold on what users train, not on one model: the suite trains
each task with plain FSDP and with each method, same seed and data, and writes one
table (final validation loss, change vs plain, bits/param, the goals) and the curves:

    python3 scripts/bench/quality_suite.py                  # everything (hours on 2 cores)
    python3 scripts/bench/quality_suite.py --tasks gpt2,regression --methods plain,tagc-lean
    python3 scripts/bench/quality_suite.py --scale 0.03     # a smoke run: 3% of the steps

Tasks (:data:`TASKS`): the tiny GPT-2 on the built-in corpus, the same at a small and a
large per-rank batch, a model about 8x larger, a run 3x the 1000-step grid, a
Llama-style model built from a config (RMSNorm, SwiGLU, GQA; ``tagc.train.hf``, what
``finetune_hf.py`` runs), and the teacher-student regression
(``tagc_bench.teacher_student``) at a small and a large batch, whose single seeds move
by a few percent with rounding alone, hence several seeds.  Every run is launched
through the installed package (``torchrun ... -m tagc.train``), in the current folder.
Methods (:data:`METHODS`): ``plain`` and the shipped presets (``tagc.presets``) as they
are at run time, plus the same quantizers with no feedback (``*-nofb``), with the residual
feedback (``*-res``; ``*-res8`` / ``*-res4`` with the residual kept on int8 / int4
codes), and with EF21 (``int4-ef21``, ``tagc-balanced`` until issue 42; ``ternary-ef21``,
the former ``tagc-lean``), derived from the preset files so that they follow them.

Each run keeps its folder under ``--out_dir`` with ``suite_run.json``: the command, the
resolved TAGC config, and the code it ran (the git tree of the code directories, plus a
hash of any uncommitted change to them); ``--reuse`` takes a finished run only when
both match, so a table never mixes code versions silently.  Writes ``--doc`` (markdown)
and ``--curves`` (PNG: per task, % above plain FSDP along training).
"""
from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml

from tagc import presets
from tagc.train.runs import TRAIN_GPT2, code_id, execute, reusable, run_meta, val_curve

logger = logging.getLogger(__name__)
# the checkout this script sits in (scripts/bench/): --doc and --curves go to its docs/
ROOT = Path(__file__).resolve().parents[2]

# Goals of issue 22 (README): final validation loss vs plain FSDP on every task, and
# feedback "earning its memory": at most this many points above the same quantizer
# without feedback.
GOALS = {"tagc-balanced": 1.0, "tagc-lean": 2.0}
FEEDBACK_MARGIN = 0.5
# torchrun's arguments that start the Hugging Face trainer (tagc.train.hf, what
# scripts/finetune_hf.py runs) from the installed package
FINETUNE_HF = ("-m", "tagc.train.hf")
# the interpreter's arguments that start the teacher-student task (every method of a seed):
# checkout code (scripts/bench/tagc_bench), started by its script from any folder
TEACHER_STUDENT = (str(ROOT / "scripts" / "research" / "teacher_student.py"),)


@dataclass(frozen=True)
class Task:
    """One task of the suite.

    Attributes:
        trainer: ``gpt2`` (``tagc.train``, train_gpt2.py's), ``hf`` (``tagc.train.hf``,
            finetune_hf.py's) or ``regression`` (``scripts/research/teacher_student.py``, every
            method in one launch per seed).
        steps: optimizer steps at scale 1.
        args: trainer options beyond the step count.
        seeds: seeds run (each against plain FSDP of the same seed).
        note: what the task varies, for the table.
    """

    trainer: str
    steps: int
    args: Tuple[str, ...] = ()
    seeds: Tuple[int, ...] = (1337,)
    note: str = ""


LLAMA = ("llama:hidden_size=256,intermediate_size=688,num_hidden_layers=2,"
         "num_attention_heads=4,num_key_value_heads=2")
TASKS: Dict[str, Task] = {
    "gpt2": Task("gpt2", 1000, note="tiny GPT-2 (2 x 256, 1.7M), batch 8 x 128 per rank"),
    "gpt2-batch4": Task("gpt2", 1000, ("--batch_size=4",), note="small batch: 4 sequences per rank"),
    "gpt2-batch32": Task("gpt2", 300, ("--batch_size=32",),
                         note="large batch: 32 per rank, 300 steps (about task gpt2's tokens)"),
    "gpt2-wide": Task("gpt2", 1000, ("--n_layer=4", "--n_head=8", "--n_embd=512"),
                      note="4 x 512 (12.8M params, 7.6x)"),
    "gpt2-long": Task("gpt2", 3000, note="3x the 1000-step grid (the schedule stretches)"),
    # issue 42: beyond the widest; 500 steps is about 35 minutes a run on this machine
    "gpt2-25m": Task("gpt2", 500, ("--fsdp=2", "--n_layer=8", "--n_head=8", "--n_embd=512"),
                     note="8 x 512 (25.45M params), FSDP2"),
    # finetune_hf.py takes train-tiny.yaml's knobs as options (the YAML names a GPT-2 size)
    "llama": Task("hf", 600, (f"--hf_config={LLAMA}", "--block_size=128", "--batch_size=8",
                              "--learning_rate=1e-3", "--min_lr=1e-4", "--warmup_iters=30"),
                  note="Llama from a config: RMSNorm, SwiGLU, GQA (2 x 256)"),
    "regression": Task("regression", 150, ("--batch", "16"), seeds=(0, 1, 2, 3, 4),
                       note="teacher-student MLP, batch 16 per rank, AdamW 3e-3"),
    "regression-b256": Task("regression", 100, ("--batch", "256"), seeds=(0, 1, 2),
                            note="the same at batch 256"),
}
# method -> (preset it derives from, overrides); None: plain FSDP
METHODS: Dict[str, Optional[Tuple[str, Dict[str, Any]]]] = {
    "plain": None,
    "tagc-balanced": ("tagc-balanced", {}),
    "tagc-lean": ("tagc-lean", {}),
    "tagc-full": ("tagc-full", {}),  # int8 gathers: FSDP2 tasks only
    "int4-nofb": ("tagc-balanced", {"error_feedback": False, "ef21": False}),
    "ternary-nofb": ("tagc-lean", {"error_feedback": False, "ef21": False}),
    # the int4 ablations below keep the block they were measured at, the presets' 256
    # until tagc-balanced took 64 (int4b64-res4-half)
    # the whole residual fed back (residual_factor 1; quant mode derives 0.5)
    "int4-res": ("tagc-balanced", {"quant_block": 256, "error_feedback": True, "ef21": False,
                                   "residual_code": "none", "residual_factor": 1.0}),
    "ternary-res": ("tagc-lean", {"error_feedback": True, "ef21": False, "residual_code": "none",
                                  "residual_factor": 1.0}),
    # the residual kept as block codes (residual_code, issue 42's memory budget)
    "int4-res8": ("tagc-balanced", {"quant_block": 256, "error_feedback": True, "ef21": False,
                                    "residual_code": "int8", "residual_factor": 1.0}),
    "int4-res4": ("tagc-balanced", {"quant_block": 256, "error_feedback": True, "ef21": False,
                                    "residual_code": "int4", "residual_factor": 1.0}),
    "ternary-res4": ("tagc-lean", {"error_feedback": True, "ef21": False,
                                   "residual_code": "int4", "residual_factor": 1.0}),
    # half of the residual fed back (residual_factor, issue 56)
    "int4-res4-half": ("tagc-balanced", {"quant_block": 256, "error_feedback": True,
                                         "ef21": False, "residual_code": "int4",
                                         "residual_factor": 0.5}),
    # the same on blocks of 64 (4.5 bits per value): tagc-balanced since issue 56 item 4
    "int4b64-res4-half": ("tagc-balanced", {"quant_block": 64, "error_feedback": True,
                                            "ef21": False, "residual_code": "int4",
                                            "residual_factor": 0.5}),
    # ternary under two-level log scales (tls, 1.74 bits; issue 56 item 3's candidate)
    "tls": ("tagc-lean", {"quant_format": "tls"}),
    # a top-k preset, and with its residual on codes
    "tagc-sparse": ("tagc-sparse", {}),
    "sparse-res8": ("tagc-sparse", {"residual_code": "int8"}),
    "sparse-res4": ("tagc-sparse", {"residual_code": "int4"}),
    # tagc-balanced until issue 42: int4 + damped EF21 on an fp32 residual
    "int4-ef21": ("tagc-balanced", {"quant_block": 256, "error_feedback": True, "ef21": True,
                                    "residual_code": "none"}),
    # tagc-lean before it dropped its feedback (SUITE.md): ternary + damped EF21
    "ternary-ef21": ("tagc-lean", {"error_feedback": True, "ef21": True,
                                   "residual_code": "none"}),
}
# a method with feedback -> its quantizer without (the "earns its memory" check)
NO_FEEDBACK = {"tagc-balanced": "int4-nofb", "ternary-ef21": "ternary-nofb",
               "int4-res": "int4-nofb", "ternary-res": "ternary-nofb",
               "int4-res8": "int4-nofb", "int4-res4": "int4-nofb",
               "int4-res4-half": "int4-nofb", "int4b64-res4-half": "int4-nofb",
               "ternary-res4": "ternary-nofb", "int4-ef21": "int4-nofb",
               "sparse-res8": "tagc-sparse", "sparse-res4": "tagc-sparse"}


def method_config(method: str) -> Optional[Dict[str, Any]]:
    """The TAGC config fields of ``method`` as the preset files say now (None: plain).

    Args:
        method: a name of :data:`METHODS`.
    Returns:
        the fields.
    Raises:
        SystemExit: an unknown method.
    """
    if method not in METHODS:
        raise SystemExit(f"unknown method {method!r}; known: {', '.join(METHODS)}")
    spec = METHODS[method]
    if spec is None:
        return None
    preset, over = spec
    fields = yaml.safe_load(presets.resolve(preset).read_text()) or {}
    fields.update(over)
    if "ef21" in over:
        fields.pop("ef21_damping", None)  # follows ef21
    return fields


@dataclass
class Run:
    """One trained (task, seed, method): its final loss, bits and validation curve."""

    task: str
    seed: int
    method: str
    final: float
    bits: float
    cbits: Optional[float]
    curve: List[Tuple[int, float]]
    seconds: float
    code: Dict[str, str] = field(default_factory=dict)


def _finished(folder: Path) -> None:
    """``--report-only``: ``folder`` must hold a finished run (whatever code it ran:
    the doc names each run's commit)."""
    if not ((folder / "suite_run.json").is_file() and (folder / "summary.json").is_file()):
        raise SystemExit(f"quality_suite: --report-only: no finished run in {folder}")


def run_lm(name: str, task: Task, seed: int, method: str, args: argparse.Namespace,
           code: Dict[str, str]) -> Run:
    """One GPT-2 / Hugging Face run (torchrun, 2 ranks) of ``method`` on ``task``."""
    folder = Path(args.out_dir) / name / str(seed) / method
    fields = method_config(method)
    steps = max(1, round(task.steps * args.scale))
    trainer = [*TRAIN_GPT2, str(presets.resolve("train-tiny"))] if task.trainer == "gpt2" \
        else list(FINETUNE_HF)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={args.nproc}", *trainer,
           f"--out_dir={folder}", "--progress=false", f"--seed={seed}",
           f"--max_iters={steps}", f"--eval_interval={max(1, steps // 20)}", *task.args]
    if fields is not None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "tagc.yaml").write_text(yaml.safe_dump(fields, sort_keys=False))
        cmd.append(f"--tagc={folder / 'tagc.yaml'}")
    meta = run_meta(cmd, {"tagc": fields, "steps": steps, "args": list(task.args)}, code)
    if args.report_only:
        _finished(folder)
    elif not (args.reuse and reusable(folder, meta, "summary.json")):
        execute(cmd, folder, meta)
    # a reused run keeps the wall time it recorded when it ran
    seconds = json.loads((folder / "suite_run.json").read_text())["seconds"]
    s = json.loads((folder / "summary.json").read_text())
    cb = s.get("compressed_bits_per_param")
    return Run(name, seed, method, s["final_val_loss"], s["bits_per_param"],
               None if cb is None or cb != cb else cb, val_curve(folder), seconds,
               json.loads((folder / "suite_run.json").read_text())["code"])


def run_regression(name: str, task: Task, seed: int, methods: Sequence[str],
                   args: argparse.Namespace, code: Dict[str, str]) -> List[Run]:
    """Every method of one seed in one teacher-student launch (same processes)."""
    folder = Path(args.out_dir) / name / str(seed)
    folder.mkdir(parents=True, exist_ok=True)
    steps = max(1, round(task.steps * args.scale))
    variants, configs = [], {}
    for m in methods:
        fields = method_config(m)
        configs[m] = fields
        if fields is None:
            variants.append("plain")
        else:
            path = folder / f"{m}.yaml"
            path.write_text(yaml.safe_dump(fields, sort_keys=False))
            variants.append(str(path))
    cmd = [sys.executable, *TEACHER_STUDENT, *variants,
           "--seed", str(seed), "--steps", str(steps), *task.args, "--out_dir", str(folder),
           "--nproc", str(args.nproc)]
    meta = run_meta(cmd, {"methods": configs, "steps": steps, "args": list(task.args)}, code)
    if args.report_only:
        _finished(folder)
    elif not (args.reuse and reusable(folder, meta, "summary.json")):
        execute(cmd, folder, meta)
    # a reused run keeps the wall time it recorded when it ran
    seconds = json.loads((folder / "suite_run.json").read_text())["seconds"]
    s = json.loads((folder / "summary.json").read_text())
    curves: Dict[str, List[Tuple[int, float]]] = {}
    with open(folder / "metrics.csv", newline="") as f:
        for r in csv.DictReader(f):
            if r["val_loss"]:
                curves.setdefault(r["variant"], []).append((int(r["step"]), float(r["val_loss"])))
    world = args.nproc
    plain_bits = 32.0 * (world - 1) / world  # what the plain reduce-scatter sends
    out = []
    for m, v, r in zip(methods, variants, s["runs"]):
        ratio = r["stats"].get("wire_ratio", 1.0) if r["stats"] else 1.0
        # layers: all: every unit is compressed, so "all" and "compressed" agree
        bits = plain_bits * ratio
        out.append(Run(name, seed, m, r["val_loss"], bits, None if m == "plain" else bits,
                       curves[v], seconds / len(methods),
                       json.loads((folder / "suite_run.json").read_text())["code"]))
    return out


def run_suite(tasks: Sequence[str], methods: Sequence[str],
              args: argparse.Namespace) -> Tuple[List[Run], Dict[str, float]]:
    """Train every (task, seed, method); returns the runs and each task's summed run time."""
    code = code_id()
    if "plain" not in methods:
        methods = ["plain", *methods]
    runs: List[Run] = []
    wall: Dict[str, float] = {}
    for name in tasks:
        task = TASKS[name]
        task_runs: List[Run] = []
        for seed in (args.seeds or task.seeds):
            if task.trainer == "regression":
                task_runs += run_regression(name, task, seed, methods, args, code)
            else:
                task_runs += [run_lm(name, task, seed, m, args, code) for m in methods]
        runs += task_runs
        # summed from the runs' records, so reused runs count what they took then
        wall[name] = sum(r.seconds for r in task_runs)
        logger.info("%s: %.0f s of runs", name, wall[name])
    return runs, wall


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


# Student's t, the 0.975 quantile, by degrees of freedom 1..30 (beyond: the normal
# 1.96): the half-width of a 95% interval of a mean over few seeds.
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201,
        2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074,
        2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def ci95(xs: Sequence[float]) -> Optional[float]:
    """Half-width of the 95% confidence interval of the mean of ``xs`` (t interval,
    sample standard deviation); None for fewer than two values."""
    n = len(xs)
    if n < 2:
        return None
    m = _mean(xs)
    sd = (sum((x - m) ** 2 for x in xs) / (n - 1)) ** 0.5
    return (T975[n - 2] if n - 1 <= len(T975) else 1.96) * sd / n ** 0.5


def summarize(runs: Sequence[Run]) -> Dict[Tuple[str, str], Dict[str, Any]]:
    """Per (task, method): the mean final loss, the per-seed change vs plain FSDP of the
    same seed (mean, min, max, in %) and the mean bits/param.

    Args:
        runs: every run, plain included for each (task, seed).
    Returns:
        ``{(task, method): {"loss", "pct", "ci", "lo", "hi", "seeds", "bits", "cbits"}}``
        (``ci``: :func:`ci95` of the per-seed changes, None for one seed).
    Raises:
        ValueError: a (task, seed) without its plain run.
    """
    base = {(r.task, r.seed): r.final for r in runs if r.method == "plain"}
    cells: Dict[Tuple[str, str], List[Run]] = {}
    for r in runs:
        if (r.task, r.seed) not in base:
            raise ValueError(f"{r.task} seed {r.seed}: no plain FSDP run to compare with")
        cells.setdefault((r.task, r.method), []).append(r)
    out = {}
    for key, rs in cells.items():
        pct = [100.0 * (r.final / base[(r.task, r.seed)] - 1.0) for r in rs]
        cb = [r.cbits for r in rs if r.cbits is not None]
        out[key] = {"loss": _mean([r.final for r in rs]), "pct": _mean(pct), "ci": ci95(pct),
                    "lo": min(pct),
                    "hi": max(pct), "seeds": len(rs), "bits": _mean([r.bits for r in rs]),
                    "cbits": _mean(cb) if cb else None}
    return out


def write_doc(runs: Sequence[Run], wall: Dict[str, float], path: Path, command: str,
              loads: Tuple[Tuple[float, ...], Tuple[float, ...]], scale: float) -> str:
    """The markdown table (task x method), the goals and the feedback check."""
    cells = summarize(runs)
    tasks = list(dict.fromkeys(r.task for r in runs))
    methods = list(dict.fromkeys(r.method for r in runs))
    codes = {json.dumps(r.code, sort_keys=True) for r in runs}
    code = json.loads(next(iter(codes)))
    lines = [f"Command: `{command}`", "",
             f"Code: commit {code['commit']}{' + uncommitted changes ' + code['dirty'] if code['dirty'] else ''}"
             f" (code tree {code['tree']}){'; RUNS FROM SEVERAL CODE VERSIONS' if len(codes) > 1 else ''}; "
             f"{time.strftime('%Y-%m-%d %H:%M %Z')}; load average {loads[0][0]:.1f} at start, "
             f"{loads[1][0]:.1f} at the end (losses do not depend on it; wall times do)."
             + ("" if scale == 1 else f" **Scale {scale:g}: every task at {scale:g}x its steps "
                "(a smoke run, not the suite's result).**"),
             "", "2 gloo ranks on the CPU. Change: final validation loss vs plain FSDP of the "
             "same task and seed (mean over seeds; with several, ± the 95% interval of that mean "
             "(t) and min..max over seeds). Bits/param: what a "
             "rank sends per gradient element per step, over all parameters / over the "
             "compressed units.", "",
             "| task | what | seeds | plain loss | wall |", "|---|---|---|---|---|"]
    for t in tasks:
        seeds = len({r.seed for r in runs if r.task == t})
        note = TASKS[t].note if t in TASKS else ""
        lines.append(f"| {t} | {note} | {seeds} | "
                     f"{cells[(t, 'plain')]['loss']:.4f} | {wall.get(t, float('nan')) / 60:.0f} min |")
    lines += ["", "| task | " + " | ".join(m for m in methods if m != "plain") + " |",
              "|---|" + "---|" * (len(methods) - 1)]
    for t in tasks:
        row = []
        for m in methods:
            if m == "plain":
                continue
            c = cells.get((t, m))
            if c is None:
                row.append("-")
                continue
            rng = f" ±{c['ci']:.2f} ({c['lo']:+.1f}..{c['hi']:+.1f})" if c["seeds"] > 1 else ""
            cb = f" / {c['cbits']:.2f}" if c["cbits"] is not None else ""
            row.append(f"{c['pct']:+.2f}%{rng}, {c['bits']:.2f}{cb} b")
        lines.append(f"| {t} | " + " | ".join(row) + " |")
    lines += ["", "Goals: " + ", ".join(f"`{m}` <= +{g:g}%" for m, g in GOALS.items())
              + f" on every task; a method with feedback at most {FEEDBACK_MARGIN} points "
              "above its quantizer without feedback.", "",
              "| method | worst task | goal | vs no feedback: worst task | earns its memory |",
              "|---|---|---|---|---|"]
    for m in [*GOALS, *(m for m in NO_FEEDBACK if m not in GOALS)]:
        mine = [(cells[(t, m)]["pct"], t) for t in tasks if (t, m) in cells]
        if not mine:
            continue
        worst, wt = max(mine)
        goal = "-" if m not in GOALS else "met" if worst <= GOALS[m] else "NOT met"
        nofb = NO_FEEDBACK.get(m)
        gap_s, earns = "-", "-" if nofb else "no feedback"
        gap = [(cells[(t, m)]["pct"] - cells[(t, nofb)]["pct"], t) for t in tasks
               if nofb and (t, m) in cells and (t, nofb) in cells]
        if gap:
            g, gt = max(gap)
            gap_s, earns = f"{g:+.2f} points ({gt})", "yes" if g <= FEEDBACK_MARGIN else "NO"
        lines.append(f"| {m} | {worst:+.2f}% ({wt}) | {goal} | {gap_s} | {earns} |")
    text = "\n".join(lines) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return text


def plot_curves(runs: Sequence[Run], path: Path) -> None:
    """PNG: per task, each method's validation loss vs plain FSDP's (mean over seeds)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r.task for r in runs))
    cols = min(4, len(tasks))
    rows = -(-len(tasks) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), dpi=100,
                             squeeze=False)
    for ax, t in zip(axes.flat, tasks):
        base = {r.seed: dict(r.curve) for r in runs if r.task == t and r.method == "plain"}
        for m in dict.fromkeys(r.method for r in runs if r.task == t and r.method != "plain"):
            pts: Dict[int, List[float]] = {}
            for r in runs:
                if r.task == t and r.method == m:
                    for it, loss in r.curve:
                        if it in base[r.seed] and it > 0:
                            pts.setdefault(it, []).append(100 * (loss / base[r.seed][it] - 1))
            its = sorted(pts)
            ax.plot(its, [_mean(pts[i]) for i in its], label=m, lw=1.3)
        ax.axhline(0, color="black", lw=1.2)
        ax.set_title(t, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel("% above plain FSDP", fontsize=8)
        ax.set_ylim(-4, 8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(tasks):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> Dict[Tuple[str, str], Dict[str, Any]]:
    """Run the suite; returns :func:`summarize`'s cells."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma list of {', '.join(TASKS)}")
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma list of {', '.join(METHODS)} (plain always runs)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiplies every task's steps (a smoke run; the doc says so)")
    p.add_argument("--nproc", type=int, default=2, help="ranks")
    p.add_argument("--seeds", default="",
                   help="comma list of seeds run on every task instead of each task's own")
    p.add_argument("--out_dir", default="out/suite", help="the runs' folders")
    p.add_argument("--reuse", action="store_true",
                   help="take finished runs of the same code and configs from out_dir")
    p.add_argument("--report-only", action="store_true",
                   help="train nothing: the doc and curves of the finished runs in out_dir, "
                        "whatever code each ran (its commit is in the doc)")
    p.add_argument("--doc", default=str(ROOT / "docs" / "SUITE.md"),
                   help="the markdown table (default: this checkout's docs/SUITE.md)")
    p.add_argument("--curves", default=str(ROOT / "docs" / "suite-curves.png"),
                   help="the curves (default: this checkout's docs/suite-curves.png)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for t in tasks:
        if t not in TASKS:
            p.error(f"unknown task {t!r}; known: {', '.join(TASKS)}")
    for m in methods:
        method_config(m)
    if not args.scale > 0:
        p.error("--scale must be > 0")
    try:
        args.seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        p.error(f"--seeds must be a comma list of integers, got {args.seeds!r}")
    command = "python3 scripts/bench/quality_suite.py " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    start = os.getloadavg()
    runs, wall = run_suite(tasks, methods, args)
    text = write_doc(runs, wall, Path(args.doc), command.strip(), (start, os.getloadavg()),
                     args.scale)
    plot_curves(runs, Path(args.curves))
    print(text)
    print(f"wrote {args.doc} and {args.curves}")
    return summarize(runs)


if __name__ == "__main__":
    main()
