"""The cost model against measured runs (``--check``): bytes and step times.

A runs file (``docs/cost_model_runs.json``) holds setups (the topology, link, model
layout and compute time of a measured run) and rows (what a configuration measured on
it: the step time, and bytes counted where they are measured: ``stats_wire_mb``,
``gathers_mb`` and ``call_mb`` (every collective) at the ``torch.distributed`` call, by
the hook's counters and the step benchmark's wrapper around the collectives,
``veth_tx_mb`` by the emulated link's own counter).  :func:`check` predicts each row from first principles (and calibrated on
the setup's plain row); :func:`check_report` tabulates both.

Every number checked is in a report committed in the repository (each setup's
``report``).  A setup whose compute time is not has no ``compute``: its bytes are
checked, its step times are not; a measured field no committed report holds sits in
its row's ``untraceable`` entry, and rows with nothing left to check sit in the file's
``untraceable`` section: neither is checked nor counted.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from tagc.cost.rows import ROWS

from .configs import Compression, Config, make_config, row_config
from .layouts import RUN_MODELS, ModelSpec, run_model
from .links import Cluster, CollectiveRates
from .predict import predict

# TCP/IPv4 over Ethernet with the MTU of 1500 the emulated veth uses: a full segment
# carries 1448 payload bytes (1500 - 20 IP - 20 TCP - 12 timestamp option) in a
# 1514-byte frame (14 Ethernet header).  Only used to turn payload bytes into the
# veth's own counters in --check; the step-time model works on payload bytes and the
# measured payload rate (netem.sh `measure`, a TCP transfer).
TCP_FRAME_OVERHEAD = 1514 / 1448

# A row's measured fields (``step_s`` is checked only where the setup has ``compute``).
MEASURED = ("step_s", "stats_wire_mb", "gathers_mb", "call_mb", "veth_tx_mb",
            "in_collectives_s", "codec_s")
# the byte quantities: exact ones at the call (two decimals of MB), the veth's within 1%
BYTE_QUANTITIES = ("stats_wire_mb", "gathers_mb", "call_mb", "veth_tx_mb")


@dataclass
class CheckRow:
    """One compared quantity.

    Attributes:
        setup: the runs file's setup (or bits section).
        config: configuration or label.
        quantity: what is compared.
        predicted: the model's value.
        measured: the runs file's value.
        decimals: decimals the measurement was printed with (bytes: exact means equal
            at that precision); None for times.
        calibrated: the prediction with the setup's ``calibrate`` figure fitted to its
            plain row (times only).
        calibration_row: the plain row the fit used (its calibrated error is 0 by
            construction).
        fit: (figure, value) the calibration fitted for the row's setup.
    """

    setup: str
    config: str
    quantity: str
    predicted: float
    measured: float
    decimals: Optional[int] = None
    calibrated: Optional[float] = None
    calibration_row: bool = False
    fit: Optional[Tuple[str, float]] = None

    @property
    def error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.predicted - self.measured) / self.measured if self.measured else \
            (0.0 if self.predicted == 0 else math.inf)

    @property
    def exact(self) -> bool:
        """Equal at the printed precision (bytes)."""
        if self.decimals is None:
            return False
        return abs(self.predicted - self.measured) <= 0.5 * 10 ** -self.decimals + 1e-12

    @property
    def calibrated_error(self) -> Optional[float]:
        """Error of the calibrated prediction."""
        if self.calibrated is None:
            return None
        return (self.calibrated - self.measured) / self.measured


def load_runs(path: str) -> Dict[str, Any]:
    """Read and validate a runs file (``docs/cost_model_runs.json``'s format).

    Args:
        path: the file.
    Returns:
        the parsed file.
    Raises:
        ValueError: a field missing or of the wrong kind, naming it.
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"runs file {path}: {e}") from e
    if not isinstance(data, dict) or not isinstance(data.get("setups"), dict) \
            or not isinstance(data.get("runs"), list):
        raise ValueError(f"runs file {path}: needs a 'setups' object and a 'runs' list")
    for name, st in data["setups"].items():
        for k in ("model", "fsdp", "layout", "dtype", "ranks_per_node", "nodes", "inter_mbit",
                  "report"):
            if k not in st:
                raise ValueError(f"runs file {path}: setup {name!r} lacks {k!r}")
        if st["model"] not in RUN_MODELS:
            raise ValueError(f"runs file {path}: setup {name!r}: unknown model "
                             f"{st['model']!r}; known: {sorted(RUN_MODELS)}")
        block = st.get("quant_block")  # absent: each preset's block as the model has it
        if "quant_block" in st and (not isinstance(block, int) or isinstance(block, bool)
                                    or not 1 <= block <= 65536):
            raise ValueError(f"runs file {path}: setup {name!r}: quant_block must be an int "
                             f"in 1..65536, got {block!r}")
        c = st.get("compute", {"rest_s": None})  # none: its step times are not checked
        if "rest_s" not in c and not ("plain_fast_step_s" in c and "fast_mbit" in c):
            raise ValueError(f"runs file {path}: setup {name!r}: compute needs rest_s, or "
                             "plain_fast_step_s and fast_mbit")
    links = data.get("links", {})
    if not isinstance(links, dict):
        raise ValueError(f"runs file {path}: 'links' must map names to bench_collectives.py "
                         "outputs")
    for lname, rep in links.items():
        try:
            CollectiveRates.from_report(rep, lname)
        except (ValueError, TypeError) as e:
            raise ValueError(f"runs file {path}: link table {lname!r}: {e}") from e
    for name, st in data["setups"].items():
        for table in (st.get("collectives"), st.get("compute", {}).get("fast_collectives")):
            if table is not None and table not in links:
                raise ValueError(f"runs file {path}: setup {name!r} names unknown link table "
                                 f"{table!r}")
    for i, run in enumerate(data["runs"]):
        if run.get("setup") not in data["setups"]:
            raise ValueError(f"runs file {path}: run {i} names unknown setup {run.get('setup')!r}")
        if "config" not in run or not any(k in run for k in MEASURED):
            raise ValueError(f"runs file {path}: run {i} needs 'config' and a measured field "
                             f"({', '.join(MEASURED)})")
    untraceable = data.get("untraceable", {"runs": []})
    if not isinstance(untraceable, dict) or not isinstance(untraceable.get("runs"), list):
        raise ValueError(f"runs file {path}: 'untraceable' needs a 'runs' list")
    for sec in data.get("bits_per_param", []):
        if sec.get("model") not in RUN_MODELS or sec.get("kind") not in ("grad", "gather") \
                or not isinstance(sec.get("rows"), list):
            raise ValueError(f"runs file {path}: a bits_per_param section needs a known "
                             "model, kind grad|gather and rows")
    return data


