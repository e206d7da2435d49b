#!/usr/bin/env python3
"""Quality of coded pipeline boundaries: each code against uncompressed PP (issue 40).

Every (task, code) trains ``train_gpt2.py --pp 2 --tie_weights=false`` (two gloo ranks,
one stage each; the ``ppfsdp`` tasks four, each stage an FSDP2 pair) on the built-in corpus with the same seed and batches as the fp32
baseline of its task; the table gives the final validation loss and its change against
the baseline, with the boundary bytes per step; the curves plot each code's loss
against the baseline's along training, and the subspace's final loss against k.

Usage:
    python3 scripts/bench/pp_quality.py                          # every task and code
    python3 scripts/bench/pp_quality.py --tasks tiny-300 --codes int8 sub16
    python3 scripts/bench/pp_quality.py --report-only            # re-render the finished runs

Runs go to ``--out_dir`` (default ``out/pp-quality``, one folder per task and code,
reused when the code and configs are unchanged, ``--no-reuse`` to force), the table to
``--doc`` (default ``docs/PIPELINE.md``, the part between the markers) and the curves
to ``--curves`` (default ``docs/pp-quality.png``).
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

logger = logging.getLogger("pp_quality")
ROOT = Path(__file__).resolve().parents[2]

# task -> (steps, width, ranks per stage, trainer options beyond train-tiny.yaml's);
# ranks per stage > 1: PP x FSDP, each stage an FSDP2 group (plain FSDP2 in the baseline)
TASKS: Dict[str, Tuple[int, int, int, Tuple[str, ...]]] = {
    "tiny-300": (300, 256, 1, ()),
    "tiny-1000": (1000, 256, 1, ()),
    "wide-300": (300, 512, 1, ("--n_layer=4", "--n_head=8", "--n_embd=512")),
    "wide-1000": (1000, 512, 1, ("--n_layer=4", "--n_head=8", "--n_embd=512")),
    "ppfsdp-300": (300, 256, 2, ("--fsdp=2",)),
    "ppfsdp-1000": (1000, 256, 2, ("--fsdp=2",)),
}
# code -> PipelineConfig fields, and "stage": the TAGC preset inside each stage (PP x
# FSDP tasks only); "fp32" is the baseline (no --tagc)
CODES: Dict[str, Optional[Dict[str, Any]]] = {
    "fp32": None,
    # both parallelisms coded: the boundary and FSDP2's exchanges inside the stages
    "int8+full": {"format": "int8", "stage": "tagc-full"},
    "int4+full": {"format": "int4", "stage": "tagc-full"},
    "bf16": {"format": "bf16"},
    "int8": {"format": "int8"},
    "int4": {"format": "int4"},
    "int4-g8": {"format": "int4", "grad_format": "int8"},
    # k = the width (256 tiny, 512 wide): the reparametrisation without the rank limit
    **{f"sub{k}": {"format": "fp32", "subspace_k": k} for k in (512, 256, 128, 64, 32, 16, 8)},
    # the frozen tables at the paper's scale (std 1) and between
    **{f"sub32-std{s}": {"format": "fp32", "subspace_k": 32, "subspace_std": float(s)}
       for s in ("0.1", "1")},
    "sub32-int8": {"format": "int8", "subspace_k": 32},
    # a wider subspace, coded: the rank costs more than the codes (tiny-300 ablation)
    "sub128-int8": {"format": "int8", "subspace_k": 128},
    "sub128-int4": {"format": "int4", "subspace_k": 128},
    # past 32x on the wide model: 112 coefficients, int4, one scale per token
    "sub112-int4": {"format": "int4", "subspace_k": 112, "block": 112},
    "sub64-int8": {"format": "int8", "subspace_k": 64},
    "sub32-bf16": {"format": "bf16", "subspace_k": 32},
}
BASE = {"grad_format": None, "block": 64, "subspace_k": 0, "subspace_seed": 0,
        "subspace_std": 0.02, "schedule": "1f1b", "microbatches": 4}
MARK = ("<!-- pp-quality:start -->", "<!-- pp-quality:end -->")


def run_one(task: str, code: str, args: argparse.Namespace, cid: Dict[str, str]
            ) -> Optional[Dict[str, Any]]:
    """Train one (task, code), or reuse its finished run; returns its record (None:
    ``--report-only`` and the run never finished)."""
    steps, _, dp, extra = TASKS[task]
    folder = Path(args.out_dir) / task / code
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={2 * dp}", *TRAIN_GPT2, str(ROOT / "configs" / "train-tiny.yaml"),
           f"--out_dir={folder}", "--progress=false", "--pp=2", "--tie_weights=false",
           f"--max_iters={steps}", f"--eval_interval={max(1, steps // 20)}", *extra]
    fields = None if CODES[code] is None else {**BASE, **CODES[code]}
    if fields is not None and "stage" in fields:
        cmd.append(f"--stage_tagc={fields.pop('stage')}")
    if fields is not None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "pipeline.yaml").write_text(yaml.safe_dump(fields, sort_keys=False))
        cmd.append(f"--tagc={folder / 'pipeline.yaml'}")
    meta = run_meta(cmd, {"pipeline": fields, "steps": steps, "args": list(extra)}, cid)
    got = finished_run(cmd, folder, meta, report_only=args.report_only, reuse=args.reuse)
    if got is None:
        return None
    s, curve, rec = got["summary"], got["curve"], got["record"]
    return {"task": task, "code": code, "final": s["final_val_loss"],
            "bytes": s["boundary_bytes_per_step"], "ratio": s["boundary_ratio"],
            "stage_ratio": _stage_ratio(s) if "stage" in (CODES[code] or {}) else None,
            "step_ms": s["mean_step_ms"], "n_params": s["n_params"], "curve": curve,
            "seconds": rec["seconds"], "commit": rec["code"]["commit"]}


def _stage_ratio(summary: Dict[str, Any]) -> Optional[float]:
    """PP x FSDP with TAGC: the bytes FSDP2 sends inside the stages (gathers and
    reduce-scatters, ideal counts at the call) over what plain fp32 FSDP2 sends for the
    same calls; None without TAGC inside the stages."""
    plain = (summary.get("stage_rs_bytes_per_step_plain", 0)
             + summary.get("stage_gather_bytes_per_step_plain", 0))
    if not plain:
        return None
    return (summary["stage_rs_bytes_per_step"] + summary["stage_gather_bytes_per_step"]) / plain


def _runs_on(task: str, code: str) -> bool:
    """A subspace wider than the model does not exist; a code inside the stages needs
    stages of several ranks."""
    fields = CODES[code] or {}
    _, width, dp, _ = TASKS[task]
    return fields.get("subspace_k", 0) <= width and ("stage" not in fields or dp > 1)


def table(runs: Sequence[Dict[str, Any]]) -> str:
    """The markdown table: per task, every code against its fp32 baseline."""
    lines = ["| task | code | boundary bytes/step | fewer than fp32 | inside the stages | "
             "val loss | vs fp32 | params | run |", "|---|---|---|---|---|---|---|---|---|"]
    base = {r["task"]: r["final"] for r in runs if r["code"] == "fp32"}
    for r in runs:
        d = 100 * (r["final"] / base[r["task"]] - 1) if r["task"] in base else float("nan")
        inside = "-" if r.get("stage_ratio") is None else f"{r['stage_ratio']:.3f} of plain"
        lines.append(f"| {r['task']} | {r['code']} | {r['bytes']} | {r['ratio']:.1f}x | "
                     f"{inside} | {r['final']:.4f} | {d:+.2f}% | {r['n_params'] / 1e6:.2f}M | "
                     f"{r['seconds'] / 60:.0f} min ({r['commit']}) |")
    return "\n".join(lines)


def plot(runs: Sequence[Dict[str, Any]], path: Path) -> None:
    """Per task: each code's validation loss vs fp32's along training; then loss vs k."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r["task"] for r in runs))

    def k_of(r: Dict[str, Any]) -> int:
        """k of an fp32-coded subspace run at the paper's std, else 0."""
        f = CODES[r["code"]] or {}
        return f.get("subspace_k", 0) if f.get("format") == "fp32" and \
            "subspace_std" not in f else 0
    # the loss-against-k panel only where a subspace ran
    panels = len(tasks) + any(k_of(r) for r in runs)
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.4), dpi=100, squeeze=False)
    for ax, t in zip(axes.flat, tasks):
        base = {i: v for i, v in next((r["curve"] for r in runs if r["task"] == t and
                                       r["code"] == "fp32"), [])}
        for r in runs:
            if r["task"] == t and r["code"] != "fp32":
                pts = [(i, 100 * (v / base[i] - 1)) for i, v in r["curve"] if i in base and i]
                # one colour and style per code, the same in every panel
                n = list(CODES).index(r["code"])
                ax.plot(*zip(*pts), label=r["code"], lw=1.2, color=f"C{n % 10}",
                        ls=("-", "--")[n // 10 % 2])
        ax.axhline(0, color="black", lw=1)
        ax.set_title(t, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel("% above fp32 PP", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=5, ncol=2)
    if panels > len(tasks):
        ax = axes.flat[len(tasks)]
        for t in tasks:
            base = next((r["final"] for r in runs if r["task"] == t and r["code"] == "fp32"),
                        None)
            ks = sorted((k_of(r), r["final"]) for r in runs if r["task"] == t and k_of(r))
            if ks and base:
                ax.plot([k for k, _ in ks], [100 * (v / base - 1) for _, v in ks], "o-",
                        label=t)
        ax.set_xscale("log", base=2)
        ax.set_title("subspace: final loss vs k", fontsize=9)
        ax.set_xlabel("k", fontsize=8)
        ax.set_ylabel("% above fp32 PP", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    save_figure(fig, path)


def main(argv: Optional[Sequence[str]] = None) -> List[Dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--codes", nargs="+", default=list(CODES), choices=list(CODES),
                   help="fp32 (the baseline) always runs")
    add_comparison_args(p, TASKS, "out/pp-quality", ROOT / "docs" / "PIPELINE.md",
                        ROOT / "docs" / "pp-quality.png")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s",
                        datefmt="%H:%M:%S")
    cid = code_id()
    codes = ["fp32", *[c for c in args.codes if c != "fp32"]]
    runs = [r for r in (run_one(t, c, args, cid) for t in args.tasks for c in codes
                        if _runs_on(t, c))
            if r is not None]
    publish_comparison(table(runs), Path(args.doc), MARK, lambda: plot(runs, Path(args.curves)))
    return runs


if __name__ == "__main__":
    main()
