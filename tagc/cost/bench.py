"""The step benchmark's rows in the cost model: predictions made before a run, and the
comparison with the run once it exists (the predictions are committed first).

:func:`predict_rows` predicts every row (``tagc.cost.rows``) at every link rate of a
run from what may be measured before it: each rate's collective table and link
(``scripts/bench/bench_collectives.py``) and one unshaped step of plain FSDP on the
model (``bench_step.py --rate none --no-unshaped --configs fsdp``), which gives the
compute time (that step minus the communication the model predicts on the unshaped
link).  Every row then takes that compute time, whatever its precision: the model has
no figure for bf16 compute on this CPU.  :func:`compare` puts a ``bench_step.py`` report
beside the predictions, per row and rate: the step, the bytes by the ideal count at the
call, the veth's bytes and the exposed communication (shaped - unshaped step).
:func:`run_estimate_s` is the wall time of a planned run by the same predictions.
"""
from __future__ import annotations

import re
import statistics
from dataclasses import asdict, replace
from typing import Any, Dict, List, Optional, Sequence

from tagc.cost.shapes import BENCH_MODELS

from .check import TCP_FRAME_OVERHEAD, CheckRow, _pct, _setup_cluster
from .configs import row_config
from .layouts import ModelSpec
from .links import Cluster, CollectiveRates
from .predict import predict

# bench_step.py's rate of the unshaped pass (``--rate none``, netem.sh's word)
UNSHAPED = "none"

# the quantities compared per row and rate, with the decimals a count is exact at (None:
# a time or the veth's bytes, compared by their error)
QUANTITIES = {"step_s": None, "call_mb": 2, "veth_tx_mb": None, "exposed_s": None}

_MBIT = re.compile(r"measured ([0-9.]+) Mbit/s")


def measured_mbit(text: str) -> float:
    """The rate ``netem.sh measure`` printed (as ``bench_collectives.py`` and
    ``bench_step.py`` record it).

    Args:
        text: its line.
    Returns:
        Mbit/s.
    Raises:
        ValueError: no measurement in the text.
    """
    m = _MBIT.search(text or "")
    if m is None:
        raise ValueError(f"no 'measured N Mbit/s' in {text!r}")
    return float(m.group(1))


def rate_cluster(nodes: int, link: Dict[str, Any], source: str) -> Cluster:
    """The cluster of one link rate of a run: one rank per emulated host, gloo, the link
    as measured and its collective table (a ``bench_collectives.py`` output).

    Args:
        nodes: emulated hosts.
        link: the ``bench_collectives.py`` output (its ``link_measured`` and table).
        source: where it is (printed with predictions).
    Returns:
        the cluster, as ``--check`` builds a runs-file setup's.
    """
    setup = {"ranks_per_node": 1, "nodes": nodes}
    return _setup_cluster(setup, measured_mbit(link["link_measured"]),
                          collectives=CollectiveRates.from_report(link, source))


def plain_step_s(report: Dict[str, Any]) -> float:
    """The median step of plain FSDP in a ``bench_step.py`` run at ``--rate none``.

    Args:
        report: its ``results.json``.
    Returns:
        seconds.
    Raises:
        ValueError: not an unshaped run with an ``fsdp`` row.
    """
    if report["args"].get("rate") != UNSHAPED:
        raise ValueError(f"the plain step must come from an unshaped run (--rate {UNSHAPED}), "
                         f"not {report['args'].get('rate')!r}")
    med = _median(report["shaped"], "fsdp")
    if med is None:
        raise ValueError("the run has no fsdp row")
    return med