def _setup_cluster(st: Dict[str, Any], inter_mbit: float, intra_mbit: Optional[float] = None,
                   efficiency: float = 1.0, collectives: Optional[CollectiveRates] = None
                   ) -> Cluster:
    """The cluster of a runs-file setup (gloo), at ``inter_mbit`` between nodes."""
    n = st["ranks_per_node"]
    intra = intra_mbit if intra_mbit is not None else st.get("intra_mbit")
    if intra is None:
        if n > 1:
            raise ValueError("a setup with several ranks per node needs intra_mbit")
        intra = inter_mbit  # unused: no intra-node link with one rank per node
    # Latency: scripts/bench/bench_step.py's --delay default (0.1 ms), which this kernel's
    # tbf does not apply (no sch_netem, DESIGN section 10): an upper bound, a few ms per
    # step.
    return Cluster(n, st["nodes"], intra / 1000, inter_mbit / 1000, 1e-4, 1e-4,
                   backend="gloo", link_efficiency=efficiency, collectives=collectives,
                   pair_gather=st.get("pair_gather", True),
                   ring_exchange=st.get("ring_exchange", True),
                   worker=st.get("worker", False))


def _run_config(st: Dict[str, Any], name: str) -> Config:
    """A runs-file row's configuration: ``fsdp`` is the setup's plain layout; on
    FULL_SHARD a step benchmark row (``tagc.cost.rows``: ``fsdp-bf16``,
    ``full-noreshard``, ...) as the benchmark ran it; a setup's ``quant_block`` is the
    presets' block when it ran."""
    if st["layout"] != "hsdp" and name in ROWS:
        cfg = row_config(name, st["dtype"], st["fsdp"])
    else:
        layout = "hsdp" if st["layout"] == "hsdp" else "fsdp"
        full = layout if name == "fsdp" else f"{layout}+{name}"
        cfg = make_config(full, st["dtype"], st["fsdp"])
    if "quant_block" in st and cfg.tagc is not None:
        cfg = replace(cfg, tagc=replace(cfg.tagc, quant_block=st["quant_block"]))
    return cfg


