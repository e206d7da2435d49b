#!/usr/bin/env python3
"""Turn ``bench_step.py`` results into a markdown report and a PNG bar chart.

Usage:
    python3 scripts/bench/bench_report.py docs/runs/step-DATE/results.json
                                      # rewrites report.md + chart beside it, prints them

``bench_step.py`` runs this file at the end of a run; run alone it re-renders a saved
``results.json`` (e.g. after editing the layout) without re-running.  Besides the
tables of times and bytes the report has the CPU bound of every configuration: the
ranks' CPU-seconds per step over the machine's CPUs, the shortest step any schedule
of this machine allows, and plain FSDP's step over it, the most a configuration's
speed-up could reach here ("CPU bound" below).
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from pathlib import Path

from tagc.cost.rows import baseline

logger = logging.getLogger(__name__)

# issue 5 targets: speed-up of a configuration over plain FSDP, same strategy, same run
TARGETS = [("FULL_SHARD", "exact", 1.30), ("FULL_SHARD", "sparse", 1.35),
           ("SHARD_GRAD_OP", "exact", 1.60), ("SHARD_GRAD_OP", "sparse", 1.60),
           # issue 21: every byte compressed; the bf16 row against plain bf16 FSDP
           ("FULL_SHARD", "full", 3.0), ("FULL_SHARD", "full-bf16", 2.0)]
# issue 21: link bytes per step of tagc-full against plain fp32 FSDP's, at most this share
FULL_BYTES_SHARE = 0.25
# issue 14 targets (--hsdp): TAGC HSDP against native HSDP, same run
HSDP_SPEEDUP, HSDP_BYTES = 4.0, 15.0


def _trials(run: dict | None, strategy: str, config: str) -> list[dict]:
    if not run:
        return []
    return [t for t in run["trials"] if t["strategy"] == strategy and t["config"] == config]


def _median_step(trials: list[dict]) -> float | None:
    """Median over every timed step of every repeat (None when there are none)."""
    steps = [s for t in trials for s in t["step_s"]]
    return statistics.median(steps) if steps else None


def _rep_spread(trials: list[dict]) -> tuple[float, float] | None:
    """(min, max) over repeats of each repeat's median step time."""
    meds = [statistics.median(t["step_s"]) for t in trials if t["step_s"]]
    return (min(meds), max(meds)) if meds else None


def _mean(trials: list[dict], key: str) -> float | None:
    vals = [t[key] for t in trials if t.get(key) is not None]
    return sum(vals) / len(vals) if vals else None


def _sum_means(trials: list[dict], keys: tuple[str, ...]) -> float | None:
    """The sum of the keys' means; None when the trials have none of them (runs made
    before the key existed) or nothing ran on a worker (every value 0)."""
    means = [m for m in (_mean(trials, k) for k in keys) if m is not None]
    return sum(means) if means and any(means) else None


def stats_bytes(delta: dict, key: str = "wire_bytes") -> float | None:
    """Per-step bytes of this rank's gradient exchange, from ``state.stats()`` deltas.

    Args:
        delta: per-step difference of the numeric ``state.stats()`` entries.
        key: ``wire_bytes`` (what this rank sends on an ideal network),
            ``bytes_handed`` (send buffers handed to torch.distributed) or
            ``default_wire_bytes`` (an ideal plain reduce-scatter for the same calls).

    Returns:
        ``delta["total"][key]``, or None when the stats have no such entry.
    """
    tot = delta.get("total")
    if isinstance(tot, dict) and isinstance(tot.get(key), (int, float)):
        return float(tot[key])
    return None


def _fmt_bytes(b: float | None) -> str:
    return "-" if b is None else f"{b / 1e6:.2f} MB"


def _fmt_s(t: float | None) -> str:
    return "-" if t is None else f"{t:.3f}"