def predict_rows(model: ModelSpec, rows: Sequence[str], clusters: Dict[str, Cluster],
                 plain_s: float, codec: Optional[Dict[str, float]] = None, fsdp: int = 2,
                 worker: bool = False) -> Dict[str, Any]:
    """Every row at every rate, from one unshaped plain step.

    Args:
        model: the layout.
        rows: names of ``tagc.cost.rows.ROWS``.
        clusters: rate -> its cluster (:func:`rate_cluster`); :data:`UNSHAPED` among them.
        plain_s: plain FSDP's measured step on the unshaped link.
        codec: codec throughputs (default: this machine's).
        fsdp: 1 or 2.
        worker: TAGC's rows run their collectives on its FSDP2 worker (``fsdp_overlap``,
            the default; ``Cluster.worker``); False: one after another on the model
            thread (``--override fsdp_overlap=false``). Plain FSDP's rows block either way.
    Returns:
        ``{"compute_s": ..., "rows": {row: {rate: {step_s, comm_s, codec_s, call_mb,
        call_mb_by_kind, veth_tx_mb, exposed_s}}}}``.
    Raises:
        ValueError: no unshaped rate, or a plain step shorter than its communication.
    """
    if UNSHAPED not in clusters:
        raise ValueError(f"the unshaped rate ({UNSHAPED!r}) is needed: the compute time is "
                         "the plain step there minus its communication")
    comm = predict(model, clusters[UNSHAPED], row_config("fsdp", fsdp=fsdp), 0.0, codec).step_s
    compute = plain_s - comm
    if compute <= 0:
        raise ValueError(f"the plain step ({plain_s:.3f} s) is not longer than the "
                         f"communication predicted on the unshaped link ({comm:.3f} s)")
    timed = {rate: replace(cl, worker=worker) for rate, cl in clusters.items()}
    out: Dict[str, Any] = {}
    for name in rows:
        cfg = row_config(name, fsdp=fsdp)
        by_rate = {}
        for rate, cl in timed.items():
            p = predict(model, cl, cfg, compute, codec)
            by_rate[rate] = {"step_s": p.step_s, "comm_s": p.comm_s, "codec_s": p.codec_s,
                             "call_mb": p.ideal_bytes_per_rank / 1e6,
                             "call_mb_by_kind": {k: v / 1e6 for k, v in p.ideal.items()},
                             "veth_tx_mb": p.node_inter * TCP_FRAME_OVERHEAD / 1e6}
        for rate, r in by_rate.items():
            r["exposed_s"] = r["step_s"] - by_rate[UNSHAPED]["step_s"]
        out[name] = by_rate
    return {"compute_s": compute, "unshaped_comm_s": comm, "rows": out}


def run_estimate_s(pred: Dict[str, Any], plan: Dict[str, Any]) -> float:
    """Wall time of a planned ``bench_step.py`` run by the predictions: every trial's
    warm-up and timed steps at its predicted step, plus its build (the model made,
    sharded and registered, counted as one step of compute: an assumption, not a
    measurement); the network's set-up and the processes' start are left out.

    Args:
        pred: the predictions file.
        plan: ``rates``, ``configs``, ``warmup``, ``steps``, ``repeats``,
            ``unshaped_repeats``, ``unshaped_configs`` (``bench_step.py``'s ``_plan``).
    Returns:
        seconds.
    Raises:
        ValueError: a planned row or rate the predictions lack.
    """
    rows, build = pred["rows"], pred["compute_s"]
    passes = [(rate, plan["configs"], plan["repeats"]) for rate in plan["rates"]]
    passes.append((UNSHAPED, plan["unshaped_configs"], plan["unshaped_repeats"]))
    total = 0.0
    for rate, configs, repeats in passes:
        for c in configs:
            if c not in rows or rate not in rows[c]:
                raise ValueError(f"no prediction of {c} at {rate}")
            total += repeats * (build + (plan["warmup"] + plan["steps"]) * rows[c][rate]["step_s"])
    return total


def estimate_text(pred: Dict[str, Any], plan: Dict[str, Any]) -> str:
    """One line: the run's estimated wall time (:func:`run_estimate_s`).

    Args:
        pred: the predictions file.
        plan: the planned run.
    Returns:
        the line.
    """
    s = run_estimate_s(pred, plan)
    return (f"estimated wall time {s / 60:.0f} min ({s:.0f} s: {len(plan['rates'])} shaped "
            f"rate(s) x {len(plan['configs'])} rows x {plan['repeats']} repeats, "
            f"{plan['unshaped_repeats']} unshaped, {plan['warmup']} warm-up + {plan['steps']} "
            "timed steps per trial, by the cost model's predictions; start-up not counted)")


def _median(run: Optional[Dict[str, Any]], config: str) -> Optional[float]:
    """Median over every timed step of a configuration's trials in a run."""
    steps = [s for t in (run or {}).get("trials", []) if t["config"] == config
             for s in t["step_s"]]
    return statistics.median(steps) if steps else None