def _setup_state(st: Dict[str, Any], model: ModelSpec, codec: Optional[Dict[str, float]],
                 efficiency: float = 1.0, intra_mbit: Optional[float] = None,
                 collectives: Optional[CollectiveRates] = None,
                 fast_rates: Optional[CollectiveRates] = None) -> Tuple[Cluster, float]:
    """(cluster, compute seconds) of a setup.

    Compute is the plain row's time outside collectives (``rest_s``), or the plain
    step on the fast link minus the communication predicted there (from the fast
    link's own measured collective rates where the setup names them,
    ``fast_collectives``, else from its bandwidth alone).
    """
    cl = _setup_cluster(st, st["inter_mbit"], intra_mbit, efficiency, collectives)
    c = st["compute"]
    if "rest_s" in c:
        return cl, float(c["rest_s"])
    fast = _setup_cluster(st, c["fast_mbit"], intra_mbit, efficiency, fast_rates)
    fast = replace(fast, intra_gbit=max(fast.intra_gbit, c["fast_mbit"] / 1000))
    comm = predict(model, fast, _run_config(st, "fsdp"), 0.0, codec).comm_s
    return cl, c["plain_fast_step_s"] - comm


# The figure a setup may fit to its plain row: (search range, keyword of _setup_state).
CALIBRATABLE = {"link_efficiency": ((0.05, 1.0), "efficiency"),
                "intra_mbit": ((10.0, 1e6), "intra_mbit")}


def calibrate(st: Dict[str, Any], model: ModelSpec, codec: Optional[Dict[str, float]],
              measured_plain_s: float, collectives: Optional[CollectiveRates] = None,
              fast_rates: Optional[CollectiveRates] = None) -> Optional[Tuple[str, float]]:
    """Fit the setup's ``calibrate`` figure so the plain row's step time is matched.

    The predicted plain step falls as the figure grows (more efficiency, a faster
    link), so a bisection finds it; at a bound of the range the bound is kept.

    Args:
        st: the setup (``calibrate``: ``link_efficiency``, the default, or
            ``intra_mbit``).
        model: its model.
        codec: codec throughputs.
        measured_plain_s: the plain row's measured step time.
        collectives: the setup's measured collective rates, if any.
        fast_rates: those of its fast link (``compute.fast_collectives``), if any.
    Returns:
        (figure, fitted value), or None when the setup has no plain row.
    """
    name = st.get("calibrate", "link_efficiency")
    if name not in CALIBRATABLE:
        raise ValueError(f"calibrate: one of {sorted(CALIBRATABLE)}, got {name!r}")
    (lo, hi), kw = CALIBRATABLE[name]
    plain = _run_config(st, "fsdp")

    def step(x: float) -> float:
        """The predicted plain step at figure value x."""
        cl, compute = _setup_state(st, model, codec, collectives=collectives,
                                   fast_rates=fast_rates, **{kw: x})
        if compute < 0:  # so slow a link that the fast-link step holds no compute
            return math.inf
        return predict(model, cl, plain, compute, codec).step_s

    if step(hi) >= measured_plain_s:
        return name, hi
    if step(lo) <= measured_plain_s:
        return name, lo
    for _ in range(100):
        mid = math.sqrt(lo * hi)  # geometric: the range spans decades
        lo, hi = (mid, hi) if step(mid) > measured_plain_s else (lo, mid)
    return name, math.sqrt(lo * hi)