def _fmt_x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _load(la: list | None) -> str:
    return "?" if not la else "/".join(f"{x:.1f}" for x in la)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def summarize(report: dict) -> dict:
    """Per (strategy, config) numbers used by the tables and the chart.

    Args:
        report: the dict ``bench_step.py`` writes to results.json.

    Returns:
        {strategy: {config: {...}}} with medians, spreads, ratios, bytes and time split.
    """
    shaped, unshaped = report.get("shaped"), report.get("unshaped")
    configs = report["args"]["configs"]
    out: dict = {}
    for strat in report["args"]["strategies"]:
        rows = {}
        for cfg in configs:
            tr = _trials(shaped, strat, cfg)
            tu = _trials(unshaped, strat, cfg)
            med, med_u = _median_step(tr), _median_step(tu)
            sb = [b for b in (stats_bytes(t["stats_delta_per_step"]) for t in tr) if b is not None]
            sd = [b for b in (stats_bytes(t["stats_delta_per_step"], "default_wire_bytes") for t in tr)
                  if b is not None]
            rows[cfg] = {
                "median_s": med, "spread": _rep_spread(tr), "n_steps": sum(len(t["step_s"]) for t in tr),
                "median_unshaped_s": med_u,
                "link_wait_s": (med - med_u) if med is not None and med_u is not None else None,
                "codec_s": _mean(tr, "codec_s_per_step_per_rank"),
                "comm_s": _mean(tr, "comm_s_per_step_per_rank"),
                "worker_s": _sum_means(tr, ("worker_codec_s_per_step_per_rank",
                                            "worker_comm_s_per_step_per_rank")),
                "peer_wait_s": _mean(tr, "peer_wait_s_per_step_per_rank"),
                "cpu_s": _mean(tr, "cpu_s_per_step_per_rank"),
                # every rank's CPU time over the machine's CPUs: no step ends sooner
                "cpu_bound_s": _cpu_bound(_mean(tr, "cpu_s_per_step_per_rank"),
                                          (shaped or {}).get("world"), report.get("cpus")),
                "host_busy_s": _mean(tr, "host_busy_cpu_s_per_step"),
                "comm_unshaped_s": _mean(tu, "comm_s_per_step_per_rank"),
                "mean_s": _mean([{"m": sum(t["step_s"]) / len(t["step_s"])} for t in tr if t["step_s"]], "m"),
                "veth_tx": _mean(tr, "veth_tx_per_step_per_host"),
                "gather_tx": _mean(tr, "gather_tx_per_step_per_host"),
                "call_tx": _mean(tr, "call_tx_per_step_per_rank"),
                # the largest rank's peak over the trials (absent before issue 42)
                "peak_rss": max((b for t in tr for b in t.get("peak_rss_per_rank", [])),
                                default=None),
                "stats_bytes": sum(sb) / len(sb) if sb else None,
                "stats_default_bytes": sum(sd) / len(sd) if sd else None,
            }
        dense = rows.get("dense", {}).get("median_s")
        for cfg, r in rows.items():
            # against plain FSDP of the same precision and resharding (a bf16 row against
            # fsdp-bf16, a gather-once row against fsdp-noreshard)
            base = rows.get(baseline(cfg), {}).get("median_s")
            r["speedup_vs_fsdp"] = _ratio(base, r["median_s"])
            r["speedup_vs_dense"] = _ratio(dense, r["median_s"])
            # the most a speed-up over plain FSDP could reach on this machine's CPUs
            r["ceiling_vs_fsdp"] = _ratio(base, r["cpu_bound_s"])
        out[strat] = rows
    return out