def _mean(run: Optional[Dict[str, Any]], config: str, key: str) -> Optional[float]:
    """Mean of a per-trial figure over a configuration's trials."""
    vals = [t[key] for t in (run or {}).get("trials", [])
            if t["config"] == config and t.get(key) is not None]
    return sum(vals) / len(vals) if vals else None


def measured_rows(reports: Sequence[Dict[str, Any]]) -> Dict[str, Dict[str, Dict[str, float]]]:
    """What ``bench_step.py`` reports measured, as :func:`compare` reads it.

    Args:
        reports: ``results.json`` of each rate (a multi-rate run's folders; the
            unshaped pass, the same in each, is read from any).
    Returns:
        ``{row: {rate: {quantity: value}}}`` (quantities of :data:`QUANTITIES`; MB).
    """
    out: Dict[str, Dict[str, Dict[str, float]]] = {}
    for rep in reports:
        runs = [(rep["args"]["rate"], rep.get("shaped"))]
        if rep.get("unshaped"):
            runs.append((UNSHAPED, rep["unshaped"]))
        for rate, run in runs:
            for c in dict.fromkeys(t["config"] for t in run["trials"]):
                med = _median(run, c)
                unshaped = _median(rep.get("unshaped"), c)
                call = _mean(run, c, "call_tx_per_step_per_rank")
                veth = _mean(run, c, "veth_tx_per_step_per_host")
                got = {"step_s": med, "call_mb": None if call is None else call / 1e6,
                       "veth_tx_mb": None if veth is None else veth / 1e6,
                       "exposed_s": None if med is None or unshaped is None else med - unshaped}
                out.setdefault(c, {})[rate] = {k: v for k, v in got.items() if v is not None}
    return out


def compare(pred: Dict[str, Any], reports: Sequence[Dict[str, Any]]) -> List[CheckRow]:
    """The predictions against a run, per row, rate and quantity measured.

    Args:
        pred: the predictions file.
        reports: the run's ``results.json`` (:func:`measured_rows`).
    Returns:
        one :class:`CheckRow` per compared number (setup = the rate).
    Raises:
        ValueError: a report of another model than the predicted benchmark model's.
    """
    if "bench_model" in pred:
        want = asdict(BENCH_MODELS[pred["bench_model"]].shape)
        other = [r["shape"] for r in reports if r.get("shape") != want]
        if other:
            raise ValueError(f"the predictions are of {pred['bench_model']} ({want}); the run "
                             f"measured {other[0]}")
    meas = measured_rows(reports)
    out = []
    for row, by_rate in pred["rows"].items():
        for rate, p in by_rate.items():
            m = meas.get(row, {}).get(rate, {})
            for q, dec in QUANTITIES.items():
                if q in m:
                    out.append(CheckRow(rate, row, q, p[q], m[q], dec))
    return out


def compare_report(rows: List[CheckRow], tolerance: float) -> str:
    """The comparison as a markdown table per row and rate, and what holds.

    Args:
        rows: :func:`compare`'s result.
        tolerance: the step-time goal (0.2: within 20%).
    Returns:
        the text.
    """
    by = {(r.setup, r.config, r.quantity): r for r in rows}
    pairs = list(dict.fromkeys((r.config, r.setup) for r in rows))

    def cell(row: str, rate: str, q: str, fmt: str) -> str:
        r = by.get((rate, row, q))
        return "-" if r is None else (f"{r.predicted:{fmt}} / {r.measured:{fmt}} "
                                      f"({_pct(r.error)})")

    out = ["| row | rate | step s pred / meas (error) | at the call MB/rank pred / meas | "
           "veth tx MB/host pred / meas | exposed comm s pred / meas |", "|---|---|---|---|---|---|"]
    for row, rate in pairs:
        out.append(f"| {row} | {rate} | {cell(row, rate, 'step_s', '.3f')} | "
                   f"{cell(row, rate, 'call_mb', '.2f')} | {cell(row, rate, 'veth_tx_mb', '.2f')} | "
                   f"{cell(row, rate, 'exposed_s', '.3f')} |")
    steps = [r for r in rows if r.quantity == "step_s"]
    calls = [r for r in rows if r.quantity == "call_mb"]
    veth = [r for r in rows if r.quantity == "veth_tx_mb"]
    worst = max(steps, key=lambda r: abs(r.error), default=None)
    out += ["", f"- step time within {tolerance:.0%}: "
            f"{sum(abs(r.error) <= tolerance for r in steps)} of {len(steps)}"
            + (f" (worst {worst.config} at {worst.setup}: {_pct(worst.error)})" if worst else ""),
            f"- bytes at the call exact (two decimals of MB): {sum(r.exact for r in calls)} of "
            f"{len(calls)}",
            f"- veth bytes within 1%: {sum(abs(r.error) <= 0.01 for r in veth)} of {len(veth)}"]
    return "\n".join(out)


