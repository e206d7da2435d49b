"""Cost model of plain FSDP/HSDP and TAGC: bytes per rank and step time per step.

The command line of :mod:`tagc.cost`, ``python -m tagc.cost`` (the model: configurations,
layouts, links, the library's size rules, the check against measured runs; its docstring
says what is modelled).  It prints the tables of a sweep over node counts, the check of
``docs/cost_model_runs.json`` (bytes counted at the ``torch.distributed`` call and on
the veth, step times; rows the file lists as untraceable are not checked), or a plot.
See ``docs/COST_MODEL.md`` of the repository; ``scripts/bench/cost_model.py`` runs this
command line in a checkout, its reports' default folder there ``docs/runs/``.

With ``--predict-bench MODEL`` it predicts every row of a ``bench_step.py --model MODEL``
run at each link rate before the run (``tagc.cost.bench``), from each rate's
collective table and one unshaped plain FSDP step, and writes them to a report folder
(``predictions.json``, ``predictions.md``); ``--check`` of that file with
``--measured`` compares them with the run once it exists, per row.

Usage (``RUNS``: a runs file, e.g. the repository's ``docs/cost_model_runs.json``):
    python -m tagc.cost --params 124e6 --nodes 1,2,4,8 --ranks-per-node 8 \\
        --inter-gbit 25 --intra-gbit 400 --tflops 312 --mfu 0.4
    python -m tagc.cost --check RUNS
    python -m tagc.cost --cluster --gpus-per-node 8 --gpu-mem-gb 80 \\
        --nic-gbit 100,25 --models 124m,7b --explain     # your cluster
    python -m tagc.cost --plot cost-model.png --tflops 312
    python -m tagc.cost --predict-bench gpt2-124m --plain-step RUN/results.json \\
        --link 200mbit=C200/collectives.json --link 1gbit=C1G/collectives.json \\
        --link none=CNONE/collectives.json
    python -m tagc.cost --check predictions-gpt2-124m-DATE/predictions.json \\
        --measured step-DATE
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from ..train.runs import code_id, shown
from . import (DEFAULT_CODEC, DEFAULT_CONFIGS, DEFAULT_LAYERS, DEFAULT_UNITS, DTYPE_BYTES,
               LAYER_POLICIES, MODELS, PRESETS, Cluster, CollectiveRates, Config, ModelSpec,
               bench, check, check_report, codec_rates, default_selected_fraction,
               flops_compute_s, generic_model, gpt2_124m, load_runs, make_config, report, sweep)
from .shapes import BENCH_MODELS

# how the command is named in its help and in the reports it writes
PROG = "python -m tagc.cost"
# the step goal of the predictions (every measured step within 20%)
PREDICTION_TOLERANCE = 0.2


# --------------------------------------------------------------------------- plot


def plot(path: str, base: Cluster, nodes: Sequence[int], configs: Sequence[Config],
         models: Sequence[Tuple[ModelSpec, float]], codec: Dict[str, float],
         note: str) -> None:
    """Bytes per rank and step time against R for each model (matplotlib, lazily).

    Args:
        path: the PNG to write.
        base: the cluster.
        nodes: node counts R.
        configs: configurations.
        models: (model, compute seconds per step) pairs, one column each.
        codec: codec throughputs.
        note: the assumptions, printed under the figure.
    """
    import matplotlib  # noqa: PLC0415 - only the --plot path needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(2, len(models), figsize=(6.5 * len(models), 8.5), squeeze=False)
    for col, (model, compute) in enumerate(models):
        table = sweep(model, base, nodes, configs, compute, codec)
        for cfg in configs:
            by_r = table[cfg.name]
            axes[0][col].plot(nodes, [by_r[r].bytes_per_rank / 1e6 for r in nodes], "-",
                              marker="o", ms=3, label=cfg.name)
            axes[1][col].plot(nodes, [by_r[r].step_s for r in nodes], "-", marker="o",
                              ms=3, label=cfg.name)
        axes[0][col].set_title(f"{model.name}: bytes sent per rank per step")
        axes[1][col].set_title(f"{model.name}: step time (compute {compute:.3g} s)")
        axes[0][col].set_ylabel("MB per rank per step")
        axes[1][col].set_ylabel("seconds per step")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel(f"nodes R ({base.ranks_per_node} ranks per node)")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="best")
    fig.text(0.01, 0.005, note, fontsize=7, va="bottom", wrap=True)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- CLI


def _int_list(text: str) -> List[int]:
    """argparse type: comma-separated node counts >= 1."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e
    if not out or any(x < 1 for x in out):
        raise argparse.ArgumentTypeError(f"node counts must be >= 1, got {text!r}")
    return out