def _header(report: dict) -> list[str]:
    """The report's first lines: command, topology, load, link, model, method."""
    a, sh = report["args"], report["shape"]
    run = report.get("shaped") or {}
    per = a.get("per_node", 1)
    ranks = "one rank each" if per == 1 else (
        f"{per} ranks each on the host's unshaped loopback route; `HSDP` = sharded inside a "
        "host, replicated across hosts (`fsdp` = native HSDP, a TAGC configuration = TAGC's "
        "custom HSDP, compressing the all-reduce between hosts); `FULL_SHARD` = FSDP2 over "
        "every rank")
    lines = ["# TAGC step-time benchmark (emulated slow network)", ""]
    lines += [f"- command: `{report.get('command', '?')}` (started {report.get('started_utc', '?')} UTC, "
              f"wall time {report.get('wall_s', 0):.0f} s)",
              f"- {a['nodes']} emulated hosts (network namespaces, {ranks}; `torchrun --nnodes "
              f"{a['nodes']} --nproc-per-node {per}`), gloo over veth; link: tc rate `{a['rate']}`, "
              f"delay `{a['delay']}`",
              f"- machine load (1/5/15-min load average) at start {_load(report.get('loadavg_start'))}, "
              f"at end {_load(report.get('loadavg_end'))}, on {report.get('cpus', '?')} CPUs",
              f"- link check (TCP, shaped): {report.get('link_shaped', '?')}",
              f"- link check (unshaped): {report.get('link_unshaped', '-')}",
              f"- model: GPT-2 n_layer={sh['n_layer']} n_head={sh['n_head']} n_embd={sh['n_embd']} "
              f"vocab={sh['vocab_size']} seq={sh['block_size']} batch={sh['batch']}/rank; "
              f"FSDP{a['fsdp']}; AdamW; torch {run.get('torch', '?')}"
              + (f"; TAGC fields overridden in every configuration: `{' '.join(a['override'])}`"
                 if a.get("override") else ""),
              f"- {a['repeats']} round-robin repeats x {a['steps']} timed steps (after {a['warmup']} "
              f"warm-up) per configuration on the shaped link; {a['unshaped_repeats']} on the unshaped link",
              "- step time = max over ranks, median over all timed steps; spread = min..max of the "
              "per-repeat medians; speed-up = plain-FSDP median / configuration median",
              "- bytes/step/rank: `stats wire` = bytes this rank's TAGC gradient exchange sends on an "
              "ideal network (`state.stats()['total']['wire_bytes']`), in brackets what an ideal "
              "plain reduce-scatter of the same units would send (`default_wire_bytes`); `veth tx` = "
              "the veth's own tx counter per host (all traffic: all-gathers, gloo's "
              "all-reduce-based reduce-scatter, TCP/IP headers); `gathers` = what the parameter "
              "all-gathers send from a host (ideal ring: (N-1) x the bytes handed to "
              "`all_gather_into_tensor`/`all_gather_single`, FSDP's or TAGC's), `rest` = veth tx - "
              "gathers (the gradient exchange, control messages and every header); `-bf16` rows: "
              "`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)`, their `vs FSDP` is "
              "against `fsdp-bf16`; `-noreshard` rows: `reshard_after_forward=False` (one "
              "gather per unit and step), against `fsdp-noreshard`; `at the call` = every "
              "collective of a rank (FSDP's and TAGC's) by the ideal count at the "
              "`torch.distributed` call, what NCCL would send (reduce-scatter and all-gather "
              "(N-1)/N of the full buffer, all-reduce 2(N-1)/N; gloo's reduce-scatter is an "
              "all-reduce underneath, so the veth carries more)",
              "- `peak RSS` = the largest rank's peak resident memory over a trial (build, "
              "warm-up, timed steps; `getrusage` after resetting the process's high-water "
              "mark at the trial's start); `exposed comm s` = median step on the shaped link "
              "- median step on the unshaped link, the same configuration",
              "- time split per rank and step (means), on the thread running the model: `in "
              "collectives` = inside torch.distributed collectives (FSDP's and TAGC's; sync calls "
              "whole, async issue + wait; includes waiting for the slower peer) and waiting for "
              "TAGC's worker thread, `of it, peer wait` = the part before the last rank entered "
              "each collective (ranks' calls matched by position; `-` when they differ), "
              "`codec` = inside `_tagc` calls, `rest` = everything else "
              "(forward/backward compute, optimizer, FSDP bookkeeping); `CPU s/rank` = CPU time "
              "of a rank's process (every thread, user + system) per step; `machine busy` = the "
              "machine's busy CPU time per step (every rank and the kernel's network work, "
              "`/proc/stat`) over CPUs x mean step: near 100%, ranks time-sliced on the cores "
              "bound the step; `unshaped s` = median step with the tc limit removed; `on the "
              "worker s` = TAGC's worker thread's collectives and codec (`fsdp_overlap`, "
              "`hsdp_overlap`), which run beside the compute (`-`: no worker)", ""]
    return lines