def runs_entries(pred: Dict[str, Any], pred_path: str, reports: Dict[str, Dict[str, Any]],
                 tables: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """A run of the predicted rows as entries of the check set (``docs/cost_model_runs.json``):
    a setup per rate (the unshaped one too), its rows, and the link tables they name.

    A setup's compute is the predictions' own input (the unshaped plain step, timed on
    the unshaped link's table), so ``--check`` predicts each row as the predictions did,
    with the model as it is then; its numbers are the run's, to the precision
    ``--check`` compares them at.

    Args:
        pred: the predictions file.
        pred_path: where it is (named in each setup).
        reports: the run's ``results.json`` by path.
        tables: the predictions' link tables by their path (``inputs.links.*.table``).
    Returns:
        ``{"links": {...}, "setups": {...}, "runs": [...]}`` to merge into a runs file.
    """
    inp = pred["inputs"]
    link_name = {rate: f"{rate}-{v['table'].split('/')[-2]}" for rate, v in inp["links"].items()}
    out: Dict[str, Any] = {"links": {link_name[r]: {**tables[v["table"]], "report": v["table"]}
                                     for r, v in inp["links"].items()},
                           "setups": {}, "runs": []}
    for path, rep in reports.items():
        runs = [(rep["args"]["rate"], rep.get("shaped"), rep.get("link_shaped"))]
        if rep.get("unshaped") and not any(s.endswith(f"-{UNSHAPED}") for s in out["setups"]):
            runs.append((UNSHAPED, rep["unshaped"], rep.get("link_unshaped")))
        stamp = re.sub(r"\D", "", rep.get("started_utc", ""))[:12]
        for rate, run, link_line in runs:
            name = f"{pred['bench_model']}-{stamp}-{rate}"
            out["setups"][name] = {
                "section": f"{path.rsplit('/', 1)[0]}/report.md '## FULL_SHARD' table"
                           + (" (its unshaped s column)" if rate == UNSHAPED else ""),
                "command": rep.get("command"), "date": f"{rep.get('started_utc')} UTC, load "
                f"{rep.get('loadavg_start')} -> {rep.get('loadavg_end')} (its report)",
                "model": pred["layout"], "fsdp": pred["fsdp"], "layout": "fsdp", "dtype": "fp32",
                "ranks_per_node": 1, "nodes": pred["nodes"], "inter_mbit": measured_mbit(link_line),
                "inter_source": f"{link_line} (its report)",
                "compute": {"plain_fast_step_s": inp["plain_step"]["step_s"],
                            "fast_mbit": inp["links"][UNSHAPED]["inter_mbit"],
                            "fast_collectives": link_name[UNSHAPED],
                            "source": f"the predictions' input ({pred_path}): the unshaped plain "
                                      f"step of {inp['plain_step']['report']}"},
                "collectives": link_name[rate], "report": path.rsplit("/", 1)[0] + "/report.md"}
            if pred.get("worker"):  # TAGC's rows ran on its FSDP2 worker (Cluster.worker)
                out["setups"][name]["worker"] = True
            for c in dict.fromkeys(t["config"] for t in run["trials"]):
                row = {"setup": name, "config": c, "step_s": round(_median(run, c), 3)}
                for key, field in (("call_mb", "call_tx_per_step_per_rank"),
                                   ("gathers_mb", "gather_tx_per_step_per_host"),
                                   ("veth_tx_mb", "veth_tx_per_step_per_host")):
                    v = _mean(run, c, field)
                    if v is not None:
                        row[key] = round(v / 1e6, 2)
                wire = [t["stats_delta_per_step"].get("total", {}).get("wire_bytes")
                        for t in run["trials"] if t["config"] == c]
                if wire and None not in wire:
                    row["stats_wire_mb"] = round(sum(wire) / len(wire) / 1e6, 2)
                out["runs"].append(row)
    return out