def _codec_overrides(items: Iterable[str]) -> Dict[str, float]:
    """``--codec OP=VALUE`` items as a dict (checked by :func:`codec_rates`)."""
    out = {}
    for it in items:
        key, eq, val = it.partition("=")
        if not eq:
            raise ValueError(f"--codec: expected OP=VALUES_PER_S, got {it!r}")
        try:
            out[key] = float(val)
        except ValueError as e:
            raise ValueError(f"--codec {key}: not a number: {val!r}") from e
    return out


# what --predict-bench writes, so --check tells its file from a runs file
PREDICTIONS_KIND = "bench_step predictions"


def _links(items: Iterable[str]) -> Dict[str, str]:
    """``--link RATE=JSON`` items as {rate: path}."""
    out = {}
    for it in items:
        rate, eq, path = it.partition("=")
        if not eq or not rate or not path:
            raise ValueError(f"--link: expected RATE=JSON, got {it!r}")
        out[rate] = path
    return out


def _measured_reports(paths: Sequence[str]) -> Dict[str, dict]:
    """The results.json files of ``--measured`` (a folder: every results.json in it), by
    their path as a committed file names it."""
    files: List[Path] = []
    for p in map(Path, paths):
        files += sorted(p.rglob("results.json")) if p.is_dir() else [p]
    if not files:
        raise ValueError(f"--measured {' '.join(paths)}: no results.json")
    return {shown(f): json.loads(f.read_text()) for f in files}


def _add_to_runs(runs_file: str, pred_path: str, pred: dict, reports: Dict[str, dict]) -> None:
    """--add-to: the run's setups, rows and link tables merged into a runs file, which is
    then loaded back.  An existing setup of the same name is refused, as is a link table
    of the same name with other content; the same table again (a later run on the links
    an earlier one measured) is kept once.

    Args:
        runs_file: the runs file (``docs/cost_model_runs.json``).
        pred_path: the predictions file, as given.
        pred: its content.
        reports: the run's results.json by path.
    """
    tables = {v["table"]: json.loads(Path(v["table"]).read_text())
              for v in pred["inputs"]["links"].values()}
    new = bench.runs_entries(pred, shown(Path(pred_path)), reports, tables)
    data = json.loads(Path(runs_file).read_text())
    kept = set(new["links"]) & set(data["links"])  # the same tables, checked below
    for key in ("links", "setups"):
        clash = {k for k in set(new[key]) & set(data[key])
                 if key == "setups" or new[key][k] != data[key][k]}
        if clash:
            raise ValueError(f"--add-to {runs_file}: {key} {sorted(clash)} already there"
                             + (" with other content" if key == "links" else ""))
        data[key].update(new[key])
    data["runs"] += new["runs"]
    Path(runs_file).write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    load_runs(runs_file)
    print(f"\nadded {len(new['setups'])} setups, {len(new['runs'])} rows and "
          f"{len(new['links']) - len(kept)} link tables to {runs_file}"
          f" ({len(kept)} already there)")