def render_markdown(report: dict, summary: dict) -> str:
    """Markdown for the whole report.

    Args:
        report: results.json content.
        summary: output of :func:`summarize`.

    Returns:
        The markdown text.
    """
    lines = _header(report)
    lines += ["## Share of plain FSDP's step spent communicating", "",
              "| strategy | shaped step s | time in collectives s | share in collectives | "
              "unshaped step s | 1 - unshaped/shaped |", "|---|---|---|---|---|---|"]
    for strat, rows in summary.items():
        r = rows.get("fsdp")
        if not r:
            continue
        frac = (1 - r["median_unshaped_s"] / r["median_s"]) if r["median_s"] and r["median_unshaped_s"] else None
        share = r["comm_s"] / r["mean_s"] if r["comm_s"] is not None and r["mean_s"] else None
        lines.append(f"| {strat} | {_fmt_s(r['median_s'])} | {_fmt_s(r['comm_s'])} | {_pct(share)} | "
                     f"{_fmt_s(r['median_unshaped_s'])} | {_pct(frac)} |")
    lines.append("")
    for strat, rows in summary.items():
        lines += [f"## {strat}", "",
                  "| config | median step s | spread | vs FSDP | vs dense | stats wire/step "
                  "(plain RS) | at the call/step/rank | veth tx/step | gathers/step | rest/step "
                  "| in collectives s | of it, peer wait s | codec s | rest s | CPU s/rank "
                  "| machine busy | peak RSS/rank | unshaped s | exposed comm s | on the worker s |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
                  "---|---|"]
        for cfg, r in rows.items():
            sp = "-" if r["spread"] is None else f"{r['spread'][0]:.3f}..{r['spread'][1]:.3f}"
            vf = "-" if r["speedup_vs_fsdp"] is None else f"{r['speedup_vs_fsdp']:.2f}x"
            vd = "-" if r["speedup_vs_dense"] is None else f"{r['speedup_vs_dense']:.2f}x"
            rest = (r["mean_s"] - (r["comm_s"] or 0) - (r["codec_s"] or 0)) if r["mean_s"] else None
            plain = "" if r["stats_default_bytes"] is None else f" ({_fmt_bytes(r['stats_default_bytes'])})"
            lines.append(f"| {cfg} | {_fmt_s(r['median_s'])} | {sp} | {vf} | {vd} | "
                         f"{_fmt_bytes(r['stats_bytes'])}{plain} | {_fmt_bytes(r['call_tx'])} | "
                         f"{_fmt_bytes(r['veth_tx'])} | "
                         f"{_fmt_bytes(r['gather_tx'])} | {_fmt_bytes(_minus(r['veth_tx'], r['gather_tx']))} | "
                         f"{_fmt_s(r['comm_s'])} | {_fmt_s(r['peer_wait_s'])} | "
                         f"{_fmt_s(r['codec_s'])} | {_fmt_s(rest)} | {_fmt_s(r['cpu_s'])} | "
                         f"{_pct(_busy_share(r, report.get('cpus')))} | "
                         f"{_fmt_bytes(r['peak_rss'])} | {_fmt_s(r['median_unshaped_s'])} | "
                         f"{_fmt_s(r['link_wait_s'])} | {_fmt_s(r['worker_s'])} |")
        lines.append("")
    lines += _hsdp_targets(summary) if "HSDP" in summary else _targets(summary)
    for t in (report.get("shaped") or {}).get("trials", []):
        if t.get("profile"):
            lines += ["", f"## Profile: {t['strategy']} {t['config']} (rank 0, one untimed step, "
                      "top ops by self CPU time)", "", "```", t["profile"].rstrip(), "```"]
    lines += _cpu_bound_lines(report, summary)
    lines += ["", "## Codec speed (bench_codec.py)", "", report.get("codec_table", "").rstrip(), ""]
    return "\n".join(lines)