def check(data: Dict[str, Any], codec: Optional[Dict[str, float]] = None) -> List[CheckRow]:
    """Predictions against every measured number of a runs file.

    Step time, first principles: the setup's links as given, compute from the setup
    (:func:`_setup_state`).  Calibrated: the setup's ``calibrate`` figure fitted to its
    plain row (:func:`calibrate`), the other rows predicted with it.  A setup without
    ``compute`` has its bytes checked only; the ``untraceable`` section is not read.

    Args:
        data: :func:`load_runs`'s result.
        codec: codec throughputs (default: this machine's, where the runs ran).
    Returns:
        one row per compared quantity.
    """
    rows: List[CheckRow] = []
    links = {k: CollectiveRates.from_report(v, k) for k, v in data.get("links", {}).items()}
    for name, st in data["setups"].items():
        model = run_model(st["model"])
        coll = links[st["collectives"]] if "collectives" in st else None
        timed = "compute" in st
        fast = links.get(st.get("compute", {}).get("fast_collectives", ""))
        if timed:
            cl, compute = _setup_state(st, model, codec, collectives=coll, fast_rates=fast)
        else:  # bytes only: they do not depend on the compute time
            cl, compute = _setup_cluster(st, st["inter_mbit"], collectives=coll), 0.0
        runs = [r for r in data["runs"] if r["setup"] == name]
        meas_plain = next((r["step_s"] for r in runs if r["config"] == "fsdp" and "step_s" in r),
                          None) if timed else None
        fit = calibrate(st, model, codec, meas_plain, coll, fast) if meas_plain else None
        cal = _setup_state(st, model, codec, collectives=coll, fast_rates=fast,
                           **{CALIBRATABLE[fit[0]][1]: fit[1]}) if fit else None
        for run in runs:
            cfg = _run_config(st, run["config"])
            p = predict(model, cl, cfg, compute, codec)
            hook = (p.ideal.get("cross", 0.0) if cfg.layout == "hsdp" else
                    p.ideal.get("grad", 0.0)) + p.ideal.get("control", 0.0)
            label = cfg.name
            for key, pred, dec in (("stats_wire_mb", hook / 1e6, 2),
                                   ("gathers_mb", p.ideal.get("gather", 0.0) / 1e6, 2),
                                   ("call_mb", p.ideal_bytes_per_rank / 1e6, 2),
                                   ("veth_tx_mb", p.node_inter * TCP_FRAME_OVERHEAD / 1e6, None)):
                if key in run:
                    rows.append(CheckRow(name, label, key, pred, run[key], dec))
            if not (timed and "step_s" in run):
                continue
            pc = predict(model, cal[0], cfg, cal[1], codec).step_s if cal else None
            rows.append(CheckRow(name, label, "step_s", p.step_s, run["step_s"], None, pc,
                                 run["config"] == "fsdp", fit))
            if "in_collectives_s" in run:
                rows.append(CheckRow(name, label, "in_collectives_s", p.comm_s,
                                     run["in_collectives_s"]))
            if "codec_s" in run:
                rows.append(CheckRow(name, label, "codec_s", p.codec_s, run["codec_s"]))
    for sec in data.get("bits_per_param", []):
        model = run_model(sec["model"])
        dec = int(sec.get("decimals", 2))
        for row in sec["rows"]:
            comp = Compression(**row["compression"]) if row["compression"] else None
            cfg = Config(row["label"], "full_shard", comp, fsdp=sec["fsdp"])
            cl = Cluster(row["n"], 1, 1.0, 1.0)
            if sec["kind"] == "grad":  # the compressed units only, as the hook counts them
                units = tuple(u for u in model.units if u.compressed)
                p = predict(ModelSpec(model.name, units), cl, cfg)
                b = p.ideal.get("grad", 0.0) + p.ideal.get("control", 0.0)
                params = sum(u.numel for u in units)
            else:
                p = predict(model, cl, cfg)
                b, params = p.ideal.get("gather", 0.0), model.params
            rows.append(CheckRow(sec["section"].lstrip("# "), row["label"],
                                 f"bits/param N={row['n']}", 8 * b / params, row["bits"], dec))
    return rows


def _pct(x: Optional[float]) -> str:
    """A signed percentage, or "-"."""
    return "-" if x is None else f"{100 * x:+.1f}%"