def _predict_bench(args: argparse.Namespace, codec: Dict[str, float], runs_dir: Path,
                   prog: str) -> int:
    """--predict-bench: every row of the benchmark model's run at every --link rate,
    written as predictions.json and predictions.md.

    Args:
        args: the command line.
        codec: codec throughputs.
        runs_dir: where the default ``--out`` folder goes.
        prog: the command's name, as the report records it.
    Returns:
        the exit code.
    """
    plan = BENCH_MODELS[args.predict_bench]
    links = _links(args.link)
    if not args.plain_step or not links:
        raise ValueError("--predict-bench needs --plain-step and a --link per rate")
    step_report = json.loads(Path(args.plain_step).read_text())
    if step_report["shape"] != asdict(plan.shape):
        raise ValueError(f"--plain-step ran {step_report['shape']}, not {args.predict_bench}")
    tables = {rate: json.loads(Path(path).read_text()) for rate, path in links.items()}
    hosts = step_report["shaped"]["world"]
    if any(t["nodes"] != hosts or t["per_node"] != 1 for t in tables.values()):
        raise ValueError(f"every table must be of the plain step's {hosts} hosts, one rank each")
    clusters = {rate: bench.rate_cluster(hosts, t, links[rate]) for rate, t in tables.items()}
    model = MODELS[plan.layout](layers=args.layers)
    pred = bench.predict_rows(model, plan.configs, clusters, bench.plain_step_s(step_report),
                              codec, step_report["args"]["fsdp"], worker=not args.blocking)
    shaped = [r for r in links if r != bench.UNSHAPED]
    run_plan = {"rates": shaped, "configs": list(plan.configs), "warmup": plan.warmup,
                "steps": plan.steps, "repeats": plan.repeats,
                "unshaped_repeats": plan.unshaped_repeats, "unshaped_configs": list(plan.configs)}
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out = Path(args.out) if args.out else runs_dir / f"predictions-{args.predict_bench}-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    command = ("sudo python3 scripts/bench/bench_step.py --model " + args.predict_bench
               + " --fsdp 2 --strategies FULL_SHARD --rate " + " ".join(shaped)
               + " --no-codec" + (" --override fsdp_overlap=false" if args.blocking else "")
               + " --predictions " + shown(out / "predictions.json"))
    data = {"kind": PREDICTIONS_KIND,
            "about": "Predictions of the cost model made BEFORE the run they predict: "
                     "inputs are only each rate's link and collective table and one unshaped "
                     "step of plain FSDP; compute = that step - the communication predicted "
                     "on the unshaped link, the same for every row (bf16 compute included); "
                     "'worker': TAGC's rows timed with their collectives on its FSDP2 worker "
                     "thread, unit by unit (tagc/cost/schedule.py), else one after "
                     "another. "
                     f"Check a run with: {prog} --check THIS "
                     "--measured RUN_FOLDER",
            "made_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "code": code_id(),
            "command": " ".join([prog, *args.argv]),
            "bench_model": args.predict_bench, "layout": plan.layout, "layers": args.layers,
            "params": model.params, "nodes": hosts, "ranks_per_node": 1,
            "fsdp": step_report["args"]["fsdp"], "worker": not args.blocking,
            "inputs": {"plain_step": {"report": shown(Path(args.plain_step)),
                                      "step_s": bench.plain_step_s(step_report),
                                      "link": step_report.get("link_shaped"),
                                      "loadavg": [step_report.get("loadavg_start"),
                                                  step_report.get("loadavg_end")]},
                       "links": {rate: {"table": shown(Path(links[rate])),
                                        "link_measured": t["link_measured"],
                                        "inter_mbit": bench.measured_mbit(t["link_measured"])}
                                 for rate, t in tables.items()}},
            "plan": run_plan, "command_to_run": command, **pred}
    data["estimate_s"] = bench.run_estimate_s(data, run_plan)
    (out / "predictions.json").write_text(json.dumps(data, indent=1))
    md = _predictions_md(data)
    (out / "predictions.md").write_text(md)
    print(md)
    print(f"\nwrote {out}/predictions.json and predictions.md")
    return 0