def _cpu_bound(cpu_s: float | None, ranks: int | None, cpus: int | None) -> float | None:
    """The shortest step the machine's CPUs allow: ``ranks x cpu_s / cpus``.

    Every rank's process needs ``cpu_s`` CPU-seconds a step (every thread, user +
    system); the machine's ``cpus`` cores give at most ``cpus`` CPU-seconds per second,
    so no schedule ends a step of every rank sooner (the kernel's own network work only
    adds to it).

    Args:
        cpu_s: CPU time of one rank's process per step (the mean over ranks).
        ranks: processes sharing the machine (every rank of the run).
        cpus: the machine's CPUs.
    Returns:
        seconds, or None when a figure is missing.
    """
    if cpu_s is None or not ranks or not cpus:
        return None
    return ranks * cpu_s / cpus


def _cpu_bound_lines(report: dict, summary: dict) -> list[str]:
    """The CPU bound of every configuration and plain FSDP's step over it."""
    ranks, cpus = (report.get("shaped") or {}).get("world"), report.get("cpus")
    rows = [(strat, cfg, r) for strat, by_cfg in summary.items() for cfg, r in by_cfg.items()
            if r.get("cpu_bound_s") is not None]
    if not rows:
        return []
    lines = ["", "## CPU bound", "",
             f"{ranks} ranks share {cpus} CPUs: a step takes at least ranks x CPU s/rank / "
             f"CPUs (`bound`), whatever the link; `ceiling` = plain FSDP's median step "
             "(the same strategy and precision) / that bound, the most the configuration's "
             "speed-up could reach on this machine.", "",
             "| strategy | config | CPU s/rank | ranks x CPU s | bound s | median step s | "
             "ceiling vs FSDP |", "|---|---|---|---|---|---|---|"]
    for strat, cfg, r in rows:
        lines.append(f"| {strat} | {cfg} | {_fmt_s(r['cpu_s'])} | {_fmt_s(ranks * r['cpu_s'])} | "
                     f"{_fmt_s(r['cpu_bound_s'])} | {_fmt_s(r['median_s'])} | "
                     f"{_fmt_x(r['ceiling_vs_fsdp'])} |")
    return lines


def _busy_share(row: dict, cpus: int | None) -> float | None:
    """The machine's busy CPU time per step over what its CPUs could give in a step."""
    if row.get("host_busy_s") is None or not row.get("mean_s") or not cpus:
        return None
    return row["host_busy_s"] / (cpus * row["mean_s"])


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _verdict(m: float | None, tgt: float) -> str:
    if m is None:
        return "not measured"
    return "met" if m >= tgt else f"missed by {tgt - m:.2f}x ({100 * (tgt - m) / tgt:.0f}%)"


def _hsdp_targets(summary: dict) -> list[str]:
    """TAGC HSDP against native HSDP (step time, slow-link bytes) and TAGC FULL_SHARD."""
    hs, fs = summary["HSDP"], summary.get("FULL_SHARD", {})
    base = hs.get("fsdp", {})
    lines = ["## Targets (TAGC HSDP against native HSDP, this run)", "",
             f"| config | step vs native HSDP (target {HSDP_SPEEDUP:.0f}x) | result | "
             f"slow-link bytes vs native HSDP (target {HSDP_BYTES:.0f}x fewer) | result | "
             "step vs TAGC FULL_SHARD (target > 1x) | result |",
             "|---|---|---|---|---|---|---|"]
    for cfg, r in hs.items():
        if cfg in ("fsdp", "dense"):
            continue
        fewer = _ratio(base.get("veth_tx"), r["veth_tx"])
        vs_fs = _ratio((fs.get(cfg) or {}).get("median_s"), r["median_s"])
        lines.append(f"| {cfg} | {_fmt_x(r['speedup_vs_fsdp'])} | "
                     f"{_verdict(r['speedup_vs_fsdp'], HSDP_SPEEDUP)} | {_fmt_x(fewer)} | "
                     f"{_verdict(fewer, HSDP_BYTES)} | {_fmt_x(vs_fs)} | "
                     f"{'not measured' if vs_fs is None else ('met' if vs_fs > 1 else 'missed')} |")
    return lines


