"""What a run measures: gradient bytes per rank (GradBytes) and the metrics log
(metrics.csv, TensorBoard)."""
from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from typing import Any, Dict

logger = logging.getLogger(__name__)


class GradBytes:
    """Gradient bytes this rank sent since the run (or the resumed part) started.

    With TAGC: the hook's own counters (``state.stats()``): ``wire_bytes`` (what this
    rank sent on an ideal network), ``default_wire_bytes`` (what FSDP's ideal ring
    reduce-scatter would have sent for the same calls), unpeeled/recovered entries, and
    the compressed units' wire bits per gradient element.  Plain FSDP: the ideal ring
    reduce-scatter volume, (N-1)/N of the fp32 gradient per synced step (padding
    ignored), sent and "uncompressed" alike; native HSDP: the ring all-reduce of this
    rank's shard over the R replicas, 2(R-1)/R of it (the bytes between nodes), which
    is also the "uncompressed" figure of TAGC's local steps (``outer_every``: one
    compressed all-reduce a round against native HSDP's one a step).

    Args:
        state: the TAGCState, or None for plain FSDP.
        n_params: the model's parameters.
        world: ranks.
        replicas: HSDP replicas (1: FULL_SHARD over every rank).
    """

    def __init__(self, state: Any, n_params: int, world: int, replicas: int = 1) -> None:
        self.state = state
        if replicas > 1:
            shard = n_params * 4 / (world // replicas)
            self.plain_per_step = int(shard * 2 * (replicas - 1) / replicas)
        else:
            self.plain_per_step = int(n_params * 4 * (world - 1) / world)
        self.steps = 0
        self.start = self._totals() if state is not None else None
        self.sent = self.uncompressed = self.unpeeled = self.recovered = 0.0
        self.guard_resets = 0.0  # calls the feedback guard sent plainly (guard_ratio)
        self.gather_sent = self.gather_uncompressed = 0.0
        self.comp_bits = float("nan")  # wire bits per gradient element, compressed units

    def _totals(self) -> Dict[str, float]:
        st = self.state.stats()
        total, comp = st["total"], st["compressed_total"]
        elems = sum(u["numel"] * u["calls"] for u in st["units"].values() if u["compressed"])
        return {"sent": float(total["wire_bytes"]),
                "uncompressed": float(total["default_wire_bytes"]),
                "gather_sent": float(total["gather_wire_bytes"]),
                "gather_uncompressed": float(total["gather_default_wire_bytes"]),
                "unpeeled": float(total["unpeeled"]), "recovered": float(total["recovered"]),
                "guard_resets": float(total["guard_resets"]),
                "comp_sent": float(comp["wire_bytes"]), "comp_elems": float(elems)}

    def step(self) -> None:
        """Account one more optimizer step."""
        self.steps += 1
        if self.state is None:
            self.sent = self.uncompressed = float(self.plain_per_step * self.steps)
            return
        now, s0 = self._totals(), self.start
        self.sent = now["sent"] - s0["sent"]
        self.uncompressed = now["uncompressed"] - s0["uncompressed"]
        if getattr(self.state, "local", None) is not None:
            # local steps: the hook is called once a round, native HSDP every step
            self.uncompressed = float(self.plain_per_step * self.steps)
        self.unpeeled = now["unpeeled"] - s0["unpeeled"]
        self.recovered = now["recovered"] - s0["recovered"]
        self.guard_resets = now["guard_resets"] - s0["guard_resets"]
        self.gather_sent = now["gather_sent"] - s0["gather_sent"]
        self.gather_uncompressed = now["gather_uncompressed"] - s0["gather_uncompressed"]
        elems = now["comp_elems"] - s0["comp_elems"]
        if elems:
            self.comp_bits = 8 * (now["comp_sent"] - s0["comp_sent"]) / elems

    @property
    def saved_pct(self) -> float:
        return 100.0 * (1 - self.sent / self.uncompressed) if self.uncompressed else 0.0

    def line(self) -> str:
        """``sent X of Y uncompressed (Z% saved)`` for the log (and the parameter
        gathers' when TAGC quantizes them)."""
        out = (f"sent {_fmt_bytes(self.sent)} of {_fmt_bytes(self.uncompressed)} "
               f"uncompressed ({self.saved_pct:.1f}% saved)")
        if self.gather_sent != self.gather_uncompressed:
            pct = 100.0 * (1 - self.gather_sent / self.gather_uncompressed)
            out += (f"; param gathers {_fmt_bytes(self.gather_sent)} of "
                    f"{_fmt_bytes(self.gather_uncompressed)} ({pct:.1f}% saved)")
        return out


class MetricsLog:
    """CSV (always) and TensorBoard (if installed) metrics, written by rank 0 only."""

    # elapsed_s: wall time since the loop started (evaluations included); train_s: the
    # training steps' time alone (what a time-to-loss comparison should add up)
    FIELDS = ["kind", "iter", "loss", "lr", "step_ms", "tokens_per_s", "bytes_sent",
              "bytes_uncompressed", "unpeeled", "elapsed_s", "train_s"]

    def __init__(self, out_dir: Path, enabled: bool, tensorboard: bool, resume: bool) -> None:
        self.enabled = enabled
        self.tb = None
        if not enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / "metrics.csv"
        append = resume and path.exists()
        self.f = open(path, "a" if append else "w", newline="")
        self.w = csv.DictWriter(self.f, fieldnames=self.FIELDS)
        if not append:
            self.w.writeheader()
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(log_dir=str(out_dir / "tb"))
            except ImportError:
                logger.warning("TensorBoard logging skipped: `pip install tensorboard` "
                               "to enable it")

    def write(self, **row: Any) -> None:
        """Append one row (missing fields stay empty) and mirror numbers to TensorBoard."""
        if not self.enabled:
            return
        self.w.writerow(row)
        self.f.flush()
        if self.tb is not None:
            for key in ("loss", "lr", "step_ms", "tokens_per_s", "bytes_sent"):
                if row.get(key) is not None:
                    self.tb.add_scalar(f"{row['kind']}/{key}", row[key], row["iter"])

    def close(self) -> None:
        if self.enabled:
            self.f.close()
            if self.tb is not None:
                self.tb.close()


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1000
    return f"{n:.1f} GB"


def finish(env: Any, out_dir: Path, summary: Dict[str, Any], metrics: MetricsLog
           ) -> Dict[str, Any]:
    """The end of a run: ``summary.json`` (rank 0), the metrics closed, the process
    group destroyed if the run made it (``env``: :class:`tagc.train.loop.Env`);
    returns the summary."""
    import torch.distributed as dist

    if env.master:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    metrics.close()
    if env.own_pg:
        dist.destroy_process_group()
    return summary