def _predictions_md(data: dict) -> str:
    """predictions.md: the inputs and a table per rate of every row."""
    inp = data["inputs"]
    load = " -> ".join("/".join(f"{x:.1f}" for x in la) for la in inp["plain_step"]["loadavg"] if la)
    lines = [f"# Predictions of bench_step.py --model {data['bench_model']}, made before the run",
             "", f"- made {data['made_utc']} UTC by `{data['command']}`, commit "
             f"{data['code'].get('commit', '?')}",
             f"- model: {data['layout']} (layers={data['layers']}), {data['params'] / 1e6:.2f}M "
             f"parameters; FSDP{data['fsdp']} FULL_SHARD on {data['nodes']} emulated hosts, one "
             "rank each, gloo",
             f"- compute per step {data['compute_s']:.3f} s = the unshaped plain FSDP step "
             f"{inp['plain_step']['step_s']:.3f} s (`{inp['plain_step']['report']}`, load "
             f"{load}) - {data['unshaped_comm_s']:.3f} s of communication "
             "predicted on the unshaped link; every row takes it (no bf16 compute figure)",
             "- TAGC's rows: " + ("their collectives on the FSDP2 worker beside the compute, "
                                  "timed unit by unit (`tagc/cost/schedule.py`; its "
                                  "assumptions: COST_MODEL.md)" if data.get("worker") else
                                  "every collective on the model thread, one after another"),
             *[f"- {r}: `{v['table']}`, {v['link_measured']}" for r, v in inp["links"].items()],
             f"- the run: `{data['command_to_run']}`; {bench.estimate_text(data, data['plan'])}"]
    for rate in inp["links"]:
        lines += ["", f"## {rate}", "", "| row | step s | in collectives s | codec s | at the call "
                  "MB/rank | veth tx MB/host | exposed comm s |", "|---|---|---|---|---|---|---|"]
        for row, by_rate in data["rows"].items():
            r = by_rate[rate]
            lines.append(f"| {row} | {r['step_s']:.3f} | {r['comm_s']:.3f} | {r['codec_s']:.3f} | "
                         f"{r['call_mb']:.2f} | {r['veth_tx_mb']:.2f} | {r['exposed_s']:.3f} |")
    return "\n".join(lines) + "\n"


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The command line.

    Args:
        prog: the command's name in the usage line.
    Returns:
        the parser.
    """
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="configurations: fsdp, hsdp, fsdp+P, hsdp+P (the hook's "
                                       "hsdp_allreduce=auto), hsdp+P/2phase, hsdp+P/gather "
                                       f"with P in {sorted(PRESETS)}; codec ops: "
                                       f"{', '.join(sorted(DEFAULT_CODEC))}")
    m = p.add_argument_group("model")
    m.add_argument("--params", type=float, help="parameters (e.g. 124e6, 7e9)")
    m.add_argument("--model", choices=sorted(MODELS),
                   help="a GPT-2 layout of this repository instead of --params")
    m.add_argument("--layers", choices=LAYER_POLICIES, default=DEFAULT_LAYERS,
                   help=f"selection policy of --model, of --plot's GPT-2 124M and of "
                        f"--params' default fraction (default {DEFAULT_LAYERS}, the one "
                        "tagc-balanced/lean/full use; non_attention: the attention QKV "
                        "inputs uncompressed, as before the presets changed and as "
                        "tagc-sparse/auto/dense still do).  It applies to every "
                        "configuration of the run; --check ignores it (each measured run "
                        "names its own layout)")
    m.add_argument("--selected-fraction", type=float, default=None,
                   help="with --params (and the 7B of --plot): fraction of parameters in "
                        "compressed units (default: the tiny GPT-2's under --layers, "
                        f"{default_selected_fraction('all'):.3f} for all, "
                        f"{default_selected_fraction('non_attention'):.3f} for "
                        "non_attention)")
    m.add_argument("--units", type=int, default=DEFAULT_UNITS,
                   help=f"with --params: FSDP units (default {DEFAULT_UNITS}, GPT-2 124M's)")
    c = p.add_argument_group("cluster")
    c.add_argument("--nodes", type=_int_list, default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512],
                   help="node counts R, comma-separated")
    c.add_argument("--ranks-per-node", type=int, default=8, help="N (default 8)")
    c.add_argument("--intra-gbit", type=float, default=400.0,
                   help="per-rank bandwidth inside a node, Gbit/s (default 400)")
    c.add_argument("--inter-gbit", type=float, default=25.0,
                   help="per-node bandwidth between nodes, Gbit/s (default 25)")
    c.add_argument("--intra-latency-us", type=float, default=5.0,
                   help="per message inside a node (default 5 us)")
    c.add_argument("--inter-latency-us", type=float, default=30.0,
                   help="per message between nodes (default 30 us)")
    c.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    c.add_argument("--overlap", type=float, default=0.0,
                   help="fraction of compute that hides communication, 0..1 (default 0)")
    c.add_argument("--link-efficiency", type=float, default=1.0,
                   help="fraction of the bandwidth collectives reach (default 1)")
    c.add_argument("--collectives", metavar="JSON",
                   help="measured collective rates (scripts/bench/bench_collectives.py --out) of "
                        "your cluster: they replace the link bandwidths where they cover a "
                        "collective (measured at one R: predictions at other R reuse them)")
    w = p.add_argument_group("workload")
    w.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help="comma-separated configurations")
    w.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="fp32",
                   help="parameter/gradient dtype on the wire")
    w.add_argument("--fsdp", type=int, choices=(1, 2), default=2)
    w.add_argument("--compute-s", type=float, help="compute time per step (measured plain "
                   "step on a fast link)")
    w.add_argument("--tflops", type=float, help="peak TFLOP/s per rank: compute from "
                   "6 x params x tokens")
    w.add_argument("--mfu", type=float, default=0.4, help="with --tflops (default 0.4)")
    w.add_argument("--tokens-per-rank", type=int, default=8192,
                   help="with --tflops: tokens per rank per step (default 8 x 1024)")
    w.add_argument("--codec", action="append", default=[], metavar="OP=VALUES_PER_S",
                   help="codec throughput of one op (repeatable)")
    w.add_argument("--codec-speedup", type=float, default=1.0,
                   help="factor on the measured CPU codec throughputs (e.g. a GPU's)")
    a = p.add_argument_group("actions")
    a.add_argument("--cluster", action="store_true",
                   help="what TAGC would give on your cluster: models x nodes x FULL_SHARD/HSDP "
                        "x plain bf16/presets, memory per GPU included; its own options follow "
                        "it (--cluster --help; docs/CLUSTER.md)")
    a.add_argument("--check", metavar="FILE", help="compare with measured runs (JSON): a runs "
                   "file, or a --predict-bench predictions.json with --measured")
    a.add_argument("--measured", nargs="+", metavar="PATH",
                   help="with --check PREDICTIONS: the run's bench_step.py results.json files "
                        "or folders holding them (a multi-rate run: its folder)")
    a.add_argument("--add-to", metavar="RUNS_JSON",
                   help="with --check PREDICTIONS --measured: add the run to this runs file "
                        "(a setup per rate, its rows, the predictions' link tables)")
    b = p.add_argument_group("predictions of a bench_step.py run (--predict-bench)")
    b.add_argument("--predict-bench", metavar="MODEL", choices=sorted(BENCH_MODELS),
                   help="predict every row of bench_step.py --model MODEL (its default rows "
                        "and plan) at each --link rate, FSDP2 on 2 hosts")
    b.add_argument("--link", action="append", default=[], metavar="RATE=JSON",
                   help="a rate's bench_collectives.py output (its link measurement and "
                        "table); the unshaped one as none=JSON (repeatable)")
    b.add_argument("--plain-step", metavar="JSON",
                   help="bench_step.py results.json of one unshaped plain FSDP step (--rate "
                        "none --no-unshaped --configs fsdp): the compute time's source")
    b.add_argument("--blocking", action="store_true",
                   help="predict a run with --override fsdp_overlap=false: TAGC's collectives "
                        "one after another on the model thread (default: on its FSDP2 worker "
                        "beside the compute, the hook's default on the CPU)")
    b.add_argument("--out", metavar="DIR",
                   help="folder of predictions.json and predictions.md (default a new "
                        "predictions-MODEL-<UTC date-time>/ in the current folder; "
                        "scripts/bench/cost_model.py: in the checkout's runs folder)")
    a.add_argument("--plot", metavar="PNG", help="bytes/rank and step time vs R for GPT-2 "
                   "124M and a 7B model")
    a.add_argument("--plot-7b-units", type=int, default=32 * 7 + 3,
                   help="FSDP units of the 7B model in --plot (default 227: a Llama-2-7B "
                        "under TAGC's wrapping, 7 linear units per layer + embedding, head, "
                        "root)")
    return p


def main(argv: Optional[List[str]] = None, runs_dir: Path = Path("."), prog: str = PROG) -> int:
    """Parse the arguments and print the tables, the check or the plot.

    Args:
        argv: arguments (default sys.argv[1:]).
        runs_dir: the folder that ``--predict-bench``'s default ``--out`` goes into.
        prog: the command's name (usage line, reports).
    Returns:
        the exit code.
    """
    argv = sys.argv[1:] if argv is None else argv
    if "--cluster" in argv:  # its own command line (tagc.cost.cluster)
        from . import cluster  # noqa: PLC0415 - only --cluster needs it

        print(cluster.run([x for x in argv if x != "--cluster"], f"{prog} --cluster"))
        return 0
    p = build_parser(prog)
    args = p.parse_args(argv)
    args.argv = list(argv)
    try:
        codec = codec_rates(_codec_overrides(args.codec), args.codec_speedup)
        if args.predict_bench:
            return _predict_bench(args, codec, Path(runs_dir), prog)
        if args.check:
            data = json.loads(Path(args.check).read_text())
            if data.get("kind") == PREDICTIONS_KIND:
                if not args.measured:
                    raise ValueError("--check of predictions needs --measured (the run)")
                reports = _measured_reports(args.measured)
                rows = bench.compare(data, list(reports.values()))
                print(bench.compare_report(rows, PREDICTION_TOLERANCE))
                if args.add_to:
                    _add_to_runs(args.add_to, args.check, data, reports)
                return 0
            data = load_runs(args.check)
            print(check_report(check(data, codec), data=data))
            return 0
        coll = None
        if args.collectives:
            try:
                coll = CollectiveRates.from_report(json.loads(Path(args.collectives).read_text()),
                                                   args.collectives)
            except (OSError, ValueError) as e:
                p.error(f"--collectives {args.collectives}: {e}")
        base = Cluster(args.ranks_per_node, 1, args.intra_gbit, args.inter_gbit,
                       args.intra_latency_us * 1e-6, args.inter_latency_us * 1e-6,
                       args.backend, args.overlap, args.link_efficiency, coll)
        configs = [make_config(n.strip(), args.dtype, args.fsdp)
                   for n in args.configs.split(",") if n.strip()]
        if not configs:
            raise ValueError("--configs: no configuration given")
        fraction = (default_selected_fraction(args.layers) if args.selected_fraction is None
                    else args.selected_fraction)
        if args.plot:
            if args.tflops is None:
                raise ValueError("--plot draws two models: give --tflops (and --mfu, "
                                 "--tokens-per-rank) for their compute time")
            m124 = gpt2_124m(args.layers)
            m7 = generic_model(7e9, fraction, args.plot_7b_units, name="7B")
            pairs = [(m, flops_compute_s(m.params, args.tokens_per_rank, args.tflops, args.mfu))
                     for m in (m124, m7)]
            note = (f"{base.ranks_per_node} ranks/node; intra {base.intra_gbit:g} Gbit/s/rank, "
                    f"inter {base.inter_gbit:g} Gbit/s/node; {args.backend}, {args.dtype}; overlap "
                    f"{args.overlap:g}; compute 6 x params x {args.tokens_per_rank} tokens at "
                    f"{args.tflops:g} TFLOP/s x MFU {args.mfu:g}; codec: this CPU's measured "
                    f"throughput x {args.codec_speedup:g}; layers={args.layers}; 7B: "
                    f"{fraction:.3f} of parameters compressed. hsdp+P: the hook's default "
                    "form (all-gather at R = 2, two-phase from R = 3, lean from 4); /gather: the "
                    "all-gather form forced.")
            plot(args.plot, base, args.nodes, configs, pairs, codec, note)
            print(f"wrote {args.plot}")
            return 0
        if args.model and args.params:
            raise ValueError("give --params or --model, not both")
        if args.model:
            model = MODELS[args.model](layers=args.layers)
        elif args.params:
            model = generic_model(args.params, fraction, args.units)
        else:
            raise ValueError("give --params N (or --model NAME)")
        if args.compute_s is not None:
            compute = args.compute_s
        elif args.tflops is not None:
            compute = flops_compute_s(model.params, args.tokens_per_rank, args.tflops, args.mfu)
        else:
            compute = 0.0
            print("note: no --compute-s or --tflops: compute time 0 (communication and codec "
                  "only)\n")
        print(report(model, base, args.nodes, sweep(model, base, args.nodes, configs, compute,
                                                      codec)))
    except ValueError as e:
        p.error(str(e))
    return 0


def run(argv: Optional[List[str]] = None, runs_dir: Path = Path("."), prog: str = PROG) -> None:
    """:func:`main` as a process: its exit status, a closed pipe (``... | head``) quiet.

    Args:
        argv: arguments (default sys.argv[1:]).
        runs_dir: as for :func:`main`.
        prog: as for :func:`main`.
    """
    try:
        sys.exit(main(argv, runs_dir, prog))
    except BrokenPipeError:
        # the reader closed the pipe: point stdout at /dev/null so the interpreter's
        # flush at exit does not raise again (the `signal` docs' recipe)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