def _targets(summary: dict) -> list[str]:
    lines = ["## Targets (speed-up over plain FSDP, same strategy, this run)", "",
             "| strategy | config | target | measured | result |", "|---|---|---|---|---|"]
    for strat, cfg, tgt in TARGETS:
        r = summary.get(strat, {}).get(cfg)
        if not r or r["speedup_vs_fsdp"] is None:
            lines.append(f"| {strat} | {cfg} | {tgt:.2f}x | - | not measured |")
            continue
        m = r["speedup_vs_fsdp"]
        lines.append(f"| {strat} | {cfg} | {tgt:.2f}x | {m:.2f}x | {_verdict(m, tgt)} |")
    fs = summary.get("FULL_SHARD", {})
    if "full" in fs and "fsdp" in fs and fs["fsdp"]["veth_tx"] and fs["full"]["veth_tx"]:
        share = fs["full"]["veth_tx"] / fs["fsdp"]["veth_tx"]
        lines += ["", f"Link bytes per step, `full` / `fsdp` (veth tx): {share:.3f} (target <= "
                  f"{FULL_BYTES_SHARE:g}: {'met' if share <= FULL_BYTES_SHARE else 'missed'})"]
    return lines


def plot(summary: dict, path: Path, title: str) -> None:
    """Grouped bar chart: median step time per configuration, one group per strategy.

    Args:
        summary: output of :func:`summarize`.
        path: PNG file to write.
        title: chart title.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    strats = list(summary)
    configs = list(next(iter(summary.values()))) if summary else []
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(strats))
    for si, strat in enumerate(strats):
        xs = [i + si * width for i in range(len(configs))]
        meds = [summary[strat][c]["median_s"] or 0 for c in configs]
        err = [[max(0.0, m - (summary[strat][c]["spread"] or (m, m))[0]) for c, m in zip(configs, meds)],
               [max(0.0, (summary[strat][c]["spread"] or (m, m))[1] - m) for c, m in zip(configs, meds)]]
        bars = axes[0].bar(xs, meds, width, yerr=err, capsize=3, label=strat)
        for b, c in zip(bars, configs):
            s = summary[strat][c]["speedup_vs_fsdp"]
            if s:
                axes[0].annotate(f"{s:.2f}x", (b.get_x() + b.get_width() / 2, b.get_height()),
                                 ha="center", va="bottom", fontsize=7)
        tx = [(summary[strat][c]["veth_tx"] or 0) / 1e6 for c in configs]
        axes[1].bar(xs, tx, width, label=strat)
    for ax, ylabel in zip(axes, ("median step time [s] (label: speed-up vs FSDP)",
                                 "veth tx per step per host [MB]")):
        ax.set_xticks([i + width * (len(strats) - 1) / 2 for i in range(len(configs))])
        ax.set_xticklabels(configs, rotation=20)
        ax.set_ylabel(ylabel)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(report: dict, out: Path) -> str:
    """Write report.md and step_time.png into ``out``.

    Args:
        report: results.json content.
        out: output directory.

    Returns:
        The markdown text.
    """
    summary = summarize(report)
    md = render_markdown(report, summary)
    (out / "report.md").write_text(md)
    try:
        plot(summary, out / "step_time.png",
             f"TAGC vs FSDP{report['args']['fsdp']}, {report['args']['nodes']} hosts, {report['args']['rate']}")
    except ImportError:
        logger.warning("matplotlib not installed (pip install matplotlib): no chart")
    return md


def main(argv: list[str] | None = None) -> int:
    """Re-render report.md and the chart from a results.json.

    Args:
        argv: command line (default sys.argv[1:]).

    Returns:
        Process exit code.
    """
    p = argparse.ArgumentParser(description="Render bench_step.py results")
    p.add_argument("results", help="results.json written by bench_step.py")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    path = Path(args.results)
    print(write_report(json.loads(path.read_text()), path.parent))
    return 0


if __name__ == "__main__":
    sys.exit(main())