def check_report(rows: List[CheckRow], tolerance: float = 0.25,
                 data: Optional[Dict[str, Any]] = None) -> str:
    """The --check tables (markdown) and a summary of what holds.

    Args:
        rows: :func:`check`'s result.
        tolerance: the step-time goal (0.25: within 25%).
        data: the runs file; given, the summary also says what it holds unchecked.
    Returns:
        the text.
    """
    out = ["**bytes: predicted vs measured** (exact = equal at the printed precision; "
           "veth = the link's counter, TCP/IP framing added as 1514/1448)", "",
           "| setup | config | quantity | predicted | measured | error | match |",
           "|---|---|---|---|---|---|---|"]
    byte_rows = [r for r in rows if r.quantity in BYTE_QUANTITIES
                 or r.quantity.startswith("bits/param")]
    for r in byte_rows:
        match = ("exact" if r.exact else "NOT exact") if r.decimals is not None else \
            ("within 1%" if abs(r.error) <= 0.01 else "off by more than 1%")
        dec = 3 if r.decimals is None else max(r.decimals, 2) + 1
        out.append(f"| {r.setup} | {r.config} | {r.quantity} | {r.predicted:.{dec}f} | "
                   f"{r.measured:g} | {_pct(r.error)} | {match} |")
    out += ["", "**step time: predicted vs measured** (first principles; calibrated = the "
            "setup's one unmeasured figure fitted to its plain row, marked *)", "",
            "| setup | config | measured s | predicted s | error | calibrated s | error | "
            "in collectives pred / meas s | codec pred / meas s |",
            "|---|---|---|---|---|---|---|---|---|"]
    by_key = {(r.setup, r.config, r.quantity): r for r in rows}
    time_rows = [r for r in rows if r.quantity == "step_s"]
    for r in time_rows:
        coll = by_key.get((r.setup, r.config, "in_collectives_s"))
        cod = by_key.get((r.setup, r.config, "codec_s"))
        cal = "-" if r.calibrated is None else f"{r.calibrated:.3f}" + ("*" if r.calibration_row
                                                                       else "")
        out.append(f"| {r.setup} | {r.config} | {r.measured:.3f} | {r.predicted:.3f} | "
                   f"{_pct(r.error)} | {cal} | {_pct(r.calibrated_error)} | "
                   + (f"{coll.predicted:.3f} / {coll.measured:.3f}" if coll else "-") + " | "
                   + (f"{cod.predicted:.3f} / {cod.measured:.3f}" if cod else "-") + " |")
    fits = {r.setup: r.fit for r in time_rows if r.fit}
    out += ["", "calibration, per setup (fitted to its plain row): " + "; ".join(
        f"{k}: {f[0]} = {f[1]:.3g}" for k, f in fits.items())]
    exact = [r for r in byte_rows if r.decimals is not None]
    veth = [r for r in byte_rows if r.decimals is None]
    held = [r for r in time_rows if not r.calibration_row and r.calibrated is not None]
    ok = sum(abs(r.error) <= tolerance for r in time_rows)
    ok_cal = sum(abs(r.calibrated_error or 0) <= tolerance for r in held)
    out += ["", "**summary**", "",
            f"- bytes exact at the printed precision: {sum(r.exact for r in exact)} of "
            f"{len(exact)}",
            f"- veth bytes within 1%: {sum(abs(r.error) <= 0.01 for r in veth)} of {len(veth)} "
            f"(largest error {_pct(max((abs(r.error) for r in veth), default=0))})",
            f"- step time within {tolerance:.0%}, first principles: {ok} of {len(time_rows)}",
            f"- step time within {tolerance:.0%}, calibrated on the plain row (that row "
            f"left out): {ok_cal} of {len(held)}"]
    return "\n".join(out + (unchecked(data) if data is not None else []))


def unchecked(data: Dict[str, Any]) -> List[str]:
    """The summary's lines on what the runs file holds but does not check.

    Args:
        data: :func:`load_runs`'s result.
    Returns:
        the lines (none when everything is checked).
    """
    out = []
    bytes_only = [n for n, st in data["setups"].items() if "compute" not in st]
    if bytes_only:
        steps = sum("step_s" in r for r in data["runs"] if r["setup"] in bytes_only)
        out.append(f"- not checked, step times of {len(bytes_only)} setups whose compute time "
                   f"no committed report holds ({steps} rows; their bytes are checked): "
                   + ", ".join(bytes_only))
    fields = sum(len(r.get("untraceable", {})) for r in data["runs"])
    if fields:
        out.append(f"- not checked, {fields} measured fields of checked rows that no committed "
                   "report holds (each row's 'untraceable')")
    gone = data.get("untraceable", {}).get("runs", [])
    if gone:
        setups = list(dict.fromkeys(r["setup"] for r in gone))
        out.append(f"- not checked, {len(gone)} rows of {len(setups)} setups whose reports are "
                   "not in the repository (the runs file's 'untraceable' section): "
                   + ", ".join(setups))
    return out
