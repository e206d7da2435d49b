"""Teacher-student regression: a student MLP learns a fixed random teacher MLP, on FSDP2.

The small task on which issue 22 found ``tagc-lean`` (then ternary codes + EF21) diverging
from plain FSDP while ``tagc-balanced`` (int4 + EF21) kept up.  Unlike the tiny GPT-2 it
has no data to download, trains in seconds, and its loss can keep falling for as long
as one runs it (the teacher is in the student's class), so a compressor that stops
following the gradient shows up as a growing gap.

* Teacher: a fixed random MLP ``d_in -> teacher_width -> teacher_width -> d_out``
  (ReLU), its outputs scaled to unit variance: the loss is the fraction of the
  target's variance the student misses (1.0 = predicting 0).
* Student: ``d_in -> width (x depth hidden layers) -> d_out`` (ReLU), sharded with
  ``tagc.shard_model`` (one FSDP2 unit per Linear), AdamW at a constant learning rate.
* Every TAGC config gets ``layers: all`` and ``min_numel`` of the task (default 1024),
  so every Linear layer is compressed (the presets' 65536 would leave the input and
  output layers alone); plain FSDP uses the same unit layout.
* Each rank draws its own batch of ``N(0, I)`` inputs per step from ``(seed, step,
  rank)``; the validation loss is the MSE on a fixed held-out set of 4096 inputs.

Run (2 gloo ranks on the CPU, started here by tagc.train.launch; or under torchrun,
which sets RANK), from any folder (``scripts/research/teacher_student.py`` takes the
same arguments)::

    python3 scripts/research/teacher_student.py plain tagc-lean tagc-balanced
    python3 scripts/research/teacher_student.py plain tagc-lean ternary ternary-res \\
        --batch 256 --steps 100
    python3 scripts/research/teacher_student.py plain "tagc-balanced,guard_ratio=8"

A variant is ``plain`` (FSDP2's own reduce-scatter) or ``BASE[,field=value...]``:
BASE is a shipped preset's name (``tagc-lean`` or ``lean``: ``tagc.presets.resolve``),
a YAML path, or one of :data:`ALIASES`; the fields override the config (values read
as YAML).  Variants run
one after the other in the same processes, each from the same initial weights and
batches.  Prints each variant's final validation loss and its change vs the first
variant; writes ``<out_dir>/metrics.csv`` (variant, step, train_loss, val_loss),
``<out_dir>/guard.csv`` (variant, step, unit, the feedback guard's pooled statistic
of the unit's call: variants with the guard on) and ``<out_dir>/summary.json``.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from tagc import presets, teardown
from tagc.train.launch import run_dist

# a whole launch of every variant (minutes on the suite's sizes); a hung rank is killed
LAUNCH_TIMEOUT_S = 4 * 3600.0

# Named configs that are not presets: the ternary and int4 codes with each kind of
# feedback (every feedback knob explicit; the residual ones feed all of it back).
ALIASES: Dict[str, Dict[str, Any]] = {
    "ternary": {"mode": "quant", "quant_format": "ternary", "error_feedback": False,
                "ef21": False},
    "ternary-res": {"mode": "quant", "quant_format": "ternary", "error_feedback": True,
                    "ef21": False, "residual_factor": 1.0},
    "ternary-ef21": {"mode": "quant", "quant_format": "ternary", "error_feedback": True,
                     "ef21": True},
    "int4-res": {"mode": "quant", "quant_format": "int4", "error_feedback": True,
                 "ef21": False, "residual_factor": 1.0},
    "int4-ef21": {"mode": "quant", "quant_format": "int4", "error_feedback": True,
                  "ef21": True},
}


def mlp(d_in: int, width: int, depth: int, d_out: int) -> nn.Sequential:
    """``depth`` hidden ReLU layers of ``width``, then a linear read-out.

    Args:
        d_in: input features.
        width: hidden width.
        depth: hidden layers (>= 1).
        d_out: outputs.
    Returns:
        the MLP (PyTorch's default initialisation, from the current RNG state).
    """
    layers: List[nn.Module] = []
    d = d_in
    for _ in range(depth):
        layers += [nn.Linear(d, width), nn.ReLU()]
        d = width
    layers.append(nn.Linear(d, d_out))
    return nn.Sequential(*layers)


class Task:
    """The teacher, the held-out set and the batches: identical on every rank.

    Args:
        args: the command line (sizes and seed).
    """

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        g = torch.Generator().manual_seed(args.seed)
        with torch.random.fork_rng():
            torch.manual_seed(args.seed + 1)
            self.teacher = mlp(args.d_in, args.teacher_width, 2, args.d_out).requires_grad_(False)
        probe = torch.randn(8192, args.d_in, generator=g)
        with torch.no_grad():
            out = self.teacher(probe)
        # unit variance per output: the loss reads as a fraction of the target's variance
        self.mean, self.std = out.mean(0), out.std(0).clamp_min(1e-12)
        self.val_x = torch.randn(4096, args.d_in, generator=g)
        self.val_y = self.target(self.val_x)

    @torch.no_grad()
    def target(self, x: torch.Tensor) -> torch.Tensor:
        """The normalised teacher output of inputs ``x``."""
        return (self.teacher(x) - self.mean) / self.std

    def batch(self, step: int, rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s batch of step ``step``: the same in every variant and run."""
        g = torch.Generator().manual_seed(self.args.seed * 1_000_003 + step * 64 + rank + 7)
        x = torch.randn(self.args.batch, self.args.d_in, generator=g)
        y = self.target(x)
        if self.args.noise > 0:
            # label noise of the training targets only: the held-out loss stays the
            # fraction of the clean target's variance missed
            y = y + self.args.noise * torch.randn(y.shape, generator=g)
        return x, y


def parse_variant(spec: str) -> Optional[Dict[str, Any]]:
    """A variant's TAGCConfig fields (task overrides not applied), None for ``plain``.

    Args:
        spec: ``plain`` or ``BASE[,field=value...]`` (see the module docstring).
    Returns:
        the config fields.
    Raises:
        ValueError: an unknown BASE or a malformed override.
    """
    import yaml

    base, *over = spec.split(",")
    if base == "plain":
        if over:
            raise ValueError("plain takes no overrides")
        return None
    if base in ALIASES:
        fields = dict(ALIASES[base])
    else:
        try:
            path = presets.resolve(base)
        except ValueError as e:
            raise ValueError(f"variant {spec!r}: {base!r} is not plain, an alias "
                             f"({sorted(ALIASES)}), a shipped preset or a YAML file ({e})") \
                from None
        fields = yaml.safe_load(path.read_text()) or {}
    for part in over:
        key, eq, value = part.partition("=")
        if not eq:
            raise ValueError(f"variant {spec!r}: expected field=value, got {part!r}")
        fields[key.strip()] = yaml.safe_load(value)
    return fields


def train(spec: str, task: Task, rank: int, world: int,
          on_step: Optional[Callable[[int, Any, Any], None]] = None) -> Dict[str, Any]:
    """One variant: build, shard, register, train; returns its curve and stats.

    Args:
        spec: the variant.
        task: the task (same on every rank).
        rank, world: this rank and the number of ranks.
        on_step: called after each optimizer step with (step, model, TAGC state or None)
            (the probes read the reducers' state there).
    Returns:
        ``{"variant", "train": [(step, loss)], "val": [(step, loss)], "stats"}``; the
        train loss is the mean over ranks.
    """
    from tagc.config import TAGCConfig
    from tagc.state import register
    from tagc.wrapping import shard_model

    args = task.args
    fields = parse_variant(spec)
    task_fields = {"layers": "all", "min_numel": args.min_numel}
    cfg = TAGCConfig.from_dict({**(fields or {"mode": "dense"}), **task_fields})
    torch.manual_seed(args.seed)
    model = shard_model(mlp(args.d_in, args.width, args.depth, args.d_out), cfg)
    state = register(model, cfg) if fields is not None else None
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    curve: List[Tuple[int, float]] = []
    val: List[Tuple[int, float]] = []
    for step in range(args.steps):
        x, y = task.batch(step, rank)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if on_step is not None:
            on_step(step, model, state)
        t = loss.detach().reshape(1).clone()
        dist.all_reduce(t)
        curve.append((step + 1, float(t) / world))
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            with torch.no_grad():
                val.append((step + 1, float(nn.functional.mse_loss(model(task.val_x),
                                                                   task.val_y))))
    stats = state.stats(global_totals=True)["global_compressed_total"] if state else {}
    keep = ("calls", "compressed_calls", "plain_calls", "bypassed_calls", "guard_resets",
            "nonfinite_fallbacks", "wire_ratio")
    return {"variant": spec, "train": curve, "val": val,
            "stats": {k: stats[k] for k in keep if k in stats}}


def run_all(rank: int, world: int, args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Every variant on this rank (ranks run the same sequence)."""
    teardown.install()  # the plain variant registers no hook (tagc/teardown.py)
    torch.set_num_threads(args.threads)
    task = Task(args)
    out = []
    for spec in args.variants:
        t0 = time.perf_counter()
        trace: List[Tuple[int, str, float]] = []

        def record(step: int, model: Any, state: Any) -> None:
            # the guard's pooled statistic of each unit's last call (the same on every rank)
            for u in state.units if state is not None else ():
                if u.last_guard_stat is not None:
                    trace.append((step + 1, u.name, u.last_guard_stat))

        r = train(spec, task, rank, world, on_step=record)
        r["guard_trace"] = trace
        r["seconds"] = time.perf_counter() - t0
        out.append(r)
        if rank == 0:
            print(f"{spec}: val loss {r['val'][-1][1]:.5f} ({r['seconds']:.0f} s) "
                  f"{r['stats']}", flush=True)
    return out


def launch(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Run every variant on ``args.nproc`` gloo ranks: under torchrun in this process,
    else in new processes (``run_dist``).  Returns rank 0's results (None on other
    ranks).

    Raises:
        SystemExit: a rank failed (its traceback in the message) or the launch ran
            past :data:`LAUNCH_TIMEOUT_S`.
    """
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
        try:
            res = run_all(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
        return res if int(os.environ["RANK"]) == 0 else None
    try:
        return run_dist(run_all, args.nproc, args, timeout=LAUNCH_TIMEOUT_S)[0]
    except AssertionError as exc:
        raise SystemExit(f"a rank failed: {exc}") from exc


def report(results: List[Dict[str, Any]], args: argparse.Namespace) -> str:
    """Write metrics.csv and summary.json; returns the markdown table."""
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "metrics.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["variant", "step", "train_loss", "val_loss"])
        for r in results:
            val = dict(r["val"])
            for step, loss in r["train"]:
                w.writerow([r["variant"], step, f"{loss:.6g}",
                            f"{val[step]:.6g}" if step in val else ""])
    with open(out / "guard.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["variant", "step", "unit", "guard_stat"])
        for r in results:
            w.writerows([r["variant"], *row[:2], f"{row[2]:.6g}"] for row in r["guard_trace"])
    base = results[0]["val"][-1][1]
    lines = [f"| variant | val loss at {args.steps} | vs {results[0]['variant']} | "
             "guard resets | wire ratio |", "|---|---|---|---|---|"]
    summary = []
    for r in results:
        v = r["val"][-1][1]
        pct = 100.0 * (v / base - 1.0)
        st = r["stats"]
        lines.append(f"| {r['variant']} | {v:.5f} | {pct:+.1f}% | "
                     f"{st.get('guard_resets', '-')} | "
                     f"{st['wire_ratio']:.3f} |" if st else
                     f"| {r['variant']} | {v:.5f} | {pct:+.1f}% | - | 1.000 |")
        summary.append({"variant": r["variant"], "val_loss": v, "vs_first_pct": pct,
                        "stats": st, "seconds": r["seconds"]})
    (out / "summary.json").write_text(json.dumps({"args": vars(args), "runs": summary},
                                                 indent=1) + "\n")
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("variants", nargs="+", help="plain | BASE[,field=value...]")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch", type=int, default=16, help="examples per rank and step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--d_in", type=int, default=32)
    p.add_argument("--d_out", type=int, default=8)
    p.add_argument("--width", type=int, default=256, help="student hidden width")
    p.add_argument("--depth", type=int, default=3, help="student hidden layers")
    p.add_argument("--teacher_width", type=int, default=64)
    p.add_argument("--noise", type=float, default=0.0,
                   help="std of Gaussian noise added to the training targets (unit "
                        "variance); validation uses the clean targets")
    p.add_argument("--min_numel", type=int, default=1024,
                   help="TAGC's min_numel for every variant (layers: all)")
    p.add_argument("--eval_every", type=int, default=10)
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn (not under torchrun)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--out_dir", default="out/teacher_student")
    args = p.parse_args(argv)
    for name in ("steps", "batch", "d_in", "d_out", "width", "depth", "teacher_width",
                 "eval_every", "nproc", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not args.lr > 0:
        p.error(f"--lr must be > 0, got {args.lr}")
    if not args.noise >= 0:
        p.error(f"--noise must be >= 0, got {args.noise}")
    for v in args.variants:
        parse_variant(v)  # fail before spawning
    return args


def main(argv: Optional[Sequence[str]] = None) -> Optional[List[Dict[str, Any]]]:
    """Parse, run every variant, print and write the results (rank 0)."""
    args = parse_args(argv)
    results = launch(args)
    if results is not None:
        print(report(results, args))
    return results


if __name__ == "__main__":
    main()
